"""Server-sent events, as every streaming route sends them (chat and text completions, audio transcripts, and the
routes of other dialects): one stream per response, one JSON payload per event, an optional event name.

Headers wait for the request's first event (`refused_before_start`), so a request its worker refuses (a context too
long, a schema that does not compile) still gets a plain 4xx in the route's error shape; once the stream began, a
failure can only be an event in it.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from aiohttp import web

from appliance.front.request import Event, RequestFailed

HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
           "X-Accel-Buffering": "no"}  # nginx: pass each event on as it comes, not in buffered blocks


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


class EventStream:
    """One SSE response: open() sends the headers, send() one event, close() ends it."""

    def __init__(self, request: web.Request):
        self.request = request
        self.response = web.StreamResponse(headers=HEADERS)

    async def open(self) -> EventStream:
        await self.response.prepare(self.request)
        return self

    async def send(self, payload: dict[str, Any], event: str | None = None) -> None:
        head = f"event: {event}\n".encode() if event else b""
        await self.response.write(head + b"data: " + json.dumps(payload, ensure_ascii=False).encode() + b"\n\n")

    async def close(self, done_marker: bool = False) -> web.StreamResponse:
        """End the stream; `done_marker`: OpenAI completions' final `data: [DONE]`."""
        if done_marker:
            await self.response.write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        return self.response
