"""The recording proxy between a real client and the server: every request and its answer, as the client saw them.

The clients under test are unmodified programs; what they sent and what they were told is only visible on the
wire. The proxy forwards each request to the server, streams the answer back as it comes (keep-alives and all),
and records both. It can also answer a chosen request itself (`answer`): the tool round trips need a first turn
that is one well-formed tool call, which a random demo model never writes (it never closes a JSON string); the
client then runs the tool and replays the call and its result to the server, which answers the next turn.

It runs its own event loop in a thread, so a test or the bench can start a client subprocess and wait for it.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from bench.clients.canned import canned_tool_call, dialect_of

STOP_GRACE_S = 2.0

# Not forwarded: they describe one hop, not the message (RFC 9110 section 7.6.1), or aiohttp sets them itself.
HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
               "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding", "content-encoding"}


@dataclass
class Exchange:
    """One request as the client sent it and the answer as it got it (a stream as its whole text)."""

    method: str
    path: str
    request: dict | None          # the JSON body, None when there was none or it was not JSON
    status: int = 0
    response: str = ""            # the answer's body as text: JSON, or an SSE stream's events
    by_proxy: bool = False        # answered by the proxy itself (`answer`), not forwarded
    content_type: str = ""
    seconds: float = 0.0          # from the request's arrival to the answer's end

    @property
    def streamed(self) -> bool:
        return self.content_type.startswith("text/event-stream")

    @property
    def dialect(self) -> str | None:
        return dialect_of(self.path)

    def response_json(self) -> dict | None:
        try:
            return json.loads(self.response)
        except ValueError:
            return None

    def events(self) -> list[dict]:
        """An SSE answer's `data:` payloads that are JSON, in order."""
        found = []
        for line in self.response.splitlines():
            if line.startswith("data:"):
                try:
                    found.append(json.loads(line[5:].strip()))
                except ValueError:
                    pass
        return found

    def summary(self) -> str:
        """One line for an assertion message: the exchange and, for an error, its body."""
        model = (self.request or {}).get("model")
        error = f" {self.response[:400]}" if self.status >= 400 else ""
        return f"{self.method} {self.path} model={model} -> {self.status}{' (proxy)' if self.by_proxy else ''}{error}"


# A policy that picks the requests the proxy answers itself: the request's dialect and JSON body in, the
# answer's (status, content type, body) out, or None to forward it.
Answer = Callable[[str | None, dict], tuple[int, str, str] | None]


@dataclass
class ToolCallOnce:
    """Answer the first request that offers tool `name` with one call to it, in the request's dialect, streamed
    when it asked for a stream; forward everything else. `arguments` gets the tool's parameter schema as the
    client offered it (so a probe can name the parameter a release calls its path)."""

    name: str
    arguments: Callable[[dict], dict]
    used: bool = field(default=False)

    def __call__(self, dialect: str | None, body: dict) -> tuple[int, str, str] | None:
        tools = offered_tools(body)
        if self.used or dialect is None or self.name not in tools:
            return None
        self.used = True
        return canned_tool_call(dialect, body, self.name, self.arguments(tools[self.name]))


def offered_tools(body: dict) -> dict[str, dict]:
    """The function tools a request offers, by name, with their parameter schemas, in any dialect (chat's nested
    `function`, Responses' flat tools and namespaces, Messages' `input_schema`)."""
    found = {}
    for tool in body.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        for each in (tool.get("tools") if tool.get("type") == "namespace" else [tool]) or ():
            spec = each.get("function") if isinstance(each.get("function"), dict) else each
            if spec.get("name"):
                found[spec["name"]] = spec.get("parameters") or spec.get("input_schema") or {}
    return found


class RecordingProxy:
    """A proxy on loopback in front of `upstream`: `base` is its address, `exchanges` what went through it."""

    def __init__(self, upstream: str, answer: Answer | None = None):
        self.upstream = upstream.rstrip("/")
        self.answer = answer
        self.exchanges: list[Exchange] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="recording-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.port = 0

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> RecordingProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(STOP_GRACE_S + 30)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def __enter__(self) -> RecordingProxy:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def take(self) -> list[Exchange]:
        """The exchanges so far, and a fresh record for the next client run."""
        taken, self.exchanges = self.exchanges, []
        return taken

    async def _start(self) -> None:
        # No read timeout: a long prefill keeps the client waiting, as it would without the proxy.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
                                              auto_decompress=False)
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # A client killed mid-answer leaves its handler waiting on the server: stopping does not wait for it long.
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=STOP_GRACE_S)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        await web.SockSite(self._runner, sock).start()

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        exchange = Exchange(request.method, request.path, body if isinstance(body, dict) else None)
        self.exchanges.append(exchange)
        started = time.monotonic()
        canned = self.answer(exchange.dialect, exchange.request) if self.answer and exchange.request else None
        if canned:
            exchange.status, exchange.content_type, exchange.response = canned
            exchange.by_proxy = True
            return web.Response(status=exchange.status, text=exchange.response, content_type=exchange.content_type)
        try:
            return await self._forward(request, raw, exchange)
        finally:
            exchange.seconds = time.monotonic() - started

    async def _forward(self, request: web.Request, raw: bytes, exchange: Exchange) -> web.StreamResponse:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        try:
            upstream = await self._session.request(request.method, self.upstream + request.path_qs, data=raw or None,
                                                   headers=headers, allow_redirects=False)
        except aiohttp.ClientError as exc:
            exchange.status, exchange.response = 502, f"proxy: upstream unreachable ({exc})"
            return web.Response(status=502, text=exchange.response)
        async with upstream:
            response = web.StreamResponse(status=upstream.status, headers={
                k: v for k, v in upstream.headers.items() if k.lower() not in HOP_HEADERS})
            exchange.status, exchange.content_type = upstream.status, upstream.headers.get("Content-Type", "")
            await response.prepare(request)
            received = bytearray()
            try:
                async for chunk in upstream.content.iter_any():
                    received += chunk
                    await response.write(chunk)
            except (aiohttp.ClientError, ConnectionError):
                pass  # the client or the server went away: what came so far is the record
            finally:
                exchange.response = received.decode(errors="replace")
            await response.write_eof()
            return response
