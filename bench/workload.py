"""What the server and its in-process baseline are both asked to do: the same prompts, sizes and repetitions."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

PROMPTS = ("Tell me something.", "What is the weather like today?", "Write a short story about a lantern.",
           "List a few words you like.")
OVERHEAD_TOKENS = 32        # the task's figure: a short non-streaming chat completion
FIXED_COST_TOKENS = 1       # a one-token request: what the server adds per request, with no per-token part
STREAM_TOKENS = 512         # long enough that the decode rate, not the first token, dominates
CONCURRENCY_TOKENS = 128
CONCURRENCY_LEVELS = (1, 4, 8, 16)


@dataclass(frozen=True)
class Plan:
    """How many repetitions each figure takes; --quick only checks that every figure can be produced."""

    warmup: int
    overhead_requests: int
    stream_requests: int
    rounds_per_client: int   # concurrency: requests each client sends back to back
    fault_trials: int
    stall_trials: int
    death_trials: int        # the baseline of the fault figures: bare processes killed the same way
    blocks: int              # with peers: each figure's work is split into this many blocks, servers alternating
    revive_timeout_s: float  # SIGABRT trial on a peer: how long to wait for it to serve again


FULL = Plan(warmup=10, overhead_requests=300, stream_requests=10, rounds_per_client=6, fault_trials=50, stall_trials=8,
            death_trials=20, blocks=5, revive_timeout_s=30)
# QUICK keeps the full plan's rounds per client: with one, a concurrency level lasted 70 ms on 2 cores, and the
# 8 -> 16 clients change swung from -24 % to +80 % between quiet runs (six rounds: +25 .. +43 %, 6 s more a run).
QUICK = Plan(warmup=2, overhead_requests=10, stream_requests=2, rounds_per_client=6, fault_trials=2, stall_trials=1,
             death_trials=1, blocks=1, revive_timeout_s=3)


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def chat_body(model: str, i: int, max_tokens: int, stream: bool = False) -> dict:
    body = {"model": model, "messages": messages(i), "max_tokens": max_tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    return body


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile: with 50 samples p99 is the largest, never an interpolated value nobody saw."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def distribution(values: list[float]) -> dict[str, float]:
    return {"n": len(values), "median": statistics.median(values), "p99": percentile(values, 99),
            "min": min(values), "max": max(values)}


def stream_rate(started: float, token_times: list[float], tokens: int) -> float | None:
    """Tokens per second from the request to the arrival of the last token: the same definition on both sides.

    Counted from the request, not from the first token: a server that falls behind merges queued tokens into
    fewer, larger chunks, and a rate between the first and the last chunk would then count a burst, not a speed.
    None when nothing arrived."""
    span = token_times[-1] - started if token_times else 0.0
    return tokens / span if span > 0 and tokens else None


def split(total: int, blocks: int) -> list[int]:
    """`total` repetitions in `blocks` nearly equal parts, none empty."""
    blocks = max(1, min(blocks, total))
    return [total // blocks + (i < total % blocks) for i in range(blocks)]
