"""The routes that generate text: POST /v1/chat/completions and /v1/completions.

A request is validated (appliance.front.api.completions), handed to its model's supervisor, and whatever comes back
(tokens, a finish, or a RequestFailed) becomes a JSON response or SSE chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api.answer import AnswerParser
from appliance.front.api.completions import GenerationRequest, ResponseShaper, parse_chat, parse_completion
from appliance.front.api import lookup, sse, stream_start
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import json_body, parse_json
from appliance.front.api.images import MAX_IMAGE_REQUESTS_IN_FLIGHT, MAX_IMAGES, ImageResolver, body_limit, spool_base
from appliance.front.api.bounds import prompt_fits
from appliance.front.api.grammar_helper import CONVERTER
from appliance.front.api.results import QueuePlace
from appliance.front.api.route import Call, route
from appliance.front.api.tool_parsers import parser_for
from appliance.front.api.tools import lark_grammars
from appliance.front.request import Event, RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc.front")
IGNORED_LOGGED: set[str] = set()  # left-out tool types already logged by this process
TYPE_LABELS: set[str] = set()  # the tool and item types counted under their own label so far
MAX_TYPE_LABELS = 64
OTHER_TYPE = "other"
TYPE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


# The generation routes, for the other dialects' routes (appliance.front.api.dialects), which take images and large
# bodies through the same resolver, spool and slots.
GENERATION = web.AppKey("generation", object)


def add_routes(app: web.Application, appliance: ServerView) -> None:
    routes = GenerationRoutes(appliance)
    app[GENERATION] = routes
    app.router.add_post("/v1/chat/completions", route(appliance, "chat/completions", routes.chat_completions))
    app.router.add_post("/v1/completions", route(appliance, "completions", routes.completions))
    app.on_startup.append(routes.start)
    app.on_cleanup.append(routes.close)


class GenerationRoutes:
    def __init__(self, appliance: ServerView):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.images = ImageResolver(appliance.config.server.image_fetch, appliance.metrics, appliance.spool_budget,
                                    spool_base())
        self.large_bodies = asyncio.Semaphore(MAX_IMAGE_REQUESTS_IN_FLIGHT)  # chat bodies past max_body_bytes

    async def start(self, app: web.Application) -> None:
        """Start the image decoder with the server when it serves a vision model, and the grammar helper when it
        serves any generative model, so the first image or custom tool does not wait for a process to start."""
        if any(model.kind == "vlm" for model in self.appliance.config.models):
            await self.images.decoder.start()
        if any(model.kind in GENERATIVE_KINDS for model in self.appliance.config.models):
            await CONVERTER.process.start()

    async def close(self, app: web.Application) -> None:
        await self.images.close()
        await CONVERTER.close()

    async def chat_completions(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._generate(request, call, parse_chat, await self.chat_body(request))

    async def completions(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._generate(request, call, parse_completion, await json_body(request))

    async def chat_body(self, request: web.Request) -> Any:
        """A chat body. Images come base64 in it, so on a server with a vision model a body may pass
        max_body_bytes (up to body_limit()) if it names a vision model: a larger one is read holding one of
        MAX_IMAGE_REQUESTS_IN_FLIGHT large-body slots (the others wait, unread), parsed off the event loop, and
        refused with 413 if its model is not a VLM."""
        config = self.appliance.config
        normal, large = config.server.max_body_bytes, body_limit(config)
        if large == normal:
            return await json_body(request)
        data = bytearray()
        async with contextlib.AsyncExitStack() as held:
            while chunk := await request.content.readany():
                if len(data) <= normal < len(data) + len(chunk):
                    await held.enter_async_context(self.large_bodies)
                data += chunk
                if len(data) > large:
                    raise RequestFailed(413, "invalid_request", f"the request body exceeds the limit of {large} bytes "
                                        f"(server.max_body_bytes and room for {MAX_IMAGES} images of the largest "
                                        "max_image_bytes)", "request_entity_too_large")
            if len(data) <= normal:
                return parse_json(bytes(data))
            body = await asyncio.to_thread(parse_json, bytes(data))
        model = body.get("model") if isinstance(body, dict) else None
        # an alias reaches a VLM too
        model = lookup.configured_name(self.appliance, model) if isinstance(model, str) else None
        if not any(m.name == model and m.kind == "vlm" for m in config.models):
            raise RequestFailed(413, "invalid_request", f"the request body exceeds the limit of {normal} bytes "
                                "(server.max_body_bytes); only a request to a vision model (kind vlm) may be larger",
                                "request_entity_too_large")
        return body

    async def _generate(self, request: web.Request, call: Call, parse, body: Any) -> web.StreamResponse:
        call.label(body)
        lookup.admit_early(self.appliance, body, call, GENERATIVE_KINDS)  # before any costly work on the body
        await CONVERTER.convert(lark_grammars(body))  # parse() then finds its custom tools' grammars converted
        req = parse(body)
        if req.stream and not req.content.images:  # its model is looked up as its stream begins (stream_start)
            return await self._stream(request, call, req)
        sup = await lookup.model_for(self.appliance, req.model, call, GENERATIVE_KINDS)
        prompt_fits(req, sup.spec["max_context"])  # a prompt that cannot fit costs the worker nothing
        async with self.with_images(req, sup, call) as (sup, place):
            if req.stream:
                return await self._stream(request, call, req, sup, place)
            answers = [answer_parser(sup, req) for _ in range(req.n)]
            note_constraint(call, self.appliance.metrics, req)
            return await self._whole(sup, req, answers, place)

    @contextlib.asynccontextmanager
    async def with_images(self, req: GenerationRequest, sup, call: Call):
        """(the model's supervisor, the queue place held for the request or None) once the request's images are
        pixel files (req.images); they are removed when the request is over, by which time the worker read them.
        A request with images holds its place in the queue before they are fetched and decoded: a busy model
        refuses it now (429), not after megabytes of pixels were spooled for it."""
        place = QueuePlace(sup) if req.content.images and sup.model.kind == "vlm" else None
        try:
            req.images = await self.images.resolve(req.content, sup.model)
            if place is not None:
                sup = await place.follow(self.appliance, req.model, call, GENERATIVE_KINDS)
            yield sup, place
        finally:  # the worker has read the image files by the time the request is over
            if place is not None:
                place.release()
            self.images.release(req.images)

    @staticmethod
    def _usage(shaper: ResponseShaper, done: list[Event]) -> dict[str, Any]:
        """One usage for all choices: the prompt once (as OpenAI counts it, cached as the choice that found the
        least in the cache: the others of n found the first's), the completions summed."""
        reasoning = [e.reasoning_tokens for e in done if e.reasoning_tokens is not None]
        return shaper.usage(done[0].prompt_tokens, sum(e.completion_tokens for e in done),
                            sum(reasoning) if reasoning else None, min(e.cached_tokens for e in done))

    @staticmethod
    def _open(sup, req: GenerationRequest, place: QueuePlace | None) -> list:
        """One handle per choice (the first in the request's reserved `place`, if it has one); if one cannot be
        admitted (queue full), none is."""
        handles = []
        try:
            for frame in req.frames(sup):
                handles.append(sup.open(frame, reserved=place is not None and place.hand_over()))
        except RequestFailed:
            for handle in handles:
                sup.close(handle)
            raise
        return handles

    async def _whole(self, sup, req: GenerationRequest, answers: list[AnswerParser | None],
                     place: QueuePlace | None) -> web.Response:
        handles = self._open(sup, req, place)
        collecting = [asyncio.create_task(self._collect(sup, handle, req)) for handle in handles]
        try:
            results = await asyncio.gather(*collecting)
        finally:  # one choice failed (or the client left): the others stop too
            for task in collecting:
                task.cancel()
            for handle in handles:
                sup.close(handle)
        shaper = ResponseShaper(req)
        choices = []
        for index, ((text, logprobs, done), answer) in enumerate(zip(results, answers)):
            reply = answer.message(text, cut=done.finish_reason == "length") if answer else text
            reason = finish_reason(self.appliance.metrics, sup.name, answer, done)
            choices.append(shaper.choice(index, reply, reason, logprobs))
        return web.json_response(shaper.whole(choices, self._usage(shaper, [done for _, _, done in results])))

    @staticmethod
    async def _collect(sup, handle, req: GenerationRequest) -> tuple[str, list | None, Event]:
        """A choice's whole text, its logprobs if asked for, and its done event."""
        texts: list[str] = []
        logprobs: list | None = [] if req.params.get("logprobs") else None
        async for event in sup.events(handle):
            if event.op == "done":
                return "".join(texts), logprobs, event
            texts.append(event.text)
            if logprobs is not None:
                logprobs.extend(event.logprobs or ())
        raise AssertionError("event stream ended without done")

    async def _stream(self, request: web.Request, call: Call, req: GenerationRequest, sup=None,
                      place: QueuePlace | None = None) -> web.StreamResponse:
        """A streamed answer; `sup`: its model, ready (with `place`, the queue place its images held), or None: it
        is looked up (and waited for) as the stream begins, keep-alives going out once the request waits."""
        shaper = ResponseShaper(req)
        merged: asyncio.Queue = asyncio.Queue()  # (choice index, Event or RequestFailed) of every choice
        handles: list = []
        pumps: list[asyncio.Task] = []
        answers: list[AnswerParser | None] = []
        served = sup or lookup.model_served(self.appliance, req.model, call, GENERATIVE_KINDS)
        prompt_fits(req, served.spec["max_context"])  # a prompt that cannot fit costs the worker nothing

        async def first() -> tuple[int, Event | RequestFailed]:
            nonlocal sup
            if sup is None:
                sup = await lookup.model_for(self.appliance, req.model, call, GENERATIVE_KINDS)
            answers.extend(answer_parser(sup, req) for _ in range(req.n))
            note_constraint(call, self.appliance.metrics, req)
            handles.extend(self._open(sup, req, place))
            pumps.extend(asyncio.create_task(self._pump(sup, handle, index, merged))
                         for index, handle in enumerate(handles))
            return await merged.get()

        def open_stream():
            return sse.EventStream(request, done_marker=True).open()

        try:
            (index, event), stream = await stream_start.begin(
                first(), stream_start.window_check(self.appliance, served, req.frame()), open_stream,
                sse.keepalive_s(request))
            sse.refused_before_start(event)
            stream = stream or await open_stream()
            if req.kind == "chat":
                for choice in range(req.n):
                    await stream.send(shaper.chunk(first=True, index=choice))
            done: list[Event] = []
            while True:
                if isinstance(event, RequestFailed):
                    return await call.end_stream(stream, event)
                answer = answers[index]
                if event.op == "tokens":
                    await self._send_text(stream, shaper, answer, event.text, event.logprobs, index)
                else:
                    for delta in answer.finish(cut=event.finish_reason == "length") if answer else ():
                        await stream.send(shaper.chunk(delta, index=index))
                    reason = finish_reason(self.appliance.metrics, sup.name, answer, event)
                    await stream.send(shaper.chunk(finish_reason=reason, index=index))
                    done.append(event)
                    if len(done) == req.n:
                        if req.include_usage:
                            await stream.send(shaper.usage_chunk(self._usage(shaper, done)))
                        break
                index, event = await merged.get()
        finally:
            for pump in pumps:
                pump.cancel()
            for handle in handles:
                sup.close(handle)
        return await stream.close()

    async def _pump(self, sup, handle, index: int, merged: asyncio.Queue) -> None:
        """Move one choice's events into the merged queue until it is done or failed."""
        events = sup.events(handle)
        while True:
            event = await sse.next_event(events)
            merged.put_nowait((index, event))
            if isinstance(event, RequestFailed) or event.op == "done":
                return

    @staticmethod
    async def _send_text(stream: sse.EventStream, shaper: ResponseShaper, answer: AnswerParser | None, text: str,
                         logprobs: list | None, index: int = 0) -> None:
        """One tokens event as chunks: a chat answer's deltas (the event's logprobs ride on the first), or a
        completion's text."""
        if answer is None:
            if text or logprobs:
                await stream.send(shaper.chunk(text, logprobs=logprobs, index=index))
            return
        deltas = answer.feed(text)
        if logprobs and not deltas:
            deltas = [{}]
        for i, delta in enumerate(deltas):
            await stream.send(shaper.chunk(delta, logprobs=logprobs if i == 0 else None, index=index))


# --- shared with the other dialects' routes (appliance.front.api.dialects) --------------------------------------

def answer_parser(sup, req: GenerationRequest) -> AnswerParser | None:
    """How this model's answers are split (reasoning, tool calls); None for text completions."""
    if req.kind != "chat":
        return None
    formats = sup.life.formats or {}
    tool_parser = formats.get("tool_parser")
    if req.tools.active and sup.life.formats is not None and not tool_parser:
        raise InvalidRequest(f"model '{req.model}' has no known tool-call format: set 'tool_parser' for it in "
                             f"the config (models[].tool_parser: hermes, qwen3_coder, llama3_json or mistral)",
                             "tools")
    parser = parser_for(tool_parser, req.tools.schemas()) if req.tools.active else None
    # A call the grammar shapes cannot turn out malformed: streamed, its arguments go out as they are written.
    stream_arguments = req.stream and parser is not None and (req.constraint or {}).get("type") == "tool_calls"
    return AnswerParser(bool(formats.get("reasoning_parser")), parser, stream_arguments,
                        single_call=not req.tools.parallel, custom_tools=frozenset(req.tools.custom))


def note_constraint(call: Call, metrics, req: GenerationRequest) -> None:
    """A constrained request is counted, and a constraint genai cannot compile names the field it came from.
    Tools of a type the server cannot run, left out, are counted and logged once per type; input items and blocks
    skipped are counted."""
    for kind in req.tools.ignored:
        kind = bounded_label(kind)
        metrics.ignored_tools.labels(type=kind).inc()
        if kind not in IGNORED_LOGGED:
            IGNORED_LOGGED.add(kind)
            log.info("left out tools of type %s: the server cannot run tools of this type (counted in "
                     "openarc_ignored_tools_total, logged once per type)", kind)
    for kind in req.ignored_inputs:
        metrics.ignored_inputs.labels(endpoint=call.endpoint, type=bounded_label(kind)).inc()
    if req.constraint:
        call.params["invalid_grammar"] = req.constraint["param"]
        metrics.structured_requests.labels(model=call.model, kind=req.constraint["kind"]).inc()


def bounded_label(kind: str) -> str:
    """A type a client named, as a metric label: clients choose these strings, so past MAX_TYPE_LABELS distinct
    ones (and for anything not shaped like a type name) the label is OTHER_TYPE: the series stay bounded, and the
    once-per-type log line carries no client text but a name."""
    if kind in TYPE_LABELS:
        return kind
    if len(TYPE_LABELS) >= MAX_TYPE_LABELS or not TYPE_NAME.fullmatch(kind):
        return OTHER_TYPE
    TYPE_LABELS.add(kind)
    return kind


def finish_reason(metrics, model: str, answer: AnswerParser | None, event: Event) -> str:
    """The finish reason of one answer; its whole tool calls are counted under the configured `model`."""
    if not (answer and answer.calls):
        return event.finish_reason
    whole = len(answer.calls) - 1 if answer.cut_short else len(answer.calls)  # a call cut off is none to run
    if whole:
        metrics.tool_calls.labels(model=model).inc(whole)
    return event.finish_reason if answer.cut_short else "tool_calls"
