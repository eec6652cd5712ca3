"""Coding agents unmodified: the request shapes Codex CLI and Claude Code send (tests/fixtures/agents/, each with its
source), replayed through the official openai and anthropic SDKs against the demo model, whole and streamed, with a
tool round trip each (a call, its output, the next turn); and LiteLLM, the gateway users put in front, on its
openai/, anthropic/ and Responses paths.

The demo model's weights are random: where it could only write a shape under constraint (a custom tool's grammar,
a named tool), the request names the tool, and the test checks the wire format the client parses: the
custom_tool_call item, its input against Codex's own Lark grammar (with the `lark` package), the events that add up
to it.
"""

from __future__ import annotations

import copy
import json
import os
import re

import anthropic
import lark
import pytest

from conftest import FIXTURES, Appliance, http, model_entry
from test_metrics import samples, value

AGENTS = FIXTURES / "agents"
APPLY_PATCH = (AGENTS / "codex_apply_patch.lark").read_text()
ALIASES = {"claude-*": "demo", "gpt-5*": "demo"}


def codex_request() -> dict:
    body = json.loads((AGENTS / "codex_request.json").read_text())
    del body["_source"]
    for tool in body["tools"]:
        if tool.get("format", {}).get("definition") == "@codex_apply_patch.lark":
            tool["format"]["definition"] = APPLY_PATCH
    return body


def claude_code_request() -> tuple[dict, dict]:
    recorded = json.loads((AGENTS / "claude_code_request.json").read_text())
    return recorded["headers"], recorded["body"]


def lark_parser(grammar: str, **options) -> lark.Lark:
    """lark's own parser for a grammar; its lexers refuse zero-width terminals such as Codex's /(.*)/, so those
    are written as the same language: an optional non-empty /(.+)/."""
    return lark.Lark(grammar.replace("/(.*)/", "/(.+)/?"), parser="lalr", **options)


def valid_prefix(grammar: str, text: str) -> bool:
    """`text` is the start of some sentence of the grammar (an input cut by max_output_tokens): lark's interactive
    LALR parser takes all its tokens (the last one complete, or a regex terminal that may go on)."""
    interactive = lark_parser(grammar).parse_interactive(text)
    try:
        interactive.exhaust_lexer()
    except lark.exceptions.UnexpectedInput:
        return False
    return bool(interactive.accepts())


@pytest.fixture(scope="module")
def app(demo_model, embedding_model, tmp_path_factory):
    models = [model_entry("demo", demo_model), model_entry("demo-embedding", embedding_model, kind="embedding")]
    appliance = Appliance({"server": {"model_aliases": ALIASES}, "models": models},
                          tmp_path_factory.mktemp("agents")).start()
    yield appliance
    appliance.stop()


def test_the_grammar_fixture_is_codex_s_and_lark_reads_it():
    # the real apply_patch grammar parses a real patch (with lark, as Codex's grammar is written for)
    patch = ("*** Begin Patch\n*** Add File: README.md\n+# project\n+\n*** Update File: src/app.py\n@@ def main():\n"
             "-    pass\n+    run()\n*** End Patch\n")
    assert lark_parser(APPLY_PATCH).parse(patch)
    assert valid_prefix(APPLY_PATCH, "*** Begin Patch\n*** Add File: READ")
    assert not valid_prefix(APPLY_PATCH, "*** Begin Patch\n+ no file yet\n")


# --- Codex CLI: /v1/responses ------------------------------------------------------------------------------------

def test_codex_request_as_recorded_is_answered_streamed(app):
    body = codex_request()
    body["max_output_tokens"] = 16
    events = list(app.client().responses.create(**body))  # tool_choice auto: the demo model writes prose
    assert events[0].type == "response.created" and events[-1].type in ("response.completed", "response.incomplete")
    assert events[-1].response.model == "gpt-5-codex" and events[-1].response.store is False
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_codex_request_naming_apply_patch_gets_a_custom_tool_call_in_its_grammar(app):
    body = codex_request()
    body.update(stream=False, tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=120)
    before = value(samples(app.metrics()), "openarc_ignored_tools_total", type="web_search")
    response = app.client().responses.create(**body)
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "apply_patch" and call.call_id and call.id.startswith("ctc_")
    assert call.input.startswith("*** Begin Patch\n*** ")  # the grammar, not the model's usual walk of words
    assert valid_prefix(APPLY_PATCH, call.input), call.input
    assert response.model == "gpt-5-codex"  # the name the client asked for, served by the aliased demo
    assert [t.type for t in response.tools] == ["function", "custom"]  # web_search left out ...
    assert value(samples(app.metrics()), "openarc_ignored_tools_total", type="web_search") == before + 1  # ... and counted


def test_codex_streamed_custom_call_deltas_add_up_and_the_next_turn_is_accepted(app):
    body = codex_request()
    body.update(tool_choice={"type": "custom", "name": "apply_patch"}, max_output_tokens=120)
    del body["stream"]
    events = list(app.client().responses.create(stream=True, **body))
    final = events[-1].response  # cut by max_output_tokens: response.incomplete (the SDK's stream() wants completed)
    assert events[-1].type == "response.incomplete" and final.incomplete_details.reason == "max_output_tokens"
    [call] = [item for item in final.output if item.type == "custom_tool_call"]
    deltas = [e.delta for e in events if e.type == "response.custom_tool_call_input.delta"]
    [done] = [e for e in events if e.type == "response.custom_tool_call_input.done"]
    # the deltas add up (how many there are depends on timing: the front merges the token frames that queued up
    # while the client read, which under load can be all of them)
    assert deltas and "".join(deltas) == done.input == call.input
    assert valid_prefix(APPLY_PATCH, call.input)
    # Codex's next turn: store false, its previous output replayed inline, the call's output after it
    replay = [item.model_dump(exclude_none=True) for item in final.output]
    body["input"] = body["input"] + replay + [{"type": "custom_tool_call_output", "call_id": call.call_id,
                                               "output": "Done!"}]
    body.update(tool_choice="auto", max_output_tokens=8)
    second = app.client().responses.create(**body)
    assert second.status in ("completed", "incomplete") and second.usage.input_tokens > final.usage.input_tokens


def test_a_bounded_lark_grammar_gives_an_input_that_parses_whole(app):
    grammar = ('start: begin_patch hunk end_patch\nbegin_patch: "*** Begin Patch" LF\nend_patch: "*** End Patch" LF?\n'
               'hunk: "*** Delete File: " filename LF\nfilename: /[a-z]{1,8}\\.(py|md)/\n%import common.LF\n')
    tool = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
            "format": {"type": "grammar", "syntax": "lark", "definition": grammar}}
    response = app.client().responses.create(model="demo", input="Delete a file.", tools=[tool],
                                             tool_choice="required", max_output_tokens=200)
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert lark_parser(grammar).parse(call.input), call.input
    assert response.status == "completed"


def test_a_regex_custom_tool_and_a_text_one(app):
    tools = [{"type": "custom", "name": "pick", "format": {"type": "grammar", "syntax": "regex",
                                                             "definition": "(red|green|blue)"}},
             {"type": "custom", "name": "note", "description": "free text"}]
    response = app.client().responses.create(model="demo", input="A colour?", tools=tools,
                                             tool_choice={"type": "custom", "name": "pick"}, max_output_tokens=100)
    [call] = [item for item in response.output if item.type == "custom_tool_call"]
    assert call.name == "pick" and call.input in ("red", "green", "blue")
    # the demo's tokenizer spends about 25 tokens on the call's tags: 60 cut the free text inside the input
    free = app.client().responses.create(model="demo", input="Note it.", tools=tools, max_output_tokens=60,
                                         tool_choice={"type": "custom", "name": "note"})
    [note] = [item for item in free.output if item.type == "custom_tool_call"]
    assert note.name == "note" and note.input and free.status == "incomplete"


def test_reasoning_items_carry_encrypted_content_that_comes_back(app):
    # the demo model does not think; an item Codex replays must still be taken, and rendered as reasoning
    body = codex_request()
    body.update(stream=False, max_output_tokens=4, tools=[body["tools"][0]])
    encrypted = "openarc:v1:" + __import__("base64").urlsafe_b64encode(b"I should list the files.").decode()
    body["input"] = body["input"] + [
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encrypted},
        {"type": "function_call", "call_id": "call_1", "name": "shell", "arguments": '{"command": ["ls"]}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "README.md"},
        {"type": "reasoning", "id": "rs_2", "summary": [], "encrypted_content": "gAAAAB-another-servers-blob"}]
    response = app.client().responses.create(**body)
    assert response.reasoning.summary == "auto" and response.output_text


def test_hosted_tools_alone_with_required_are_a_400_saying_why(app):
    status, _, reply = http("POST", app.base + "/v1/responses", {
        "model": "gpt-5", "input": "Hi", "tools": [{"type": "web_search"}, {"type": "file_search"}],
        "tool_choice": "required"})
    assert status == 400 and reply["error"]["param"] == "tool_choice", reply
    assert "web_search" in reply["error"]["message"] and "cannot run" in reply["error"]["message"]


@pytest.mark.parametrize("fmt, param, words", [
    ({"type": "grammar", "syntax": "lark", "definition": 'start: WORD\n%import common.WORD\n%ignore " "\n'},
     "tools[0].format.definition", "%ignore"),
    ({"type": "grammar", "syntax": "lark", "definition": "start: /(?=a)a/"}, "tools[0].format.definition",
     "lookahead"),
    ({"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"}, "tools[0].format.definition",
     "does not load"),
    ({"type": "grammar", "syntax": "ebnf", "definition": "root ::= \"a\""}, "tools[0].format.syntax", "lark or regex"),
    ({"type": "yaml"}, "tools[0].format.type", "text or grammar"),
    ({"type": "grammar", "syntax": "regex", "definition": "(unclosed"}, "tools", "Regex"),  # genai's own check
])
def test_bad_grammars_and_unknown_formats_are_400s_in_the_responses_shape(app, fmt, param, words):
    status, _, reply = http("POST", app.base + "/v1/responses", {
        "model": "demo", "input": "Hi", "tools": [{"type": "custom", "name": "edit", "format": fmt}],
        "tool_choice": "required"})
    assert status == 400, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and words in error["message"], error


# --- chat completions: custom tools there too ---------------------------------------------------------------------

def test_chat_completions_custom_tool_call_whole_and_streamed(app):
    tool = {"type": "custom", "custom": {"name": "pick", "format": {"type": "grammar", "grammar": {
        "syntax": "regex", "definition": "(yes|no)"}}}}
    client = app.client()
    reply = client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "Yes?"}],
                                           tools=[tool], tool_choice={"type": "custom", "custom": {"name": "pick"}},
                                           max_tokens=100)
    choice = reply.choices[0]
    [call] = choice.message.tool_calls
    assert call.type == "custom" and call.custom.name == "pick" and call.custom.input in ("yes", "no")
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Yes?"}], tools=[tool], stream=True, max_tokens=100,
        tool_choice={"type": "custom", "custom": {"name": "pick"}}))
    pieces = [c.model_dump() for chunk in chunks for delta in [chunk.choices[0].delta] if chunk.choices
              for c in delta.tool_calls or ()]  # the SDK's delta type has no `custom` field: it keeps it as sent
    assert pieces[0]["type"] == "custom" and pieces[0]["custom"]["name"] == "pick"
    assert "".join(p["custom"]["input"] for p in pieces) == call.custom.input
    # the next turn: the call and its output as chat messages
    again = client.chat.completions.create(model="demo", max_tokens=3, tools=[tool], messages=[
        {"role": "user", "content": "Yes?"}, {"role": "assistant", "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "noted"}])
    assert again.choices[0].message.content


# --- a call cut by max_tokens is a call, never the family's markup ------------------------------------------------

WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_by_max_tokens_is_a_tool_call_with_finish_reason_length(app, stream):
    client = app.client()
    kwargs = dict(model="demo", messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
                  tool_choice="required", max_tokens=60)  # the case: cut inside the arguments
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
        content = "".join(d.content or "" for d in deltas)
        calls = [c for d in deltas for c in d.tool_calls or ()]
        name = calls[0].function.name
        arguments = "".join(c.function.arguments or "" for c in calls)
        finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, finish = choice.message.content or "", choice.finish_reason
        [call] = choice.message.tool_calls
        name, arguments = call.function.name, call.function.arguments
    assert "<tool_call>" not in content and not content
    # the arguments as far as they went (the grammar lays JSON out with whatever whitespace the model picked)
    assert name == "get_weather" and arguments.startswith("{") and '"city"' in arguments and finish == "length"
    with pytest.raises(ValueError):
        json.loads(arguments)  # cut: no client should run it, and finish_reason "length" says so


def test_a_cut_call_on_the_responses_and_messages_routes(app):
    response = app.client().responses.create(
        model="demo", input="Weather?", max_output_tokens=60, tool_choice="required",
        tools=[{"type": "function", **WEATHER[0]["function"]}])
    assert response.status == "incomplete" and [i.type for i in response.output] == ["function_call"]
    message = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0).messages.create(
        model="claude-haiku-4-5", max_tokens=60, messages=[{"role": "user", "content": "Weather?"}],
        tool_choice={"type": "any"}, tools=[{"name": "get_weather", "input_schema": WEATHER[0]["function"]["parameters"]}])
    assert message.stop_reason == "max_tokens" and [b.type for b in message.content] == ["tool_use"]
    assert message.content[0].name == "get_weather"


# --- Claude Code: /v1/messages ------------------------------------------------------------------------------------

def claude(app) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=60)


@pytest.mark.parametrize("stream", [False, True])
def test_claude_code_request_reaches_the_aliased_model_and_does_a_tool_round_trip(app, stream):
    headers, body = claude_code_request()
    body = copy.deepcopy(body)
    body.pop("stream")
    body["tool_choice"] = {"type": "tool", "name": "Bash"}
    body["thinking"] = {"type": "disabled"}  # a forced tool choice and thinking exclude each other at Anthropic
    # the demo model never ends a string by itself: bounds on the strings let its call end
    for prop in body["tools"][0]["input_schema"]["properties"].values():
        if prop["type"] == "string":
            prop["maxLength"] = 12
    client = claude(app)
    if stream:
        with client.messages.stream(**body, extra_headers=headers) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**body, extra_headers=headers)
    assert message.model == "claude-sonnet-4-5-20250929"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "Bash" and isinstance(use.input.get("command"), str)
    body["messages"] = body["messages"] + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in message.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "README.md",
                                      "cache_control": {"type": "ephemeral"}}]}]
    body.pop("tool_choice")
    body["max_tokens"] = 8
    follow = client.messages.create(**body, extra_headers=headers)
    assert follow.content and prompt_tokens(follow.usage) > prompt_tokens(message.usage)


def prompt_tokens(usage) -> int:
    """The whole prompt as Anthropic's usage splits it (tokens read from the prefix cache are not input_tokens)."""
    return usage.input_tokens + (usage.cache_read_input_tokens or 0) + (usage.cache_creation_input_tokens or 0)


def test_claude_code_as_recorded_streams_with_thinking_on(app):
    headers, body = claude_code_request()
    with claude(app).messages.stream(**{k: v for k, v in body.items() if k != "stream"},
                                     extra_headers=headers) as events:
        message = events.get_final_message()
    assert message.model == body["model"] and message.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_an_unmatched_model_name_is_a_404_and_the_models_list_shows_configured_models_only(app):
    with pytest.raises(anthropic.NotFoundError):
        claude(app).messages.create(model="llama-unknown", max_tokens=4, messages=[{"role": "user", "content": "x"}])
    status, _, reply = http("POST", app.base + "/v1/responses", {"model": "o3-mini", "input": "Hi"})
    assert status == 404 and reply["error"]["code"] == "model_not_found"
    assert [m.id for m in app.client().models.list()] == ["demo", "demo-embedding"]
    # metrics never carry a client's name: the aliased request counts under the model it reached
    claude(app).messages.create(model="claude-opus-4-1", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    assert "claude-opus" not in app.metrics()
    assert re.search(r'openarc_requests_total\{endpoint="messages",key="none",model="demo",priority="interactive",status="200"\}', app.metrics())


# --- through a gateway: LiteLLM's openai/, anthropic/ and Responses paths -----------------------------------------

@pytest.fixture(scope="module")
def litellm():
    """LiteLLM, imported here (it takes seconds), with its model price map read from the package, not the network."""
    os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    import litellm as module
    return module


def test_litellm_openai_path_chat_streaming_tools_and_embeddings(app, litellm):
    base = dict(model="openai/demo", api_base=app.base + "/v1", api_key="unused")
    reply = litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=8, **base)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"
    chunks = list(litellm.completion(messages=[{"role": "user", "content": "Hi"}], max_tokens=8, stream=True,
                                     **base))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == reply.choices[0].message.content
    # the case the issue found through LiteLLM: a required call cut by max_tokens came back as markup in content
    cut = litellm.completion(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=WEATHER,
                             tool_choice="required", max_tokens=60, **base).choices[0]
    assert cut.finish_reason == "length" and "<tool_call>" not in (cut.message.content or "")
    assert cut.message.tool_calls[0].function.name == "get_weather"
    vectors = litellm.embedding(model="openai/demo-embedding", api_base=app.base + "/v1", api_key="unused",
                                input=["the cat sat", "a cat"])
    assert len(vectors.data) == 2 and len(vectors.data[0]["embedding"]) == 128


def test_litellm_anthropic_path_reaches_an_aliased_model(app, litellm):
    reply = litellm.completion(model="anthropic/claude-sonnet-4-5", api_base=app.base, api_key="unused",
                               messages=[{"role": "user", "content": "Hi"}], max_tokens=8)
    assert reply.choices[0].message.content and reply.choices[0].finish_reason == "length"


def test_litellm_responses_path(app, litellm):
    response = litellm.responses(model="openai/demo", api_base=app.base + "/v1", api_key="unused", input="Hi",
                                 max_output_tokens=8)
    assert response.output[0].content[0].text and response.status == "incomplete"
