"""The load generator: asyncio + aiohttp, so one client process can keep 16 streams busy on 2 cores.

It reads any OpenAI-compatible server's dialect without trusting it: tokens are the server's `usage` where it
sends one, else the chunks that carry text (`content`, `reasoning_content` or `reasoning`); anything it does
not understand is counted as unexpected, kept as a sample, and never raised.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

CHAT_PATH = "/v1/chat/completions"
TEXT_FIELDS = ("content", "reasoning_content", "reasoning")  # where servers put generated text in a delta/message
KNOWN_DELTA_FIELDS = {"role", "refusal", "tool_calls", "function_call", *TEXT_FIELDS}
SAMPLES_KEPT = 3


@dataclass
class Unexpected:
    """What a server sent that the bench does not understand: how many, and the first few as it sent them."""

    count: int = 0
    samples: list[str] = field(default_factory=list)

    def add(self, what: str) -> None:
        self.count += 1
        if len(self.samples) < SAMPLES_KEPT:
            self.samples.append(what[:200])


@dataclass
class Reply:
    """What a client saw of one non-streaming request."""

    status: int
    tokens: int | None          # usage.completion_tokens; None when the server sends no usage
    error: dict | None = None
    unexpected: Unexpected = field(default_factory=Unexpected)
    finish_reason: str | None = None
    reasoning: bool = False     # text came in reasoning_content / reasoning (a plain model has none)


@dataclass
class Stream:
    """What an SSE client saw of one streaming request, with arrival times (time.perf_counter)."""

    status: int
    started: float                                          # when the request was sent
    token_times: list[float] = field(default_factory=list)  # arrivals of chunks that carried text
    usage_tokens: int | None = None
    error: dict | None = None
    error_at: float | None = None
    done: bool = False
    broken: str | None = None    # how the stream ended without [DONE]: the connection dropped, or just closed
    broken_at: float | None = None
    unexpected: Unexpected = field(default_factory=Unexpected)
    finish_reason: str | None = None
    reasoning: bool = False     # some text came in reasoning_content / reasoning

    @property
    def tokens(self) -> int:
        """The server's own count where it gives one, else one token per text chunk."""
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)


async def complete(session: aiohttp.ClientSession, base: str, body: dict) -> Reply:
    """One non-streaming request; a connection that fails or drops is a reply with status 0, never an exception."""
    try:
        async with session.post(base + CHAT_PATH, json=body) as response:
            raw = await response.read()
    except (aiohttp.ClientError, ConnectionError) as exc:
        return Reply(0, None, {"message": f"connection failed ({type(exc).__name__}: {exc})"})
    reply = Reply(response.status, None)
    try:
        parsed = json.loads(raw)
    except ValueError:
        reply.unexpected.add(raw.decode(errors="replace"))
        return reply
    if not isinstance(parsed, dict):
        reply.unexpected.add(raw.decode(errors="replace"))
        return reply
    if response.status != 200 or "error" in parsed:
        reply.error = parsed.get("error") if isinstance(parsed.get("error"), dict) else {"message": str(parsed)}
        return reply
    reply.tokens = _usage_tokens(parsed, reply.unexpected)
    choices = parsed.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        reply.unexpected.add(raw.decode(errors="replace"))
        return reply
    reply.finish_reason = choices[0].get("finish_reason")
    message = choices[0].get("message")
    reply.reasoning = isinstance(message, dict) and any(message.get(key) for key in TEXT_FIELDS[1:])
    return reply


async def completion_tokens(session: aiohttp.ClientSession, base: str, body: dict) -> int:
    """A request that must succeed (warm-ups): the tokens it produced, 0 when the server does not say."""
    reply = await complete(session, base, body)
    if reply.status != 200 or reply.error:
        raise RuntimeError(f"{reply.status} from the server: {reply.error}")
    return reply.tokens or 0


async def stream(session: aiohttp.ClientSession, base: str, body: dict,
                 on_token: Callable[[int], None] | None = None) -> Stream:
    """Read one SSE response to its end; on_token(count) runs as each chunk with text arrives.

    A dropped connection or a stream that ends without [DONE] is recorded (`broken`), not raised."""
    started = time.perf_counter()
    seen = Stream(0, started)
    try:
        async with session.post(base + CHAT_PATH, json=body) as response:
            seen.status = response.status
            if response.status != 200:
                _read_refusal(seen, await response.read())
                return seen
            async for line in response.content:
                if _read_line(seen, line, on_token):
                    break
    except (aiohttp.ClientError, asyncio.IncompleteReadError, ConnectionError) as exc:
        what = "connection dropped" if seen.status else "connection failed"
        seen.broken, seen.broken_at = f"{what} ({type(exc).__name__})", time.perf_counter()
        seen.error = None if seen.status else {"message": f"{what} ({type(exc).__name__}: {exc})"}
        return seen
    if not seen.done and seen.broken is None:
        seen.broken, seen.broken_at = "closed without [DONE]", time.perf_counter()
    return seen


def _read_refusal(seen: Stream, raw: bytes) -> None:
    try:
        seen.error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        seen.unexpected.add(raw.decode(errors="replace"))
    seen.error = seen.error or {"message": raw.decode(errors="replace")[:200]}


def _read_line(seen: Stream, line: bytes, on_token: Callable[[int], None] | None) -> bool:
    """One SSE line; True at [DONE]. Blank lines, comments and event/id/retry fields are plain SSE."""
    line = line.strip()
    if not line or line.startswith(b":") or line.split(b":", 1)[0] in (b"event", b"id", b"retry"):
        return False
    if not line.startswith(b"data:"):
        seen.unexpected.add(line.decode(errors="replace"))
        return False
    data = line[5:].strip()
    if data == b"[DONE]":
        seen.done = True
        return True
    try:
        event = json.loads(data)
    except ValueError:
        seen.unexpected.add(data.decode(errors="replace"))
        return False
    _record_event(seen, event, time.perf_counter(), on_token)
    return False


def _record_event(seen: Stream, event, now: float, on_token: Callable[[int], None] | None) -> None:
    if not isinstance(event, dict):
        seen.unexpected.add(json.dumps(event))
        return
    if "error" in event:
        seen.error, seen.error_at = event["error"] if isinstance(event["error"], dict) else {"message": str(event["error"])}, now
        return
    if event.get("usage") is not None:
        seen.usage_tokens = _usage_tokens(event, seen.unexpected)
    choices = event.get("choices")
    if not isinstance(choices, list) or (not choices and event.get("usage") is None):
        seen.unexpected.add(json.dumps(event))
        return
    for choice in choices:
        if isinstance(choice, dict):
            seen.finish_reason = choice.get("finish_reason") or seen.finish_reason
            delta = choice.get("delta")
            seen.reasoning = seen.reasoning or (isinstance(delta, dict) and any(delta.get(k) for k in TEXT_FIELDS[1:]))
        if _carries_text(choice, seen.unexpected):
            seen.token_times.append(now)
            if on_token:
                on_token(len(seen.token_times))


def _carries_text(choice, unexpected: Unexpected) -> bool:
    if not isinstance(choice, dict):
        unexpected.add(json.dumps(choice))
        return False
    if isinstance(choice.get("text"), str):  # /v1/completions chunks
        return bool(choice["text"])
    delta = choice.get("delta")
    if delta is None and "finish_reason" in choice:
        return False
    if not isinstance(delta, dict) or not delta.keys() <= KNOWN_DELTA_FIELDS:
        unexpected.add(json.dumps(choice))
        return False
    return any(isinstance(delta.get(key), str) and delta[key] for key in TEXT_FIELDS)


def _usage_tokens(body: dict, unexpected: Unexpected) -> int | None:
    usage = body.get("usage")
    tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    if usage is not None and not isinstance(tokens, int):
        unexpected.add(json.dumps(usage))
        return None
    return tokens


async def first_success(session: aiohttp.ClientSession, base: str, model: str, interval_s: float = 0.005,
                        timeout_s: float = 120) -> float | None:
    """Poll with one-token requests until one is answered 200; returns when it was, or None at the deadline.

    Refused connections count as "not yet": a server that is restarting may not even listen."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if (await complete(session, base, body)).status == 200:
                return time.perf_counter()
        except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError):
            pass
        await asyncio.sleep(interval_s)
    return None


async def first_model(session: aiohttp.ClientSession, base: str) -> str:
    """The first model a server lists; SystemExit naming the server when it lists none (or cannot be reached)."""
    try:
        async with session.get(base + "/v1/models") as response:
            listed = await response.json(content_type=None)
        return listed["data"][0]["id"]
    except (aiohttp.ClientError, ConnectionError, ValueError, LookupError, TypeError) as exc:
        raise SystemExit(f"python -m bench: {base}/v1/models lists no model ({type(exc).__name__}: {exc}); "
                         "name one: --model NAME, or --peer NAME=URL#MODEL") from None
