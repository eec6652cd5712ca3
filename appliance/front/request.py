"""A request's life in the front: queued, then running in a worker, then answered with events or a failure."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from appliance.front.keys import Ticket


class RequestFailed(Exception):
    """A request that ends in an error; the front turns it into an OpenAI error body with `status`."""

    def __init__(self, status: int, kind: str, message: str, code: str | None = None,
                 hint: str | None = None, retry_after: float | None = None, details: dict[str, int] | None = None):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.code = code or kind
        self.hint, self.retry_after = hint, retry_after
        # figures a dialect may word its own message from: a prompt over the window has prompt_tokens,
        # max_context and (with tools) tool_tokens (the worker's error frame)
        self.details = details or {}


@dataclass
class Event:
    op: str            # tokens | done | result (the one answer of a non-LLM kind's request) | step, picture (image)
    text: str = ""
    n: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of prompt_tokens, those the worker's prefix cache served (first tokens, done)
    completion_tokens: int = 0
    logprobs: list | None = None  # [[token text, logprob], ...] when the request asked for them
    reasoning_tokens: int | None = None  # done, on a model with a reasoning format
    stop_sequence: str | None = None  # done: the stop sequence that ended the answer, if one did
    result: dict[str, Any] | None = None  # result: the one answer of a one-answer kind; step, picture: the frame
    max_tokens: int | None = None  # first tokens: the answer's limit, as the worker fitted it to the window


@dataclass
class Request:
    """A request's life in the front: waiting in the queue, then running in the worker."""

    id: int
    frame: dict[str, Any]
    op: str = "generate"  # the ipc op that carries it to the worker
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    dispatched: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    ended: bool = False
    ticket: Ticket = field(default_factory=Ticket)  # its key and priority class


def shutting_down() -> RequestFailed:
    """The 503 of a request the server will not take because it is stopping (or this model's worker is)."""
    return RequestFailed(503, "shutting_down", "the server is shutting down", retry_after=1)
