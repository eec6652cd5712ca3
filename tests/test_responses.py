"""POST /v1/responses through `openarc serve` with the official openai SDK: whole and streamed responses, structured
output, function calls and their results, reasoning items, previous_response_id, errors in OpenAI's shape.

The demo model's weights are random: a well-formed call or a schema-valid object shows that the request reached
genai's constrained decoding through the same path as chat completions, and its answer was translated back.
"""

from __future__ import annotations

import json

import openai
import pytest
from pydantic import BaseModel, Field

from conftest import FIXTURES, Appliance, http, model_entry
from test_metrics import samples, value

TEMPLATES = FIXTURES / "chat-templates"


class Weather(BaseModel, extra="forbid"):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather forecast",
          "parameters": Weather.model_json_schema(), "strict": True}]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    models = [model_entry("demo", demo_model),
              model_entry("qwen3", demo_model, chat_template=str(TEMPLATES / "Qwen-Qwen3-0.6B.jinja"))]
    appliance = Appliance({"server": {"stored_responses": 3}, "models": models},
                          tmp_path_factory.mktemp("responses")).start()
    yield appliance
    appliance.stop()


def test_create_returns_a_message_with_usage(app):
    response = app.client().responses.create(model="demo", input="Hello", max_output_tokens=5)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.content[0].type == "output_text"
    assert response.output_text == message.content[0].text and response.output_text
    assert response.usage.output_tokens == 5 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + 5
    assert response.usage.output_tokens_details.reasoning_tokens == 0
    # a model that ends its answer by itself completes
    done = app.client().responses.create(model="demo", input=[{"role": "user", "content": "Hi"}],
                                         instructions="Be brief.")
    assert done.status == "completed" and done.incomplete_details is None and done.instructions == "Be brief."
    assert 0 < done.usage.output_tokens < 64


def test_stream_sends_the_typed_events_in_order_and_the_sdk_assembles_them(app):
    client = app.client()
    with client.responses.stream(model="demo", input="Hello", max_output_tokens=8) as stream:
        events = list(stream)
        final = stream.get_final_response() if events[-1].type == "response.completed" else None
    types = [e.type for e in events]
    assert types[:5] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added", "response.output_text.delta"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text and text
    assert events[-1].response.usage.output_tokens == 8
    assert final is None  # incomplete: the SDK has no completed response to give
    # the whole response to the same request with the same seed-free demo model has the same shape
    with client.responses.stream(model="demo", input="Hi") as stream:
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text


def test_parse_with_a_pydantic_model_gives_the_object(app):
    response = app.client().responses.parse(model="demo", input=QUESTION, text_format=Weather, max_output_tokens=200)
    assert isinstance(response.output_parsed, Weather)
    with app.client().responses.stream(model="demo", input=QUESTION, text_format=Weather,
                                       max_output_tokens=200) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Weather)


def test_json_object_format_gives_a_json_object(app):
    response = app.client().responses.create(model="demo", input="Give JSON", max_output_tokens=200,
                                             text={"format": {"type": "json_object"}})
    assert isinstance(json.loads(response.output_text), dict)


def test_a_required_function_call_then_its_output_in_a_second_turn(app):
    client = app.client()
    first = client.responses.create(model="demo", input=QUESTION, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=300)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and first.status == "completed"
    for call in calls:
        assert call.name == "get_weather" and call.call_id and call.id.startswith("fc_")
        Weather.model_validate_json(call.arguments)
    turn = [{"role": "user", "content": QUESTION}, *[c.model_dump(exclude_none=True) for c in calls],
            *[{"type": "function_call_output", "call_id": c.call_id, "output": "sunny, 21 C"} for c in calls]]
    second = client.responses.create(model="demo", input=turn, tools=TOOLS, max_output_tokens=5)
    assert second.output_text and second.usage.input_tokens > first.usage.input_tokens
    # the same conversation through chat completions renders the same prompt
    chat = client.chat.completions.create(model="demo", max_tokens=1, tools=[
        {"type": "function", "function": {k: v for k, v in TOOLS[0].items() if k != "type"}}], messages=[
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]},
        *[{"role": "tool", "tool_call_id": c.call_id, "content": "sunny, 21 C"} for c in calls]])
    assert chat.usage.prompt_tokens == second.usage.input_tokens


def test_a_named_function_call_streams_its_arguments(app):
    with app.client().responses.stream(model="demo", input=QUESTION, tools=TOOLS, max_output_tokens=300,
                                       tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    [call] = [item for item in final.output if item.type == "function_call"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert done.arguments == call.arguments and call.name == "get_weather"
    Weather.model_validate_json(call.arguments)


def test_previous_response_id_chains_the_conversation(app):
    client = app.client()
    first = client.responses.create(model="demo", input=QUESTION, max_output_tokens=6)
    second = client.responses.create(model="demo", input="And tomorrow?", previous_response_id=first.id,
                                     max_output_tokens=4)
    assert second.previous_response_id == first.id
    alone = client.responses.create(model="demo", input="And tomorrow?", max_output_tokens=4)
    assert second.usage.input_tokens > alone.usage.input_tokens + first.usage.output_tokens
    third = client.responses.create(model="demo", input="Thanks", previous_response_id=second.id, max_output_tokens=1)
    assert third.usage.input_tokens > second.usage.input_tokens
    # store: false is not kept
    unstored = client.responses.create(model="demo", input=QUESTION, max_output_tokens=2, store=False)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="demo", input="more", previous_response_id=unstored.id)
    assert unstored.id in info.value.body["message"] and info.value.body["param"] == "previous_response_id"


def test_an_unknown_previous_response_id_is_a_400_naming_it(app):
    status, _, body = http("POST", app.base + "/v1/responses", {"model": "demo", "input": "Hi",
                                                                "previous_response_id": "resp_nope"})
    assert status == 400 and "resp_nope" in body["error"]["message"]
    assert body["error"]["param"] == "previous_response_id" and body["error"]["type"] == "invalid_request_error"


def test_the_store_keeps_the_last_n_of_a_model(app):
    client = app.client()
    ids = [client.responses.create(model="demo", input="Hi", max_output_tokens=1).id for _ in range(4)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="demo", input="Hi", previous_response_id=ids[0], max_output_tokens=1)
    for kept in ids[1:]:
        assert client.responses.create(model="demo", input="Hi", previous_response_id=kept, max_output_tokens=1,
                                       store=False).status == "incomplete"


def test_a_reasoning_model_gives_a_reasoning_item(app):
    """Qwen3's template with a forced call: the demo model thinks first (it never closes the block)."""
    client = app.client()
    response = client.responses.create(model="qwen3", input=QUESTION, tools=TOOLS, tool_choice="required",
                                       max_output_tokens=12)
    [reasoning] = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text
    assert response.usage.output_tokens_details.reasoning_tokens == 12
    with client.responses.stream(model="qwen3", input=QUESTION, tools=TOOLS, tool_choice="required",
                                 max_output_tokens=12) as stream:
        events = list(stream)
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    done = next(e for e in events if e.type == "response.reasoning_text.done")
    assert deltas and "".join(deltas) == done.text
    # a reasoning item passed back is the assistant turn's reasoning
    again = client.responses.create(model="qwen3", max_output_tokens=1, input=[
        {"role": "user", "content": QUESTION}, reasoning.model_dump(exclude_none=True),
        {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}])
    assert again.usage.input_tokens > 0


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [5]}, "input[0]"),  # an item type the server cannot represent is skipped, not refused
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "tools": [{"type": "teleport"}], "tool_choice": {"type": "teleport"}}, "tool_choice"),
    ({"input": "Hi", "tools": [{"type": "web_search"}], "tool_choice": "required"}, "tool_choice"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
    ({"input": "Hi", "tools": TOOLS, "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name"),
    ({"input": "Hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"input": "Hi", "stream": "yes"}, "stream"),
    ({"input": "Hi", "store": 1}, "store"),
])
def test_malformed_requests_are_400s_naming_the_responses_field(app, body, param):
    status, _, reply = http("POST", app.base + "/v1/responses", {"model": "demo", **body})
    assert status == 400, reply
    assert reply["error"]["param"] == param and reply["error"]["type"] == "invalid_request_error", reply
    assert "function." not in reply["error"]["message"] and "response_format" not in reply["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_genai_cannot_compile_is_a_400_naming_text_format(app, stream):
    status, _, reply = http("POST", app.base + "/v1/responses", {
        "model": "demo", "input": "Hi", "stream": stream,
        "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": 5}}}})
    assert status == 400 and reply["error"]["param"] == "text.format.schema", reply
    assert reply["error"]["code"] == "invalid_grammar"


def test_requests_are_counted_under_the_route(app):
    app.client().responses.create(model="demo", input="Hi", max_output_tokens=1)
    metrics = app.metrics()
    assert value(samples(metrics), "openarc_requests_total", model="demo", endpoint="responses", status="200") >= 1
