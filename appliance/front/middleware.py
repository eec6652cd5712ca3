"""The two middlewares every request passes through: errors (no traceback ever reaches a client, and a request whose
answer began is never answered again) and auth (the API key a request presents, or a 401).

A module of its own because both are one policy for every route, whichever family it belongs to; appliance.front.app
puts them in front of all of them. Each reads the appliance's current config and keys, which a reload replaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any, Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from appliance.front.api.server_view import ServerView
from appliance.front.api import messages, sse
from appliance.front.api.errors import error_response
from appliance.front.api.route import REFUSAL
from appliance.front.request_ledger import request_scope

log = logging.getLogger("openarc.server")  # the name these lines always had in the log



class MalformedHttp(logging.Filter):
    """aiohttp's HTTP parser refuses a malformed request (a request line or header past 8,190 bytes, bad framing)
    with a plain-text 400 before any middleware, and logs it with a traceback: a client's bad input, not a fault
    of ours. It is logged as one line instead (issue 36: no traceback in the log from any request)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            record.msg, record.args = "refused a malformed HTTP request: %s", (exc.message,)
            record.exc_info, record.exc_text, record.levelno, record.levelname = None, None, logging.INFO, "INFO"
        return True


logging.getLogger("aiohttp.server").addFilter(MalformedHttp())

PROBES = {"/health", "/ready"}
INVALID_KEY = "invalid or missing API key (Authorization: Bearer ... or x-api-key: ...)"
OPEN_ROUTES = PROBES | {"/"}  # no key asked (probes carry none), nor on /metrics unless the config says so


class Middlewares:
    """Both middlewares of one appliance (appliance.front.server.Appliance): each reads its current config and keys,
    which a reload replaces."""

    def __init__(self, appliance: ServerView):
        self.appliance = appliance

    @web.middleware
    async def errors(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves as an error body in the route's dialect; no traceback ever reaches a client. A request
        whose answer began (its headers went out, on any route) is never answered again: an event stream is ended
        (the route wrapper sent the error event), any other body cut short."""
        sse.watch(request)
        try:
            with request_scope():  # the request ledger's (OPENARC_DEBUG_INVARIANTS): what the route left open
                response = await handler(request)
            return refusal_logged(request, response)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            stream, response = sse.opened(request), sse.prepared(request)
            if response is None:
                return refusal_logged(request, error_answer(request, exc, self.appliance.config.server.max_body_bytes))
            log.error("%s after the answer of %s %s began", type(exc).__name__, request.method, request.path,
                      exc_info=exc)
            if stream is not None:
                with contextlib.suppress(Exception):  # a stream that cannot even end: its connection does
                    return await stream.close()
            sse.cut(request)  # a body of another kind (chunked audio) is cut short
            return response

    @web.middleware
    async def auth(self, request: web.Request, handler) -> web.StreamResponse:
        """The key a request presents (request["api_key"], for the route wrapper), or a 401. Anthropic's clients
        send x-api-key, OpenAI's Authorization: Bearer; the presented key is never logged."""
        if self.appliance.keys and not open_route(request.path, self.appliance.config.server.metrics_require_key):
            key = self.appliance.keys.presented(request.headers)
            if key is None:
                return error_shape(request)(401, INVALID_KEY, "invalid_api_key")
            request["api_key"] = key
        return await handler(request)


def refusal_logged(request: web.Request, response: web.StreamResponse) -> web.StreamResponse:
    """Every 4xx and 5xx a client is answered with leaves one line at info: the route, the status, the error's code
    and param, the model and the key's name; never the body. The route wrapper notes what it knows (REFUSAL); an
    error answered elsewhere (auth, no such route) is read from its own error body. The probes' 503s (/health,
    /ready while a model loads) are their answers, not refusals: a probe every few seconds would fill the log."""
    if response.status < 400 or request.path in PROBES:
        return response
    noted = request.get(REFUSAL) or _error_fields(response)
    key = request.get("api_key")
    log.info("refused %s %s: %d code=%s param=%s model=%s key=%s", *map(_one_line, (
        request.method, request.path)), response.status, *map(_one_line, (
        noted.get("code") or "-", noted.get("param") or "-", noted.get("model") or "-",
        key.name if key is not None else "-")))
    return response


def _one_line(value: Any) -> str:
    """A field of a log line as one line of printable text: the path is decoded (a client's %0A is a newline) and
    a param may quote a client's field name, so either could otherwise start a log line of the client's making."""
    text = str(value)
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _error_fields(response: web.StreamResponse) -> dict[str, Any]:
    """The code and param of an error body in OpenAI's shape, or Anthropic's type ({} for anything else)."""
    body = getattr(response, "body", None)
    try:
        parsed = json.loads(body) if isinstance(body, bytes) else None
    except ValueError:
        return {}
    error = parsed.get("error") if isinstance(parsed, dict) else None
    if not isinstance(error, dict):
        return {}
    return {"code": error.get("code") or error.get("type"), "param": error.get("param")}


def error_answer(request: web.Request, exc: Exception, max_body_bytes: int) -> web.StreamResponse:
    """The error body of a request that raised before its answer began."""
    if not isinstance(exc, web.HTTPException):
        log.error("unhandled error in %s %s", request.method, request.path, exc_info=exc)
        return error_shape(request)(500, "internal server error", code="internal_error")
    if exc.status < 400:
        raise exc
    message = {404: f"no route {request.method} {request.path}",
               405: f"method {request.method} is not allowed on {request.path}",
               413: f"request body exceeds the limit of {max_body_bytes} bytes"}
    return error_shape(request)(exc.status, message.get(exc.status, exc.reason),
                                code=exc.reason.lower().replace(" ", "_"))


def error_shape(request: web.Request) -> Callable[..., web.Response]:
    """Anthropic's error body on its routes, OpenAI's everywhere else."""
    return messages.error_response if request.path.startswith("/v1/messages") else error_response


def open_route(path: str, metrics_require_key: bool) -> bool:
    return path in OPEN_ROUTES or (path == "/metrics" and not metrics_require_key)
