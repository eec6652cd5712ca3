"""The load generator: asyncio + aiohttp, so one client process can keep 16 streams busy on 2 cores."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

CHAT_PATH = "/v1/chat/completions"


@dataclass
class Stream:
    """What an SSE client saw of one streaming request, with arrival times (time.perf_counter)."""

    status: int
    token_times: list[float] = field(default_factory=list)
    completion_tokens: int = 0
    error: dict | None = None
    error_at: float | None = None
    done: bool = False


async def complete(session: aiohttp.ClientSession, base: str, body: dict) -> tuple[int, dict]:
    async with session.post(base + CHAT_PATH, json=body) as response:
        return response.status, await response.json(content_type=None)


async def completion_tokens(session: aiohttp.ClientSession, base: str, body: dict) -> int:
    status, reply = await complete(session, base, body)
    if status != 200:
        raise RuntimeError(f"{status} from the server: {reply}")
    return reply["usage"]["completion_tokens"]


async def stream(session: aiohttp.ClientSession, base: str, body: dict,
                 on_token: Callable[[int], None] | None = None) -> Stream:
    """Read one SSE response to its end; on_token(count) runs as each chunk with text arrives."""
    async with session.post(base + CHAT_PATH, json=body) as response:
        seen = Stream(response.status)
        if response.status != 200:
            seen.error = (await response.json(content_type=None)).get("error")
            return seen
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                seen.done = True
                break
            _record_event(seen, json.loads(data), time.perf_counter(), on_token)
    if not seen.completion_tokens:  # a server that sends no usage chunk: one chunk per token
        seen.completion_tokens = len(seen.token_times)
    return seen


def _record_event(seen: Stream, event: dict, now: float, on_token: Callable[[int], None] | None) -> None:
    if "error" in event:
        seen.error, seen.error_at = event["error"], now
        return
    if event.get("usage"):
        seen.completion_tokens = event["usage"]["completion_tokens"]
    for choice in event.get("choices") or ():
        if (choice.get("delta") or {}).get("content") or choice.get("text"):
            seen.token_times.append(now)
            if on_token:
                on_token(len(seen.token_times))


async def first_success(session: aiohttp.ClientSession, base: str, model: str, interval_s: float = 0.005,
                        timeout_s: float = 120) -> float:
    """Poll with one-token requests until one is answered 200 (503 while restarting); returns when it was.

    The deadline only catches a model that never comes back, so the bench still stops what it started."""
    body = {"model": model, "messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status, _ = await complete(session, base, body)
        if status == 200:
            return time.perf_counter()
        await asyncio.sleep(interval_s)
    raise RuntimeError(f"{model} did not answer 200 within {timeout_s:g}s")
