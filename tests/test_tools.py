"""Tool calling through `openarc serve`: requests with tools, constrained calls in each model family's format,
parsing, streaming deltas the SDK assembles, conversation turns with tool results, and reasoning templates.

The demo model's weights are random, so a well-formed call with schema-valid arguments shows that constrained
decoding (genai structural tags in the model's own format) reached genai and the answer was parsed back.
"""

from __future__ import annotations

import json
import openai
import pytest
from pydantic import BaseModel, Field

from conftest import FIXTURES, Appliance, http, model_entry
from test_metrics import samples, value

TEMPLATES = FIXTURES / "chat-templates"
CHAT = [{"role": "user", "content": "What is the weather in Paris?"}]
DEEP: list = []
for _ in range(40):
    DEEP = [DEEP]


class WeatherArgs(BaseModel, extra="forbid"):
    city: str = Field(max_length=10)
    days: int = Field(ge=1, le=7)


class TimeArgs(BaseModel, extra="forbid"):
    zone: str = Field(max_length=8)


TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WeatherArgs.model_json_schema()}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time",
                                      "parameters": TimeArgs.model_json_schema()}},
]
ARGS = {"get_weather": WeatherArgs, "get_time": TimeArgs}
FAMILIES = {"qwen3": ("Qwen-Qwen3-0.6B.jinja", "hermes"), "coder": ("tool_chat_template_qwen3coder.jinja", "qwen3_coder"),
            "llama": ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json"),
            "mistral": ("mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja", "mistral")}


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    models = [model_entry("demo", demo_model), model_entry("sdpa", demo_model, pipeline="stateful"),
              model_entry("notools", demo_model, tool_parser="none"),
              model_entry("r1", demo_model, chat_template=str(TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja")),
              # the distills' original template: no <think> in it, only the </think> it splits history on
              model_entry("r1-original", demo_model,
                          chat_template=str(TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"))]
    from appliance.demo.catalog import build_demo_model
    varied = build_demo_model(tmp_path_factory.mktemp("models") / "varied", logit_scale=1.0)
    models.append(model_entry("varied", varied))
    models += [model_entry(name, demo_model, chat_template=str(TEMPLATES / template))
               for name, (template, _) in FAMILIES.items()]
    appliance = Appliance({"models": models}, tmp_path_factory.mktemp("tools")).start()
    yield appliance
    appliance.stop()


def assert_valid_calls(calls, names=ARGS) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        ARGS[call.function.name].model_validate_json(call.function.arguments)
        assert call.function.name in names


def call_deltas(chunks) -> list:
    """The tool-call delta of every streamed chunk that has one, in order."""
    return [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]


def test_status_shows_each_models_formats_detected_or_configured(app):
    status = {m["name"]: m for m in app.status()["models"]}
    assert (status["demo"]["tool_parser"], status["demo"]["reasoning_parser"]) == ("hermes", None)
    assert status["notools"]["tool_parser"] is None
    assert (status["qwen3"]["tool_parser"], status["qwen3"]["reasoning_parser"]) == ("hermes", "qwen3")
    assert (status["r1"]["tool_parser"], status["r1"]["reasoning_parser"]) == (None, "deepseek_r1")
    assert (status["r1-original"]["tool_parser"], status["r1-original"]["reasoning_parser"]) == (None, "deepseek_r1")
    for name, (_, family) in FAMILIES.items():
        assert status[name]["tool_parser"] == family


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}  # Qwen3's template closes the think block


@pytest.mark.parametrize("model", ["demo", "sdpa", *FAMILIES])
def test_required_tool_choice_returns_schema_valid_calls(app, model):
    reply = app.client().chat.completions.create(model=model, messages=CHAT, tools=TOOLS, tool_choice="required",
                                                 max_tokens=300, extra_body=NO_THINKING)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert_valid_calls(choice.message.tool_calls)


@pytest.mark.parametrize("model", ["demo", "coder", "mistral"])
def test_a_named_function_is_the_one_called_streamed_too(app, model):
    named = {"type": "function", "function": {"name": "get_time"}}
    client = app.client()
    reply = client.chat.completions.create(model=model, messages=CHAT, tools=TOOLS, tool_choice=named, max_tokens=300)
    assert [c.function.name for c in reply.choices[0].message.tool_calls] == ["get_time"]
    assert_valid_calls(reply.choices[0].message.tool_calls, ["get_time"])
    # the SDK's stream helper assembles the deltas into the same shape
    with client.chat.completions.stream(model=model, messages=CHAT, tools=TOOLS, tool_choice=named,
                                        max_tokens=300) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    assert final.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(final.choices[0].message.tool_calls, ["get_time"])


def test_the_sdks_pydantic_tools_come_back_parsed(app):
    class GetWeather(WeatherArgs):
        """Weather forecast"""
    reply = app.client().chat.completions.parse(model="demo", messages=CHAT, tool_choice="required", max_tokens=300,
                                                tools=[openai.pydantic_function_tool(GetWeather)])
    call = reply.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_streamed_deltas_have_openais_shape(app):
    chunks = list(app.client().chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, stream=True,
                                                       tool_choice="required", max_tokens=300))
    deltas = call_deltas(chunks)
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.id and first.type == "function" and first.function.name
    assert all(d.id is None and d.function.name is None for d in rest if d.index == first.index)
    arguments = "".join(d.function.arguments or "" for d in deltas if d.index == 0)
    ARGS[first.function.name].model_validate_json(arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


NOTE_TOOL = {"type": "function", "function": {"name": "write_note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "minLength": 200, "maxLength": 260}},
    "required": ["text"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def paced(demo_model, tmp_path_factory):
    """The JSON tool-call families on workers that take 5 ms per engine step: every step's text is its own frame
    (longer than the worker's 2 ms hold) and the front is never behind, however busy the machine."""
    models = [model_entry("demo", demo_model)] + [
        model_entry(name, demo_model, chat_template=str(TEMPLATES / FAMILIES[name][0])) for name in ("llama", "mistral")]
    appliance = Appliance({"models": models}, tmp_path_factory.mktemp("paced"),
                          env={"OPENARC_DEBUG_STEP_DELAY_S": "0.005"}).start()
    yield appliance
    appliance.stop()


@pytest.mark.parametrize("model", ["demo", "llama", "mistral"])
def test_enforced_calls_stream_their_arguments_as_they_are_written(paced, model):
    # A named call's shape is the grammar's, so its arguments go out fragment by fragment (a call the model
    # chooses freely is held until it parses): 200+ characters take dozens of engine steps, so dozens of fragments.
    named = {"type": "function", "function": {"name": "write_note"}}
    chunks = list(paced.client().chat.completions.create(model=model, messages=CHAT, tools=[NOTE_TOOL], stream=True,
                                                         tool_choice=named, max_tokens=600))
    deltas = call_deltas(chunks)
    assert deltas[0].id and deltas[0].function.name == "write_note" and deltas[0].function.arguments == ""
    fragments = [d.function.arguments for d in deltas[1:]]
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in deltas[1:])
    assert len(fragments) >= 10, fragments
    arguments = json.loads("".join(fragments))
    assert set(arguments) == {"text"} and 200 <= len(arguments["text"]) <= 260
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_call_cut_off_by_max_tokens_does_not_finish_as_tool_calls(app):
    # The call's head takes about 45 tokens on the demo model and its arguments 50 more: 70 ends inside them. What
    # arrived streams as it was written, but the finish says "length", so no client runs a call with half its
    # arguments.
    named = {"type": "function", "function": {"name": "write_note"}}
    calls_before = value(samples(app.metrics()), "openarc_tool_calls_total", model="demo")
    chunks = list(app.client().chat.completions.create(model="demo", messages=CHAT, tools=[NOTE_TOOL], stream=True,
                                                       tool_choice=named, max_tokens=70))
    deltas = call_deltas(chunks)
    assert deltas[0].function.name == "write_note"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert arguments.startswith("{") and not arguments.rstrip().endswith("}")
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert value(samples(app.metrics()), "openarc_tool_calls_total", model="demo") == calls_before  # no call counted


def test_parallel_tool_calls_false_allows_one_call(app):
    """On the demo variant whose samples vary, sampling sometimes goes on after a call (a separator instead of
    EOS): with parallel calls allowed some answers hold several calls; with parallel_tool_calls false none does."""
    def calls(seed, parallel):
        reply = app.client().chat.completions.create(model="varied", messages=CHAT, tools=TOOLS, tool_choice="required",
                                                     temperature=2.0, seed=seed, parallel_tool_calls=parallel,
                                                     max_tokens=600)
        assert reply.choices[0].finish_reason == "tool_calls", reply
        assert_valid_calls(reply.choices[0].message.tool_calls)
        return len(reply.choices[0].message.tool_calls)
    seeds = range(1, 7)
    assert max(calls(seed, True) for seed in seeds) > 1
    assert {calls(seed, False) for seed in seeds} == {1}


def test_several_calls_streamed_as_written_are_the_calls_of_the_whole_answer(app):
    # Same seed, same tokens: the SDK's assembly of the streamed deltas (each call's head, then its arguments in
    # fragments, call after call) gives the calls the whole answer holds; the whole answer's arguments are
    # re-serialised, the streamed ones are the model's own text, so they are compared as JSON.
    def ask(seed):
        return dict(model="varied", messages=CHAT, tools=TOOLS, tool_choice="required", temperature=2.0, seed=seed,
                    max_tokens=600)
    client = app.client()
    for seed in range(1, 7):
        whole = client.chat.completions.create(**ask(seed)).choices[0].message.tool_calls
        if len(whole) > 1:
            break
    else:
        raise AssertionError("no seed gave several calls")  # test_parallel_tool_calls_false_allows_one_call's seeds
    with client.chat.completions.stream(**ask(seed)) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in streamed] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert len({c.id for c in streamed}) == len(streamed)


def test_two_turn_conversation_with_a_tool_result_reaches_the_template(app, demo_model):
    import openvino_genai
    client = app.client()
    first = client.chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, tool_choice="required",
                                           max_tokens=300).choices[0].message
    call = first.tool_calls[0]
    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                      {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    second = client.chat.completions.create(model="demo", messages=history, tools=TOOLS, max_tokens=5)
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls
    # The prompt the model saw is the template rendering of that conversation with the call's arguments as an
    # object and the tool result in a <tool_response> turn, token for token.
    tokenizer = openvino_genai.Tokenizer(str(demo_model))
    expected = [*CHAT, {"role": "assistant", "content": "", "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": call.function.name, "arguments": json.loads(call.function.arguments)}}]},
        {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": "sunny, 21 C"}]
    prompt = tokenizer.apply_chat_template(expected, add_generation_prompt=True, tools=TOOLS)
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt and call.function.arguments in prompt
    tokens = tokenizer.encode(prompt, add_special_tokens=False).input_ids.get_shape()[1]
    assert second.usage.prompt_tokens == tokens


def test_auto_lets_the_model_write_prose(app):
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, max_tokens=10)
    assert reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "length" and reply.choices[0].message.content


def test_a_call_the_model_writes_itself_is_parsed_and_a_malformed_one_is_content(app):
    client = app.client()
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[a-z]{3,8}", "days": [1-7]\}\}\n</tool_call>'
    reply = client.chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": call}})
    assert reply.choices[0].finish_reason == "tool_calls"
    assert_valid_calls(reply.choices[0].message.tool_calls)
    broken = r'Let me see\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": [a-z]{3,8}\n</tool_call>'
    reply = client.chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": broken}})
    message = reply.choices[0].message
    assert message.tool_calls is None and reply.choices[0].finish_reason == "stop"
    assert message.content.startswith("Let me see. <tool_call>")


def test_a_template_that_opens_the_think_block_splits_reasoning(app):
    client = app.client()
    reply = client.chat.completions.create(model="r1", messages=CHAT, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": r"[a-z ]{5,30}</think>\n\nOK [a-z]{2,5}"}})
    message = reply.choices[0].message
    assert message.reasoning_content and "<think>" not in message.reasoning_content
    assert message.content.startswith("OK "), message
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens


def test_a_template_that_only_strips_reasoning_still_splits_the_think_block_the_model_opens(app):
    """DeepSeek-R1-Distill-Llama-8B's original template never writes <think>: the model opens the block itself,
    and it goes to reasoning_content, not into content (where it landed before the template was detected)."""
    reply = app.client().chat.completions.create(
        model="r1-original", messages=CHAT, max_tokens=100,
        extra_body={"structured_outputs": {"regex": r"<think>\n[a-z ]{5,30}\n</think>\n\nOK [a-z]{2,5}"}})
    message = reply.choices[0].message
    assert message.reasoning_content and "think>" not in message.reasoning_content
    assert message.content.startswith("OK ") and "think>" not in message.content, message
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens


@pytest.mark.parametrize("model, field", [("qwen3", "tools"), ("qwen3", "response_format"),
                                          ("r1", "response_format")])
def test_a_reasoning_model_thinks_before_a_forced_answer(app, model, field):
    """Forced calls and response_format apply after the think block (the template's or the model's own): the
    demo model, which never closes the block by itself, is made to open one and then thinks on until max_tokens."""
    extra = ({"tools": TOOLS, "tool_choice": "required"} if field == "tools"
             else {"response_format": {"type": "json_object"}})
    reply = app.client().chat.completions.create(model=model, messages=CHAT, max_tokens=12, **extra)
    message = reply.choices[0].message
    assert message.reasoning_content and not message.content and not message.tool_calls, message
    assert not message.reasoning_content.lstrip().startswith(("{", "<tool_call>"))  # free thought, not the answer
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens_details.reasoning_tokens == 12
    # with thinking off, the same request answers at once
    if model == "qwen3":
        reply = app.client().chat.completions.create(model=model, messages=CHAT, max_tokens=300, extra_body=NO_THINKING,
                                                     **extra)
        assert reply.choices[0].message.tool_calls or json.loads(reply.choices[0].message.content) is not None


def test_structured_outputs_constrain_a_reasoning_models_whole_answer(app):
    reply = app.client().chat.completions.create(model="qwen3", messages=CHAT, max_tokens=20,
                                                 extra_body={"structured_outputs": {"regex": "[a-z]{5}"}})
    assert reply.choices[0].message.content and len(reply.choices[0].message.content) == 5


def test_chat_template_kwargs_reach_the_template(app):
    client = app.client()
    on = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=1)
    off = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.usage.prompt_tokens > on.usage.prompt_tokens  # the empty <think>\n\n</think>\n\n block


def test_a_conversation_the_template_refuses_is_a_400(app):
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
             for i in range(2)]
    history = CHAT + [{"role": "assistant", "content": None, "tool_calls": calls}]
    with pytest.raises(openai.BadRequestError) as info:  # Llama 3's template allows one call per message
        app.client().chat.completions.create(model="llama", messages=history, tools=TOOLS)
    assert "single tool-calls" in info.value.body["message"]
    assert app.client().chat.completions.create(model="qwen3", messages=history, tools=TOOLS, max_tokens=2)


def counters(app) -> tuple[float, float]:
    """(tool calls returned, requests constrained for tool calls) of the demo model so far."""
    scrape = samples(app.metrics())
    return (value(scrape, "openarc_tool_calls_total", model="demo"),
            value(scrape, "openarc_structured_requests_total", kind="tool_calls", model="demo"))


def test_auto_with_a_strict_tool_is_constrained_only_once_a_call_starts(app):
    strict = [{"type": "function", "function": {**TOOLS[0]["function"], "strict": True}}, TOOLS[1]]
    calls, constrained = counters(app)
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, tools=strict, max_tokens=10)
    assert reply.choices[0].message.content and reply.choices[0].message.tool_calls is None
    assert counters(app) == (calls, constrained + 1)  # constrained (the trigger arms the grammar), and no call


def test_tool_calls_are_counted(app):
    calls, constrained = counters(app)
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, tools=TOOLS, tool_choice="required",
                                                 max_tokens=300)
    assert counters(app) == (calls + len(reply.choices[0].message.tool_calls), constrained + 1)


def test_tools_on_a_model_without_a_tool_format_are_a_400_naming_the_key(app):
    with pytest.raises(openai.BadRequestError) as info:
        app.client().chat.completions.create(model="notools", messages=CHAT, tools=TOOLS)
    assert "notools" in info.value.body["message"] and "tool_parser" in info.value.body["message"]
    # tool_choice none needs no format: the tools stay out of the prompt
    reply = app.client().chat.completions.create(model="notools", messages=CHAT, tools=TOOLS, tool_choice="none",
                                                 max_tokens=3)
    assert reply.choices[0].message.content


@pytest.mark.parametrize("body, param", [
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": {"a": 1}}, "tools"),
    ({"tools": TOOLS, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "default": DEEP}}}]},
     "tools[0].function.parameters"),
])
def test_malformed_tool_requests_are_refused_by_name(app, body, param):
    status, _, reply = http("POST", app.base + "/v1/chat/completions", {"model": "demo", "messages": CHAT, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_parallel_tool_calls_false_returns_the_first_of_the_calls_written_under_plain_auto(app):
    """Under plain `auto` nothing constrains the calls: the model writes two (a regex makes it), and with
    parallel_tool_calls false the answer holds the first one only, whole or streamed."""
    call = r'\{{"name": "{name}", "arguments": \{{"zone": "[a-z]{{3}}"\}}\}}'
    two = (r'<tool_call>\n' + call.format(name="get_time") + r'\n</tool_call>\n<tool_call>\n' +
           call.format(name="get_time") + r'\n</tool_call>')
    ask = dict(model="demo", messages=CHAT, tools=TOOLS, max_tokens=300,
               extra_body={"structured_outputs": {"regex": two}})
    client = app.client()
    assert len(client.chat.completions.create(**ask).choices[0].message.tool_calls) == 2
    reply = client.chat.completions.create(**ask, parallel_tool_calls=False)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert len(reply.choices[0].message.tool_calls) == 1
    assert_valid_calls(reply.choices[0].message.tool_calls)
    with client.chat.completions.stream(**ask, parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert len(streamed) == 1
