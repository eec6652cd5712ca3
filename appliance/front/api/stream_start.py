"""How a streamed answer begins: the checks a client reacts to by status come before the headers, and a request that
waits (queued behind others, its model loading, a long prefill) gets its headers early and keep-alives from then on
(appliance.front.api.sse.EventStream), never a silence a proxy cuts.

A stream's first event (its first tokens, or its worker's refusal) usually comes within a moment: then the headers
wait for it, and a refusal is a plain 4xx as before. A request whose first event has not come after
CHECK_AFTER_S is waiting: its prompt is checked against the window by the token counter process (the same
Prompts.check the worker runs, so the same refusal, word for word), a prompt over the window is refused with its 400
now, and otherwise the headers go out while it goes on waiting, within the keep-alive interval whatever happens (a
check not answered by then is left to the worker, whose refusal is then an error event). The key, the model and the key's limits are checked
before any of this (appliance.front.api.lookup). What can still fail after the headers (a load that fails, a worker
that dies, a queue that was full when the model came up) is the dialect's stream error event, as any failure
mid-stream is.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, TypeVar

from appliance.front.api import sse
from appliance.front.request import RequestFailed

T = TypeVar("T")

# How long a stream's first event may take before its request counts as waiting (at most a quarter of the keep-alive
# interval). Short, so the first byte comes long before any proxy's idle cut; long enough that most requests never
# pay a second tokenizing.
CHECK_AFTER_S = 1.0


async def begin(first: Awaitable[T], check: Callable[[], Awaitable[Any]] | None,
                open_stream: Callable[[], Awaitable[sse.EventStream]],
                interval: float) -> tuple[T, sse.EventStream | None]:
    """`first`'s result (the request's first event, however the route gets it), and the stream if its headers went
    out while the request waited (None: they are still to send). `check`: the window check of a waiting request
    (None: none can be made before the worker's: a vision model's image tokens), whose 4xx is raised before the
    headers. `interval`: the keep-alive interval, the longest the client waits for a byte: a check not answered by
    then (a token counter process still starting) is left to the worker, and the headers go out."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + interval
    task = asyncio.ensure_future(first)
    try:
        await asyncio.wait({task}, timeout=min(CHECK_AFTER_S, interval / 4))
        if not task.done() and check is not None:
            await _checked(task, check, deadline - loop.time())
        if task.done():
            return task.result(), None
        stream = await open_stream()
        return await task, stream
    finally:
        if not task.done():  # the check refused, or the client left: the request goes too
            task.cancel()


async def _checked(first: asyncio.Future, check: Callable[[], Awaitable[Any]], within: float) -> None:
    """Wait for the window check, the first event or `within` seconds, whichever comes first; raise the check's
    refusal (a 4xx). A check that cannot be made (the counter down: a 5xx) or is late leaves the window to the
    worker. The check is never cancelled halfway (the counter process answers one question at a time): one outrun
    ends on its own, its answer dropped."""
    checking = asyncio.ensure_future(check())
    checking.add_done_callback(_drop_outcome)
    await asyncio.wait({first, asyncio.shield(checking)}, timeout=max(0.0, within),
                       return_when=asyncio.FIRST_COMPLETED)
    if checking.done() and not first.done():
        refused = None if checking.cancelled() else checking.exception()
        if isinstance(refused, RequestFailed) and refused.status < 500:
            raise refused


def _drop_outcome(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()  # read, so an outrun check's failure is not logged as never retrieved


def window_check(appliance, sup, frame: dict[str, Any]) -> Callable[[], Awaitable[Any]] | None:
    """The window check of a request for `sup`'s model (the supervisor lookup.model_served found), None for a
    vision model (the counter cannot count its image tokens: its worker checks)."""
    if sup.model.kind != "llm":
        return None
    return lambda: appliance.prompt_counter.check(sup.spec, frame)
