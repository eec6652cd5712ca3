"""/v1/responses against the Open Responses specification: the flows its compliance suite runs (basic, streaming,
system prompt, tool calling, image input, multi-turn, assistant phase), each whole, streamed and over the WebSocket
mode, every response and event validated against the spec's schemas (tests/openresponses_spec.py); the settings the
response object repeats; images and files in input; unknown call ids; POST /v1/responses/compact; the WebSocket
mode's continuations, evictions, bounds and cancellation.

The demo models' weights are random: a forced tool call stands for the suite's tool-calling case (a model that
chooses to call a tool is beyond them), and the compaction's summary is as good as a random model writes it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import json
import signal
import time

import aiohttp
import pytest
import yaml
from PIL import Image

from conftest import Appliance, http, model_entry, wait_until
from openresponses_spec import (SCHEMAS, TRANSPORTS, check, check_event, final, over_socket, socket_turn,
                                socket_turns, socket_url, streamed, whole)
from test_metrics import samples, value

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "Get the current weather for a location",
                "parameters": {"type": "object", "properties": {"location": {"type": "string", "maxLength": 20}},
                               "required": ["location"], "additionalProperties": False}}
DEFAULT_MAX_TOKENS = 96
# an answer the demo model cannot end before max_output_tokens: a list longer than any answer here
ENDLESS = {"type": "json_schema", "name": "list", "schema": {"type": "array", "minItems": 10000,
                                                             "items": {"type": "string", "maxLength": 12}}}


def png(rgb=(220, 30, 30), size=(32, 32)) -> str:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def app(demo_model, demo_vlm, tmp_path_factory):
    models = [model_entry("demo", demo_model, default_max_tokens=DEFAULT_MAX_TOKENS),
              model_entry("vlm", demo_vlm, kind="vlm", max_image_bytes=1 << 16)]  # messages up to ~1.7 MB
    appliance = Appliance({"server": {"stored_responses": 8}, "models": models},
                          tmp_path_factory.mktemp("responses-spec")).start()
    yield appliance
    appliance.stop()


def message(role: str, content, **extra) -> dict:
    return {"type": "message", "role": role, "content": content, **extra}


# The compliance suite's flows (src/lib/compliance-tests.ts), with the tool call forced.
FLOWS = {
    "basic": {"model": "demo", "input": [message("user", "Say hello in exactly 3 words.")]},
    "system-prompt": {"model": "demo", "input": [message("system", "You are a pirate. Always respond in pirate speak."),
                                                 message("user", "Say hello.")]},
    "tool-calling": {"model": "demo", "input": [message("user", "What's the weather like in San Francisco?")],
                     "tools": [WEATHER_TOOL], "tool_choice": "required", "max_output_tokens": 200},
    "image-input": {"model": "vlm", "input": [message("user", [
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": png()}])]},
    "multi-turn": {"model": "demo", "input": [
        message("user", "My name is Alice."),
        message("assistant", "Hello Alice! Nice to meet you. How can I help you today?"),
        message("user", "What is my name?")]},
    "assistant-phase": {"model": "demo", "input": [
        message("user", "Plan, then answer."),
        message("assistant", [{"type": "output_text", "text": "Let me think."}], phase="commentary"),
        message("assistant", [{"type": "output_text", "text": "Done."}], phase="final_answer"),
        message("user", "Go on.")]},
}


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("flow", FLOWS)
def test_the_compliance_flows_meet_the_spec(app, flow, transport):
    response, events = TRANSPORTS[transport](app.base, FLOWS[flow])
    assert response["status"] == "completed" and response["output"] and response["completed_at"] is not None
    if flow == "tool-calling":
        [call] = [item for item in response["output"] if item["type"] == "function_call"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"]), dict)
    if flow == "image-input":
        assert response["output"][0]["content"][0]["text"].startswith("Red")  # the demo VLM names the colour
    if transport != "whole":
        types = [event["type"] for event in events]
        assert types[:2] == ["response.created", "response.in_progress"]
        for event in events[:2]:
            assert event["response"]["completed_at"] is None and event["response"]["status"] == "in_progress"
        if flow == "tool-calling":
            assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(types)
            added = [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"]
            assert "function_call" in added


def test_the_response_repeats_the_settings_it_was_made_with(app):
    unset = whole(app.base, {"model": "demo", "input": "Hi"})
    # unset: greedy decoding (temperature 0), the model's default_max_tokens, no penalties, one service tier
    assert unset["temperature"] == 0 and unset["top_p"] == 1 and unset["max_output_tokens"] == DEFAULT_MAX_TOKENS
    assert unset["presence_penalty"] == 0 and unset["frequency_penalty"] == 0 and unset["top_logprobs"] == 0
    assert unset["background"] is False and unset["service_tier"] == "default" and unset["max_tool_calls"] is None
    assert unset["safety_identifier"] is None and unset["prompt_cache_key"] is None
    asked = {"temperature": 0.7, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": -0.5,
             "max_output_tokens": 7, "max_tool_calls": 3, "safety_identifier": "user-42",
             "prompt_cache_key": "agent-1", "service_tier": "auto"}
    set_ = whole(app.base, {"model": "demo", "input": "Hi", **asked})
    assert {key: set_[key] for key in asked} == {**asked, "service_tier": "default"}
    assert set_["usage"]["output_tokens"] <= 7


@pytest.mark.parametrize("sent", [
    {"type": "json_schema", "name": "city", "schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
    {"type": "json_schema", "name": "city", "description": "A city.", "strict": False,
     "schema": {"type": "object", "properties": {"city": {"type": "string"}}}},
])
def test_a_json_schema_format_is_repeated_with_every_field_the_spec_requires(app, sent):
    """The spec's JsonSchemaResponseFormat requires description and strict (an unset description is null; strict is
    what was sent, else true: the schema is always enforced). Its `schema` is typed null in the spec (1e33c10), which
    no server that repeats the schema meets: that one field is left out of the check."""
    status, _, reply = http("POST", app.base + "/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": 4,
                                                                  "text": {"format": sent}})
    assert status == 200, reply
    echoed = reply["text"]["format"]
    assert set(SCHEMAS["JsonSchemaResponseFormat"]["required"]) <= set(echoed), echoed
    assert echoed == {"description": None, "strict": True, **sent}
    check("ResponseResource", {**reply, "text": {"format": {**echoed, "schema": None}}})


@pytest.mark.parametrize("body, param, code", [
    ({"top_logprobs": 2}, "top_logprobs", None),
    ({"background": True}, "background", None),
    ({"service_tier": "gold"}, "service_tier", None),
    ({"prompt_cache_key": "k" * 65}, "prompt_cache_key", None),
    ({"input": [message("user", [{"type": "input_image", "file_id": "file-1"}])]}, "input[0].content[0].file_id",
     "unsupported_file_id"),
    ({"input": [message("user", [{"type": "input_file", "file_id": "file-1"}])]}, "input[0].content[0].file_id",
     "unsupported_file_id"),
    ({"input": [message("user", [{"type": "input_file", "file_url": "https://example.com/a.txt"}])]},
     "input[0].content[0].file_url", "unsupported_file"),
    ({"input": [message("user", [{"type": "input_file", "filename": "a.pdf",
                                  "file_data": "data:application/pdf;base64," + base64.b64encode(b"%PDF-1.7\n\xe2\xe3\xcf\xd3").decode()}])]},
     "input[0].content[0].file_data", "unsupported_file"),
    ({"input": [message("user", [{"type": "input_image", "image_url": png()}])]}, "input[0].content[0]",
     "model_not_vision"),
    ({"input": [message("user", "Hi"), {"type": "function_call_output", "call_id": "call_nobody", "output": "1"}]},
     "input[1].call_id", "unknown_call_id"),
    ({"input": [{"type": "compaction", "encrypted_content": "gAAAA-another-server"}]},
     "input[0].encrypted_content", "invalid_compaction"),
])
def test_what_cannot_be_honoured_is_a_400_naming_it(app, body, param, code):
    status, _, reply = http("POST", app.base + "/v1/responses", {"model": "demo", "input": "Hi", **body})
    assert status == 400 and reply["error"]["param"] == param, reply
    assert code is None or reply["error"]["code"] == code, reply


def test_an_unknown_call_id_is_refused_naming_it_and_a_known_one_is_taken(app):
    first = whole(app.base, {**FLOWS["tool-calling"], "store": True})
    [call] = [item for item in first["output"] if item["type"] == "function_call"]
    answer = {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"}
    taken = whole(app.base, {"model": "demo", "previous_response_id": first["id"], "input": [answer],
                             "tools": [WEATHER_TOOL]})
    assert taken["status"] == "completed"
    status, _, reply = http("POST", app.base + "/v1/responses", {
        "model": "demo", "previous_response_id": first["id"], "tools": [WEATHER_TOOL],
        "input": [{**answer, "call_id": "call_elsewhere"}]})
    assert status == 400 and "call_elsewhere" in reply["error"]["message"]


def test_a_text_file_reaches_the_model_as_text(app):
    notes = "TODO: rename parse_config to load_config in cli.py\n" * 5
    part = {"type": "input_file", "filename": "notes.txt", "file_data": base64.b64encode(notes.encode()).decode()}
    alone = whole(app.base, {"model": "demo", "input": [message("user", [{"type": "input_text", "text": "Read"}])]})
    with_file = whole(app.base, {"model": "demo", "input": [message("user", [{"type": "input_text", "text": "Read"},
                                                                              part])]})
    as_text = whole(app.base, {"model": "demo", "input": [message("user", "Read" + "[file: notes.txt]\n" + notes)]})
    assert with_file["usage"]["input_tokens"] == as_text["usage"]["input_tokens"] > alone["usage"]["input_tokens"]


def test_the_stream_error_event_has_the_spec_shape_and_the_sdk_fields():
    from appliance.front.api.responses import RESPONSES, ResponseStream, parse_responses
    from appliance.front.api.response_store import ResponseStore
    from appliance.front.request import RequestFailed
    stream = ResponseStream(parse_responses({"model": "demo", "input": "Hi", "stream": True}, ResponseStore(1), "none"))
    events = [data for _, data in stream.start(None)]
    failure = RequestFailed(503, "worker_crashed", "the model's worker stopped", "worker_crashed")
    events += [data for _, data in stream.fail(failure, RESPONSES.stream_event(failure))]
    response = final(events)
    error = events[-2]
    assert error["type"] == "error" and error["error"]["code"] == "worker_crashed"
    assert (error["code"], error["message"], error["param"]) == ("worker_crashed", "the model's worker stopped", None)
    assert response["status"] == "failed" and response["error"]["code"] == "worker_crashed"
    assert response["completed_at"] is None


# --- compaction ---------------------------------------------------------------------------------------------------

def test_compact_returns_a_compaction_that_responses_take_back(app):
    conversation = [message("user", "Build a CLI that renames photos by date. Use Python and click."),
                    message("assistant", "I will write rename.py with a click command and EXIF dates."),
                    message("user", "Also keep a dry-run flag. The tests go in tests/test_rename.py.")] * 6
    started = time.monotonic()
    status, _, compacted = http("POST", app.base + "/v1/responses/compact", {"model": "demo", "input": conversation})
    took = time.monotonic() - started
    assert status == 200, compacted
    check("CompactResource", compacted)
    [item] = compacted["output"]
    assert item["type"] == "compaction" and item["encrypted_content"]
    usage = compacted["usage"]
    assert usage["input_tokens"] > 0 and 0 < usage["output_tokens"] <= 1024
    print(f"compaction: {usage['input_tokens']} tokens in, {usage['output_tokens']} out, {took:.2f} s")
    # the compaction stands for the conversation in a later request, at a fraction of its tokens
    full = whole(app.base, {"model": "demo", "input": conversation + [message("user", "Next step?")]})
    after = whole(app.base, {"model": "demo", "input": [item, message("user", "Next step?")]})
    assert after["status"] == "completed" and after["usage"]["input_tokens"] < full["usage"]["input_tokens"]
    # over a stored response too
    stored = whole(app.base, {"model": "demo", "input": conversation[:3]})
    status, _, again = http("POST", app.base + "/v1/responses/compact",
                            {"model": "demo", "previous_response_id": stored["id"]})
    assert status == 200 and check("CompactResource", again)["output"][0]["type"] == "compaction"


def test_compacting_a_conversation_longer_than_the_context_is_a_400_saying_so(app):
    # about 150k demo tokens: past the demo's 128k window (its own, max_context unset)
    conversation = [message("user", "Rename every photo by its EXIF date and keep a dry-run flag. " * 320)] * 12
    status, _, reply = http("POST", app.base + "/v1/responses/compact", {"model": "demo", "input": conversation})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded", reply
    assert whole(app.base, {"model": "demo", "input": "Hi"})["status"] == "completed"


@pytest.mark.parametrize("body, param", [({"input": "Hi"}, "model"), ({"model": "demo"}, "input")])
def test_compact_without_a_model_or_a_conversation_is_a_400(app, body, param):
    status, _, reply = http("POST", app.base + "/v1/responses/compact", body)
    assert status == 400 and reply["error"]["param"] == param, reply


# --- WebSocket mode -----------------------------------------------------------------------------------------------

def test_a_socket_continues_its_store_false_responses_and_refuses_unknown_ids(app):
    first, second, unknown = asyncio.run(socket_turns(
        app.base, {"model": "demo", "input": "My name is Alice.", "store": False},
        {"model": "demo", "input": "What is my name?", "previous_response_id": "resp_later"},
        {"model": "demo", "input": "Hi", "previous_response_id": "resp_nobody"}))
    response = final(first)
    assert response["store"] is False and second[-1]["type"] == "error"
    assert second[-1]["error"]["code"] == unknown[-1]["error"]["code"] == "previous_response_not_found"
    assert unknown[-1]["status"] == 400 and unknown[-1]["error"]["param"] == "previous_response_id"

    async def chain():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            one = final(await socket_turn(ws, {"model": "demo", "input": "My name is Alice.", "store": False}))
            two = final(await socket_turn(ws, {"model": "demo", "input": "What is my name?", "store": False,
                                               "previous_response_id": one["id"]}))
            return one, two
    one, two = asyncio.run(chain())
    assert two["previous_response_id"] == one["id"] and two["usage"]["input_tokens"] > one["usage"]["input_tokens"]
    # another connection (and HTTP) never saw the store: false response
    status, _, reply = http("POST", app.base + "/v1/responses", {"model": "demo", "input": "Hi",
                                                                 "previous_response_id": one["id"]})
    assert status == 400 and reply["error"]["code"] == "previous_response_not_found"


def test_the_official_sdk_s_websocket_client_chains_and_reads_errors(app):
    """openai's own WebSocket client (client.responses.connect(), on the `websockets` package), unmodified."""
    client = app.client()
    with client.responses.connect() as connection:
        def turn(**body):
            connection.response.create(model="demo", **body)
            for event in connection:
                if event.type in ("response.completed", "response.incomplete", "error"):
                    return event
        first = turn(input="My name is Alice.", store=False)
        second = turn(input="What is my name?", store=False, previous_response_id=first.response.id)
        unknown = turn(input="Hi", previous_response_id="resp_nobody")
    assert first.type == second.type == "response.completed"
    assert second.response.previous_response_id == first.response.id
    assert second.response.usage.input_tokens > first.response.usage.input_tokens
    assert unknown.type == "error" and unknown.error.code == "previous_response_not_found"
    assert unknown.error.param == "previous_response_id"


def test_a_failed_continuation_evicts_the_id_it_used(app):
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            one = final(await socket_turn(ws, {"model": "demo", "input": "Hi", "store": False}))
            bad = await socket_turn(ws, {"model": "demo", "previous_response_id": one["id"], "input": [
                {"type": "function_call_output", "call_id": "call_nobody", "output": "1"}]})
            again = await socket_turn(ws, {"model": "demo", "previous_response_id": one["id"], "input": "Hi"})
            fresh = final(await socket_turn(ws, {"model": "demo", "input": "Hi"}))
            return bad, again, fresh
    bad, again, fresh = asyncio.run(run())
    assert bad[-1]["status"] == 400 and bad[-1]["error"]["param"] == "input[0].call_id"
    assert "call_nobody" in bad[-1]["error"]["message"]
    assert again[-1]["error"]["code"] == "previous_response_not_found"
    assert fresh["status"] == "completed"  # the connection goes on


def test_a_socket_runs_its_responses_in_order_and_bounds_those_waiting(app):
    """One running, MAX_PENDING waiting: a message past them is refused at once, and the others all complete, in
    the order they were sent."""
    from appliance.front.api.responses_ws import MAX_PENDING

    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            for i in range(MAX_PENDING + 3):  # the first runs for 400 tokens while the others are sent at once
                await ws.send_json({"type": "response.create", "model": "demo", "input": f"turn {i}",
                                    "max_output_tokens": 400 if i == 0 else 2, "text": {"format": ENDLESS},
                                    "metadata": {"turn": str(i)}})
                while i == 0 and (await asyncio.wait_for(ws.receive_json(), 60))["type"] != "response.created":
                    pass
            refused, done = 0, []
            while len(done) + refused < MAX_PENDING + 3:
                event = await asyncio.wait_for(ws.receive_json(), 60)
                if event["type"] == "error":
                    assert check("WebSocketErrorEvent", event)["error"]["code"] == "too_many_pending_responses"
                    refused += 1
                elif event["type"] in ("response.completed", "response.incomplete"):
                    done.append(int(event["response"]["metadata"]["turn"]))
            return refused, done
    refused, done = asyncio.run(run())
    assert refused == 2 and done == list(range(MAX_PENDING + 1)), (refused, done)


def test_a_warm_up_generates_nothing_and_is_continued(app):
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            warm = await socket_turn(ws, {"model": "demo", "generate": False, "store": False,
                                          "instructions": "Answer briefly.", "input": "Context: the repo is openarc."})
            turn = final(await socket_turn(ws, {"model": "demo", "input": "Which repo?",
                                                "previous_response_id": final(warm)["id"]}))
            return final(warm), turn
    warm, turn = asyncio.run(run())
    assert warm["output"] == [] and warm["usage"]["output_tokens"] == 0 and turn["status"] == "completed"


def test_a_warm_up_is_held_to_the_model_s_window_as_a_generation_is(app):
    """Warm-ups chained by previous_response_id grow the conversation a socket keeps: past the window no
    generation could take (the demo's 128k tokens, at most 64 characters a token: 8.4M characters), the warm-up
    is refused as the generation would be, and the conversation does not grow in the server's memory."""
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            previous, replies = None, []
            for _ in range(11):
                body = {"model": "demo", "generate": False, "input": "x" * 900_000}
                reply = await socket_turn(ws, {**body, "previous_response_id": previous} if previous else body)
                replies.append(reply[-1])
                if reply[-1]["type"] == "error":
                    return replies
                previous = final(reply)["id"]
            return replies
    replies = asyncio.run(run())
    assert [r["type"] for r in replies] == ["response.completed"] * 9 + ["error"], [r["type"] for r in replies]
    assert replies[-1]["status"] == 400 and replies[-1]["error"]["code"] == "context_length_exceeded", replies[-1]


@pytest.mark.parametrize("sent, param", [
    ("not json", None), ('{"type": "session.update"}', "type"), ('[1, 2]', "type"),
    ('{"type": "response.create", "model": "demo", "input": "Hi", "stream": true}', "stream"),
    ('{"type": "response.create", "model": "demo", "input": "Hi", "background": false}', "background"),
    ('{"type": "response.create", "model": "nope", "input": "Hi"}', None),
    ('{"type": "response.create", "model": "demo", "input": "Hi", "generate": "no"}', "generate"),
    # nested past the JSON decoder's recursion limit, well inside the size bound: refused like any bad JSON
    ("[" * 100_000 + "]" * 100_000, None),
    ('{"type": "response.create", "model": "demo", "input": ' + "[" * 100_000 + "]" * 100_000 + "}", None),
], ids=lambda sent: sent[:48] if isinstance(sent, str) else None)
def test_malformed_messages_get_an_error_and_the_socket_goes_on(app, sent, param):
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            await ws.send_str(sent)
            error = await asyncio.wait_for(ws.receive_json(), 30)
            after = final(await socket_turn(ws, {"model": "demo", "input": "Hi"}))
            return error, after
    error, after = asyncio.run(run())
    check("WebSocketErrorEvent", error)
    assert error["status"] in (400, 404) and (param is None or error["error"]["param"] == param), error
    assert after["status"] == "completed"


def test_an_oversized_message_closes_the_socket_with_1009(app):
    """Past the body limit (1 MB and room for 8 images of the VLM's 64 KB here) the server reads no further: it
    closes with 1009 (message too big), or resets a client still writing the rest."""
    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            try:
                await ws.send_str(json.dumps({"type": "response.create", "model": "demo", "input": "x" * (3 << 20)}))
                message = await asyncio.wait_for(ws.receive(), 30)
            except (ConnectionError, aiohttp.ClientOSError):
                return "reset"
            return message.type == aiohttp.WSMsgType.CLOSE and ws.close_code
    assert asyncio.run(run()) in (1009, "reset")
    assert whole(app.base, {"model": "demo", "input": "Hi"})["status"] == "completed"


def test_a_socket_closed_mid_response_cancels_it_and_is_counted(app):
    def closed():
        return value(samples(app.metrics()), "openarc_requests_total", model="demo", endpoint="responses",
                     status="499") or 0
    before = closed()

    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            await ws.send_json({"type": "response.create", "model": "demo", "input": "Hi",
                                "max_output_tokens": 4000, "text": {"format": ENDLESS}})
            while (await asyncio.wait_for(ws.receive_json(), 30))["type"] != "response.output_text.delta":
                pass
    asyncio.run(run())
    wait_until(lambda: closed() >= before + 1, 30, "the closed socket's response counted as 499")
    wait_until(lambda: app.model_status("demo")["requests_running"] == 0, 30, "the model idle again")


def test_sockets_are_bounded_per_key_and_count_responses_like_http(app):
    from appliance.front.api.responses_ws import MAX_SOCKETS_PER_KEY

    async def run():
        async with aiohttp.ClientSession() as session:
            sockets = [await session.ws_connect(socket_url(app.base)) for _ in range(MAX_SOCKETS_PER_KEY)]
            try:
                with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
                    await session.ws_connect(socket_url(app.base))
                answered = final(await socket_turn(sockets[0], {"model": "demo", "input": "Hi"}))
            finally:
                for ws in sockets:
                    await ws.close()
            again = await session.ws_connect(socket_url(app.base))
            await again.close()
            return refused.value.status, answered
    before = value(samples(app.metrics()), "openarc_requests_total", model="demo", endpoint="responses",
                   status="200") or 0
    status, answered = asyncio.run(run())
    assert status == 429 and answered["status"] == "completed"
    assert value(samples(app.metrics()), "openarc_requests_total", model="demo", endpoint="responses",
                 status="200") == before + 1


def test_a_get_without_an_upgrade_says_what_the_route_is(app):
    status, _, reply = http("GET", app.base + "/v1/responses")
    assert status == 400 and reply["error"]["code"] == "websocket_required"


def test_a_socket_presents_its_key_and_each_response_meets_its_limits(appliance_factory, demo_model):
    secret = "bob-s3cret-ws"
    app = appliance_factory({"server": {"api_keys": [{"name": "bob", "key_env": "KEY_BOB", "requests_per_minute": 2,
                                                      "models": ["demo"]}]},
                             "models": [model_entry("demo", demo_model)]}, env={"KEY_BOB": secret})

    async def connect(headers):
        async with aiohttp.ClientSession() as session:
            try:
                async with session.ws_connect(socket_url(app.base), headers=headers) as ws:
                    return [await socket_turn(ws, {"model": "demo", "input": "Hi", "max_output_tokens": 2})
                            for _ in range(3)]
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status
    assert asyncio.run(connect({})) == 401
    assert asyncio.run(connect({"Authorization": "Bearer wrong"})) == 401
    first, second, third = asyncio.run(connect({"Authorization": f"Bearer {secret}"}))
    assert final(first)["status"] == final(second)["status"] == "incomplete"
    assert third[-1]["status"] == 429 and third[-1]["error"]["type"] == "rate_limit_error", third[-1]

    async def warm_up():  # a response too, that generates nothing: within the same limits
        async with aiohttp.ClientSession() as session, \
                session.ws_connect(socket_url(app.base), headers={"Authorization": f"Bearer {secret}"}) as ws:
            return await socket_turn(ws, {"model": "demo", "input": "Hi", "generate": False})
    warm = asyncio.run(warm_up())
    assert warm[-1]["type"] == "error" and warm[-1]["status"] == 429, warm[-1]
    scrape = samples(app.metrics())
    assert value(scrape, "openarc_requests_total", endpoint="responses", key="bob", status="200") == 2
    assert value(scrape, "openarc_requests_total", endpoint="responses", key="bob", status="429") == 2


def test_a_stopping_server_closes_its_sockets_going_away(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})

    async def run():
        async with aiohttp.ClientSession() as session, session.ws_connect(socket_url(app.base)) as ws:
            final(await socket_turn(ws, {"model": "demo", "input": "Hi", "max_output_tokens": 2}))
            started = time.monotonic()
            stopping = asyncio.get_running_loop().run_in_executor(None, app.stop)
            message = await asyncio.wait_for(ws.receive(), 30)
            await stopping
            return message.type, ws.close_code, time.monotonic() - started
    kind, code, took = asyncio.run(run())
    assert kind == aiohttp.WSMsgType.CLOSE and code == 1001 and took < 15, (kind, code, took)


def test_an_open_socket_answers_only_while_its_key_is_configured(appliance_factory, demo_model):
    """A socket is authenticated at its upgrade and again at each response.create, as an HTTP request would be with
    the upgrade's headers: a key a reload removed (or gave another secret) gets a 401 and the socket closes (1008);
    a key the reload kept goes on, under its new settings."""
    secrets = {"KEY_BOB": "bob-s3cret-ws", "KEY_EVE": "eve-s3cret-ws"}
    keys = [{"name": "bob", "key_env": "KEY_BOB"}, {"name": "eve", "key_env": "KEY_EVE"}]
    app = appliance_factory({"server": {"api_keys": keys}, "models": [model_entry("demo", demo_model)]}, env=secrets)
    turn = {"model": "demo", "input": "Hi", "max_output_tokens": 2}

    async def run():
        async with aiohttp.ClientSession() as session:
            bob = await session.ws_connect(socket_url(app.base),
                                           headers={"Authorization": f"Bearer {secrets['KEY_BOB']}"})
            eve = await session.ws_connect(socket_url(app.base), headers={"x-api-key": secrets["KEY_EVE"]})
            before = [final(await socket_turn(ws, turn))["status"] for ws in (bob, eve)]
            marker = app.logs().count("reloaded")
            app.config_path.write_text(yaml.safe_dump({
                "server": {"api_keys": [{**keys[0], "models": ["other"]}], "port": app.port, "host": "127.0.0.1"},
                "models": [model_entry("demo", demo_model)]}))
            app.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: app.logs().count("reloaded") > marker, 30, "the reload")
            revoked = await socket_turn(eve, turn)
            closed = await asyncio.wait_for(eve.receive(), 30)
            narrowed = await socket_turn(bob, turn)
            await bob.close()
            return before, revoked[-1], closed.type, closed.data, narrowed[-1]
    before, revoked, closed, code, narrowed = asyncio.run(run())
    assert before == ["incomplete", "incomplete"]
    check("WebSocketErrorEvent", revoked)
    assert revoked["status"] == 401 and revoked["error"]["code"] == "invalid_api_key", revoked
    assert closed == aiohttp.WSMsgType.CLOSE and code == 1008
    # bob goes on, under the models the reload gave him: only "other" now
    assert narrowed["status"] == 404 and narrowed["error"]["code"] == "model_not_found", narrowed


def test_sockets_whose_peer_stopped_answering_are_closed_and_free_their_key_s_places(appliance_factory, demo_model):
    """A peer gone silent (a NAT that dropped the connection, a frozen client: here, one that answers no ping) would
    hold its place among the key's MAX_SOCKETS_PER_KEY for good; the server's heartbeat (shortened here) closes it,
    while a socket that answers its pings stays open and answers."""
    from appliance.front.api.responses_ws import MAX_SOCKETS_PER_KEY
    app = appliance_factory({"models": [model_entry("demo", demo_model)]}, env={"OPENARC_DEBUG_WS_HEARTBEAT_S": "0.5"})

    async def run():
        async with aiohttp.ClientSession() as session:
            alive = await session.ws_connect(socket_url(app.base))  # answers pings while it reads
            silent = [await session.ws_connect(socket_url(app.base), autoping=False)
                      for _ in range(MAX_SOCKETS_PER_KEY - 1)]
            started = time.monotonic()
            while True:
                try:
                    another = await session.ws_connect(socket_url(app.base))
                    break
                except aiohttp.WSServerHandshakeError as exc:
                    assert exc.status == 429 and time.monotonic() - started < 30, "the silent sockets still held"
                    with contextlib.suppress(asyncio.TimeoutError):  # aiohttp answers a ping inside receive()
                        await alive.receive(timeout=0.2)
            answered = final(await socket_turn(alive, {"model": "demo", "input": "Hi", "max_output_tokens": 2}))
            for ws in [alive, another, *silent]:
                with contextlib.suppress(ConnectionError):  # the silent ones are closed already
                    await ws.close()
            return answered
    assert asyncio.run(run())["status"] == "incomplete"
