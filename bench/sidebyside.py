"""`--peer`: several OpenAI-compatible servers driven alternately with one workload, in one table.

Where the user names a server's process (--peer-pid; the bench knows its own appliance's), the table also holds
its memory (the process and its children) and a SIGABRT-mid-stream trial: what the client saw, how soon, and
whether the server answers again. A peer's trial comes last: it may not survive it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass

import aiohttp

from appliance.host.telemetry import process_rss_bytes
from bench import client, workload
from bench.phases import Aggregate, Counts, Latency, Server, Streaming
from bench.report import MB
from bench.workload import chat_body, distribution

ABORT_AFTER_CHUNKS = 5        # mid-stream: the client has seen this many chunks with text
ABORT_STREAM_TOKENS = 2000    # far more than get generated before the signal
ABORT_ANSWER_TIMEOUT_S = 30   # a client that has seen nothing by then is reported as left hanging
REVIVE_POLL_S = 0.05


@dataclass
class AbortTrial:
    target: str                    # the process signalled: pid and command
    saw: str                       # what the client saw after the signal
    after_s: float | None          # signal -> that
    serves_again_s: float | None   # signal -> the first 200 of a one-token request; None: not within the timeout
    waited_s: float
    history: str = ""              # the server's own crash count and restart backoff (openarc's /openarc/status)

    def text(self) -> str:
        when = f" after {self.after_s * 1e3:.1f} ms" if self.after_s is not None else ""
        again = (f"serves again after {self.serves_again_s:.2f} s" if self.serves_again_s is not None
                 else f"not serving {self.waited_s:g} s later")
        history = f"; {self.history}" if self.history else ""
        return f"{self.saw}{when}; {again}{history} (SIGABRT to {self.target})"


async def crash_history(session: aiohttp.ClientSession, base: str, model: str) -> tuple[int, float | None] | None:
    """(crashes so far, the restart backoff in force) where the server says (openarc's /openarc/status), else None:
    a server's second trial in a row waits out a doubled backoff, which is its policy, not its speed."""
    try:
        async with session.get(base + "/openarc/status") as response:
            status = await response.json() if response.status == 200 else {}
        found = next(m for m in status.get("models", ()) if m.get("name") == model)
        return int(found.get("crashes") or 0), found.get("restart_backoff_s")
    except (aiohttp.ClientError, ValueError, StopIteration, TypeError, AttributeError):
        return None


def history_text(before: tuple[int, float | None] | None, after: tuple[int, float | None] | None) -> str:
    if before is None or after is None:
        return "crash count and backoff not reported by the server"
    backoff = f"{after[1]:g} s" if after[1] is not None else "none"
    return f"{before[0]} crashes before this trial, {after[0]} after; restart backoff in force {backoff}"


async def abort_trial(session: aiohttp.ClientSession, base: str, model: str, pid: int,
                      revive_timeout_s: float) -> AbortTrial:
    """SIGABRT `pid` once a stream is under way, as its client would live through it."""
    target = f"pid {pid}, {command(pid)}"
    sent: list[float] = []

    def abort(chunks: int) -> None:
        if chunks == ABORT_AFTER_CHUNKS and not sent:
            os.kill(pid, signal.SIGABRT)
            sent.append(time.perf_counter())

    body = chat_body(model, 0, ABORT_STREAM_TOKENS, stream=True)
    before = await crash_history(session, base, model)
    trial = await _abort(session, base, model, body, abort, sent, target, revive_timeout_s)
    trial.history = history_text(before, await crash_history(session, base, model))
    return trial


async def _abort(session, base, model, body, abort, sent, target, revive_timeout_s) -> AbortTrial:
    try:
        seen = await asyncio.wait_for(client.stream(session, base, body, on_token=abort), ABORT_ANSWER_TIMEOUT_S)
    except asyncio.TimeoutError:
        if not sent:
            return AbortTrial(target, f"no {ABORT_AFTER_CHUNKS} chunks within {ABORT_ANSWER_TIMEOUT_S} s: not signalled",
                              None, None, 0)
        return AbortTrial(target, f"nothing within {ABORT_ANSWER_TIMEOUT_S} s (left hanging)", None,
                          await _serves_again(session, base, model, sent[0], revive_timeout_s), revive_timeout_s)
    if not sent:
        return AbortTrial(target, f"the stream ended before chunk {ABORT_AFTER_CHUNKS}: not signalled", None, None, 0)
    saw, at = _what_the_client_saw(seen)
    return AbortTrial(target, saw, at - sent[0] if at else None,
                      await _serves_again(session, base, model, sent[0], revive_timeout_s), revive_timeout_s)


def _what_the_client_saw(seen: client.Stream) -> tuple[str, float | None]:
    if seen.error is not None:
        code = seen.error.get("code") or seen.error.get("type") or "?"
        return f"SSE error event ({code})" + (", then [DONE]" if seen.done else ""), seen.error_at
    if seen.broken:
        return seen.broken, seen.broken_at
    return f"a complete stream ({seen.tokens} tokens), no error", None


async def _serves_again(session: aiohttp.ClientSession, base: str, model: str, since: float,
                        timeout_s: float) -> float | None:
    served = await client.first_success(session, base, model, interval_s=REVIVE_POLL_S, timeout_s=timeout_s)
    return served - since if served is not None else None


def command(pid: int) -> str:
    """A process's command line, shortened: which process a trial signalled."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:
        return "gone"
    words = [os.path.basename(argv[0].decode(errors="replace"))] + [a.decode(errors="replace") for a in argv[1:3] if a]
    return " ".join(words)[:60]


def rss_bytes(pids: list[int]) -> int:
    return sum(process_rss_bytes(pid) for pid in pids)


# --- the table ------------------------------------------------------------------------------------------------

@dataclass
class Measured:
    """Everything the HTTP phases found, by server name."""

    fixed: dict[str, Latency]
    latency: dict[str, Latency]
    streaming: dict[str, Streaming]
    concurrency: dict[str, list[Aggregate]]


def _latency_cell(found: Latency) -> str:
    if not found.seconds:
        return "no successful reply" + _problems(found.counts)
    d = distribution(found.seconds)
    return f"{d['median'] * 1e3:.2f} / {d['p99'] * 1e3:.2f} ms" + _problems(found.counts)


def _baseline_latency(samples: list[float] | None) -> str:
    if not samples:
        return ""
    d = distribution(samples)
    return f"{d['median'] * 1e3:.2f} / {d['p99'] * 1e3:.2f} ms"


def _problems(counts: Counts) -> str:
    problems = counts.problems()
    return f" ({problems})" if problems else ""


def _tokens_cell(counts: Counts) -> str:
    counted = [n for n in counts.produced if n is not None]
    if not counted:
        return "not counted (no usage)" if counts.produced else "no reply"
    return counts.problems() or f"{counts.asked} in all {len(counted)} replies"


def _stream_cell(found: Streaming) -> str:
    if not found.rates:
        return "no stream to measure" + _problems(found.counts)
    return f"{statistics.median(found.rates):,.0f} tokens/s" + _problems(found.counts)


def _aggregate_cell(level: Aggregate) -> str:
    return f"{level.rate:,.0f} tokens/s" + _problems(level.counts)


def _cpu_cell(level: Aggregate) -> str:
    return ", ".join(f"{name} {share:.0%}" for name, share in level.cpu.items()) or "not measured (no pid)"


def rows(servers: list[Server], measured: Measured, baseline: dict | None, rss: dict[str, int | None],
         aborts: dict[str, AbortTrial | None]) -> list[list[str]]:
    """The side-by-side table: one row per figure, the in-process baseline first, then each server."""
    names = [s.name for s in servers]
    base = baseline or {}
    table = [
        [f"Latency, {workload.FIXED_COST_TOKENS}-token request: median / p99",
         _baseline_latency(base.get("fixed_latencies_s"))] + [_latency_cell(measured.fixed[n]) for n in names],
        [f"Latency, {workload.OVERHEAD_TOKENS}-token request: median / p99",
         _baseline_latency(base.get("latencies_s"))] + [_latency_cell(measured.latency[n]) for n in names],
        [f"Tokens per {workload.OVERHEAD_TOKENS}-token reply", str(workload.OVERHEAD_TOKENS) if baseline else ""]
        + [_tokens_cell(measured.latency[n].counts) for n in names],
        [f"SSE rate, {workload.STREAM_TOKENS} tokens asked",
         f"{statistics.median(base['stream_tokens_per_s']):,.0f} tokens/s" if baseline else ""]
        + [_stream_cell(measured.streaming[n]) for n in names],
    ]
    for i, clients in enumerate(workload.CONCURRENCY_LEVELS):
        in_process = base.get("aggregate_tokens_per_s", {}).get(str(clients))
        table.append([f"Aggregate, {clients} client{'s' * (clients > 1)} x {workload.CONCURRENCY_TOKENS} tokens",
                      f"{in_process:,.0f} tokens/s" if in_process else ""]
                     + [_aggregate_cell(measured.concurrency[n][i]) for n in names])
    table.append(["Dialect deviations (all replies)", ""] + [deviations_text(measured, n) for n in names])
    # The bench's own client shares the cores: a server that sends one event per token costs it more CPU, which the
    # server's figures pay for; shown per server, nothing subtracted.
    table.append(["Load generator CPU per request (latency; SSE)", ""]
                 + [f"{measured.latency[n].spend.text() or 'none'}; {measured.streaming[n].spend.text() or 'none'}"
                    for n in names])
    most = workload.CONCURRENCY_LEVELS[-1]
    base_cpu = base.get("aggregate_cpu", {}).get(str(most))
    table.append([f"CPU at {most} clients, share of one core", f"{base_cpu:.0%}" if base_cpu else ""]
                 + [_cpu_cell(measured.concurrency[n][-1]) for n in names])
    table.append(["Resident memory (process and children)",
                  f"{base['rss_bytes'] / MB:.0f} MB" if baseline else ""]
                 + [f"{rss[n] / MB:.0f} MB" if rss.get(n) else "not measured (no pid)" for n in names])
    death = base.get("death_notice_s")
    table.append([f"SIGABRT mid-stream (after chunk {ABORT_AFTER_CHUNKS})",
                  f"socket closes after {statistics.median(death) * 1e3:.1f} ms" if death else ""]
                 + [aborts[n].text() if aborts.get(n) else "not measured (no pid)" for n in names])
    return table


def deviations_text(measured: Measured, name: str) -> str:
    """Every dialect deviation a server's replies showed, over all phases, with how many replies."""
    phases = [measured.fixed[name].counts, measured.latency[name].counts, measured.streaming[name].counts,
              *(level.counts for level in measured.concurrency[name])]
    total: dict[str, int] = {}
    for counts in phases:
        for kind, n in counts.deviations.items():
            total[kind] = total.get(kind, 0) + n
    replies = sum(len(counts.produced) for counts in phases)
    return "; ".join(f"{kind}: {n} of {replies} replies" for kind, n in total.items()) or f"none in {replies} replies"


def markdown(servers: list[Server], table: list[list[str]]) -> list[str]:
    header = ["Figure", "In process"] + [f"{s.name} ({s.base})" for s in servers]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(cell.replace("|", "/") for cell in row) + " |" for row in table]
