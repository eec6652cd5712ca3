"""Streams never fall silent: a stream queued behind long requests gets its headers and keep-alives while it waits,
so a proxy that cuts idle connections (ours here, cutting after a few seconds of silence; a real nginx with its
default 60 s proxy_read_timeout) passes it through whole. The checks a client reacts to by status still come first:
a queued stream whose prompt is over the window is a plain 400, not a 200 with an error event.

The keep-alive interval is shortened (server.stream_keepalive_s) and the proxy's idle cut with it, in the ratio of
the defaults to the common cuts (15 s against 20 s); the nginx test keeps the defaults: it waits over 60 s.
"""

from __future__ import annotations

import asyncio
import http.client as httplib
import json
import shutil
import subprocess
import threading
import time

import anthropic
import pytest

from conftest import free_port, http, model_entry, wait_until

KEEPALIVE_S = 0.5
SILENCE_CUT_S = 2.0  # the proxy's idle cut: a stream silent this long is closed
SLOW_STEPS = {"OPENARC_DEBUG_STEP_DELAY_S": "0.05"}  # 20 tokens a second: the long request takes seconds
CHAT = [{"role": "user", "content": "Say something."}]
HANG_BOUND_S = 120


class IdleCuttingProxy:
    """A TCP proxy on loopback that closes a connection when its upstream has sent nothing for `silence_s`, as an
    idle-timeout proxy or load balancer does. `cuts` counts the connections it closed so."""

    def __init__(self, upstream_port: int, silence_s: float):
        self.upstream_port, self.silence_s = upstream_port, silence_s
        self.port = free_port()
        self.cuts = 0
        self.loop = asyncio.new_event_loop()
        self.started = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        assert self.started.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self.started.set()
        self.loop.run_forever()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        """Pipe both ways until the client hangs up, or cut the connection after silence_s without a byte from the
        upstream (counted only while the client still holds the connection open)."""
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        upward = asyncio.create_task(self._pipe(client_r, up_w))
        try:
            while not upward.done():
                reading = asyncio.ensure_future(up_r.read(65536))
                done, _ = await asyncio.wait({reading, upward}, timeout=self.silence_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if not done:
                    reading.cancel()
                    self.cuts += 1
                    return
                if reading not in done:
                    reading.cancel()
                    return
                if not (data := reading.result()):
                    return
                client_w.write(data)
                await client_w.drain()
        except ConnectionError:
            pass
        finally:
            upward.cancel()
            for writer in (client_w, up_w):
                writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()

    async def _shutdown(self) -> None:
        self.server.close()
        tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


def start_long(app, max_tokens: int) -> threading.Thread:
    """A long streamed request that holds the model's only slot; it runs to its end on a thread."""
    def run():
        for _ in app.client(timeout=HANG_BOUND_S).chat.completions.create(
                model="demo", messages=CHAT, max_tokens=max_tokens, stream=True):
            pass
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    wait_until(lambda: app.model_status("demo")["requests_running"] == 1, 30, "the long request running")
    return thread


def raw_stream(port: int, path: str, body: dict, timeout: float = HANG_BOUND_S) -> tuple[int, list[str], float]:
    """A streamed request's status, the lines of its body (keep-alive comments included), and when its headers
    came (seconds after sending)."""
    connection = httplib.HTTPConnection("127.0.0.1", port, timeout=timeout)
    sent = time.monotonic()
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = connection.getresponse()
    headers_after = time.monotonic() - sent
    lines = response.read().decode().splitlines()
    connection.close()
    return response.status, lines, headers_after


def one_slot(appliance_factory, long_demo_model, keepalive_s: float):
    """One slot (a long request will hold it), keep-alives every `keepalive_s`, a window of 512."""
    return appliance_factory({"server": {"stream_keepalive_s": keepalive_s},
                              "models": [model_entry("demo", long_demo_model, max_running=1, max_context=512)]},
                             env=SLOW_STEPS)


@pytest.fixture
def idle_proxy():
    """IdleCuttingProxy(upstream port, silence_s), closed after the test."""
    proxies: list[IdleCuttingProxy] = []
    yield lambda port, silence_s: proxies.append(IdleCuttingProxy(port, silence_s)) or proxies[-1]
    for proxy in proxies:
        proxy.close()


def test_a_queued_stream_survives_a_proxy_that_cuts_silence(appliance_factory, long_demo_model, idle_proxy):
    app = one_slot(appliance_factory, long_demo_model, KEEPALIVE_S)
    proxy = idle_proxy(app.port, SILENCE_CUT_S)
    long = start_long(app, max_tokens=160)  # about 8 s at 20 tokens a second
    started = time.monotonic()
    status, lines, headers_after = raw_stream(proxy.port, "/v1/chat/completions",
                                              {"model": "demo", "messages": CHAT, "max_tokens": 4, "stream": True})
    waited = time.monotonic() - started
    assert status == 200
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-5:]
    assert waited > 2 * SILENCE_CUT_S  # it waited long enough for the proxy to cut a silent stream twice over
    assert headers_after < SILENCE_CUT_S  # its headers came while it was queued
    assert lines.count(": keep-alive") >= (waited - SILENCE_CUT_S) / SILENCE_CUT_S
    assert proxy.cuts == 0
    long.join(HANG_BOUND_S)

    # Anthropic's route keeps a queued stream alive with its ping events, which its SDK skips
    long = start_long(app, max_tokens=120)
    client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{proxy.port}", api_key="none", max_retries=0,
                                 timeout=HANG_BOUND_S)
    with client.messages.stream(model="demo", max_tokens=4, messages=CHAT) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "max_tokens" and message.content[0].text
    assert proxy.cuts == 0
    long.join(HANG_BOUND_S)


def test_a_queued_stream_over_the_window_is_refused_by_status(appliance_factory, long_demo_model):
    """The window is checked before the headers of a stream that waits: a 400 in the route's own shape (the
    keep-alive interval, the check's time, is long: the token counter process starts on the first check)."""
    app = one_slot(appliance_factory, long_demo_model, 60.0)
    long = start_long(app, max_tokens=120)
    too_long = [{"role": "user", "content": "word " * 600}]
    status, lines, _ = raw_stream(app.port, "/v1/chat/completions",
                                  {"model": "demo", "messages": too_long, "stream": True})
    body = json.loads("\n".join(lines))
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "512" in body["error"]["message"]
    status, _, body = http("POST", app.base + "/v1/messages", {"model": "demo", "max_tokens": 10, "stream": True,
                                                               "messages": too_long})
    assert status == 400 and body["type"] == "error", body
    assert app.model_status("demo")["requests_running"] == 1  # the long request went on
    long.join(HANG_BOUND_S)


NGINX_CONF = """
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/error.log;
events {{}}
http {{
    access_log {tmp}/access.log;
    client_body_temp_path {tmp}/body;
    proxy_temp_path {tmp}/proxy;
    fastcgi_temp_path {tmp}/fastcgi;
    uwsgi_temp_path {tmp}/uwsgi;
    scgi_temp_path {tmp}/scgi;
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
        }}
    }}
}}
"""


@pytest.mark.slow
def test_a_stream_queued_over_a_minute_passes_nginx_with_its_defaults(appliance_factory, long_demo_model,
                                                                      tmp_path):
    """nginx's default proxy_read_timeout is 60 s: a stream that waited silent that long got 504 Gateway Time-out.
    The server's default keep-alive (15 s) keeps it open; nothing else of nginx's settings is changed."""
    app = appliance_factory({"models": [model_entry("demo", long_demo_model, max_running=1)]}, env=SLOW_STEPS)
    port = free_port()
    (tmp_path / "nginx.conf").write_text(NGINX_CONF.format(tmp=tmp_path, port=port, upstream=app.port))
    binary = shutil.which("nginx") or "/usr/sbin/nginx"  # the Makefile's APT_PACKAGES install nginx-light
    nginx = subprocess.Popen([binary, "-c", str(tmp_path / "nginx.conf"),
                              "-p", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_until(lambda: http("GET", f"http://127.0.0.1:{port}/health", timeout=2)[0] == 200, 10, "nginx up")
        long = start_long(app, max_tokens=1400)  # about 70 s at 20 tokens a second
        started = time.monotonic()
        status, lines, _ = raw_stream(port, "/v1/chat/completions",
                                      {"model": "demo", "messages": CHAT, "max_tokens": 4, "stream": True})
        assert time.monotonic() - started > 60
        assert status == 200 and "data: [DONE]" in lines, lines[-5:]
        assert lines.count(": keep-alive") >= 4
        long.join(HANG_BOUND_S)
    finally:
        nginx.terminate()
        nginx.wait(10)


# --- stream_start.begin, without processes ---------------------------------------------------------------------

def run_begin(first_after: float, check_after: float | None, check_refuses: bool = False, interval: float = 0.4):
    """begin() over a first event that comes after `first_after` s and a window check answered after `check_after`
    s (None: no check); returns (outcome, the stream opened or None, seconds until the headers or the end)."""
    from appliance.front.api import stream_start
    from appliance.front.request import RequestFailed

    async def main():
        opened_at = []

        async def first():
            await asyncio.sleep(first_after)
            return "first event"

        async def check():
            await asyncio.sleep(check_after)
            if check_refuses:
                raise RequestFailed(400, "invalid_request", "too long", "context_length_exceeded")
            return {"input_tokens": 1}

        async def open_stream():
            opened_at.append(time.monotonic() - started)
            return "stream"

        started = time.monotonic()
        try:
            outcome, stream = await stream_start.begin(first(), check if check_after is not None else None,
                                                       open_stream, interval)
        except RequestFailed as exc:
            outcome, stream = exc, None
        return outcome, stream, opened_at[0] if opened_at else time.monotonic() - started

    return asyncio.run(main())


def test_begin_waits_for_a_quick_first_event_and_opens_early_for_a_slow_one():
    outcome, stream, _ = run_begin(first_after=0.01, check_after=0.01)
    assert (outcome, stream) == ("first event", None)  # headers wait: a refusal would still be a status
    outcome, stream, headers = run_begin(first_after=1.0, check_after=0.05)
    assert (outcome, stream) == ("first event", "stream") and headers < 0.4  # checked, then opened while it waits
    outcome, stream, headers = run_begin(first_after=1.0, check_after=5.0)
    assert (outcome, stream) == ("first event", "stream") and headers < 0.6  # a late check never holds the headers
    outcome, stream, headers = run_begin(first_after=1.0, check_after=None)
    assert stream == "stream" and headers < 0.4


def test_begin_raises_a_checks_refusal_before_the_headers():
    outcome, stream, took = run_begin(first_after=5.0, check_after=0.05, check_refuses=True)
    assert getattr(outcome, "status", None) == 400 and stream is None and took < 1.0
