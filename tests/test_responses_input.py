"""The Responses input's policies as pure functions, on generated sequences: a tool output is taken exactly when a
call with its call_id came before it (else a 400 naming that output's call_id); a file is text exactly when its
bytes are UTF-8 without NUL (else a 400 saying what is taken); a compaction item comes back as the summary it holds.
"""

from __future__ import annotations

import base64

import pytest
from hypothesis import example, given, settings, strategies as st

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.input_parts import chat_parts
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses import (COMPACTION_PREFIX, ENCRYPTED_PREFIX, encrypted_reasoning,
                                           parse_responses)

IDS = st.sampled_from(["call_a", "call_b", "call_c"])
ITEMS = st.one_of(
    st.builds(lambda text: {"type": "message", "role": "user", "content": text}, st.text(max_size=5)),
    st.builds(lambda call_id: {"type": "function_call", "call_id": call_id, "name": "f", "arguments": "{}"}, IDS),
    st.builds(lambda call_id: {"type": "function_call_output", "call_id": call_id, "output": "ok"}, IDS),
    st.builds(lambda call_id: {"type": "tool_search_call", "call_id": call_id, "execution": "client",
                               "arguments": {"query": "q"}}, IDS),
    st.builds(lambda call_id: {"type": "tool_search_output", "call_id": call_id, "execution": "client",
                               "tools": []}, IDS),
)
CALLS = ("function_call", "tool_search_call")
OUTPUTS = ("function_call_output", "tool_search_output")


def parse(items):
    return parse_responses({"model": "m", "input": items}, ResponseStore(1), "none")


@settings(max_examples=300, deadline=None)
@given(st.lists(ITEMS, min_size=1, max_size=8))
def test_a_tool_output_is_taken_exactly_when_its_call_came_before(items):
    called: set[str] = set()
    unanswerable = None
    for i, item in enumerate(items):
        if item["type"] in CALLS:
            called.add(item["call_id"])
        elif item["type"] in OUTPUTS and item["call_id"] not in called and unanswerable is None:
            unanswerable = i
    if unanswerable is None:
        messages = parse(items).gen.messages
        assert all(not key.startswith("_") for m in messages for key in m)  # no mark of the parse is left behind
        assert [m["tool_call_id"] for m in messages if m["role"] == "tool"] == [
            item["call_id"] for item in items if item["type"] in OUTPUTS]
    else:
        with pytest.raises(InvalidRequest) as refused:
            parse(items)
        assert refused.value.param == f"input[{unanswerable}].call_id" and refused.value.code == "unknown_call_id"
        assert items[unanswerable]["call_id"] in str(refused.value)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.binary(max_size=64), st.text(max_size=32).map(str.encode)), st.booleans())
def test_a_file_is_text_exactly_when_its_bytes_are_utf8_without_nul(data, as_data_url):
    encoded = base64.b64encode(data).decode()
    part = {"type": "input_file", "filename": "f.txt",
            "file_data": f"data:text/plain;base64,{encoded}" if as_data_url else encoded}
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\x00" not in text:
        assert chat_parts([part], "c") == [{"type": "text", "text": "[file: f.txt]\n" + text}]
    else:
        with pytest.raises(InvalidRequest) as refused:
            chat_parts([part], "c")
        assert refused.value.code == "unsupported_file" and "only text files" in str(refused.value)


@given(st.text(max_size=40))
def test_a_compaction_item_comes_back_as_its_summary_in_one_user_turn(summary):
    messages = parse([{"type": "compaction", "encrypted_content": encrypted_reasoning(summary)},
                      {"type": "message", "role": "user", "content": "Next?"}]).gen.messages
    assert messages == [{"role": "user", "content": COMPACTION_PREFIX + summary + "\n\nNext?"}]


def test_a_fault_of_ours_mid_stream_ends_it_with_the_spec_s_error_and_failed_events():
    """A bug while translating an answer (here: the item stream raising on the second delta) ends a streamed
    response with its dialect's own failure, numbered like the rest, never a bare event or a cut stream."""
    import asyncio
    import types

    from appliance.front.api.answer import AnswerParser
    from appliance.front.api.dialects import Dialect, DialectRoute
    from appliance.front.api.responses import RESPONSES, ResponseStream
    from appliance.front.api.route import Call
    from appliance.front.request import Event
    from openresponses_spec import final

    class Faulty(ResponseStream):
        def extended(self, item, text_):
            if item.text != text_:
                raise KeyError("a bug")
            return super().extended(item, text_)

    class Sink:
        sent: list = []

        async def open(self):
            pass

        async def send(self, events):
            self.sent += [data for _, data in events]

        async def close(self):
            return "closed"

    async def events():
        for text_ in ("Hello", " world", "!"):
            yield Event("tokens", text=text_, prompt_tokens=3)

    counted = types.SimpleNamespace(labels=lambda **labels: types.SimpleNamespace(inc=lambda: None))
    appliance = types.SimpleNamespace(metrics=types.SimpleNamespace(request_errors=counted))
    route = DialectRoute(appliance, None, Dialect(None, Faulty, None))
    req = parse([{"type": "message", "role": "user", "content": "Hi"}])
    req.gen.stream = True
    sink = Sink()
    async def answer():
        stream = events()
        first = await stream.__anext__()  # the route reads the first event before the stream begins
        return await route._answer(Call(appliance, "responses", RESPONSES), stream, first, req,
                                   AnswerParser(False, None), sink)

    assert asyncio.run(answer()) == "closed"
    response = final(sink.sent)
    assert sink.sent[-2]["type"] == "error" and sink.sent[-2]["error"]["code"] == "internal_error"
    assert response["status"] == "failed" and response["error"]["message"] == "internal server error"


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_=+/!. é", max_size=24))
@example("!!!")  # once taken as an empty summary: the decoder skipped what is not base64
@example("AB==")  # base64 of b"\x00" with stray bits: not what this server wrote
def test_a_compaction_item_is_taken_exactly_when_this_server_wrote_it(payload):
    """Only an encrypted_content that encrypted_reasoning() made (its exact encoding) is read back: a damaged or
    foreign one is a 400, never a summary made of what a lenient decoder kept."""
    encrypted = ENCRYPTED_PREFIX + payload
    try:
        messages = parse([{"type": "compaction", "encrypted_content": encrypted}]).gen.messages
    except InvalidRequest as refused:
        assert refused.code == "invalid_compaction" and refused.param == "input[0].encrypted_content"
        return
    summary = messages[0]["content"].removeprefix(COMPACTION_PREFIX)
    assert encrypted_reasoning(summary) == encrypted
