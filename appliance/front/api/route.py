"""The one wrapper every API route runs in: it labels the request, counts it and its duration however it ends
(answered, failed, or abandoned by its client), and shapes its errors in the route's dialect.

A route is `async def handler(request, call) -> web.StreamResponse`; it raises InvalidRequest or RequestFailed for
anything that is not its answer, and tells `call` which configured model the request named (`call.label(body)`).
The wrapper turns those exceptions into the route's error body (`ErrorShape`: OpenAI's unless the route brings its
own, as an Anthropic-style route would) and counts in a `finally`, so a handler cancelled by a client that hung up
is counted too, with status CLIENT_CLOSED. Once a handler's event stream is open (its 200 and headers sent), any
exception it raises, expected or not, ends that stream with the dialect's error event instead: a second response
written into an open stream would leave the client reading garbage on a connection that never ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front import keys
from appliance.front.api import lookup, sse
from appliance.front.api.errors import ERROR_TYPES, InvalidRequest, error_body, json_error
from appliance.front.api.token_budget import TokenBudget
from appliance.front.limits import Limited
from appliance.front.priority import BACKGROUND, HEADER, INTERACTIVE, BadPriority, request_class
from appliance.front.request import RequestFailed

log = logging.getLogger("openarc.server")

# The status label of a request whose client went away before its answer was complete (nginx's convention):
# numeric, so a dashboard's `status=~"4.."` or `"5.."` still sorts it, and it is neither a 2xx nor a 5xx.
CLIENT_CLOSED = "499"
# A handler that raised something else: the errors middleware answers 500 and logs the traceback.
UNHANDLED = "500"

# The request's key under which the wrapper notes a refusal's code, param and model for the errors middleware's line.
REFUSAL = "openarc.refusal"

# Error kinds counted under a broader one in openarc_request_errors_total.
ERROR_KIND_GROUPS = {"model_not_found": "invalid_request", "context_length_exceeded": "invalid_request"}


class ErrorShape:
    """How a route's errors look to its clients; OpenAI's bodies by default. A route of another dialect
    (Anthropic's Messages, say) passes its own subclass to `route()`."""

    event_name: str | None = None  # the SSE event name of stream_event's payload (chat's events have none)

    def body(self, failure: RequestFailed, param: str | None) -> dict[str, Any]:
        """The JSON body of an error answered with failure.status."""
        return error_body(failure.message, ERROR_TYPES.get(failure.status, "server_error"), failure.code, param,
                          failure.hint)

    def stream_event(self, failure: RequestFailed) -> dict[str, Any]:
        """The SSE payload of a failure after the stream began (headers sent: the status is already 200)."""
        return self.body(failure, None)

    def response(self, failure: RequestFailed, param: str | None) -> web.Response:
        return json_error(self.body(failure, param), failure.status, failure.retry_after)


OPENAI = ErrorShape()


def as_failure(exc: InvalidRequest | RequestFailed) -> tuple[RequestFailed, str | None]:
    """Either exception as a RequestFailed, with the request parameter it names (an InvalidRequest's own)."""
    if isinstance(exc, InvalidRequest):
        return RequestFailed(400, "invalid_request", str(exc), exc.code or "invalid_request"), exc.param
    return exc, None


class Call:
    """One request as the wrapper counts it: its endpoint, its model label, its API key and priority class, and
    error kinds that name a parameter."""

    def __init__(self, appliance: ServerView, endpoint: str, errors: ErrorShape, request: web.Request | None = None):
        self.appliance = appliance  # appliance.front.server.Appliance
        self.endpoint = endpoint
        self.errors = errors
        self.model = ""  # the metrics label: a configured model's name, else ""
        # error kind -> the request field it came from (a constraint genai cannot compile names its field)
        self.params: dict[str, str] = {}
        self.request = request
        self.api_key = request.get("api_key") if request is not None else None  # appliance.front.keys.ApiKey
        self.key = self.api_key.name if self.api_key else keys.NO_KEY  # the metrics label, never the secret
        self.header = request.headers.get(HEADER) if request is not None else None
        self.priority = self.api_key.config.priority if self.api_key else INTERACTIVE
        self.body: Any = None  # what label() was given: the body its token budget is estimated from
        self.ticket: keys.Ticket | None = None  # admit()'s, which the router counts the request's tokens on

    def label(self, body: Any) -> None:
        """The model label, and the class the body and the X-OpenArc-Priority header make the request."""
        self.body = body
        self.model = lookup.model_label(self.appliance, body)
        try:
            self.priority = request_class(self.priority, self.header, body)
        except BadPriority as exc:
            raise InvalidRequest(str(exc), HEADER, "invalid_priority") from None

    @property
    def is_background(self) -> bool:
        return self.priority == BACKGROUND

    def may_use(self, model: str) -> bool:
        return self.api_key is None or self.api_key.may_use(model)

    def admit(self, budget: TokenBudget) -> None:
        """The request's key admits it (its limits, reserving `budget` of its tokens_per_minute), or a 429 with
        Retry-After; the request's ticket is then what the router queues it with (appliance.front.keys.CURRENT).
        The budget has no default: a caller that reserved nothing by omission undid the limit.
        Once admitted, a request is not admitted again (a second lookup of its model, after an unload)."""
        if self.ticket is None:
            limits = self.api_key.limits if self.api_key else None
            reservation = None
            if limits is not None:
                try:
                    reservation = limits.admit(budget.total)
                except Limited as exc:
                    self.appliance.metrics.rate_limited.labels(key=self.key, reason=exc.reason).inc()
                    raise RequestFailed(429, "rate_limited", str(exc), retry_after=exc.retry_after) from None
            self.ticket = keys.Ticket(self.key, self.priority, limits, reservation, prompt_estimate=budget.prompt)
        keys.CURRENT.set(self.ticket)

    def release(self) -> None:
        """The request ended: its ticket settles with its key (once)."""
        if self.ticket is not None:
            ticket, self.ticket = self.ticket, None
            ticket.settle()

    def count_error(self, kind: str) -> None:
        metrics = self.appliance.metrics
        metrics.request_errors.labels(model=self.model, kind=ERROR_KIND_GROUPS.get(kind, kind),
                                      endpoint=self.endpoint).inc()

    def failed(self, exc: InvalidRequest | RequestFailed) -> web.Response:
        """The error response of a request refused by its route or failed on its way through a model, counted."""
        failure, param = as_failure(exc)
        self.count_error(failure.kind)
        param = param or self.params.get(failure.kind)
        if self.request is not None:
            self.request[REFUSAL] = {"code": failure.code, "param": param, "model": self.model}
        return self.errors.response(failure, param)

    def stream_failed(self, failure: RequestFailed) -> dict[str, Any]:
        """The SSE payload of a failure once the stream began, counted."""
        self.count_error(failure.kind)
        return self.errors.stream_event(failure)

    async def end_stream(self, stream: sse.EventStream, failure: RequestFailed) -> web.StreamResponse:
        """An open stream's last event: the failure, in the dialect's error event; then its end."""
        await stream.send(self.stream_failed(failure), self.errors.event_name)
        return await stream.close()

    async def answer_failure(self, request: web.Request, exc: Exception) -> web.StreamResponse:
        """What a request whose handler raised gets: its error response before the stream opened, the error event
        in the stream after (a fault of ours, unless the handler raised a request's failure)."""
        stream, response = sse.opened(request), sse.prepared(request)
        if response is None:
            if isinstance(exc, (InvalidRequest, RequestFailed)):
                return self.failed(exc)
            raise exc  # the errors middleware answers 500 and logs it
        if stream is None:  # a body of another kind (chunked audio) has no error event: it is cut short
            log.error("%s after the answer of %s began", type(exc).__name__, request.path, exc_info=exc)
            sse.cut(request)
            return response
        if stream.closed:
            log.error("%s after the end of a stream of %s", type(exc).__name__, request.path, exc_info=exc)
            return stream.response
        if isinstance(exc, (InvalidRequest, RequestFailed)):
            failure = as_failure(exc)[0]
        else:
            log.error("unhandled error in a stream of %s", request.path, exc_info=exc)
            failure = RequestFailed(500, "internal_error", "internal server error", "internal_error")
        return await self.end_stream(stream, failure)


Handler = Callable[[web.Request, Call], Awaitable[web.StreamResponse]]


def route(appliance: ServerView, endpoint: str, handler: Handler, errors: ErrorShape = OPENAI):
    """The aiohttp handler of one API route: `handler` in the wrapper (see the module's docstring)."""

    async def wrapped(request: web.Request) -> web.StreamResponse:
        started = time.monotonic()
        call = Call(appliance, endpoint, errors, request)
        status = UNHANDLED
        sse.watch(request)
        try:
            try:
                response = await handler(request, call)
            except ConnectionResetError:
                raise
            except Exception as exc:  # noqa: BLE001 - an open stream must end with an event, whatever was raised
                response = await call.answer_failure(request, exc)
            status = str(response.status)
            return response
        except (asyncio.CancelledError, ConnectionResetError):
            status = CLIENT_CLOSED  # the client hung up: aiohttp cancelled the handler, or a write found it gone
            raise
        finally:
            counted(call, status, started)

    return wrapped


def counted(call: Call, status: str, started: float) -> None:
    """A request's end, however it ended (a route's, or a WebSocket's response in appliance.front.api.responses_ws):
    its key's slot given back, it and its duration counted."""
    call.release()
    metrics = call.appliance.metrics
    metrics.requests.labels(model=call.model, endpoint=call.endpoint, status=status, key=call.key,
                            priority=call.priority).inc()
    metrics.request_duration.labels(model=call.model, endpoint=call.endpoint).observe(time.monotonic() - started)
