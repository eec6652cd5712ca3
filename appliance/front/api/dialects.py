"""The routes of the other API dialects: POST /v1/responses (OpenAI Responses), /v1/messages and
/v1/messages/count_tokens (Anthropic Messages).

Each dialect's module translates its request into the chat generation request (appliance.front.api.responses,
.messages); here it runs on the chat path (the model's answer parser splits reasoning and tool calls) and the
answer's deltas go through the dialect's item stream, into named SSE events or one whole object. The route wrapper
(appliance.front.api.route) counts and shapes errors: a failure before the first byte is the dialect's error body,
a failure mid-stream the dialect's error event, then the end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from appliance.front.api import compaction, lookup, messages, responses, sse
from appliance.front.api.answer_items import Events
from appliance.front.api.count_tokens import CountTokensRoute
from appliance.front.api.generate import GENERATION, answer_parser, finish_reason, note_constraint
from appliance.front.api.lark_grammar import convert_off_loop
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses_ws import ResponsesSockets
from appliance.front.api.route import Call, route
from appliance.front.api.tools import lark_grammars
from appliance.front.request import Event, RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc.front")


@dataclass
class Dialect:
    parse: Callable[[Any], Any]              # body -> the dialect's request (with .gen, the chat request)
    stream: Callable[[Any], Any]             # request -> its item stream (start, feed, finish, fail)
    whole: Callable[[Any], dict[str, Any]]   # the finished item stream -> the whole object
    finished: Callable[[Any, Any], None] = lambda req, stream: None  # after the answer's end (storing it)
    bound: Callable[[Any, Any], None] = lambda req, model: None  # once the model (config.ModelConfig) is known


def add_routes(app: web.Application, appliance) -> None:
    store = ResponseStore(appliance.config.server.stored_responses)
    generation = app[GENERATION]

    def keep(req: responses.ResponsesRequest, stream: responses.ResponseStream) -> None:
        if req.store:
            store.keep(req.gen.model, stream.id, stream.stored())

    def bind(req: responses.ResponsesRequest, model) -> None:
        req.bind(model)

    responses_route = DialectRoute(appliance, generation, Dialect(
        lambda body: responses.parse_responses(body, store), responses.ResponseStream, lambda s: s.response, keep,
        bind))
    routes = {
        "responses": (responses_route.handler, responses.RESPONSES),
        "responses/compact": (DialectRoute(appliance, generation, Dialect(
            lambda body: compaction.parse_compact(body, store), compaction.CompactionStream,
            lambda s: s.compaction())).handler, responses.RESPONSES),
        "messages": (DialectRoute(appliance, generation, Dialect(messages.parse_messages, messages.MessageStream,
                                                                 lambda s: s.message)).handler, messages.ANTHROPIC),
    }
    for endpoint, (handler, errors) in routes.items():
        app.router.add_post(f"/v1/{endpoint}", route(appliance, endpoint, handler, errors))
    ResponsesSockets(appliance, responses_route, store).mount(app)
    CountTokensRoute(appliance).mount(app)


class DialectRoute:
    """One dialect's generation route; `handler` runs in the route wrapper. `answer` runs one request whose events
    go to a sink: the HTTP stream here, a WebSocket's messages in appliance.front.api.responses_ws."""

    def __init__(self, appliance, generation, dialect: Dialect):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.generation = generation  # appliance.front.api.generate.GenerationRoutes: images, large bodies
        self.dialect = dialect

    async def handler(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await self.generation.chat_body(request)
        call.label(body)
        return await self.answer(call, self.dialect.parse, body, SseSink(request))

    async def answer(self, call: Call, parse, body: Any, sink) -> Any:
        """One request (`call.label(body)` done): the sink's end for a stream, else the whole object's response."""
        await convert_off_loop(lark_grammars(body))  # parse() then finds its custom tools' grammars converted
        req = parse(body)
        gen = req.gen
        sup = await lookup.model_for(self.appliance, gen.model, call, GENERATIVE_KINDS)
        async with self.generation.with_images(gen, sup, call) as (sup, place):
            self.dialect.bound(req, sup.model)
            answer = answer_parser(sup, gen)
            note_constraint(call, self.appliance.metrics, gen)
            handle = sup.open(gen.frame(), reserved=place is not None and place.hand_over())
            try:
                return await self._answer(call, sup.events(handle), req, answer, sink)
            finally:
                sup.close(handle)

    async def _answer(self, call: Call, events, req, answer, sink) -> Any:
        """The chat path's events as the dialect's: a stream, or one whole object at the end."""
        items = self.dialect.stream(req)
        event = await sse.next_event(events)
        sse.refused_before_start(event)
        if req.gen.stream:
            await sink.open()
            await sink.send(items.start(event))
        while True:
            if isinstance(event, RequestFailed):
                if not req.gen.stream:
                    raise event
                await sink.send(items.fail(event, call.stream_failed(event)))
                return await sink.close()
            try:
                out = self._translate(req, answer, items, event, call.model)
            except Exception as exc:  # noqa: BLE001 - a fault of ours mid-stream ends it with the dialect's failure
                if not req.gen.stream:
                    raise
                log.error("unhandled error in a stream of /v1/%s", call.endpoint, exc_info=exc)
                event = RequestFailed(500, "internal_error", "internal server error", "internal_error")
                continue
            if req.gen.stream:
                await sink.send(out)
            if event.op == "done":
                return await sink.close() if req.gen.stream else web.json_response(self.dialect.whole(items))
            event = await sse.next_event(events)

    def _translate(self, req, answer, items, event: Event, model: str) -> Events:
        """One event of the chat path (new text, or the end) as the dialect's events."""
        if event.op == "tokens":
            return [e for delta in answer.feed(event.text) for e in items.feed(delta)]
        out = [e for delta in answer.finish(cut=event.finish_reason == "length") for e in items.feed(delta)]
        out += items.finish(event, finish_reason(self.appliance.metrics, model, answer, event))
        self.dialect.finished(req, items)
        return out


class SseSink:
    """A dialect's events as named SSE events (Anthropic's SDK reads the name; OpenAI's the data's type)."""

    def __init__(self, request: web.Request):
        self.request = request
        self.stream: sse.EventStream | None = None

    async def open(self) -> None:
        self.stream = await sse.EventStream(self.request).open()

    async def send(self, events: Events) -> None:
        for name, data in events:
            await self.stream.send(data, name)

    async def close(self) -> web.StreamResponse:
        return await self.stream.close()
