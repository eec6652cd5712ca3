"""What the one-answer routes share (embeddings, rerank; count_tokens and audio, whose body is a form, use one_result
alone): read the JSON body, find a model of the right kind, refuse too many inputs, hand one frame to its worker,
wait for its one `result`, count it, shape it.

A route module supplies a parse function (body -> a ResultRequest) and a shape function (request, the result
Event: its `result` dict and `prompt_tokens` -> web.Response); the route wrapper (appliance.front.api.route) counts
it and shapes its failures exactly as on the generation routes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import lookup
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import json_body
from appliance.front.api.route import Call
from appliance.front.request import Event


@dataclass
class ResultRequest:
    """A validated request for a worker: which model, how many inputs (counted against the model's max_inputs),
    and the body of its `request` frame, which the worker's engine reads (appliance.worker.engines.<kind>)."""

    model: str
    inputs: int
    body: dict[str, Any]


class ResultRoute:
    """One POST route of a one-answer kind; `handler` runs in the route wrapper (appliance.front.api.route)."""

    def __init__(self, appliance: ServerView, kinds: tuple[str, ...],
                 parse: Callable[[Any], ResultRequest],
                 shape: Callable[[ResultRequest, Event], web.Response]):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.kinds = kinds
        self.parse, self.shape = parse, shape

    async def handler(self, request: web.Request, call: Call) -> web.Response:
        body = await json_body(request)
        call.label(body)
        req = self.parse(body)
        sup = await lookup.model_for(self.appliance, req.model, call, self.kinds)
        if req.inputs > sup.model.max_inputs:
            raise InvalidRequest(f"{req.inputs} inputs exceed this model's max_inputs={sup.model.max_inputs}",
                                 code="too_many_inputs")
        return self.shape(req, await one_result(sup, {"kind": sup.model.kind, "body": req.body}))


class QueuePlace:
    """A place held in a model's queue (ModelSupervisor.reserve) for a request whose costly input is still to be
    read or decoded (an audio upload, a chat request's images): a busy model refuses it (429) before that cost is
    paid, and the model counts it as work meanwhile. hand_over() gives the place to the request being opened
    (open(reserved=...)); release() gives it back if it never was."""

    def __init__(self, sup):
        sup.reserve()  # RequestFailed (429, 503) if there is no room
        self.sup = sup
        self.held = True

    def hand_over(self) -> bool:
        held, self.held = self.held, False
        return held

    def release(self) -> None:
        if self.held:  # refused or failed before it was opened
            self.held = False
            self.sup.router.unreserve()

    async def follow(self, appliance: ServerView, name: str, call, kinds: tuple[str, ...]):
        """The supervisor to open the request on: this place's while it takes the request (an unload's drain
        waits for the place), else, the model unloaded under the request once that drain gave up waiting, the
        model's next load (waited for up to its ready_wait_s) with a new place in its queue."""
        if not self.sup.life.admits(self.held):
            self.release()
            sup = await lookup.model_for(appliance, name, call, kinds)
            sup.reserve()
            self.sup, self.held = sup, True
        return self.sup


async def one_result(sup, frame: dict[str, Any], reserved: bool = False) -> Event:
    """Hand one `request` frame to the model's worker (in its reserved place, if it has one) and wait for its one
    result."""
    return await result_of(sup, sup.open(frame, op="request", reserved=reserved))


async def result_of(sup, handle) -> Event:
    """The one result of a request opened on the model; the request is closed whatever happens."""
    try:
        async for event in sup.events(handle):
            if event.op == "result":
                return event
    finally:
        sup.close(handle)
    raise AssertionError("event stream ended without a result")
