"""OpenAI-style error bodies: every failure a client sees has this shape, whatever route it called."""

from __future__ import annotations

from typing import Any

from aiohttp import web


class InvalidRequest(ValueError):
    """A request the client must fix: HTTP 400 naming the offending parameter."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


def error_body(message: str, type_: str, code: str | None = None, param: str | None = None,
               hint: str | None = None) -> dict[str, Any]:
    error = {"message": message, "type": type_, "param": param, "code": code}
    if hint:
        error["hint"] = hint
    return {"error": error}


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error",
               409: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error"}


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   hint: str | None = None, retry_after: float | None = None) -> web.Response:
    """An OpenAI error answered outside the API routes (the middlewares: 401, 404, 413, 500)."""
    return json_error(error_body(message, ERROR_TYPES.get(status, "server_error"), code, param, hint), status,
                      retry_after)


def json_error(body: dict[str, Any], status: int, retry_after: float | None = None) -> web.Response:
    """An error body of any dialect, with Retry-After (whole seconds, at least 1) when retrying helps."""
    headers = {"Retry-After": str(max(1, round(retry_after)))} if retry_after else None
    return web.json_response(body, status=status, headers=headers)
