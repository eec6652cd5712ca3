"""POST /v1/messages and /v1/messages/count_tokens through `openarc serve` with the official anthropic SDK: whole and
streamed messages, tool_use blocks and tool_result turns, thinking blocks, stop sequences, token counts, and errors
and auth in Anthropic's shape.

The demo model's weights are random: a tool_use block whose input validates against its schema shows that the
request reached genai's constrained decoding through the same path as chat completions, and came back translated.
"""

from __future__ import annotations

import anthropic
import pytest
from pydantic import BaseModel, Field

from conftest import FIXTURES, Appliance, http, model_entry
from test_metrics import samples, value

TEMPLATES = FIXTURES / "chat-templates"
KEY = "test-messages-key"


class Weather(BaseModel, extra="forbid"):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


class Time(BaseModel, extra="forbid"):
    zone: str = Field(max_length=8)


TOOLS = [{"name": "get_weather", "description": "Weather forecast", "input_schema": Weather.model_json_schema()},
         {"name": "get_time", "description": "Local time", "input_schema": Time.model_json_schema()}]
SCHEMAS = {"get_weather": Weather, "get_time": Time}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    models = [model_entry("demo", demo_model), model_entry("small", demo_model, max_context=40),
              model_entry("qwen3", demo_model, chat_template=str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja")),
              model_entry("r1", demo_model,
                          chat_template=str(TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"))]
    appliance = Appliance({"server": {"api_key_env": "TEST_MESSAGES_KEY"}, "models": models},
                          tmp_path_factory.mktemp("messages"), env={"TEST_MESSAGES_KEY": KEY}).start()
    yield appliance
    appliance.stop()


def client(app) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.base, api_key=KEY, max_retries=0, timeout=60)


def assert_valid_tool_use(blocks, names=SCHEMAS) -> None:
    uses = [b for b in blocks if b.type == "tool_use"]
    assert uses
    for use in uses:
        assert use.name in names and use.id
        SCHEMAS[use.name].model_validate(use.input)


def prompt_of(usage) -> int:
    """The whole prompt of an Anthropic usage: computed, written to and read from the cache."""
    return usage.input_tokens + usage.cache_creation_input_tokens + usage.cache_read_input_tokens


def test_create_returns_a_message_with_usage(app):
    message = client(app).messages.create(model="demo", max_tokens=5, messages=QUESTION, system="Be brief.")
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    [block] = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 5
    done = client(app).messages.create(model="demo", max_tokens=200, messages=QUESTION)
    assert done.stop_reason == "end_turn" and 0 < done.usage.output_tokens < 64


def test_stream_assembles_text(app):
    with client(app).messages.stream(model="demo", max_tokens=8, messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8 and final.usage.input_tokens > 0
    whole = client(app).messages.create(model="demo", max_tokens=8, messages=QUESTION)
    assert whole.content[0].text == text and prompt_of(whole.usage) == prompt_of(final.usage)


def test_the_raw_stream_has_anthropics_event_order(app):
    with client(app).messages.create(model="demo", max_tokens=4, messages=QUESTION, stream=True) as stream:
        events = list(stream)
    types = [event.type for event in events]
    assert types[:2] == ["message_start", "content_block_start"]
    counted = client(app).messages.count_tokens(model="demo", messages=QUESTION).input_tokens
    assert prompt_of(events[0].message.usage) == counted == prompt_of(events[-2].usage)
    assert types[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]


def test_tool_choice_any_gives_a_schema_valid_input(app):
    message = client(app).messages.create(model="demo", max_tokens=300, messages=QUESTION, tools=TOOLS,
                                          tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    assert_valid_tool_use(message.content)


def test_stream_assembles_a_tool_use_block(app):
    with client(app).messages.stream(model="demo", max_tokens=300, messages=QUESTION, tools=TOOLS,
                                     tool_choice={"type": "tool", "name": "get_time"}) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    assert final.stop_reason == "tool_use" and [b.name for b in final.content if b.type == "tool_use"] == ["get_time"]
    assert_valid_tool_use(final.content, ["get_time"])


def test_a_tool_result_turn_reaches_the_template(app):
    anthropic_client = client(app)
    first = anthropic_client.messages.create(model="demo", max_tokens=300, messages=QUESTION, tools=TOOLS,
                                             tool_choice={"type": "tool", "name": "get_weather",
                                                          "disable_parallel_tool_use": True})
    [use] = [b for b in first.content if b.type == "tool_use"]
    turns = QUESTION + [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
                        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                      "content": "sunny, 21 C"}]}]
    second = anthropic_client.messages.create(model="demo", max_tokens=5, messages=turns, tools=TOOLS)
    assert second.content[0].type == "text" and second.stop_reason == "max_tokens"
    # the same conversation through chat completions is the same prompt, token for token
    chat = app.client(api_key=KEY).chat.completions.create(
        model="demo", max_tokens=1, messages=QUESTION + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": use.id, "type": "function", "function": {"name": use.name, "arguments": __import__("json").dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": "sunny, 21 C"}],
        tools=[{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                 "parameters": t["input_schema"]}} for t in TOOLS])
    assert chat.usage.prompt_tokens == prompt_of(second.usage)
    counted = anthropic_client.messages.count_tokens(model="demo", messages=turns, tools=TOOLS)
    assert counted.input_tokens == prompt_of(second.usage)


def test_count_tokens_counts_with_the_models_template(app):
    anthropic_client = client(app)
    counted = anthropic_client.messages.count_tokens(model="demo", messages=QUESTION, system="Be brief.")
    message = anthropic_client.messages.create(model="demo", max_tokens=1, messages=QUESTION, system="Be brief.")
    assert counted.input_tokens == prompt_of(message.usage) > 0
    with_tools = anthropic_client.messages.count_tokens(model="demo", messages=QUESTION, tools=TOOLS)
    assert with_tools.input_tokens > counted.input_tokens
    metrics = samples(app.metrics())
    assert value(metrics, "openarc_requests_total", model="demo", endpoint="messages/count_tokens", status="200") >= 2
    assert app.model_status("demo")["requests_running"] == 0


def test_a_stop_sequence_is_named(app):
    anthropic_client = client(app)
    text = anthropic_client.messages.create(model="demo", max_tokens=10, messages=QUESTION).content[0].text
    word = text.split()[2]
    message = anthropic_client.messages.create(model="demo", max_tokens=10, messages=QUESTION,
                                               stop_sequences=["no such text", word])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == word
    assert word not in message.content[0].text and text.startswith(message.content[0].text)
    with anthropic_client.messages.stream(model="demo", max_tokens=10, messages=QUESTION,
                                          stop_sequences=[word]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == word


def test_thinking_comes_back_as_thinking_blocks(app):
    """Qwen3's template with thinking enabled and a forced call: the demo model thinks first (and never closes the
    block); with thinking off (the default) the template closes it and the call comes at once."""
    anthropic_client = client(app)
    thinking = {"type": "enabled", "budget_tokens": 10}
    message = anthropic_client.messages.create(model="qwen3", max_tokens=12, messages=QUESTION, tools=TOOLS,
                                               tool_choice={"type": "any"}, thinking=thinking)
    [block] = message.content
    assert block.type == "thinking" and block.thinking and message.stop_reason == "max_tokens"
    with anthropic_client.messages.stream(model="qwen3", max_tokens=12, messages=QUESTION, tools=TOOLS,
                                          tool_choice={"type": "any"}, thinking=thinking) as stream:
        events = list(stream)
        final = stream.get_final_message()
    deltas = [e.delta.thinking for e in events if e.type == "content_block_delta" and e.delta.type == "thinking_delta"]
    assert deltas and "".join(deltas) == final.content[0].thinking
    off = anthropic_client.messages.create(model="qwen3", max_tokens=300, messages=QUESTION, tools=TOOLS,
                                           tool_choice={"type": "any"})
    assert off.stop_reason == "tool_use" and all(b.type != "thinking" for b in off.content)
    assert_valid_tool_use(off.content)
    # a template that opens the block itself: everything the model writes is thinking
    r1 = anthropic_client.messages.create(model="r1", max_tokens=12, messages=QUESTION, thinking=thinking)
    assert [b.type for b in r1.content] == ["thinking"]
    # thinking blocks passed back are the assistant turn's reasoning
    again = anthropic_client.messages.create(model="qwen3", max_tokens=1, messages=QUESTION + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": ""},
                                          {"type": "text", "text": "Sunny."}]},
        {"role": "user", "content": "Thanks"}])
    assert again.usage.input_tokens > 0


def test_max_tokens_is_a_cap_the_context_bounds(app):
    """Claude Code asks for 32000 tokens whatever the model: the answer gets what the context has left."""
    anthropic_client = client(app)
    message = anthropic_client.messages.create(model="small", max_tokens=32000, messages=QUESTION)
    assert message.stop_reason == "model_context_window_exceeded"
    assert prompt_of(message.usage) + message.usage.output_tokens == 40
    with anthropic_client.messages.stream(model="small", max_tokens=32000, messages=QUESTION) as stream:
        assert stream.get_final_message().stop_reason == "model_context_window_exceeded"
    # a prompt that does not fit at all is still refused
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model="small", max_tokens=10, messages=[{"role": "user", "content": "Hi " * 60}])
    assert info.value.body["error"]["message"].startswith("prompt is too long: ")  # Anthropic's words
    # chat completions and Responses fit a limit too, sent or not: the answer ends at the window's end
    for limit in ({"max_tokens": 32000}, {}):
        status, _, body = http("POST", app.base + "/v1/chat/completions", {"model": "small", "messages": QUESTION,
                                                                          **limit}, headers={"x-api-key": KEY})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        assert body["usage"]["total_tokens"] == 40
    status, _, body = http("POST", app.base + "/v1/responses", {"model": "small", "input": "Hi"},
                           headers={"x-api-key": KEY})
    assert status == 200 and body["status"] == "incomplete", body
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["usage"]["total_tokens"] == 40


def test_a_vision_model_serves_text_messages_and_counts(appliance_factory, demo_vlm):
    """Kind vlm runs the same chat path: a text-only conversation and its token count work on it too (images in
    these dialects are refused at the route)."""
    app = appliance_factory({"models": [model_entry("vlm", demo_vlm, kind="vlm")]})
    anthropic_client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0)
    message = anthropic_client.messages.create(model="vlm", max_tokens=5, messages=QUESTION)
    assert message.content[0].text and message.usage.output_tokens <= 5
    assert anthropic_client.messages.count_tokens(model="vlm", messages=QUESTION).input_tokens == \
        prompt_of(message.usage)
    response = app.client().responses.create(model="vlm", input="Hi", max_output_tokens=3)
    assert response.output_text


def test_bearer_auth_works_too_and_a_wrong_key_is_anthropics_401(app):
    status, _, body = http("POST", app.base + "/v1/messages", {"model": "demo", "max_tokens": 1, "messages": QUESTION},
                           headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200, body
    with pytest.raises(anthropic.AuthenticationError) as info:
        anthropic.Anthropic(base_url=app.base, api_key="wrong", max_retries=0).messages.create(
            model="demo", max_tokens=1, messages=QUESTION)
    assert info.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                          "message": info.value.body["error"]["message"]}}


@pytest.mark.parametrize("body, words", [
    ({"messages": QUESTION}, "'max_tokens' is required"),
    ({"max_tokens": 0, "messages": QUESTION}, "max_tokens"),
    ({"max_tokens": 5, "messages": []}, "messages"),
    ({"max_tokens": 5, "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
    ({"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages[0].content[0].type"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "server tool"),
    ({"max_tokens": 5, "messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled"}}, "budget_tokens"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": 5}}, "budget_tokens"),
    ({"max_tokens": 5, "messages": QUESTION, "thinking": {"type": "enabled", "budget_tokens": "x"}},
     "budget_tokens"),
    ({"max_tokens": 5, "messages": QUESTION, "temperature": 1.5}, "temperature"),
    ({"max_tokens": 5, "messages": QUESTION, "stop_sequences": "x"}, "stop_sequences"),
])
def test_malformed_requests_are_anthropic_400s(app, body, words):
    status, _, reply = http("POST", app.base + "/v1/messages", {"model": "demo", **body}, headers={"x-api-key": KEY})
    assert status == 400, reply
    assert reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error", reply
    assert words in reply["error"]["message"], reply


def test_adaptive_thinking_ignores_its_budget(app):
    """Only an enabled block's budget is compared with max_tokens: adaptive's, whatever it holds, is not read (it
    was a 500 comparing "x" with an integer)."""
    body = {"model": "demo", "max_tokens": 3, "messages": QUESTION,
            "thinking": {"type": "adaptive", "budget_tokens": "x"}}
    status, _, reply = http("POST", app.base + "/v1/messages", body, headers={"x-api-key": KEY})
    assert status == 200 and reply["type"] == "message", reply


def test_an_unknown_model_and_route_are_anthropic_404s(app):
    with pytest.raises(anthropic.NotFoundError) as info:
        client(app).messages.create(model="claude-sonnet-4-5", max_tokens=1, messages=QUESTION)
    assert info.value.body["error"]["type"] == "not_found_error" and "claude-sonnet-4-5" in str(info.value.body)
    status, _, reply = http("POST", app.base + "/v1/messages/batches", {}, headers={"x-api-key": KEY})
    assert status == 404 and reply["error"]["type"] == "not_found_error"


def test_requests_are_counted_under_the_route(app):
    client(app).messages.create(model="demo", max_tokens=1, messages=QUESTION)
    with pytest.raises(anthropic.BadRequestError):
        client(app).messages.create(model="demo", max_tokens=0, messages=QUESTION)
    metrics = samples(app.metrics())
    assert value(metrics, "openarc_requests_total", model="demo", endpoint="messages", status="200") >= 1
    assert value(metrics, "openarc_requests_total", model="demo", endpoint="messages", status="400") >= 1
