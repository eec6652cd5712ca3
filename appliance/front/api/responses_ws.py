"""WebSocket mode of the Responses API: GET /v1/responses upgraded to a WebSocket (aiohttp's own support). Each
`response.create` message is a streamed /v1/responses request without the transport fields (`stream`,
`stream_options`, `background` are refused, as the spec says they must not be sent); its events come back as text
messages, the same events an SSE stream carries. A refusal before its response began is the spec's WebSocket error
message: {"type": "error", "status": ..., "error": {"type", "code", "message", "param"}}.

The same path as HTTP: each message is a request of its own to the route wrapper's Call (the key the upgrade
presented, its limits, its priority class and the X-OpenArc-Priority header of the upgrade), counted under the
endpoint "responses" with its status, run by the same DialectRoute (appliance.front.api.dialects). A connection
runs its messages one at a time, in order (at most MAX_PENDING wait behind the one running); a socket that closes
cancels the response it runs, as a closed HTTP stream does (its worker request is cancelled).

previous_response_id: a connection keeps its last CACHED_RESPONSES responses, `store: false` ones too, and looks
there first, then in the server's store (appliance.front.api.response_store). A continuation that fails (a 400, a
failed response) evicts the id it used from this connection: using it again is previous_response_not_found, so a
client cannot build on a turn the server did not take. `generate: false` warms a conversation up: the request is
checked and kept for a continuation, and nothing is generated.

Bounds: a message is at most the server's request-body limit (images included; aiohttp closes with 1009 past it), a
connection takes at most MAX_MESSAGES messages, a key holds at most MAX_SOCKETS_PER_KEY sockets and the server
MAX_SOCKETS (a 429, websocket_connection_limit_reached, before the upgrade); a socket whose peer answers no ping
within the heartbeat is closed, freeing its place.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import logging
import os
import time
from typing import Any

from aiohttp import WSCloseCode, WSMsgType, web

from appliance.front import keys
from appliance.front.api import lookup, sse
from appliance.front.api.errors import InvalidRequest, error_response
from appliance.front.api.fields import flag, parse_json
from appliance.front.api.images import body_limit
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses import RESPONSES, ResponseStream, parse_responses
from appliance.front.api.route import CLIENT_CLOSED, UNHANDLED, Call, as_failure, counted
from appliance.front.middleware import INVALID_KEY
from appliance.front.request import Event, RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc.front")

MAX_SOCKETS_PER_KEY = 16
MAX_SOCKETS = 256
MAX_MESSAGES = 10_000  # per connection: a client past it opens a new one
MAX_PENDING = 4  # response.create messages waiting behind the running one
CACHED_RESPONSES = 16  # per connection, for previous_response_id
TRANSPORT_FIELDS = ("stream", "stream_options", "background")
# A peer gone silent (a NAT that dropped the connection, a frozen client) would hold one of its key's places for
# good: the server pings every HEARTBEAT_S and closes a socket whose pong has not come within half of it.
HEARTBEAT_S = float(os.environ.get("OPENARC_DEBUG_WS_HEARTBEAT_S") or 30)


class ResponsesSockets:
    """The WebSocket route: its open sockets, counted per key."""

    def __init__(self, appliance, route, store: ResponseStore):
        self.appliance = appliance  # appliance.front.server.Appliance
        self.route = route  # the /v1/responses DialectRoute
        self.store = store
        self.per_key: collections.Counter[str] = collections.Counter()
        self.sockets: set[web.WebSocketResponse] = set()

    def mount(self, app: web.Application) -> None:
        app.router.add_get("/v1/responses", self.handler)
        app.on_shutdown.append(self.close_all)

    async def handler(self, request: web.Request) -> web.StreamResponse:
        # no permessage-deflate: the events are small and many, and deflating each (in a thread, past a few KB) costs
        # a turn more time than it saves on loopback or a LAN
        ws = web.WebSocketResponse(max_msg_size=body_limit(self.appliance.config), compress=False,
                                   heartbeat=HEARTBEAT_S)
        if not ws.can_prepare(request).ok:
            return error_response(400, "GET /v1/responses is WebSocket mode: connect with a WebSocket upgrade "
                                       "(POST /v1/responses creates a response over HTTP)", "websocket_required")
        key = request.get("api_key")
        name = key.name if key else keys.NO_KEY
        if self.per_key[name] >= MAX_SOCKETS_PER_KEY or len(self.sockets) >= MAX_SOCKETS:
            return error_response(429, f"too many WebSockets open (at most {MAX_SOCKETS_PER_KEY} per key, "
                                       f"{MAX_SOCKETS} in all): close one first", "websocket_connection_limit_reached",
                                  retry_after=1)
        await ws.prepare(request)
        self.per_key[name] += 1
        self.sockets.add(ws)
        try:
            await Connection(self, ws, request).run()
        finally:
            self.sockets.discard(ws)
            self.per_key[name] -= 1
            if not self.per_key[name]:
                del self.per_key[name]
        return ws

    async def close_all(self, app: web.Application) -> None:
        for ws in list(self.sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")


class Connection:
    """One socket: its queue of response.create messages, run one at a time, and its responses for
    previous_response_id."""

    def __init__(self, sockets: ResponsesSockets, ws: web.WebSocketResponse, request: web.Request):
        self.sockets, self.ws, self.request = sockets, ws, request
        self.pending: asyncio.Queue = asyncio.Queue(MAX_PENDING)
        self.cache: collections.OrderedDict[str, list[dict[str, Any]]] = collections.OrderedDict()
        self.evicted: set[str] = set()
        self.messages = 0
        # the /v1/responses route whose finished answers are kept here too, after the server's store kept them
        base = sockets.route.dialect
        self.route = copy.copy(sockets.route)
        self.route.dialect = dataclasses.replace(base, finished=self._finished)

    async def run(self) -> None:
        runner = asyncio.create_task(self._run_pending())
        try:
            async for message in self.ws:
                if message.type == WSMsgType.TEXT:
                    await self._received(message.data)
                elif message.type == WSMsgType.BINARY:
                    await self.refuse(InvalidRequest("messages are JSON text: send a response.create event as text",
                                                     "type"))
        finally:  # closed: the response it runs is cancelled, as a closed HTTP stream's is
            runner.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await runner

    async def _received(self, data: str) -> None:
        self.messages += 1
        if self.messages > MAX_MESSAGES:
            await self.refuse(RequestFailed(429, "rate_limited", f"a connection takes at most {MAX_MESSAGES} "
                                            "messages: open a new one", "websocket_message_limit_reached"))
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"message limit reached")
            return
        try:
            body = create_event(data)
            self.pending.put_nowait(body)
        except InvalidRequest as exc:
            await self.refuse(exc)
        except asyncio.QueueFull:
            await self.refuse(RequestFailed(429, "rate_limited", f"{MAX_PENDING} responses already wait on this "
                                            "connection behind the running one", "too_many_pending_responses"))
        except Exception:  # noqa: BLE001 - a fault of ours with one message must not end the connection
            log.exception("unhandled error reading a WebSocket message")
            await self.refuse(RequestFailed(500, "internal_error", "internal server error", "internal_error"))

    async def _run_pending(self) -> None:
        while True:
            await self.respond(await self.pending.get())

    async def respond(self, body: dict[str, Any]) -> None:
        """One response.create, counted as an HTTP request is (appliance.front.api.route)."""
        if not self.authorized():
            await self.refuse(RequestFailed(401, "invalid_api_key", INVALID_KEY))
            await self.ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"API key revoked")
            return
        started, status = time.monotonic(), UNHANDLED
        call = Call(self.sockets.appliance, "responses", RESPONSES, self.request)
        sink = SocketSink(self.ws)
        previous = body.get("previous_response_id")
        try:
            try:
                call.label(body)
                generate = True if body.get("generate") is None else flag(body, "generate")
                body.pop("generate", None)
                if not generate:
                    await self.warm_up(call, body, sink)
                else:
                    await self.route.answer(call, self.parse, body, sink)
                status = "200"
            except (InvalidRequest, RequestFailed) as exc:
                failure, param = as_failure(exc)
                status = str(failure.status)
                call.count_error(failure.kind)
                await self.refuse(exc, param or call.params.get(failure.kind))
            except ConnectionResetError:
                status = CLIENT_CLOSED
            except Exception:  # noqa: BLE001 - one response's fault must not end the connection's others
                log.exception("unhandled error in a WebSocket response")
                await self.refuse(RequestFailed(500, "internal_error", "internal server error", "internal_error"))
        except asyncio.CancelledError:
            status = CLIENT_CLOSED
            raise
        finally:
            counted(call, status, started)
            if isinstance(previous, str) and (status != "200" or sink.failed):
                self.evict(previous)

    def authorized(self) -> bool:
        """Whether the key the socket was opened with still holds under the current keys, read at each response as
        an HTTP request's is (a reload may revoke it, change its secret, its models or its limits: the socket then
        runs under what the key is now, or not at all). request["api_key"] is what Call reads."""
        ring = self.sockets.appliance.keys
        key = ring.presented(self.request.headers) if ring else None
        if ring and key is None:
            return False
        self.request["api_key"] = key
        return True

    def _finished(self, req, stream: ResponseStream) -> None:
        self.sockets.route.dialect.finished(req, stream)
        self.keep(stream.id, stream.stored())

    def parse(self, body: dict[str, Any], key: str):
        return parse_responses(body, self.sockets.store, key, lambda response_id: self.history(key, response_id))

    async def warm_up(self, call: Call, body: dict[str, Any], sink: SocketSink) -> None:
        """generate: false: the request checked and kept for a continuation; a response with no output. Admitted and
        its grammars converted as a generating one's are (parsing them on the event loop held every client)."""
        await self.route.prepare(call, body)
        req = self.parse(body, call.key)
        self.route.servable(call, req.gen)  # as a generation would be: its model served, its prompt within the window
        stream = ResponseStream(req)
        await sink.send(stream.start(None))
        await sink.send(stream.finish(Event("done", finish_reason="stop"), "stop"))
        self.keep(stream.id, [dict(turn) for turn in req.history])

    def history(self, key: str, response_id: str) -> list[dict[str, Any]]:
        """The conversation a response ended: this connection's, else the one the server stored for `key`."""
        if response_id in self.evicted:
            raise InvalidRequest(f"previous response '{response_id}' is not found: a continuation of it failed on "
                                 "this connection, which evicted it", "previous_response_id",
                                 "previous_response_not_found")
        if response_id in self.cache:
            return [dict(turn) for turn in self.cache[response_id]]
        return self.sockets.store.history(key, response_id)

    def keep(self, response_id: str, conversation: list[dict[str, Any]]) -> None:
        self.cache[response_id] = conversation
        while len(self.cache) > CACHED_RESPONSES:
            self.cache.popitem(last=False)

    def evict(self, response_id: str) -> None:
        self.cache.pop(response_id, None)
        self.evicted.add(response_id)

    async def refuse(self, exc: InvalidRequest | RequestFailed, param: str | None = None) -> None:
        """The spec's WebSocket error message."""
        failure, own = as_failure(exc)
        error = RESPONSES.body(failure, param or own)["error"]
        with contextlib.suppress(ConnectionResetError):
            await self.ws.send_json({"type": "error", "status": failure.status, "error": error})


def create_event(data: str) -> dict[str, Any]:
    """A response.create message's body as a streamed /v1/responses request's."""
    try:  # the request bodies' parser: too deep a nesting is bad JSON too, not a RecursionError ending the socket
        body = parse_json(data)
    except InvalidRequest:
        raise InvalidRequest("the message is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict) or body.get("type") != "response.create":
        raise InvalidRequest("a message must be a JSON object with \"type\": \"response.create\"", "type")
    for field in TRANSPORT_FIELDS:
        if field in body:
            raise InvalidRequest(f"'{field}' is not sent in WebSocket mode: every response streams its events "
                                 "on the socket", field)
    del body["type"]
    return {**body, "stream": True}


class SocketSink:
    """A response's events as the socket's messages; `failed` once it sent response.failed."""

    def __init__(self, ws: web.WebSocketResponse):
        self.ws = ws
        self.failed = False

    async def open(self) -> SocketSink:
        return self  # a socket is open already: nothing goes out before the response's first event

    @staticmethod
    def keepalive_s() -> float:
        """How long a waiting response's window check may take (a socket needs no keep-alive of its own)."""
        return sse.KEEPALIVE_S

    async def send(self, events) -> None:
        for _, data in events:
            self.failed = self.failed or data.get("type") == "response.failed"
            await self.ws.send_json(data)

    async def close(self) -> None:
        return None
