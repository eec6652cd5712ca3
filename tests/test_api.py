"""The OpenAI API as a client sees it: the official SDK and raw HTTP against a live appliance on loopback."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest

from conftest import http, model_entry

CHAT = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    """One appliance for the read-only API tests of this module (two models, one of them stateful, one keyed)."""
    from conftest import Appliance
    config = {"server": {"max_body_bytes": 4096},
              "models": [model_entry("demo", demo_model, max_context=512, max_queue=2, max_running=1),
                         model_entry("sdpa", demo_model, pipeline="stateful")]}
    appliance = Appliance(config, tmp_path_factory.mktemp("api")).start()
    yield appliance
    appliance.stop()


def test_models_lists_every_configured_model(app):
    ids = [m.id for m in app.client().models.list().data]
    assert ids == ["demo", "sdpa"]


@pytest.mark.parametrize("model", ["demo", "sdpa"])
def test_chat_completion_stops_by_itself_with_usage(app, model):
    reply = app.client().chat.completions.create(model=model, messages=CHAT)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.role == "assistant"
    assert choice.message.content.strip() and choice.message.content.isprintable()
    assert reply.usage.completion_tokens >= 48
    assert reply.usage.prompt_tokens > 5
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_greedy_output_is_deterministic_and_the_same_on_both_pipelines(app):
    replies = [app.client().chat.completions.create(model=m, messages=CHAT, max_tokens=12).choices[0].message.content
               for m in ("demo", "demo", "sdpa")]
    assert replies[0] == replies[1] == replies[2]


def test_max_tokens_ends_with_length(app):
    reply = app.client().completions.create(model="demo", prompt="Once", max_tokens=5)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5
    assert reply.object == "text_completion"


def test_streaming_chat_yields_chunks_then_done(app):
    stream = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=20, stream=True,
                                                  stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].usage.completion_tokens == 20
    whole = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=20).choices[0].message.content
    assert text == whole


def test_streaming_completion_raw_sse_ends_with_done(app):
    request = urllib.request.Request(app.base + "/v1/completions", method="POST",
                                     data=json.dumps({"model": "demo", "prompt": "Hi", "max_tokens": 3,
                                                      "stream": True}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_sequence_cuts_the_output(app):
    full = app.client().completions.create(model="demo", prompt="Once", max_tokens=30).choices[0].text
    word = full.split()[3]
    cut = app.client().completions.create(model="demo", prompt="Once", max_tokens=30, stop=[word]).choices[0]
    assert cut.finish_reason == "stop"
    assert word not in cut.text
    assert full.startswith(cut.text)


def test_sampling_with_a_seed_is_reproducible(app):
    def sample(seed):
        return app.client().completions.create(model="demo", prompt="Once", max_tokens=16, temperature=1.5,
                                               top_p=0.95, seed=seed).choices[0].text
    assert sample(7) == sample(7)


def test_health_ready_and_status(app):
    assert http("GET", app.base + "/health")[0] == 200
    status, _, body = http("GET", app.base + "/ready")
    assert status == 200 and body["models"] == {"demo": "ready", "sdpa": "ready"}
    models = app.status()["models"]
    assert [(m["name"], m["state"], m["device"], m["restarts"], m["last_error"]) for m in models] == [
        ("demo", "ready", "CPU", 0, None), ("sdpa", "ready", "CPU", 0, None)]
    assert all(isinstance(m["pid"], int) for m in models)


def assert_openai_error(response, status: int, code: str | None = None):
    got_status, headers, body = response
    assert got_status == status, body
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"]), body
    assert body["error"]["message"]
    if code:
        assert body["error"]["code"] == code, body
    return body["error"]


@pytest.mark.parametrize("payload, param", [
    ({"model": "demo"}, "messages"),
    ({"model": "demo", "messages": []}, "messages"),
    ({"model": "demo", "messages": "hi"}, "messages"),
    ({"model": "demo", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"model": "demo", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"model": "demo", "messages": CHAT, "max_tokens": "5"}, "max_tokens"),
    ({"model": "demo", "messages": CHAT, "max_tokens": 0}, "max_tokens"),
    ({"model": "demo", "messages": CHAT, "temperature": 3}, "temperature"),
    ({"model": "demo", "messages": CHAT, "top_p": True}, "top_p"),
    ({"model": "demo", "messages": CHAT, "stop": [1]}, "stop"),
    ({"model": "demo", "messages": CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"model": "demo", "messages": CHAT, "stream": "yes"}, "stream"),
    ({"model": "demo", "messages": CHAT, "n": 9}, "n"),
    ({"messages": CHAT}, "model"),
    ({"model": 3, "messages": CHAT}, "model"),
])
def test_wrong_types_are_400_naming_the_parameter(app, payload, param):
    error = assert_openai_error(http("POST", app.base + "/v1/chat/completions", payload), 400)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies_are_400(app, raw):
    assert_openai_error(http("POST", app.base + "/v1/chat/completions", raw=raw), 400)


def test_unknown_model_is_404(app):
    error = assert_openai_error(http("POST", app.base + "/v1/chat/completions", {"model": "gpt-9", "messages": CHAT}),
                                404, "model_not_found")
    assert "gpt-9" in error["message"]


def test_body_over_the_limit_is_413(app):
    big = {"model": "demo", "messages": [{"role": "user", "content": "x" * 8000}]}
    assert_openai_error(http("POST", app.base + "/v1/chat/completions", big), 413)


def test_a_prompt_over_the_window_is_400_and_a_limit_over_it_is_fitted(app):
    error = assert_openai_error(http("POST", app.base + "/v1/completions", {"model": "demo", "prompt": "word " * 600}),
                                400, "context_length_exceeded")
    assert "512" in error["message"]
    # the same refusal on a streaming request is still a plain 400, not an event in a 200 stream
    assert_openai_error(http("POST", app.base + "/v1/completions",
                             {"model": "demo", "prompt": "word " * 600, "stream": True}),
                        400, "context_length_exceeded")
    # a limit larger than what the window leaves is fitted to it, not refused
    status, _, body = http("POST", app.base + "/v1/completions",
                           {"model": "demo", "prompt": "word " * 100, "max_tokens": 500})
    assert status == 200 and body["usage"]["prompt_tokens"] + 500 > 512, body


def test_unknown_route_and_wrong_method_are_openai_errors(app):
    assert_openai_error(http("GET", app.base + "/v1/nothing"), 404)
    assert_openai_error(http("GET", app.base + "/v1/chat/completions"), 405)


def test_full_queue_is_429_and_never_500(appliance_factory, demo_model):
    """max_running=1, max_queue=2: of 8 simultaneous long requests, some run, the rest get 429 at once. The worker
    takes 10 ms a step, so each request runs for about half a second and the eight surely overlap: on the plain demo
    model a request took ~10 ms, and on a busy machine the eight once went one after the other, all 200."""
    app = appliance_factory({"models": [model_entry("demo", demo_model, max_queue=2, max_running=1)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.01"})
    results: list[tuple[int, float]] = []
    together = threading.Barrier(8)

    def one():
        together.wait()
        started = time.monotonic()
        status = http("POST", app.base + "/v1/completions", {"model": "demo", "prompt": "x", "max_tokens": 200})[0]
        results.append((status, time.monotonic() - started))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    statuses = sorted(s for s, _ in results)
    assert len(statuses) == 8
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 3  # one running + two queued always fit
    assert max(seconds for status, seconds in results if status == 429) < 5  # refused at once, not after a wait


def test_api_key_guards_everything_but_health_and_ready(appliance_factory, demo_model):
    app = appliance_factory({"server": {"api_key_env": "TEST_OPENARC_KEY"}, "models": [model_entry("demo", demo_model)]},
                            env={"TEST_OPENARC_KEY": "s3cret-key"})
    assert http("GET", app.base + "/health")[0] == 200
    assert http("GET", app.base + "/ready")[0] == 200
    for path in ("/v1/models", "/openarc/status"):
        assert_openai_error(http("GET", app.base + path), 401, "invalid_api_key")
        assert_openai_error(http("GET", app.base + path, headers={"Authorization": "Bearer wrong"}), 401)
        assert http("GET", app.base + path, headers={"Authorization": "Bearer s3cret-key"})[0] == 200
    with pytest.raises(openai.AuthenticationError):
        app.client(api_key="wrong").chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    reply = app.client(api_key="s3cret-key").chat.completions.create(model="demo", messages=CHAT, max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    assert "s3cret-key" not in app.logs() and "wrong" not in app.logs()


# --- a handler that raises after its stream opened ----------------------------------------------------------

def test_an_exception_after_a_stream_opened_ends_it_and_never_answers_twice():
    """The front's real middlewares and route wrapper on a real socket, with handlers that raise once their event
    stream is open (headers sent): an OpenAI route's stream ends with its error event, an Anthropic one's with its
    `error` event, a handler outside the wrapper has its stream ended by the errors middleware, a chunked body of
    another kind is cut short; no second HTTP response is ever written into a stream, and every connection ends."""
    import asyncio

    import aiohttp
    from aiohttp import web

    from appliance.config import demo_config
    from appliance.front.api import messages, sse
    from appliance.front.api.route import route
    from appliance.front.app import make_app
    from appliance.front.server import Appliance
    from conftest import free_port

    def raising(done_marker: bool):
        async def handler(request, call=None):
            stream = await sse.EventStream(request.clone(client_max_size=1 << 20), done_marker).open()
            await stream.send({"type": "first"})
            raise KeyError("a bug after the headers")
        return handler

    async def raw_then_raising(request, call=None):  # a chunked body of another kind (as audio speech sends)
        response = web.StreamResponse(headers={"Content-Type": "audio/wav"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(b"RIFF")
        raise KeyError("a bug after the headers")

    async def scenario() -> dict[str, tuple[int, str]]:
        appliance = Appliance(demo_config())
        app = make_app(appliance)
        app.router.add_post("/test/openai", route(appliance, "test", raising(True)))
        app.router.add_post("/test/anthropic", route(appliance, "test", raising(False), messages.ANTHROPIC))
        app.router.add_post("/test/bare", raising(False))
        app.router.add_post("/test/raw", route(appliance, "test", raw_then_raising))
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        seen = {}
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                for path in ("/test/openai", "/test/anthropic", "/test/bare"):
                    async with session.post(f"http://127.0.0.1:{port}{path}", json={}) as response:
                        seen[path] = response.status, await response.text()
                async with session.post(f"http://127.0.0.1:{port}/test/raw", json={}) as response:
                    raw = bytearray()
                    with pytest.raises(aiohttp.ClientPayloadError):  # cut short: never a complete-looking body
                        async for chunk in response.content.iter_any():
                            raw += chunk
                    seen["raw"] = response.status, bytes(raw)
        finally:
            await runner.cleanup()
        return seen

    seen = asyncio.run(scenario())
    assert seen.pop("raw") == (200, b"RIFF")  # no second response in the body
    for path, (status, text) in seen.items():
        assert status == 200 and "HTTP/1.1" not in text and text.startswith('data: {"type": "first"}'), (path, text)
    assert seen["/test/openai"][1].endswith('"param": null, "code": "internal_error"}}\n\ndata: [DONE]\n\n')
    assert seen["/test/anthropic"][1].endswith('event: error\ndata: {"type": "error", "error": {"type": "api_error", '
                                               '"message": "internal server error"}}\n\n')
    assert seen["/test/bare"][1] == 'data: {"type": "first"}\n\n'
