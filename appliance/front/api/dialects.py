"""The routes of the other API dialects: POST /v1/responses (OpenAI Responses), /v1/messages and
/v1/messages/count_tokens (Anthropic Messages).

Each dialect's module translates its request into the chat generation request (appliance.front.api.responses,
.messages); here it runs on the chat path (the model's answer parser splits reasoning and tool calls) and the
answer's deltas go through the dialect's item stream, into named SSE events or one whole object. The route wrapper
(appliance.front.api.route) counts and shapes errors: a failure before the first byte is the dialect's error body,
a failure mid-stream the dialect's error event, then the end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from appliance.front.api import lookup, messages, responses, sse
from appliance.front.api.answer_items import Events
from appliance.front.api.count_tokens import CountTokensRoute
from appliance.front.api.fields import json_body
from appliance.front.api.generate import answer_parser, finish_reason, note_constraint
from appliance.front.api.bounds import prompt_fits
from appliance.front.api.grammar_helper import CONVERTER
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.route import Call, route
from appliance.front.api.tools import lark_grammars
from appliance.front.request import Event, RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS


@dataclass
class Dialect:
    parse: Callable[[Any], Any]              # body -> the dialect's request (with .gen, the chat request)
    stream: Callable[[Any], Any]             # request -> its item stream (start, feed, finish, fail)
    whole: Callable[[Any], dict[str, Any]]   # the finished item stream -> the whole object
    finished: Callable[[Any, Any], None] = lambda req, stream: None  # after the answer's end (storing it)


def add_routes(app: web.Application, appliance) -> None:
    store = ResponseStore(appliance.config.server.stored_responses)

    def keep(req: responses.ResponsesRequest, stream: responses.ResponseStream) -> None:
        if req.store:
            store.keep(req.gen.model, stream.id, req.history + [stream.turn()])

    routes = {
        "responses": (DialectRoute(appliance, Dialect(lambda body: responses.parse_responses(body, store),
                                                      responses.ResponseStream, lambda s: s.response, keep)).handler,
                      responses.RESPONSES),
        "messages": (DialectRoute(appliance, Dialect(messages.parse_messages, messages.MessageStream,
                                                     lambda s: s.message)).handler, messages.ANTHROPIC),
    }
    for endpoint, (handler, errors) in routes.items():
        app.router.add_post(f"/v1/{endpoint}", route(appliance, endpoint, handler, errors))
    CountTokensRoute(appliance).mount(app)


class DialectRoute:
    """One dialect's generation route; `handler` runs in the route wrapper."""

    def __init__(self, appliance, dialect: Dialect):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.dialect = dialect

    async def handler(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await json_body(request)
        call.label(body)
        lookup.admit_early(self.appliance, body, call, GENERATIVE_KINDS)  # before any costly work on the body
        await CONVERTER.convert(lark_grammars(body))  # parse() then finds its custom tools' grammars converted
        req = self.dialect.parse(body)
        gen = req.gen
        sup = await lookup.model_for(self.appliance, gen.model, call, GENERATIVE_KINDS)
        prompt_fits(gen, sup.model.max_context)  # a prompt that cannot fit costs the worker nothing
        answer = answer_parser(sup, gen)
        note_constraint(call, self.appliance.metrics, gen)
        handle = sup.open(gen.frame())
        try:
            return await self._answer(request, call, sup.events(handle), req, answer)
        finally:
            sup.close(handle)

    async def _answer(self, request: web.Request, call: Call, events, req, answer) -> web.StreamResponse:
        """The chat path's events as the dialect's: a stream, or one whole object at the end."""
        items, stream = self.dialect.stream(req), None
        event = await sse.next_event(events)
        sse.refused_before_start(event)
        if req.gen.stream:
            stream = await sse.EventStream(request).open()
            await send(stream, items.start(event))
        while True:
            if isinstance(event, RequestFailed):
                if stream is None:
                    raise event
                await send(stream, items.fail(event, call.stream_failed(event)))
                return await stream.close()
            out = self._translate(req, answer, items, event, call.model)
            if stream is not None:
                await send(stream, out)
            if event.op == "done":
                return await stream.close() if stream is not None else web.json_response(self.dialect.whole(items))
            event = await sse.next_event(events)

    def _translate(self, req, answer, items, event: Event, model: str) -> Events:
        """One event of the chat path (new text, or the end) as the dialect's events."""
        if event.op == "tokens":
            return [e for delta in answer.feed(event.text) for e in items.feed(delta)]
        out = [e for delta in answer.finish(cut=event.finish_reason == "length") for e in items.feed(delta)]
        out += items.finish(event, finish_reason(self.appliance.metrics, model, answer, event))
        self.dialect.finished(req, items)
        return out


async def send(stream: sse.EventStream, events: Events) -> None:
    """Named events (Anthropic's SDK reads the name; OpenAI's the data's type)."""
    for name, data in events:
        await stream.send(data, name)
