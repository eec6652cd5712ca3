"""The judge of the real-client runs (bench.clients.verdicts, reading, canned) on hand-made records: each check
passes a run that did what a user needs and names what went wrong in one that did not. No process runs here."""

from __future__ import annotations

import json

import pytest

from bench.clients import verdicts
from bench.clients.canned import CALL_ID, canned_tool_call
from bench.clients.catalog import Turn
from bench.clients.proxy import Exchange, offered_tools
from bench.clients.reading import answer_text, ending, output_tokens, replayed_result
from bench.clients.runs import MARKER_TEXT, ClientRun

ANSWER = "Amber river calm lantern."
TOOLS = [{"type": "function", "function": {"name": "read", "parameters": {
    "type": "object", "properties": {"filePath": {"type": "string"}}, "required": ["filePath"]}}}]


def chat_stream(text: str, finish: str = "stop", tokens: int = 257, keepalive: bool = True) -> str:
    """A chat completions stream as a server sends it: keep-alive comments during the prefill, then the chunks."""
    words = text.split(" ")
    chunks = [{"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": part}}]}
              for part in [words[0], *(" " + word for word in words[1:])]]
    chunks.append({"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
    chunks.append({"object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": tokens}})
    events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks)
    return (": keep-alive\n\n" if keepalive else "") + events + "data: [DONE]\n\n"


def served(text: str = ANSWER, request: dict | None = None, **stream) -> Exchange:
    return Exchange("POST", "/v1/chat/completions", request or {"model": "demo", "stream": True}, 200,
                    chat_stream(text, **stream), content_type="text/event-stream")


def run(exchanges: list[Exchange], stdout: str = ANSWER + "\n", returncode: int = 0) -> ClientRun:
    return ClientRun("opencode", "1", Turn("hi", "demo"), returncode, stdout, "", 1.0, exchanges)


def test_a_streamed_answer_behind_keep_alives_is_read_whole():
    exchange = served()
    assert (answer_text(exchange), ending(exchange), output_tokens(exchange)) == (ANSWER, "stop", 257)


def test_a_run_that_printed_its_answer_passes_and_each_failure_is_named():
    assert verdicts.answered(run([served()])) is None
    assert verdicts.answered(run([served()], returncode=1)) == "exited 1"
    assert verdicts.answered(run([served()], stdout="")).startswith("printed none of the server's answers")
    refused = Exchange("POST", "/v1/chat/completions", {"model": "demo"}, 400, '{"error": {}}')
    assert verdicts.answered(run([refused, served()])).startswith("refused: POST /v1/chat/completions")


def test_a_side_request_after_the_answer_does_not_hide_it():
    """Qwen Code asks something more after its answer; the answer judged is the one printed."""
    result = run([served(), served("Quiet pebble.")])
    assert verdicts.answered(result) is None and answer_text(verdicts.shown(result)) == ANSWER


def test_an_answer_cut_by_a_limit_is_not_complete_nor_long():
    cut = run([served(finish="length", tokens=256)])
    assert verdicts.completed(cut) == "the answer ended 'length'"
    assert verdicts.long_answer(cut) == "the answer ended 'length'"
    assert verdicts.long_answer(run([served(request={"model": "demo", "max_tokens": 100})])) == \
        "the client sent a limit (100)"
    assert verdicts.long_answer(run([served()])) is None


@pytest.mark.parametrize("stream", [False, True])
def test_the_round_trip_needs_the_result_replayed_and_its_answer_shown(stream):
    request = {"model": "demo", "stream": stream, "tools": TOOLS}
    arguments = {"filePath": "/w/marker.txt"}
    status, content_type, body = canned_tool_call("chat", request, "read", arguments)
    first = Exchange("POST", "/v1/chat/completions", request, status, body, by_proxy=True, content_type=content_type)
    call = json.loads(body)["choices"][0]["message"]["tool_calls"] if not stream else \
        [{"id": CALL_ID, "type": "function", "function": {"name": "read", "arguments": json.dumps(arguments)}}]
    replay = {**request, "messages": [{"role": "user", "content": "read it"},
                                      {"role": "assistant", "tool_calls": call},
                                      {"role": "tool", "tool_call_id": CALL_ID, "content": MARKER_TEXT}]}
    second = served(request=replay)
    assert replayed_result(second) == MARKER_TEXT and ending(first) == "tool_calls"
    assert verdicts.round_trip(run([first, second])) is None
    forgot = served(request={**replay, "messages": replay["messages"][:2]})
    assert verdicts.round_trip(run([first, forgot])).startswith("the tool's result was not sent back")
    assert verdicts.round_trip(run([second])).startswith("the proxy's tool call was never asked for")


def test_tools_are_found_in_every_dialects_shape():
    schema = {"type": "object"}
    body = {"tools": [{"type": "function", "function": {"name": "chat_fn", "parameters": schema}},
                      {"type": "function", "name": "responses_fn", "parameters": schema},
                      {"type": "namespace", "name": "ns", "tools": [{"type": "function", "name": "inner"}]},
                      {"name": "Read", "input_schema": schema}, {"type": "web_search"}]}
    assert offered_tools(body) == {"chat_fn": schema, "responses_fn": schema, "inner": {}, "Read": schema}
