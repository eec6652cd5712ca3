"""The request shapes current agents send (issue 42), through `openarc serve` with the official SDKs: Claude Code
2.1.332's first request (a system message inside `messages`, output_config, adaptive thinking with display omitted,
deferred tools) and Codex 0.171's (a `namespace` of tools, a client `tool_search`), both recorded shapes in
tests/fixtures/agents/ with their sources; the server's line for every refusal, and `HEAD /`.

The demo model's weights are random: a call to a namespaced tool or to tool_search is forced with `tool_choice`
(constrained decoding writes its shape), and the test checks what the client parses: the item's type, its bare
name and namespace, whole and streamed, and the next turn replaying it.
"""

from __future__ import annotations

import copy
import json

import anthropic
import pytest

from conftest import FIXTURES, Appliance, http, model_entry
from test_messages import QUESTION
from test_metrics import samples, value

AGENTS = FIXTURES / "agents"
TEMPLATES = FIXTURES / "chat-templates"
ALIASES = {"claude-*": "demo", "gpt-5*": "demo", "demo-coder": "demo"}
# a template of each form a mid-conversation system message takes (tests/test_system_turns.py): a system turn, a user turn
FORMS = {"qwen3": "Qwen-Qwen3-0.6B.jinja", "mistral": "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja"}


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    models = [model_entry("demo", demo_model), model_entry("small", demo_model, max_context=40)] + [
        model_entry(name, demo_model, chat_template=str(TEMPLATES / template)) for name, template in FORMS.items()]
    appliance = Appliance({"server": {"model_aliases": ALIASES}, "models": models},
                          tmp_path_factory.mktemp("shapes")).start()
    yield appliance
    appliance.stop()


def claude_code() -> tuple[dict, dict]:
    recorded = json.loads((AGENTS / "claude_code_2.1.332_request.json").read_text())
    return recorded["headers"], recorded["body"]


def codex(variant: str) -> dict:
    body = json.loads((AGENTS / "codex_0.171_requests.json").read_text())[variant]
    for tool in body["tools"]:
        if tool.get("format", {}).get("definition") == "@codex_apply_patch.lark":
            tool["format"]["definition"] = (AGENTS / "codex_apply_patch.lark").read_text()
    return body


def create(app, body: dict):
    """responses.create with Codex's body as sent: fields the SDK does not name go as they are (extra_body)."""
    known = {k: v for k, v in body.items() if k != "client_metadata"}
    return app.client().responses.create(**known, extra_body={"client_metadata": body["client_metadata"]}
                                         if "client_metadata" in body else None)


def anthropic_client(app) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=120)


# --- Claude Code 2.1.332: /v1/messages ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["claude-opus-5-5", "qwen3", "mistral"])  # the demo's, a system turn, a user turn
def test_claude_code_s_first_request_is_answered_streamed_with_its_system_message_in_place(app, model):
    headers, body = claude_code()
    body.update(model=model, max_tokens=16)  # 64000 as sent is fitted to the context; 16 keeps the test short
    with anthropic_client(app).messages.stream(extra_headers=headers, **{k: v for k, v in body.items()
                                                                         if k != "stream"}) as stream:
        events = [event.type for event in stream]
        message = stream.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert message.model == model and message.content and message.stop_reason in ("end_turn", "max_tokens")
    # thinking asked with display: omitted comes back empty (the demo rarely thinks; if it does, no text leaks)
    assert all(block.thinking == "" for block in message.content if block.type == "thinking")
    # the count and the answer render the same prompt, the system message at its place in both
    counted = anthropic_client(app).messages.count_tokens(
        model=model, system=body["system"], messages=body["messages"], tools=body["tools"],
        thinking=body["thinking"], extra_headers=headers)
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens


def test_the_system_message_adds_to_the_prompt_where_it_stands(app):
    """The next turn's prompt begins with this turn's up to the answer: the system message, rendered after the
    user's turn, is part of the prefix the cache keeps, not a change to the top of the prompt."""
    headers, body = claude_code()
    without = copy.deepcopy(body)
    without["messages"] = without["messages"][:1]
    client = anthropic_client(app)
    for model in ("qwen3", "mistral"):
        kept = client.messages.count_tokens(model=model, messages=body["messages"], system=body["system"])
        bare = client.messages.count_tokens(model=model, messages=without["messages"], system=body["system"])
        assert kept.input_tokens > bare.input_tokens + 10
    # each worker said at load which form its template takes
    assert "model qwen3: a system message in mid-conversation is rendered as a system turn at its place" in app.logs()
    assert "model mistral: a system message in mid-conversation is rendered as a user turn at its place" in app.logs()


def test_chat_completions_and_responses_place_a_mid_conversation_system_message_the_same_way(app):
    """The form is the worker's, so every chat route gets it: on Mistral's template, which drops a system message
    after the first, the reminder still reaches the prompt (as a marked user turn)."""
    reminder = "Mind the tests and keep every answer under three lines."
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "List the files."}]
    sizes = []
    for messages in (chat, chat + [{"role": "system", "content": reminder}]):
        reply = app.client().chat.completions.create(model="mistral", max_tokens=1, messages=messages)
        sizes.append(reply.usage.prompt_tokens)
    assert sizes[1] > sizes[0] + 10
    response = app.client().responses.create(model="mistral", max_output_tokens=1, instructions="Be terse.", input=[
        {"role": "user", "content": "List the files."}, {"role": "developer", "content": reminder}])
    assert response.usage.input_tokens == sizes[1]


def test_deferred_tools_are_served_and_a_server_tool_is_left_out_and_counted(app):
    headers, body = claude_code()
    deferred = {"name": "get_weather", "description": "Weather forecast", "defer_loading": True,
                "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
                                 "required": ["city"], "additionalProperties": False}}
    tools = body["tools"] + [deferred, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}]
    before = value(samples(app.metrics()), "openarc_ignored_tools_total", type="web_search_20250305") or 0
    message = anthropic_client(app).messages.create(
        model="demo", max_tokens=200, messages=QUESTION, tools=tools, extra_headers=headers,
        tool_choice={"type": "tool", "name": "get_weather"})  # a deferred tool, called: its definition is served
    [use] = [block for block in message.content if block.type == "tool_use"]
    assert use.name == "get_weather" and set(use.input) == {"city"}, message
    assert value(samples(app.metrics()), "openarc_ignored_tools_total", type="web_search_20250305") == before + 1
    with pytest.raises(anthropic.BadRequestError) as info:  # forcing the tool the server cannot run
        anthropic_client(app).messages.create(model="demo", max_tokens=5, messages=QUESTION, tools=tools,
                                              tool_choice={"type": "tool", "name": "web_search"})
    assert "server tool" in info.value.body["error"]["message"]


def test_block_types_the_model_does_not_need_are_skipped_and_counted(app):
    before = value(samples(app.metrics()), "openarc_ignored_inputs_total", endpoint="messages",
                   type="container_upload") or 0
    message = anthropic_client(app).messages.create(model="demo", max_tokens=3, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "container_upload", "file_id": "f1"}]}])
    assert message.content
    assert value(samples(app.metrics()), "openarc_ignored_inputs_total", endpoint="messages",
                 type="container_upload") == before + 1


def test_a_prompt_over_the_window_gets_anthropic_s_words(app):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client(app).messages.create(model="small", max_tokens=64000,
                                              messages=[{"role": "user", "content": "Hi " * 60}])
    error = info.value.body["error"]
    assert error["type"] == "invalid_request_error"
    words = error["message"].split()  # prompt is too long: N tokens > 39 maximum (the window is 40)
    assert words[:4] == ["prompt", "is", "too", "long:"] and words[5:] == ["tokens", ">", "39", "maximum"]
    assert int(words[4]) > 40


def test_output_config_format_gives_an_object_of_its_schema(app):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
              "additionalProperties": False}
    message = anthropic_client(app).messages.create(
        model="demo", max_tokens=100, messages=QUESTION,
        output_config={"effort": "low", "format": {"type": "json_schema", "schema": schema}})
    assert set(json.loads(message.content[-1].text)) == {"city"}


# --- Codex 0.171: /v1/responses ----------------------------------------------------------------------------------

def test_codex_s_first_requests_are_answered_streamed(app):
    for variant in ("configured", "catalog"):
        body = codex(variant)
        body["max_output_tokens"] = 8  # Codex sends none; 8 keeps the test short
        events = list(create(app, body))
        assert events[0].type == "response.created", variant
        assert events[-1].type in ("response.completed", "response.incomplete"), (variant, events[-1])
        tools = [tool.type for tool in events[-1].response.tools]
        assert ("namespace" in tools) == (variant == "configured") and ("tool_search" in tools) == (variant != "configured")


def test_a_namespaced_call_comes_back_with_its_bare_name_and_namespace_whole_streamed_and_replayed(app):
    body = codex("configured")
    body.update(max_output_tokens=120, tool_choice={"type": "function", "name": "spawn_agent",
                                                    "namespace": "multi_agent_v1"})
    # a random model never ends a free string: the task is bounded here (the namespace's shape is Codex's)
    [namespace] = [tool for tool in body["tools"] if tool["type"] == "namespace"]
    namespace["tools"][0]["parameters"]["properties"] = {"task": {"type": "string", "maxLength": 12}}
    events = list(create(app, body))
    added = [e.item for e in events if e.type == "response.output_item.added" and e.item.type == "function_call"]
    done = [e.item for e in events if e.type == "response.output_item.done" and e.item.type == "function_call"]
    assert added and done
    for item in (added[0], done[0]):
        assert (item.name, item.namespace) == ("spawn_agent", "multi_agent_v1")
    call = done[0]
    assert "task" in json.loads(call.arguments)
    # whole, too
    whole = create(app, {**body, "stream": False})
    [item] = [i for i in whole.output if i.type == "function_call"]
    assert (item.name, item.namespace) == ("spawn_agent", "multi_agent_v1")
    # Codex replays the call with its namespace and its output: the next turn renders the same joined name
    body.update(tool_choice="auto", max_output_tokens=4, input=body["input"] + [
        call.model_dump(exclude_none=True), {"type": "function_call_output", "call_id": call.call_id,
                                             "output": "agent a1 started"}])
    second = create(app, {**body, "stream": False})
    assert second.status in ("completed", "incomplete")
    assert second.usage.input_tokens > events[-1].response.usage.input_tokens


def test_tool_search_is_a_function_whose_call_is_a_tool_search_call_and_its_output_loads_tools(app):
    body = codex("catalog")
    body.update(max_output_tokens=150, tool_choice={"type": "tool_search"})
    # a random model never ends a free string: its query is bounded here (the tool's shape is Codex's)
    [search_tool] = [tool for tool in body["tools"] if tool["type"] == "tool_search"]
    search_tool["parameters"]["properties"] = {"query": {"type": "string", "maxLength": 12}}
    events = list(create(app, body))
    done = [e.item for e in events if e.type == "response.output_item.done"]
    searches = [item for item in done if item.type == "tool_search_call"]
    assert searches, [item.type for item in done]
    search = searches[0]
    assert search.execution == "client" and search.call_id and isinstance(search.arguments, dict)
    assert "query" in search.arguments
    assert not [e for e in events if e.type == "response.function_call_arguments.delta"]
    # Codex runs the search and sends its output: the loaded namespace's tools can be called from then on
    loaded = {"type": "namespace", "name": "calendar", "description": "Calendar tools.", "tools": [
        {"type": "function", "name": "create_event", "description": "Creates an event.", "strict": False,
         "defer_loading": True, "parameters": {"type": "object", "properties": {
             "title": {"type": "string", "maxLength": 12}},
                                               "required": ["title"], "additionalProperties": False}}]}
    body.update(stream=False, input=body["input"] + [
        search.model_dump(exclude_none=True),
        {"type": "tool_search_output", "call_id": search.call_id, "status": "completed", "execution": "client",
         "tools": [loaded]}], tool_choice={"type": "function", "name": "create_event", "namespace": "calendar"})
    second = create(app, body)
    [call] = [item for item in second.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("create_event", "calendar") and "title" in json.loads(call.arguments)


def test_tool_types_and_items_the_server_cannot_run_are_left_out_counted_and_only_forcing_one_is_a_400(app):
    before = samples(app.metrics())
    body = {"model": "demo", "max_output_tokens": 3, "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}},
        {"type": "tool_search", "execution": "server"}, {"type": "brand_new_tool", "name": "x"}],
        "input": [{"role": "user", "content": "Hi"}, {"type": "item_reference", "id": "msg_1"},
                  {"type": "brand_new_item", "data": 1}]}
    response = app.client().responses.create(**body)
    assert response.output_text is not None and [t.type for t in response.tools] == ["function"]
    after = samples(app.metrics())
    for kind in ("tool_search", "brand_new_tool"):
        assert value(after, "openarc_ignored_tools_total", type=kind) == \
               (value(before, "openarc_ignored_tools_total", type=kind) or 0) + 1
    assert value(after, "openarc_ignored_inputs_total", endpoint="responses", type="brand_new_item") == \
           (value(before, "openarc_ignored_inputs_total", endpoint="responses", type="brand_new_item") or 0) + 1
    assert "left out tools of type brand_new_tool" in app.logs()  # logged once per type
    status, _, reply = http("POST", app.base + "/v1/responses", {**body, "tool_choice": {"type": "brand_new_tool"}})
    assert status == 400 and reply["error"]["param"] == "tool_choice" and "cannot run" in reply["error"]["message"]


# --- The server's side: refusals logged, HEAD / ------------------------------------------------------------------

def test_every_refusal_leaves_a_line_without_the_body(app):
    secret = "do-not-log-this-prompt"
    status, _, _ = http("POST", app.base + "/v1/messages", {"model": "demo", "max_tokens": 5, "messages": [
        {"role": "tool", "content": secret}]})
    assert status == 400
    status, _, _ = http("POST", app.base + "/v1/chat/completions", {"model": "nope", "messages": [
        {"role": "user", "content": secret}]})
    assert status == 404
    status, _, _ = http("GET", app.base + "/v1/nothing-here")
    assert status == 404
    logs = app.logs()
    assert "refused POST /v1/messages: 400 code=invalid_request param=messages[0].role model=demo key=-" in logs
    assert "refused POST /v1/chat/completions: 404 code=model_not_found" in logs
    assert "refused GET /v1/nothing-here: 404 code=not_found" in logs
    assert secret not in logs


def test_a_refusal_line_cannot_be_forged_through_the_path(app):
    """The path is decoded: a client's %0A would start a log line of its own making (a forged refusal, a fake
    event for whoever reads the log), with or without a key."""
    forged = "2026-01-01 00:00:00,000 INFO openarc.server: FORGED"
    status, _, _ = http("GET", app.base + "/v1/nothing%0A" + forged.replace(" ", "%20") + "%0D")
    assert status == 404
    lines = app.logs().splitlines()
    assert not any(line.startswith(forged) for line in lines)
    assert any("refused GET /v1/nothing" in line and "FORGED" in line for line in lines)  # one line, escaped


def test_head_and_get_of_the_root_say_what_answers(app):
    status, headers, _ = http("HEAD", app.base + "/")
    assert status == 200
    status, _, body = http("GET", app.base + "/")
    assert status == 200 and body["name"] == "openarc" and body["api"] == "/v1" and body["version"]
