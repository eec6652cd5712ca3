"""Server-sent events, as every streaming route sends them (chat and text completions, audio transcripts, and the
routes of other dialects): one stream per response, one JSON payload per event, an optional event name.

Headers wait for the request's first event (`refused_before_start`), so a request its worker refuses (a context too
long, a schema that does not compile) still gets a plain 4xx in the route's error shape; once the stream began, a
failure can only be an event in it. A request that waits longer (queued, its model loading, a long prefill) gets its
headers early, after the checks a client reacts to by status (appliance.front.api.stream_start), and an open stream
never falls silent: when nothing was sent for the server's stream_keepalive_s, a keep-alive goes out (an SSE comment
line on the OpenAI routes, Anthropic's `ping` event on Messages), so no proxy or client takes it for a dead one.
A response whose headers went out is recorded on its request (`prepared`, an event stream also as `opened`):
whatever raises after that, the route wrapper ends an event stream with the dialect's error event (another kind of
body is cut), and the errors middleware never writes a second response.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable

from aiohttp import web

from appliance.front.request import Event, RequestFailed

OPEN_STREAM = "openarc.event_stream"  # the request's key of its StreamSlot

# The longest an open stream stays silent by default (server.stream_keepalive_s): under nginx's 60 s
# proxy_read_timeout and the 20-30 s idle cuts of common proxies and load balancers.
KEEPALIVE_S = 15.0
# the app's key of a callable giving the interval now (the config's, as a reload leaves it)
KEEPALIVE_INTERVAL: web.AppKey[Callable[[], float]] = web.AppKey("keepalive_s")
COMMENT = b": keep-alive\n\n"  # an SSE comment line: every SSE parser skips it
PING = b'event: ping\ndata: {"type": "ping"}\n\n'  # Anthropic's keep-alive event, which its SDKs skip

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}  # nginx: pass each event on as it comes, not in buffered blocks


def keepalive_s(request: web.Request) -> float:
    """The longest a stream of this request's app may stay silent (server.stream_keepalive_s, as a reload left it)."""
    return request.config_dict.get(KEEPALIVE_INTERVAL, lambda: KEEPALIVE_S)()


def refused_before_start(event: Event | RequestFailed) -> None:
    """Raise a request's first event if it is a failure the client must fix (any 4xx), before headers go out; a
    fault of ours (5xx) is streamed as an error event like a failure later on."""
    if isinstance(event, RequestFailed) and event.status < 500:
        raise event


async def next_event(events: AsyncIterator[Event]) -> Event | RequestFailed:
    """The next event of a request (ModelSupervisor.events), a failure returned rather than raised."""
    try:
        return await events.__anext__()
    except RequestFailed as exc:
        return exc


class StreamSlot:
    """Where a request's answer is recorded once its headers went out: one object, shared with the request's clones
    (aiohttp copies the request's dict to a clone). `response`: any response prepared for it (recorded by the app's
    on_response_prepare signal, whoever prepared it); `stream`: its event stream, if that is what it is."""

    response: web.StreamResponse | None = None
    stream: EventStream | None = None


def watch(request: web.Request) -> None:
    """Give the request a slot for its answer (before its handler runs, so its clones share it)."""
    request.setdefault(OPEN_STREAM, StreamSlot())


async def record_prepared(request: web.Request, response: web.StreamResponse) -> None:
    """The app's on_response_prepare signal: the request's answer began (its status and headers are going out)."""
    slot = request.get(OPEN_STREAM)
    if slot is not None and slot.response is None:
        slot.response = response


def prepared(request: web.Request) -> web.StreamResponse | None:
    """The response whose headers went out for this request, if one did: the request is answered, whatever
    happens next."""
    slot = request.get(OPEN_STREAM)
    return slot.response if slot is not None else None


def opened(request: web.Request) -> EventStream | None:
    """The request's event stream if its headers went out (its status is then 200, whatever happens next)."""
    slot = request.get(OPEN_STREAM)
    return slot.stream if slot is not None else None


def cut(request: web.Request) -> None:
    """End the connection of an answer that began and cannot be finished in its own format (a chunked audio body):
    the client sees an incomplete body, never a complete-looking one nor a second response."""
    if request.transport is not None:
        request.transport.close()


class EventStream:
    """One SSE response: open() sends the headers, send() one event, close() ends it. `done_marker`: OpenAI
    completions' final `data: [DONE]`, sent by close(). `keepalive`: what is sent when nothing else was for the
    app's keep-alive interval (COMMENT, or PING on Anthropic's route)."""

    def __init__(self, request: web.Request, done_marker: bool = False, keepalive: bytes = COMMENT):
        self.request = request
        self.response = web.StreamResponse(headers=HEADERS)
        self.done_marker = done_marker
        self.keepalive = keepalive
        self.closed = False
        self.last_write = time.monotonic()
        self.heartbeat: asyncio.Task | None = None

    async def open(self) -> EventStream:
        watch(self.request)
        self.request[OPEN_STREAM].stream = self
        await self.response.prepare(self.request)
        self.last_write = time.monotonic()
        self.heartbeat = asyncio.create_task(self._beat(keepalive_s(self.request)))
        return self

    async def send(self, payload: dict[str, Any], event: str | None = None) -> None:
        head = f"event: {event}\n".encode() if event else b""
        await self._write(head + b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def _write(self, data: bytes) -> None:
        self.last_write = time.monotonic()
        await self.response.write(data)

    async def _beat(self, interval: float) -> None:
        """While the stream is open: a keep-alive whenever nothing was written for `interval` seconds. It ends with
        the stream, or at the first write that finds the client gone (the handler's own write then says so)."""
        with contextlib.suppress(ConnectionError, RuntimeError):
            while not self.closed:
                await asyncio.sleep(max(0.0, self.last_write + interval - time.monotonic()))
                if not self.closed and time.monotonic() - self.last_write >= interval:
                    await self._write(self.keepalive)

    async def close(self) -> web.StreamResponse:
        """End the stream (once: a second close is a no-op)."""
        if not self.closed:
            self.closed = True
            if self.heartbeat is not None:
                self.heartbeat.cancel()
            if self.done_marker:
                await self.response.write(b"data: [DONE]\n\n")
            await self.response.write_eof()
        return self.response
