"""What the one-answer routes share (embeddings, rerank, audio): read the body, find a model of the right kind,
refuse too many inputs, hand one frame to its worker, wait for its one `result`, count it, shape it.

A route module supplies a parse function (body -> a ResultRequest) and a shape function (request, the result
Event: its `result` dict and `prompt_tokens` -> web.Response); failures become OpenAI error bodies exactly as on
the generation routes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import json_body
from appliance.front.request import Event, RequestFailed


@dataclass
class ResultRequest:
    """A validated request for a worker: which model, how many inputs (counted against the model's max_inputs),
    and the body of its `request` frame, which the worker's engine reads (appliance.worker.engines.<kind>)."""

    model: str
    inputs: int
    body: dict[str, Any]


class ResultRoute:
    """One POST route of a one-answer kind; an instance is the aiohttp handler."""

    def __init__(self, appliance, endpoint: str, kinds: tuple[str, ...],
                 parse: Callable[[Any], ResultRequest],
                 shape: Callable[[ResultRequest, Event], web.Response],
                 read: Callable[[web.Request], Awaitable[Any]] = json_body):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, draining
        self.endpoint, self.kinds = endpoint, kinds
        self.parse, self.shape, self.read = parse, shape, read

    async def __call__(self, request: web.Request) -> web.Response:
        started = time.monotonic()
        model_label = ""
        try:
            body = await self.read(request)
            model_label = self.appliance.model_label(body)
            req = self.parse(body)
            sup = await self.appliance.model_for(req.model, self.endpoint, self.kinds)
            if req.inputs > sup.model.max_inputs:
                raise InvalidRequest(f"{req.inputs} inputs exceed this model's max_inputs={sup.model.max_inputs}",
                                     code="too_many_inputs")
            response = self.shape(req, await self._result(sup, req))
        except (InvalidRequest, RequestFailed) as exc:
            response = self.appliance.failed(model_label, self.endpoint, exc)
        metrics = self.appliance.metrics
        metrics.requests.labels(model=model_label, endpoint=self.endpoint, status=str(response.status)).inc()
        metrics.request_duration.labels(model=model_label, endpoint=self.endpoint).observe(time.monotonic() - started)
        return response

    @staticmethod
    async def _result(sup, req: ResultRequest) -> Event:
        handle = sup.open({"kind": sup.model.kind, "body": req.body}, op="request")
        try:
            async for event in sup.events(handle):
                if event.op == "result":
                    return event
        finally:
            sup.close(handle)
        raise AssertionError("event stream ended without a result")
