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

from appliance.front.api import compaction, lookup, messages, responses, sse, stream_start
from appliance.front.api.server_view import ServerView
from appliance.front.api.answer_items import Events
from appliance.front.api.count_tokens import CountTokensRoute
from appliance.front.api.bounds import prompt_fits
from appliance.front.api.generate import GENERATION, answer_parser, finish_reason, note_constraint
from appliance.front.api.grammar_helper import CONVERTER
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses_ws import ResponsesSockets
from appliance.front.api.route import Call, route
from appliance.front.api.tools import lark_grammars
from appliance.front.request import Event, RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc.front")


@dataclass
class Dialect:
    parse: Callable[[Any, str], Any]         # body, key name -> the dialect's request (.gen: the chat request)
    stream: Callable[[Any], Any]             # request -> its item stream (start, feed, finish, fail)
    whole: Callable[[Any], dict[str, Any]]   # the finished item stream -> the whole object
    finished: Callable[[Any, Any], None] = lambda req, stream: None  # after the answer's end (storing it)
    keepalive: bytes = sse.COMMENT  # what a silent stream sends (appliance.front.api.sse.EventStream)


def add_routes(app: web.Application, appliance: ServerView) -> None:
    store = ResponseStore(appliance.config.server.stored_responses)
    generation = app[GENERATION]

    def keep(req: responses.ResponsesRequest, stream: responses.ResponseStream) -> None:
        if req.store:
            store.keep(req.key, req.gen.model, stream.id, stream.stored())

    responses_route = DialectRoute(appliance, generation, Dialect(
        lambda body, key: responses.parse_responses(body, store, key), responses.ResponseStream, lambda s: s.response, keep))
    routes = {
        "responses": (responses_route.handler, responses.RESPONSES),
        "responses/compact": (DialectRoute(appliance, generation, Dialect(
            lambda body, key: compaction.parse_compact(body, store, key), compaction.CompactionStream,
            lambda s: s.compaction())).handler, responses.RESPONSES),
        "messages": (DialectRoute(appliance, generation, Dialect(lambda body, key: messages.parse_messages(body),
                                                                 messages.MessageStream, lambda s: s.message,
                                                                 keepalive=sse.PING)).handler,
                     messages.ANTHROPIC),
    }
    for endpoint, (handler, errors) in routes.items():
        app.router.add_post(f"/v1/{endpoint}", route(appliance, endpoint, handler, errors))
    ResponsesSockets(appliance, responses_route, store).mount(app)
    CountTokensRoute(appliance).mount(app)


class DialectRoute:
    """One dialect's generation route; `handler` runs in the route wrapper. `answer` runs one request whose events
    go to a sink: the HTTP stream here, a WebSocket's messages in appliance.front.api.responses_ws."""

    def __init__(self, appliance: ServerView, generation, dialect: Dialect):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.generation = generation  # appliance.front.api.generate.GenerationRoutes: images, large bodies
        self.dialect = dialect

    async def handler(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await self.generation.chat_body(request)
        call.label(body)
        return await self.answer(call, self.dialect.parse, body, SseSink(request, self.dialect.keepalive))

    async def answer(self, call: Call, parse, body: Any, sink) -> Any:
        """One request (`call.label(body)` done): the sink's end for a stream, else the whole object's response."""
        await self.prepare(call, body)
        req = parse(body, call.key)
        gen = req.gen
        if not gen.content.images:  # its model is looked up as its stream begins (stream_start)
            return await self._run(call, req, sink)
        sup = await lookup.model_for(self.appliance, gen.model, call, GENERATIVE_KINDS)
        async with self.generation.with_images(gen, sup, call) as (sup, place):
            return await self._run(call, req, sink, sup, place)

    def servable(self, call: Call, gen, sup=None):
        """The served model `gen` names (`sup` if looked up already), once its prompt can fit the model's window: a
        prompt that cannot costs the worker nothing, and a conversation kept for later (a WebSocket's warm-up) never
        grows past what a generation could take."""
        served = sup or lookup.model_served(self.appliance, gen.model, call, GENERATIVE_KINDS)
        prompt_fits(gen, served.spec["max_context"])
        return served

    async def prepare(self, call: Call, body: Any) -> None:
        """What every parse of a body waits for: its key admitted, then its custom tools' grammars converted in the
        helper process (parse() finds them there; one it did not find is converted on the caller's thread, the
        front's event loop)."""
        lookup.admit_early(self.appliance, body, call, GENERATIVE_KINDS)  # before any costly work on the body
        await CONVERTER.convert(lark_grammars(body))

    async def _run(self, call: Call, req, sink, sup=None, place=None) -> Any:
        """`req` answered into `sink` (a stream) or as one whole object; `sup`: its model, ready (with `place`, the
        queue place its images held), or None: it is looked up (and waited for) as the answer begins, keep-alives
        going out once a stream waits (appliance.front.api.stream_start)."""
        gen = req.gen
        served = self.servable(call, gen, sup)
        opened: list = []  # (its model, the request's handle) once it is admitted

        async def first():
            """The model (waited for), the answer's parser, the request's events and its first."""
            model = sup or await lookup.model_for(self.appliance, gen.model, call, GENERATIVE_KINDS)
            answer = answer_parser(model, gen)
            note_constraint(call, self.appliance.metrics, gen)
            opened.append((model, model.open(gen.frame(model), reserved=place is not None and place.hand_over())))
            events = model.events(opened[0][1])
            return answer, events, await sse.next_event(events)

        try:
            opened_early = None  # the sink, if the stream's headers went out while the request waited
            if gen.stream:
                (answer, events, event), opened_early = await stream_start.begin(
                    first(), stream_start.window_check(self.appliance, served, gen.frame()), sink.open,
                    sink.keepalive_s())
            else:
                answer, events, event = await first()
            sse.refused_before_start(event)
            if gen.stream and opened_early is None:
                await sink.open()
            return await self._answer(call, events, event, req, answer, sink)
        finally:
            for model, handle in opened:
                model.close(handle)

    async def _answer(self, call: Call, events, event, req, answer, sink) -> Any:
        """The chat path's events as the dialect's: a stream (open), or one whole object at the end."""
        items = self.dialect.stream(req)
        started = items.start(event)  # also what the whole object repeats from the first event (its limit)
        if req.gen.stream:
            await sink.send(started)
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
    """A dialect's events as named SSE events (Anthropic's SDK reads the name; OpenAI's the data's type), with the
    dialect's keep-alive while the stream is silent."""

    def __init__(self, request: web.Request, keepalive: bytes = sse.COMMENT):
        self.request = request
        self.keepalive = keepalive
        self.stream: sse.EventStream | None = None

    def keepalive_s(self) -> float:
        return sse.keepalive_s(self.request)

    async def open(self) -> SseSink:
        self.stream = await sse.EventStream(self.request, keepalive=self.keepalive).open()
        return self

    async def send(self, events: Events) -> None:
        for name, data in events:
            await self.stream.send(data, name)

    async def close(self) -> web.StreamResponse:
        return await self.stream.close()
