"""Each figure: drive the server, compare with the in-process baseline measured in the same run."""

from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from appliance.telemetry import process_rss_bytes
from bench import client, workload
from bench.launcher import FAULT_MODEL, STALL_TIMEOUT_S, OwnAppliance
from bench.report import MB, Figure, judged, not_measured
from bench.workload import Plan, chat_body, distribution

# Names of the figures only the bench's own appliance can measure (http_only() lists them as not measured).
ABORT_TO_ERROR = "SIGABRT mid-stream -> client has the error event"
RECOVERY = "Recovery after SIGABRT, minus the model's load time"
STALL_TO_ERROR = f"SIGSTOP -> client error, minus stall_timeout_s={STALL_TIMEOUT_S:g}"
FRONT_RSS = "Front RSS"
WORKER_RSS = "Worker RSS beyond the bare pipeline"

FAULT_AFTER_CHUNKS = 5      # a fault lands once the client has seen this many chunks: mid-stream
FAULT_STREAM_TOKENS = 2000  # far more than get generated before the fault


class ClientCost:
    """The load generator's own CPU time over a phase: it shares the 2 cores with what it measures."""

    def __enter__(self) -> ClientCost:
        self.cpu, self.wall = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.cpu, self.wall = time.process_time() - self.cpu, time.perf_counter() - self.wall

    def per_request(self, requests: int) -> str:
        return f"{self.cpu / requests * 1e3:.2f} ms CPU/request, {self.cpu / self.wall:.0%} of a core"


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


# --- overhead: one short request at a time -------------------------------------------------------------

async def overhead(session: aiohttp.ClientSession, base: str, model: str, plan: Plan, baseline: dict | None) -> list[Figure]:
    for i in range(plan.warmup):
        await client.completion_tokens(session, base, chat_body(model, i, workload.OVERHEAD_TOKENS))
    samples, short = [], 0
    with ClientCost() as cost:
        for i in range(plan.overhead_requests):
            started = time.perf_counter()
            tokens = await client.completion_tokens(session, base, chat_body(model, i, workload.OVERHEAD_TOKENS))
            samples.append(time.perf_counter() - started)
            short += tokens < workload.OVERHEAD_TOKENS  # a model that stopped early (--url): not comparable
    server = distribution(samples)
    measured = f"median {ms(server['median'])}, p99 {ms(server['p99'])} (n={server['n']})"
    if short:
        measured += f"; {short} replies stopped before {workload.OVERHEAD_TOKENS} tokens"
    spend = cost.per_request(len(samples))
    name = f"Latency, {workload.OVERHEAD_TOKENS}-token chat completion"
    if baseline is None:
        return [Figure(name, measured, server["median"] * 1e3, "ms", client=spend)]
    base = distribution(baseline["latencies_s"])
    base_text = f"median {ms(base['median'])}, p99 {ms(base['p99'])}"
    added_median, added_p99 = server["median"] - base["median"], server["p99"] - base["p99"]
    ratio = server["median"] / base["median"]
    return [judged(f"{name}: median ratio", ratio, "x", f"{ratio:.2f}x ({measured})", at_most=1.25,
                   baseline=base_text, client=spend),
            judged(f"{name}: added median", added_median * 1e3, "ms", ms(added_median), at_most=1.5),
            Figure(f"{name}: added p99", ms(added_p99), added_p99 * 1e3, "ms")]


# --- streaming: the rate an SSE client receives --------------------------------------------------------

async def streaming(session: aiohttp.ClientSession, base: str, model: str, plan: Plan, baseline: dict | None) -> Figure:
    await client.stream(session, base, chat_body(model, 0, workload.STREAM_TOKENS, stream=True))
    rates = []
    with ClientCost() as cost:
        for i in range(plan.stream_requests):
            seen = await client.stream(session, base, chat_body(model, i, workload.STREAM_TOKENS, stream=True))
            if seen.error or not seen.done:
                raise RuntimeError(f"a benchmark stream failed: {seen.error or 'no [DONE]'}")
            rates.append(workload.decode_rate(seen.token_times, seen.completion_tokens))
    rate = statistics.median(rates)
    name = f"Streaming, {workload.STREAM_TOKENS} tokens over SSE: decode rate"
    measured = f"{rate:,.0f} tokens/s"
    spend = cost.per_request(len(rates))
    if baseline is None:
        return Figure(name, measured, rate, "tokens/s", client=spend)
    base = statistics.median(baseline["stream_tokens_per_s"])
    share = rate / base * 100
    return judged(name, share, "%", f"{share:.0f} % ({measured})", at_least=80,
                  baseline=f"{base:,.0f} tokens/s (streamer callback)", client=spend)


# --- concurrency: aggregate throughput ------------------------------------------------------------------

async def aggregate_rate(session: aiohttp.ClientSession, base: str, model: str, clients: int, rounds: int) -> float:
    async def one_client(c: int) -> int:
        tokens = 0
        for _ in range(rounds):
            tokens += await client.completion_tokens(session, base, chat_body(model, c, workload.CONCURRENCY_TOKENS))
        return tokens

    started = time.perf_counter()
    totals = await asyncio.gather(*(one_client(c) for c in range(clients)))
    return sum(totals) / (time.perf_counter() - started)


async def concurrency(session: aiohttp.ClientSession, base: str, model: str, plan: Plan,
                      baseline: dict | None) -> list[Figure]:
    figures = []
    for clients in workload.CONCURRENCY_LEVELS:
        await aggregate_rate(session, base, model, clients, 1)  # warm this batch size
        with ClientCost() as cost:
            rate = await aggregate_rate(session, base, model, clients, plan.rounds_per_client)
        name = f"Concurrency, {clients} client{'s' * (clients > 1)}: aggregate tokens/s"
        spend = cost.per_request(clients * plan.rounds_per_client)
        if baseline is None:
            figures.append(Figure(name, f"{rate:,.0f} tokens/s", rate, "tokens/s", client=spend))
            continue
        in_process = baseline["aggregate_tokens_per_s"][str(clients)]
        share = rate / in_process * 100
        figures.append(judged(name, share, "%", f"{share:.0f} % ({rate:,.0f} tokens/s)", at_least=90,
                              baseline=f"{in_process:,.0f} tokens/s ({clients} request{'s' * (clients > 1)} per batch)",
                              client=spend))
    return figures


# --- memory -------------------------------------------------------------------------------------------

class PeakRss:
    """Samples a process's RSS every 20 ms while a phase runs; keeps the largest."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, process_rss_bytes(pid)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, process_rss_bytes(self.pid))
            await asyncio.sleep(0.02)


def memory(front_idle: int, front_peak: int, worker: int, baseline: dict | None) -> list[Figure]:
    figures = [judged("Front RSS, idle", front_idle / MB, "MB", f"{front_idle / MB:.1f} MB", below=80),
               judged("Front RSS, peak under load (up to 16 clients)", front_peak / MB, "MB",
                      f"{front_peak / MB:.1f} MB", below=80)]
    if baseline is None:
        return figures + [Figure("Worker RSS", f"{worker / MB:.1f} MB", worker / MB, "MB")]
    extra = worker - baseline["rss_bytes"]
    return figures + [judged(WORKER_RSS, extra / MB, "MB",
                             f"{extra / MB:.1f} MB (worker {worker / MB:.1f} MB)", below=30,
                             baseline=f"{baseline['rss_bytes'] / MB:.1f} MB (bare process, same pipeline and work)")]


# --- faults: a worker that dies or stops, as its client sees it ------------------------------------------

@dataclass
class FaultTrial:
    to_error_s: float      # signal sent -> the client has the SSE error event
    recovery_s: float      # signal sent -> the model answers a request again
    load_s: float          # the restarted workers' load time (openarc_model_load_seconds)
    restarts: int          # 1, unless the model went down again before it served (a fault of its own)
    code: str


async def load_seconds_sum(session: aiohttp.ClientSession, base: str, model: str) -> tuple[float, float]:
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    for family in text_string_to_metric_families(text):
        if family.name == "openarc_model_load_seconds":
            values = {s.name: s.value for s in family.samples if s.labels.get("model") == model}
            return values["openarc_model_load_seconds_sum"], values["openarc_model_load_seconds_count"]
    raise RuntimeError("no openarc_model_load_seconds in /metrics")


async def fault_trial(session: aiohttp.ClientSession, app: OwnAppliance, sig: signal.Signals) -> FaultTrial:
    pid = await app.worker_pid(session, FAULT_MODEL)
    loads_before = await load_seconds_sum(session, app.base, FAULT_MODEL)
    sent: list[float] = []

    def signal_worker(chunks: int) -> None:
        if chunks == FAULT_AFTER_CHUNKS:
            os.kill(pid, sig)
            sent.append(time.perf_counter())

    seen = await client.stream(session, app.base, chat_body(FAULT_MODEL, 0, FAULT_STREAM_TOKENS, stream=True),
                               on_token=signal_worker)
    if not sent or seen.error is None or not seen.done:
        raise RuntimeError(f"fault trial went wrong: signal sent={bool(sent)}, error={seen.error}, [DONE]={seen.done}")
    served = await client.first_success(session, app.base, FAULT_MODEL)
    load_sum, load_count = await load_seconds_sum(session, app.base, FAULT_MODEL)
    return FaultTrial(seen.error_at - sent[0], served - sent[0], load_sum - loads_before[0],
                      round(load_count - loads_before[1]), seen.error["code"])


async def trials(session: aiohttp.ClientSession, app: OwnAppliance, sig: signal.Signals, count: int) -> list[FaultTrial]:
    done = [await fault_trial(session, app, sig) for _ in range(count)]
    codes = {t.code for t in done}
    expected = "stall" if sig is signal.SIGSTOP else "worker_crash"
    if codes != {expected}:
        raise RuntimeError(f"{sig.name} trials ended with error codes {codes}, expected {expected}")
    return done


def spread(values: list[float]) -> str:
    d = distribution(values)
    return f"p50 {ms(d['median'])}, p99 {ms(d['p99'])} (n={d['n']})"


def extra_restarts(trials: list[FaultTrial]) -> str:
    again = sum(t.restarts > 1 for t in trials)
    return f"; {again} of {len(trials)} needed more than one restart" if again else ""


def fault_figures(aborts: list[FaultTrial], stalls: list[FaultTrial], baseline: dict) -> list[Figure]:
    to_error = [t.to_error_s for t in aborts]
    recovery = [t.recovery_s - t.load_s for t in aborts]
    loads = [t.load_s / t.restarts for t in aborts]
    beyond_stall = [t.to_error_s - STALL_TIMEOUT_S for t in stalls]
    return [
        judged(ABORT_TO_ERROR, workload.percentile(to_error, 99) * 1e3, "ms",
               spread(to_error), below=50,
               baseline=f"{spread(baseline['death_notice_s'])}: bare process SIGABRT -> its socket closes"),
        judged(RECOVERY, workload.percentile(recovery, 99), "s",
               f"{spread(recovery)}; one load takes {spread(loads)}{extra_restarts(aborts)}", below=1),
        judged(STALL_TO_ERROR, max(beyond_stall), "s",
               spread(beyond_stall) + extra_restarts(stalls), below=0.5),
    ]


def http_only(reason: str) -> list[Figure]:
    """Figures that need the bench's own appliance (signals to its workers, /proc of its processes)."""
    return [not_measured(name, reason) for name in (ABORT_TO_ERROR, RECOVERY, STALL_TO_ERROR, FRONT_RSS, WORKER_RSS)]
