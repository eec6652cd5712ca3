"""The Responses and Messages translations as pure functions, without processes: requests into the chat request the
generation path runs, an answer's chat deltas into each dialect's events and whole object, the response store."""

from __future__ import annotations

import json

import pytest

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.messages import MessageStream, count_frame, parse_messages
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses import RESPONSES, ResponseStream, parse_responses
from appliance.front.request import Event, RequestFailed

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HEAD = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                        "function": {"name": "get_weather", "arguments": ""}}]}
DELTAS = [{"reasoning_content": "Let me "}, {"reasoning_content": "think."}, {"content": "Sure"}, {"content": "."},
          HEAD, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
          {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}]
DONE = Event("done", finish_reason="stop", prompt_tokens=20, completion_tokens=9, reasoning_tokens=3)


FIRST = Event("tokens", text="", n=1, prompt_tokens=20)


def run(stream, deltas=DELTAS, done=DONE, finish_reason="tool_calls") -> list:
    events = stream.start(FIRST)
    for delta in deltas:
        events += stream.feed(delta)
    return events + stream.finish(done, finish_reason)


# --- Responses ------------------------------------------------------------------------------------------------

def responses_request(**body):
    return parse_responses({"model": "m", "input": "Hi", **body}, ResponseStore(4), "none")


def test_a_responses_answer_streams_items_in_order_and_the_whole_response_matches():
    stream = ResponseStream(responses_request())
    events = run(stream)
    types = [name for name, _ in events]
    assert types == ["response.created", "response.in_progress",
                     "response.output_item.added", "response.content_part.added",
                     "response.reasoning_text.delta", "response.reasoning_text.delta", "response.reasoning_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.content_part.added",
                     "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.output_item.added", "response.function_call_arguments.delta",
                     "response.function_call_arguments.delta", "response.function_call_arguments.done",
                     "response.output_item.done", "response.completed"]
    assert all(data["type"] == name for name, data in events)
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    response = stream.response
    assert events[-1][1]["response"] == response and response["status"] == "completed"
    reasoning, message, call = response["output"]
    assert reasoning["type"] == "reasoning" and reasoning["content"] == [{"type": "reasoning_text",
                                                                          "text": "Let me think."}]
    assert message["content"][0]["text"] == "Sure." and message["role"] == "assistant"
    assert (call["type"], call["call_id"], call["name"], json.loads(call["arguments"])) == \
           ("function_call", "call_1", "get_weather", {"city": "Paris"})
    assert response["usage"] == {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0},
                                 "output_tokens": 9, "output_tokens_details": {"reasoning_tokens": 3},
                                 "total_tokens": 29}
    # the item an output_item.done carries is the one in the response
    assert [data["item"] for name, data in events if name == "response.output_item.done"] == response["output"]


def test_a_cut_answer_is_incomplete_and_its_last_item_too():
    stream = ResponseStream(responses_request(max_output_tokens=3))
    events = run(stream, [{"content": "Hello"}], finish_reason="length")
    assert events[-1][0] == "response.incomplete"
    assert stream.response["incomplete_details"] == {"reason": "max_output_tokens"}
    assert stream.response["output"][0]["status"] == "incomplete"


def test_a_failure_is_an_error_event_then_response_failed():
    stream = ResponseStream(responses_request())
    events = stream.start(FIRST) + stream.feed({"content": "Hi"})
    failure = RequestFailed(503, "worker_crash", "the worker died")
    events += stream.fail(failure, RESPONSES.stream_event(failure))
    (error_name, error), (failed_name, failed) = events[-2:]
    assert (error_name, error["code"], error["message"]) == ("error", "worker_crash", "the worker died")
    assert failed_name == "response.failed" and failed["response"]["status"] == "failed"
    assert failed["response"]["error"]["message"] == "the worker died"


def test_input_items_become_the_chat_turns_a_template_renders():
    req = responses_request(instructions="Be brief.", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Hmm."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]},
        {"role": "developer", "content": "Mind the units."}])
    assert req.gen.messages == [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Hmm.", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny", "name": "get_weather"},
        {"role": "assistant", "content": "Sunny."}, {"role": "system", "content": "Mind the units."}]
    assert req.history == req.gen.messages[1:]  # instructions are not carried to a chained response


def test_codex_items_custom_calls_reasoning_and_hosted_tools_become_chat_turns():
    from appliance.front.api.responses import encrypted_reasoning
    req = responses_request(instructions="You are Codex.", include=["reasoning.encrypted_content"], store=False,
                            reasoning={"effort": "medium", "summary": "auto"}, input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sandbox: on."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Add a README."}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": encrypted_reasoning("Plan.")},
        {"type": "custom_tool_call", "id": "ctc_1", "call_id": "c1", "name": "apply_patch",
         "input": "*** Begin Patch\n*** End Patch\n", "status": "completed"},
        {"type": "custom_tool_call_output", "call_id": "c1", "output": "Done!"},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "reasoning", "id": "rs_2", "summary": [{"type": "summary_text", "text": "Then."}],
         "encrypted_content": "gAAAA-not-ours"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Added."}]}],
        tools=[{"type": "custom", "name": "apply_patch", "format": {"type": "grammar", "syntax": "lark",
                                                                    "definition": 'start: "x"'}},
               {"type": "web_search"}, {"type": "local_shell"}])
    assert req.gen.messages == [
        {"role": "system", "content": "You are Codex.\n\nSandbox: on."},  # one system turn, as templates take
        {"role": "user", "content": "Add a README."},
        {"role": "assistant", "content": "", "reasoning_content": "Plan.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "apply_patch", "arguments": {"input": "*** Begin Patch\n*** End Patch\n"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Done!", "name": "apply_patch"},
        {"role": "assistant", "content": "Added.", "reasoning_content": "Then."}]
    assert req.gen.tools.ignored == ["web_search", "local_shell"]
    assert req.gen.tools.tools[0]["function"]["parameters"]["required"] == ["input"]
    assert req.gen.constraint["tools"] == [{"name": "apply_patch", "custom": {
        "type": "grammar", "grammar": 'root ::= r_start\nr_start ::= t_X\nt_X ::= "x"\n'}}]  # enforced under auto
    assert req.echo["tools"] == [{"type": "custom", "name": "apply_patch", "description": None, "format": {
        "type": "grammar", "syntax": "lark", "definition": 'start: "x"'}}]
    assert req.echo["reasoning"] == {"effort": "medium", "summary": "auto"} and req.encrypted_reasoning


def test_a_custom_call_streams_as_a_custom_tool_call_item_with_encrypted_reasoning_before_it():
    from appliance.front.api.responses import decrypted_reasoning
    req = responses_request(include=["reasoning.encrypted_content"])
    stream = ResponseStream(req)
    head = {"tool_calls": [{"index": 0, "id": "call_1", "type": "custom", "custom": {"name": "apply_patch",
                                                                                      "input": ""}}]}
    events = run(stream, [{"reasoning_content": "Edit it."}, head,
                          {"tool_calls": [{"index": 0, "custom": {"input": "*** Begin"}}]},
                          {"tool_calls": [{"index": 0, "custom": {"input": " Patch\n"}}]}])
    names = [name for name, _ in events]
    assert names.count("response.custom_tool_call_input.delta") == 2
    done = next(data for name, data in events if name == "response.custom_tool_call_input.done")
    reasoning, call = stream.response["output"]
    assert call == {"id": call["id"], "type": "custom_tool_call", "call_id": "call_1", "name": "apply_patch",
                    "input": "*** Begin Patch\n", "status": "completed"} and done["input"] == call["input"]
    assert call["id"].startswith("ctc_") and decrypted_reasoning(reasoning["encrypted_content"]) == "Edit it."
    assert stream.turn()["tool_calls"][0]["function"] == {"name": "apply_patch",
                                                          "arguments": {"input": "*** Begin Patch\n"}}


def test_tools_are_strict_by_default_and_tool_choice_and_text_format_translate():
    tool = {"type": "function", "name": "get_weather", "parameters": SCHEMA}
    req = responses_request(tools=[tool], tool_choice={"type": "function", "name": "get_weather"},
                            parallel_tool_calls=False)
    assert req.gen.tools.tools[0]["function"]["strict"] is True
    assert req.gen.constraint["required"] and req.gen.constraint["single"]
    assert req.echo["tools"][0]["name"] == "get_weather" and req.echo["parallel_tool_calls"] is False
    free = responses_request(tools=[{**tool, "strict": False}])
    assert free.gen.constraint is None
    fmt = responses_request(text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}})
    assert fmt.gen.constraint["kind"] == "json_schema" and json.loads(fmt.gen.constraint["schema"]) == SCHEMA
    assert fmt.gen.constraint["param"] == "text.format.schema"  # named if genai cannot compile it


def test_previous_response_id_chains_the_stored_conversation():
    store = ResponseStore(2)
    store.keep("k", "m", "resp_a", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])
    req = parse_responses({"model": "m", "input": "More", "previous_response_id": "resp_a"}, store, "k")
    assert [m["content"] for m in req.gen.messages] == ["Hi", "Hello", "More"] and req.key == "k"
    with pytest.raises(InvalidRequest) as info:
        parse_responses({"model": "m", "input": "More", "previous_response_id": "resp_b"}, store, "k")
    assert "resp_b" in str(info.value) and info.value.param == "previous_response_id"


def test_a_stored_response_is_found_by_its_own_key_only():
    """Ids are not secrets (they appear in logs and clients' histories): another key's request must not read the
    conversation it stored (every model's store was searched, whichever key asked)."""
    store = ResponseStore(2)
    store.keep("alice", "m", "resp_a", [{"role": "user", "content": "alice's secret plans"}])
    with pytest.raises(InvalidRequest) as info:
        parse_responses({"model": "m", "input": "More", "previous_response_id": "resp_a"}, store, "bob")
    assert info.value.code == "previous_response_not_found"
    assert parse_responses({"model": "m", "input": "More", "previous_response_id": "resp_a"}, store, "alice")


def test_the_store_keeps_the_last_n_of_each_key_and_model():
    store = ResponseStore(2)
    for name in ("a", "b", "c"):
        store.keep("k", "m", name, [{"role": "user", "content": name}])
    store.keep("k", "other", "x", [])
    store.keep("j", "m", "y", [])  # another key's: not one of k's two on m
    with pytest.raises(InvalidRequest):
        store.history("k", "a")
    assert store.history("k", "b") and store.history("k", "c") and store.history("k", "x") == []
    store.history("k", "b")[0]["content"] = "changed"  # a copy: chaining cannot alter what is kept
    assert store.history("k", "b") == [{"role": "user", "content": "b"}]
    ResponseStore(0).keep("k", "m", "a", [])
    with pytest.raises(InvalidRequest):
        ResponseStore(0).history("k", "a")


def test_the_answer_as_a_turn_for_the_store():
    stream = ResponseStream(responses_request())
    run(stream)
    assert stream.turn() == {"role": "assistant", "content": "Sure.", "reasoning_content": "Let me think.",
                             "tool_calls": [{"id": "call_1", "type": "function",
                                             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}


@pytest.mark.parametrize("body, param", [
    ({"input": None}, "input"), ({"input": [5]}, "input[0]"),
    ({"tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"tools": [{"type": "tool_search", "execution": "server"}], "tool_choice": {"type": "tool_search"}},
     "tool_choice"),
    ({"tools": [{"type": "namespace", "name": "ns"}]}, "tools[0]"),
    ({"input": [{"type": "tool_search_output", "call_id": "s", "tools": "all"}]}, "input[0].tools"),
    ({"tools": [{"type": "function", "name": "f", "parameters": []}]}, "tools[0].parameters"),
    ({"text": {"format": {"type": "json_schema", "name": "w", "schema": 5}}}, "text.format.schema"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"reasoning": "high"}, "reasoning"), ({"instructions": 5}, "instructions"),
    ({"tools": [{"type": "custom", "name": "e", "format": {"type": "grammar", "syntax": "lark", "definition": ""}}]},
     "tools[0].format.definition"),
    ({"tools": [{"type": "custom", "name": "bad name"}]}, "tools[0].name"),
    ({"tools": [{"type": "custom", "name": "e"}], "tool_choice": {"type": "function", "name": "e"}}, "tool_choice"),
    ({"tools": [{"type": "mcp"}], "tool_choice": {"type": "custom", "name": "e"}}, "tool_choice"),
    ({"include": ["everything"]}, "include"),
    ({"input": [{"type": "custom_tool_call", "call_id": "c", "name": "e", "input": 5}]}, "input[0].input"),
])
def test_refusals_name_the_responses_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        responses_request(**body)
    assert info.value.param == param


# --- Messages -------------------------------------------------------------------------------------------------

def messages_request(**body):
    return parse_messages({"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "Hi"}], **body})


def test_a_message_streams_content_blocks_and_the_whole_message_matches():
    stream = MessageStream(messages_request())
    events = run(stream)
    assert [name for name, _ in events] == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["thinking_delta"] * 2 + ["text_delta"] * 2 + ["input_json_delta"] * 2
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"city": "Paris"}'
    no_cache = {"cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    assert events[0][1]["message"]["usage"] == {"input_tokens": 20, "output_tokens": 0, **no_cache}
    assert stream.message["content"] == [{"type": "thinking", "thinking": "Let me think.", "signature": ""},
                                         {"type": "text", "text": "Sure."},
                                         {"type": "tool_use", "id": "call_1", "name": "get_weather",
                                          "input": {"city": "Paris"}}]
    assert stream.message["stop_reason"] == "tool_use" and stream.message["usage"] == {"input_tokens": 20,
                                                                                       "output_tokens": 9, **no_cache}
    assert events[-2][1]["delta"] == {"stop_reason": "tool_use", "stop_sequence": None}


@pytest.mark.parametrize("finish_reason, stop_sequence, tokens, expected", [
    ("stop", None, 7, "end_turn"), ("length", None, 50, "max_tokens"), ("stop", "END", 7, "stop_sequence"),
    ("length", None, 30, "model_context_window_exceeded")])  # the worker fitted max_tokens into the context
def test_stop_reasons(finish_reason, stop_sequence, tokens, expected):
    stream = MessageStream(messages_request())
    assert stream.req.gen.params["max_tokens"] == 50  # a cap: the worker fits it to the window (every route)
    run(stream, [{"content": "x"}], Event("done", finish_reason="stop", completion_tokens=tokens,
                                          stop_sequence=stop_sequence), finish_reason)
    assert (stream.message["stop_reason"], stream.message["stop_sequence"]) == (expected, stop_sequence)


def test_a_tool_use_cut_short_has_an_empty_input():
    stream = MessageStream(messages_request())
    run(stream, [HEAD, {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Pa'}}]}],
        Event("done", finish_reason="length", completion_tokens=50), finish_reason="length")
    assert stream.message["content"][0]["input"] == {} and stream.message["stop_reason"] == "max_tokens"


def test_content_blocks_become_the_chat_turns_a_template_renders():
    req = messages_request(system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
                           messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hmm.", "signature": "sig"},
                                          {"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "t1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "text", "text": "Thanks"},
                                     {"type": "tool_result", "tool_use_id": "t1",
                                      "content": [{"type": "text", "text": "sunny"}]}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "no", "is_error": True}]}])
    assert req.gen.messages == [
        {"role": "system", "content": "Be brief.\nBe kind."}, {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "reasoning_content": "Hmm.", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "t1", "content": "sunny", "name": "get_weather"},
        {"role": "user", "content": "Thanks"},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: no", "name": "get_weather"}]


def test_tool_choice_thinking_and_sampling_translate():
    tools = [{"name": "get_weather", "input_schema": SCHEMA}]
    req = messages_request(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                           thinking={"type": "enabled", "budget_tokens": 20}, top_k=5, stop_sequences=["END"],
                           temperature=0.5, metadata={"user_id": "u"})
    assert req.gen.constraint["required"] and req.gen.constraint["single"]
    assert req.gen.template_kwargs == {"enable_thinking": True}
    assert (req.gen.params["top_k"], req.gen.params["stop"], req.gen.params["temperature"]) == (5, ["END"], 0.5)
    assert messages_request(tools=tools).gen.constraint is None
    assert messages_request(tools=tools, tool_choice={"type": "none"}).gen.tools.active is False
    assert messages_request().gen.template_kwargs == {"enable_thinking": False}
    assert messages_request(thinking={"type": "disabled", "budget_tokens": "x"}).gen.template_kwargs == \
           {"enable_thinking": False}  # a budget that does not apply is not read
    assert messages_request(tool_choice={"type": "auto"}).gen.tools.active is False  # no tools: accepted
    model, body = count_frame({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "tools": tools})
    assert model == "m" and body["tools"][0]["function"]["name"] == "get_weather"


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": None}, "max_tokens"), ({"system": 5}, "system"),
    ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "image"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"text": "no type"}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "system", "content": [{"type": "image"}]}]}, "messages[0].content[0]"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}],
      "tool_choice": {"type": "tool", "name": "web_search"}}, "tool_choice"),
    ({"thinking": {"type": "adaptive", "display": "loud"}}, "thinking.display"),
    ({"output_config": "high"}, "output_config"), ({"output_config": {"effort": 3}}, "output_config.effort"),
    ({"output_config": {"format": {"type": "xml"}}}, "output_config.format"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": []}]}]},
     "messages[0].content[0].input"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"), ({"tool_choice": "any"}, "tool_choice"),
    ({"thinking": {"type": "enabled", "budget_tokens": 50}}, "thinking.budget_tokens"),
    ({"top_k": 0}, "top_k"), ({"stop_sequences": [""]}, "stop_sequences"),
])
def test_message_refusals_name_the_field(body, param):
    with pytest.raises(InvalidRequest) as info:
        messages_request(**body)
    assert info.value.param == param


# --- Current agents' shapes (issue 42): Claude Code 2.1.332, Codex 0.171 ---------------------------------------

def test_a_system_message_inside_messages_stays_at_its_place_and_block_types_the_model_needs_not_are_skipped():
    req = messages_request(system="Top.", output_config={"effort": "high"},
                           thinking={"type": "adaptive", "display": "omitted"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "container_upload", "file_id": "f"}]},
        {"role": "system", "content": [{"type": "text", "text": "Mind the tests."}, {"type": "text", "text": "Be brief."}],
         "output_config": {"effort": "low"}},
        {"role": "assistant", "content": [{"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}},
                                          {"type": "text", "text": "Ok."}]},
        {"role": "user", "content": "Go on."}])
    assert req.gen.messages == [{"role": "system", "content": "Top."}, {"role": "user", "content": "Hi"},
                                {"role": "system", "content": "Mind the tests.\nBe brief."},
                                {"role": "assistant", "content": "Ok."}, {"role": "user", "content": "Go on."}]
    assert req.gen.ignored_inputs == ["container_upload", "server_tool_use"]
    assert req.gen.template_kwargs == {"enable_thinking": True} and req.thinking_omitted


def test_omitted_thinking_comes_back_as_empty_thinking_blocks():
    stream = MessageStream(messages_request(thinking={"type": "adaptive", "display": "omitted"}))
    events = run(stream)
    assert not [data for name, data in events if name == "content_block_delta"
                and data["delta"]["type"] == "thinking_delta"]
    assert stream.message["content"][0] == {"type": "thinking", "thinking": "", "signature": ""}
    assert stream.message["content"][1]["text"] == "Sure."


def test_deferred_tools_are_served_and_server_tools_left_out():
    tools = [{"name": "Bash", "input_schema": SCHEMA, "defer_loading": True, "cache_control": {"type": "ephemeral"}},
             {"type": "custom", "name": "Read", "input_schema": SCHEMA},
             {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
             {"type": "tool_search_tool_regex_20251119", "name": "tool_search_tool_regex"}]
    req = messages_request(tools=tools, tool_choice={"type": "tool", "name": "Bash"})
    assert [t["function"]["name"] for t in req.gen.tools.tools] == ["Bash", "Read"]
    assert req.gen.tools.ignored == ["web_search_20250305", "tool_search_tool_regex_20251119"]
    assert req.gen.constraint["tools"][0]["name"] == "Bash"


def test_output_config_format_constrains_the_answer_to_its_schema():
    req = messages_request(output_config={"effort": "max", "format": {"type": "json_schema", "schema": SCHEMA}})
    assert req.gen.constraint["type"] == "json_schema" and json.loads(req.gen.constraint["schema"]) == SCHEMA
    assert req.gen.constraint["param"] == "output_config.format"
    with pytest.raises(InvalidRequest):
        messages_request(output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                         tools=[{"name": "f", "input_schema": SCHEMA}], tool_choice={"type": "any"})


def test_a_prompt_over_the_window_gets_anthropic_s_words_on_messages_only():
    from appliance.front.api.messages import ANTHROPIC
    failure = RequestFailed(400, "invalid_request", "This model's maximum context length is 4096 tokens; the prompt "
                            "has 5012 tokens and max_tokens is 64000.", "context_length_exceeded")
    assert ANTHROPIC.body(failure, None) == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "prompt is too long: 5012 tokens > 4095 maximum"}}
    assert RESPONSES.body(failure, None)["error"]["message"] == failure.message  # OpenAI's words elsewhere
    failure.details = {"prompt_tokens": 7000, "max_context": 6000}  # the worker's own figures, where it sends them
    assert ANTHROPIC.body(failure, None)["error"]["message"] == "prompt is too long: 7000 tokens > 5999 maximum"
    # a prompt of exactly the window leaves the answer no room: the maximum is one token short of the window
    failure.details = {"prompt_tokens": 6000, "max_context": 6000}
    assert ANTHROPIC.body(failure, None)["error"]["message"] == "prompt is too long: 6000 tokens > 5999 maximum"


NAMESPACE = {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn_agent", "description": "Start one.", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}}]}
TOOL_SEARCH = {"type": "tool_search", "execution": "client", "description": "# Tool discovery",
               "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "limit": {"type": "number"}},
                              "required": ["query"], "additionalProperties": False}}


def test_namespace_tools_join_the_prompt_under_a_name_the_model_writes_and_calls_come_back_bare():
    req = responses_request(tools=[NAMESPACE, {"type": "image_generation"}, {"type": "brand_new_kind", "name": "x"}],
                            tool_choice={"type": "function", "name": "spawn_agent", "namespace": "multi_agent_v1"},
                            input=[{"role": "user", "content": "Go"},
                                   {"type": "function_call", "call_id": "c0", "name": "spawn_agent",
                                    "namespace": "multi_agent_v1", "arguments": '{"task": "a"}'},
                                   {"type": "function_call_output", "call_id": "c0", "output": "started"}])
    assert [t["function"]["name"] for t in req.gen.tools.tools] == ["multi_agent_v1__spawn_agent"]
    assert req.gen.tools.ignored == ["image_generation", "brand_new_kind"]
    assert req.gen.tools.named == "multi_agent_v1__spawn_agent"
    assert req.gen.messages[1]["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"
    assert req.echo["tools"] == [NAMESPACE]
    head = {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                            "function": {"name": "multi_agent_v1__spawn_agent", "arguments": '{"task": "b"}'}}]}
    stream = ResponseStream(req)
    events = run(stream, [head])
    added = [data["item"] for name, data in events if name == "response.output_item.added"]
    done = [data["item"] for name, data in events if name == "response.output_item.done"]
    for item in (added[0], done[0], stream.response["output"][0]):
        assert (item["type"], item["name"], item["namespace"]) == ("function_call", "spawn_agent", "multi_agent_v1")
    assert done[0]["arguments"] == '{"task": "b"}'
    assert stream.turn()["tool_calls"][0]["function"]["name"] == "multi_agent_v1__spawn_agent"  # replays the same


def test_a_client_tool_search_is_a_function_whose_call_is_a_tool_search_call_and_its_output_loads_tools():
    req = responses_request(tools=[TOOL_SEARCH, {"type": "tool_search", "execution": "server"}], input=[
        {"role": "user", "content": "Make an event"},
        {"type": "tool_search_call", "call_id": "s1", "execution": "client", "status": "completed",
         "arguments": {"query": "calendar"}},
        {"type": "tool_search_output", "call_id": "s1", "execution": "client", "status": "completed",
         "tools": [{**NAMESPACE, "name": "calendar", "tools": [{**NAMESPACE["tools"][0], "name": "create",
                                                               "defer_loading": True}]}]},
        {"type": "item_reference", "id": "x"}, {"type": "web_search_call", "status": "completed"}])
    assert [t["function"]["name"] for t in req.gen.tools.tools] == ["tool_search", "calendar__create"]
    assert req.gen.tools.ignored == ["tool_search"]  # the server-run one is a hosted tool
    assert req.gen.ignored_inputs == ["item_reference", "web_search_call"]
    assert req.gen.messages[1]["tool_calls"][0]["function"] == {"name": "tool_search",
                                                                "arguments": {"query": "calendar"}}
    assert req.gen.messages[2] == {"role": "tool", "tool_call_id": "s1", "content": "Tools loaded: calendar__create",
                                   "name": "tool_search"}
    assert req.echo["tools"] == [TOOL_SEARCH]  # the loaded tools are not the request's
    head = {"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                            "function": {"name": "tool_search", "arguments": '{"query": "mail", "limit": 2}'}}]}
    stream = ResponseStream(req)
    events = run(stream, [head])
    item = stream.response["output"][0]
    assert item["type"] == "tool_search_call" and item["id"].startswith("tsc_")
    assert (item["call_id"], item["execution"], item["arguments"]) == ("call_9", "client", {"query": "mail", "limit": 2})
    names = [name for name, _ in events]
    assert "response.function_call_arguments.delta" not in names and names.count("response.output_item.done") == 1


def searched(call_id: str, tools: list) -> list:
    return [{"type": "tool_search_call", "call_id": call_id, "execution": "client", "arguments": {"query": "q"}},
            {"type": "tool_search_output", "call_id": call_id, "execution": "client", "tools": tools}]


def test_a_tool_loaded_twice_or_also_in_the_request_is_offered_once():
    """A model that searches twice and finds the same tool, or finds one the request also carries: every later
    turn replays both, so refusing the duplicate would end the session."""
    create = {**NAMESPACE["tools"][0], "name": "create"}
    req = responses_request(tools=[TOOL_SEARCH, {**NAMESPACE, "name": "calendar", "tools": [create]}], input=[
        {"role": "user", "content": "Make an event"}, *searched("s1", [{**NAMESPACE, "name": "calendar",
                                                                        "tools": [create]}]),
        *searched("s2", [{**NAMESPACE, "name": "calendar", "tools": [create]}, {**create, "name": "top"}]),
        *searched("s3", [{**create, "name": "top"}])])
    assert [t["function"]["name"] for t in req.gen.tools.tools] == ["tool_search", "calendar__create", "top"]


@pytest.mark.parametrize("tools, input_tools, param", [
    ([NAMESPACE, {"type": "function", "name": "bad name"}], None, "tools[1].name"),
    ([{"type": "web_search"}, {"type": "function", "name": "bad name"}], None, "tools[1].name"),
    ([{"type": "web_search"}, {"type": "function", "name": "f", "parameters": "nope"}], None, "tools[1].parameters"),
    ([{**NAMESPACE, "tools": [NAMESPACE["tools"][0], {"type": "function", "name": "no good"}]}], None,
     "tools[0].tools[1].name"),
    ([TOOL_SEARCH], [{"type": "function", "name": "bad name"}], "input[2].tools[0].name"),
    ([TOOL_SEARCH, NAMESPACE], [5], "input[2].tools[0]"),
])
def test_a_malformed_tool_is_named_where_the_request_has_it(tools, input_tools, param):
    """The tools the prompt offers are a flat list (namespaces opened, hosted tools left out, loaded tools
    added), but a refusal names the tool's place in the request."""
    body = {"tools": tools}
    if input_tools is not None:
        body["input"] = [{"role": "user", "content": "Hi"}, *searched("s1", input_tools)]
    with pytest.raises(InvalidRequest) as refused:
        responses_request(**body)
    assert refused.value.param == param and f"'{param}'" in str(refused.value)


def test_a_tool_search_output_answers_a_call_made_before_it():
    with pytest.raises(InvalidRequest) as refused:
        responses_request(tools=[TOOL_SEARCH], input=[{"role": "user", "content": "Hi"},
                                                      searched("s1", [])[1]])
    assert refused.value.param == "input[1].call_id" and refused.value.code == "unknown_call_id"


def test_namespaced_names_that_join_alike_are_refused_naming_both():
    clash = [{**NAMESPACE, "name": "a", "tools": [{"type": "function", "name": "b__c"}]},
             {**NAMESPACE, "name": "a__b", "tools": [{"type": "function", "name": "c"}]}]
    with pytest.raises(InvalidRequest) as refused:
        responses_request(tools=clash)
    assert refused.value.param == "tools[1].tools[0].name"
    assert "'tools[0].tools[0]'" in str(refused.value) and "a__b__c" in str(refused.value)


@pytest.mark.parametrize("bad, param", [({"name": "bad name", "input_schema": {"type": "object"}}, "tools[1].name"),
                                        ({"name": "f", "input_schema": {"type": "object"}, "description": 5},
                                         "tools[1].description")])
def test_a_malformed_client_tool_after_a_server_tool_is_named_where_the_request_has_it(bad, param):
    with pytest.raises(InvalidRequest) as refused:
        messages_request(tools=[{"type": "web_search_20250305", "name": "web_search"}, bad])
    assert refused.value.param == param and f"'{param}'" in str(refused.value)


def test_a_limit_out_of_range_names_its_bounds_exactly():
    with pytest.raises(InvalidRequest) as refused:
        responses_request(max_output_tokens=0)
    assert str(refused.value) == "'max_output_tokens' must be between 1 and 9223372036854775807, got 0"
    # any larger whole number is a limit the worker fits to the window (issue 42)
    assert responses_request(max_output_tokens=99_999_999_999).gen.params["max_tokens"] == 99_999_999_999
    with pytest.raises(InvalidRequest, match=r"between 0 and 1, got 1.5"):
        responses_request(top_p=1.5)


def test_client_named_types_are_bounded_metric_labels():
    from appliance.front.api import generate
    assert generate.bounded_label("web_search") == "web_search"
    assert generate.bounded_label("evil\nrefused POST /x") == generate.OTHER_TYPE  # no client text in the log line
    for i in range(generate.MAX_TYPE_LABELS + 5):
        generate.bounded_label(f"type_{i}")
    assert len(generate.TYPE_LABELS) <= generate.MAX_TYPE_LABELS
    assert generate.bounded_label("yet_another_new_type") == generate.OTHER_TYPE
    assert generate.bounded_label("web_search") == "web_search"  # a type seen before keeps its label
