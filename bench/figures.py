"""Each figure: drive the server, compare with the in-process baseline measured in the same run."""

from __future__ import annotations

import asyncio
import os
import signal
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from appliance.host.telemetry import process_rss_bytes
from bench import client, workload
from bench.launcher import FAULT_MODEL, STALL_TIMEOUT_S, OwnAppliance
from bench.phases import Aggregate, Counts, Latency, Streaming
from bench.report import MB, NOT_COMPARABLE, Figure, judged, not_measured, percent
from bench.workload import chat_body, distribution

# Names of the figures only the bench's own appliance can measure (http_only() lists them as not measured).
ABORT_TO_ERROR = "SIGABRT mid-stream -> client has the error event"
RECOVERY = "Recovery after SIGABRT, minus the pipeline's own load"
SPAWN = "Worker spawn cost in a restart (spawn to ready, minus the pipeline's own load)"
STALL_TO_ERROR = f"SIGSTOP -> client error, minus stall_timeout_s={STALL_TIMEOUT_S:g}"
FRONT_RSS = "Front RSS"
WORKER_RSS = "Worker RSS beyond the bare pipeline, after the load phases"

FAULT_AFTER_CHUNKS = 5      # a fault lands once the client has seen this many chunks: mid-stream
FAULT_STREAM_TOKENS = 2000  # far more than get generated before the fault

# The targets (issue 9, "the last milliseconds"): medians over 5 full runs are what docs/performance.md reports.
LATENCY_RATIO_TARGET = 1.2       # 32-token request, server median / in-process median
FIXED_COST_TARGET_MS = 0.3       # 1-token request, server median - in-process median
PER_TOKEN_TARGET_US = 20         # issue 21: what the worker adds to each token beyond its step loop (16-core host)
STREAM_TARGET_PERCENT = 90
BATCHING_TARGET_PERCENT = 92
BATCHING_TARGET_CLIENTS = (4, 8, 16)


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def tokens_per_s(rate: float) -> str:
    return f"{rate:,.0f} tokens/s"


def unequal(name: str, measured: str, value: float | None, unit: str, counts: Counts, baseline: str = "",
            client: str = "") -> Figure:
    """A figure whose server did other work than its baseline (replies stopped early, failed, or uncounted)."""
    return Figure(name, f"{measured}; {counts.problems()}", value, unit, baseline, verdict=NOT_COMPARABLE, client=client)


EQUAL_WORK = "equal work: the baseline generated the server's own token count, reply by reply"


def equal_work(baseline: dict | None) -> dict:
    """The baseline's figures for the work the server really did, where it stopped early (phases.equal_work)."""
    return (baseline or {}).get("equal_work") or {}


# --- latency: one short request at a time ---------------------------------------------------------------

def latency(found: Latency, baseline_s: list[float] | None, tokens: int, step_s: list[float] | None = None,
            equal_s: list[float] | None = None) -> list[Figure]:
    """The ratio to generate(), for information (the headline is costs(): what a request and a token add); where
    the server stopped early, against the baseline's equal work (`equal_s`) instead."""
    name = f"Latency, {tokens}-token chat completion"
    if not found.seconds:
        return [Figure(name, f"no successful reply; {found.counts.problems()}", None, "ms", verdict=NOT_COMPARABLE)]
    server = distribution(found.seconds)
    measured = f"median {ms(server['median'])}, p99 {ms(server['p99'])} (n={server['n']})"
    spend = found.spend.text()
    if baseline_s is None:
        figure = Figure(name, measured, server["median"] * 1e3, "ms", client=spend)
        return [figure if found.counts.comparable() else unequal(name, measured, figure.value, "ms", found.counts)]
    base = distribution(baseline_s)
    base_text = f"generate(): median {ms(base['median'])}, p99 {ms(base['p99'])}"
    if step_s:
        base_text += f"; step loop: median {ms(statistics.median(step_s))}"
    added_p99 = server["p99"] - base["p99"]
    ratio = server["median"] / base["median"]
    if not found.counts.comparable() and equal_s:
        equal = statistics.median(equal_s)
        ratio = server["median"] / equal
        return [Figure(f"{name}: median ratio to generate(), equal work", f"{ratio:.2f}x ({measured}; "
                       f"{found.counts.problems()})", ratio, "x", f"generate() median {ms(equal)}; {EQUAL_WORK}",
                       client=spend)]
    if not found.counts.comparable():
        return [unequal(f"{name}: median ratio", f"{ratio:.2f}x ({measured})", ratio, "x", found.counts, base_text, spend)]
    return [Figure(f"{name}: median ratio to generate()", f"{ratio:.2f}x ({measured})", ratio, "x", base_text,
                   client=spend),
            Figure(f"{name}: added p99", ms(added_p99), added_p99 * 1e3, "ms")]


def costs(one: Latency, many: Latency, baseline: dict | None) -> list[Figure]:
    """The headline: what the server adds to a request (the 1-token request's added median) and to each further
    token ((32-token added - 1-token added) / 31, against the step loop: the worker's own engine API, so this is
    the worker's per-step work beyond it), with the spread of the baseline's repeats beside each."""
    fixed_name = "Per-request fixed cost: 1-token request, added median"
    token_name = f"Per-token added cost: from the 1- and {many.counts.asked}-token requests"
    if baseline is None or not one.seconds or not many.seconds:
        why = "needs the in-process baseline (--model-path)" if baseline is None else "no successful reply"
        return [not_measured(fixed_name, why), not_measured(token_name, why)]
    if not (one.counts.comparable() and many.counts.comparable()):
        problems = one.counts.problems() or many.counts.problems()
        return [Figure(fixed_name, problems, None, "ms", verdict=NOT_COMPARABLE),
                Figure(token_name, problems, None, "us", verdict=NOT_COMPARABLE)]
    steps = many.counts.asked - one.counts.asked
    server1, server_n = statistics.median(one.seconds), statistics.median(many.seconds)
    gen1, gen_n = statistics.median(baseline["fixed_latencies_s"]), statistics.median(baseline["latencies_s"])
    loop1, loop_n = statistics.median(baseline["step_fixed_latencies_s"]), statistics.median(baseline["step_latencies_s"])
    fixed = server1 - gen1
    per_token = ((server_n - server1) - (loop_n - loop1)) / steps
    per_token_gen = ((server_n - server1) - (gen_n - gen1)) / steps
    noise = spread_note(baseline["fixed_latencies_s"])
    # How far the medians themselves could move, per token: a per-token figure inside it is not a finding
    token_noise = median_noise(baseline["step_latencies_s"]) / steps
    return [
        judged(fixed_name, fixed * 1e3, "ms", f"{ms(fixed)} (server {ms(server1)})", at_most=FIXED_COST_TARGET_MS,
               baseline=f"generate() {ms(gen1)}, step loop {ms(loop1)}; {noise}", client=one.spend.text(),
               noise=median_noise(baseline["fixed_latencies_s"]) * 1e3),
        judged(token_name, per_token * 1e6, "us",
               f"{per_token * 1e6:.1f} us/token beyond the step loop ({per_token_gen * 1e6:.1f} beyond generate())",
               at_most=PER_TOKEN_TARGET_US, noise=token_noise * 1e6,
               baseline=f"step loop {(loop_n - loop1) / steps * 1e6:.1f} us/token, generate() "
                        f"{(gen_n - gen1) / steps * 1e6:.1f} us/token", client=many.spend.text()),
        Figure(f"In-process step loop / generate(), {many.counts.asked}-token request",
               f"{loop_n / gen_n:.2f}x (what driving the engine from Python costs, no server)", loop_n / gen_n, "x",
               f"generate() {ms(gen_n)}, step loop {ms(loop_n)}"),
    ]


def spread_bounds(values: list[float]) -> tuple[float, float]:
    """p10 and p90 of the baseline's repeats."""
    ordered = sorted(values)
    return ordered[len(ordered) // 10], ordered[min(len(ordered) - 1, len(ordered) * 9 // 10)]


def spread_width(values: list[float]) -> float:
    low, high = spread_bounds(values)
    return high - low


def median_noise(values: list[float]) -> float:
    """How far a median of these repeats could move between runs: the p10 .. p90 width over sqrt(n). A figure made
    of medians is judged against this, not against the spread of single repeats, which is sqrt(n) times wider and
    once called a per-token cost five times its target "within noise"."""
    return spread_width(values) / math.sqrt(len(values))


def spread_note(values: list[float]) -> str:
    """The spread of the baseline's repeats (p10 .. p90): a difference inside it is noise, not a finding."""
    low, high = spread_bounds(values)
    return f"baseline repeats spread {ms(low)} .. {ms(high)} (p10 .. p90)"


# --- streaming: the rate an SSE client receives --------------------------------------------------------

def streaming(found: Streaming, baseline: dict | None) -> Figure:
    """Like with like: the server (which holds text up to TEXT_HOLD_S to send fewer frames) against the engine's raw
    step rate (the step loop reading every handle each step, no per-token callback); generate() with a per-token
    Python callback is shown beside it, for information."""
    name = f"Streaming, {workload.STREAM_TOKENS} tokens over SSE: tokens/s against the raw step rate"
    if not found.rates:
        return Figure(name, f"no stream to measure; {found.counts.problems()}", None, "tokens/s", verdict=NOT_COMPARABLE)
    rate = statistics.median(found.rates)
    measured = tokens_per_s(rate)
    spend = found.spend.text()
    if baseline is None:
        figure = Figure(name, measured, rate, "tokens/s", client=spend)
        return figure if found.counts.comparable() else unequal(name, measured, rate, "tokens/s", found.counts)
    base = statistics.median(baseline["stream_tokens_per_s"])
    share = rate / base * 100
    callback = baseline.get("stream_callback_tokens_per_s")
    base_text = f"{tokens_per_s(base)} (step loop, no callback)"
    if callback:
        base_text += f"; generate() with a per-token callback {tokens_per_s(statistics.median(callback))}"
    equal = equal_work(baseline).get("stream_tokens_per_s")
    if not found.counts.comparable() and equal:
        share = rate / statistics.median(equal) * 100
        return Figure(name + ", equal work", f"{share:.0f} % ({measured}; {found.counts.problems()})", share, "%",
                      f"{tokens_per_s(statistics.median(equal))} (step loop); {EQUAL_WORK}", client=spend)
    if not found.counts.comparable():
        return unequal(name, f"{share:.0f} % ({measured})", share, "%", found.counts, base_text, spend)
    rates = baseline["stream_tokens_per_s"]
    return judged(name, share, "%", f"{percent(share)} ({measured}; text held up to 2 ms a frame)",
                  at_least=STREAM_TARGET_PERCENT, baseline=base_text, client=spend,
                  noise=spread_width(rates) / base * 100 if len(rates) > 1 else 0.0)


# --- concurrency: aggregate throughput ------------------------------------------------------------------

def concurrency(found: list[Aggregate], baseline: dict | None, max_running: int | None = None) -> list[Figure]:
    """`max_running`: the server's own batch limit, shown beside each level (a level above it queues)."""
    figures = []
    for level in found:
        clients = level.clients
        name = f"Concurrency, {clients} client{'s' * (clients > 1)}: aggregate tokens/s"
        if clients > 1:
            name += f" (server max_running {max_running if max_running else 'unknown'})"
        measured, spend = tokens_per_s(level.rate), level.spend.text()
        if baseline is None:
            figure = Figure(name, measured, level.rate, "tokens/s", client=spend)
            figures.append(figure if level.counts.comparable() else unequal(name, measured, level.rate, "tokens/s",
                                                                             level.counts))
            continue
        in_process = baseline["aggregate_tokens_per_s"][str(clients)]
        share = level.rate / in_process * 100
        base_text = f"{tokens_per_s(in_process)} ({clients} request{'s' * (clients > 1)} per batch, tokens counted)"
        if baseline.get("aggregate_short", {}).get(str(clients)):
            base_text += f"; {baseline['aggregate_short'][str(clients)]} tokens fewer than planned"
        equal = equal_work(baseline).get("aggregate_tokens_per_s", {}).get(str(clients))
        if not level.counts.comparable() and equal:
            share = level.rate / equal * 100
            figures.append(Figure(name + ", equal work", f"{share:.0f} % ({measured}; {level.counts.problems()})",
                                  share, "%", f"{tokens_per_s(equal)}; {EQUAL_WORK}", client=spend))
        elif not level.counts.comparable():
            figures.append(unequal(name, f"{share:.0f} % ({measured})", share, "%", level.counts, base_text, spend))
        elif clients in BATCHING_TARGET_CLIENTS:
            figures.append(judged(name, share, "%", f"{percent(share)} ({measured})", at_least=BATCHING_TARGET_PERCENT,
                                  baseline=base_text, client=spend))
        else:
            figures.append(Figure(name, f"{share:.0f} % ({measured})", share, "%", base_text, client=spend))
    return figures + [scaling(found, judge=baseline is not None), cpu_shares(found[-1], baseline)]


# Two measurements on a machine whose cores 8 clients already fill: what they differ by when nothing changed (the
# quick plan's 6 rounds a client, 2 quiet cores, four runs: +25 .. +43 %; with 1 round a level lasted 70 ms and one
# run in five fell by a quarter); a real fall at 16 clients (a queue that serialises, a front that saturates) is larger.
SCALING_NOISE_PERCENT = 10.0


def scaling(found: list[Aggregate], judge: bool) -> Figure:
    """The aggregate must not fall as clients double from 8 to 16 (the in-process batch keeps rising); judged only
    where the in-process batch was measured on the same machine in the same run and every reply of both levels
    generated the tokens asked for."""
    by_clients = {level.clients: level for level in found}
    low, high = by_clients[8], by_clients[16]
    name = "Concurrency, 8 -> 16 clients: aggregate change"
    if not low.rate:
        return Figure(name, "no throughput at 8 clients", None, "%", verdict=NOT_COMPARABLE)
    change = high.rate / low.rate * 100
    measured = f"{change - 100:+.0f} % ({tokens_per_s(low.rate)} -> {tokens_per_s(high.rate)})"
    # replies that stopped early are mostly prefill and per-request work: the target speaks of generating the
    # tokens asked for, so such levels are reported, not judged (as their own aggregate figures are)
    incomplete = next((level for level in (low, high) if not level.counts.comparable()), None)
    if incomplete:
        return unequal(name, measured, change, "%", incomplete.counts)
    # two single measurements: where 8 clients already fill the cores (2 here) both levels run at the machine's
    # rate, and a few percent between them is the run's own wobble (SCALING_NOISE_PERCENT), not a fall
    return judged(name, change, "%", measured, at_least=100, noise=SCALING_NOISE_PERCENT) if judge else \
        Figure(name, measured, change, "%")


def cpu_shares(level: Aggregate, baseline: dict | None) -> Figure:
    """Who used the 2 cores while the most clients ran: the server's processes and the load generator."""
    shares = ", ".join(f"{name} {share:.0%}" for name, share in level.cpu.items())
    base = baseline and baseline.get("aggregate_cpu", {}).get(str(level.clients))
    return Figure(f"CPU at {level.clients} clients (share of one core)", shares or "not measured", None, "",
                  f"{base:.0%} (the bare process)" if base else "")


# --- memory -------------------------------------------------------------------------------------------

class PeakRss:
    """Samples a process's RSS every 20 ms while a phase runs; keeps the largest."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, process_rss_bytes(pid)

    async def run(self) -> None:
        while True:
            self.peak = max(self.peak, process_rss_bytes(self.pid))
            await asyncio.sleep(0.02)


class LoopLag:
    """The front's own event-loop lag (openarc_event_loop_lag_seconds, how late a short timer fired), read from
    /metrics every half second while the HTTP figures run; keeps the largest."""

    INTERVAL_S = 0.5

    def __init__(self, session: aiohttp.ClientSession, base: str):
        self.session, self.base, self.peak, self.samples = session, base, 0.0, 0

    async def run(self) -> None:
        while True:
            family = (await scrape(self.session, self.base)).get("openarc_event_loop_lag_seconds")
            if family:
                self.peak = max([self.peak] + [sample.value for sample in family.samples])
                self.samples += 1
            await asyncio.sleep(self.INTERVAL_S)

    def figure(self) -> Figure:
        return Figure("Front event-loop lag under load (largest sample)", f"{ms(self.peak)} ({self.samples} samples, "
                      f"every {self.INTERVAL_S:g} s)", self.peak * 1e3, "ms")


def memory(front_idle: int, front_peak: int, worker: int, baseline: dict | None) -> list[Figure]:
    """Resident memory in MiB (2^20 bytes), each labelled with when it was read."""
    figures = [judged("Front RSS, idle (after warm-up, before the load phases)", front_idle / MB, "MiB",
                      f"{front_idle / MB:.1f} MiB", below=80),
               judged("Front RSS, peak under load (up to 16 clients)", front_peak / MB, "MiB",
                      f"{front_peak / MB:.1f} MiB", below=80)]
    if baseline is None:
        return figures + [Figure("Worker RSS, after the load phases", f"{worker / MB:.1f} MiB", worker / MB, "MiB")]
    extra = worker - baseline["rss_bytes"]
    return figures + [judged(WORKER_RSS, extra / MB, "MiB",
                             f"{extra / MB:.1f} MiB (worker {worker / MB:.1f} MiB, read after the load phases)",
                             below=30, baseline=f"{baseline['rss_bytes'] / MB:.1f} MiB (bare process, same pipeline "
                                                f"and work, read after it)")]


# --- faults: a worker that dies or stops, as its client sees it ------------------------------------------

@dataclass
class FaultTrial:
    to_error_s: float      # signal sent -> the client has the SSE error event
    recovery_s: float      # signal sent -> the model answers a request again
    load_s: float          # the restarted workers' load time (openarc_model_load_seconds: spawn to ready)
    restarts: int          # 1, unless the model went down again before it served (a fault of its own)
    code: str
    pipeline_s: float      # the pipeline's own load in the worker that served (/openarc/status pipeline_load_seconds)


async def scrape(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """The server's /metrics, by metric family name."""
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    return {family.name: family for family in text_string_to_metric_families(text)}


async def load_seconds_sum(session: aiohttp.ClientSession, base: str, model: str) -> tuple[float, float]:
    family = (await scrape(session, base)).get("openarc_model_load_seconds")
    if family is None:
        raise RuntimeError("no openarc_model_load_seconds in /metrics")
    values: dict[str, float] = {}
    for s in family.samples:  # summed over its sources (cache, compiled)
        if s.labels.get("model") == model:
            values[s.name] = values.get(s.name, 0.0) + s.value
    return values["openarc_model_load_seconds_sum"], values["openarc_model_load_seconds_count"]


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
    if served is None:
        raise RuntimeError(f"{FAULT_MODEL} did not serve again after {sig.name}")
    load_sum, load_count = await load_seconds_sum(session, app.base, FAULT_MODEL)
    return FaultTrial(seen.error_at - sent[0], served - sent[0], load_sum - loads_before[0],
                      round(load_count - loads_before[1]), seen.error["code"],
                      await pipeline_load_seconds(session, app.base, FAULT_MODEL))


async def pipeline_load_seconds(session: aiohttp.ClientSession, base: str, model: str) -> float:
    async with session.get(base + "/openarc/status") as response:
        status = await response.json()
    return next(m["pipeline_load_seconds"] for m in status["models"] if m["name"] == model)


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
    recovery = [t.recovery_s - t.pipeline_s * t.restarts for t in aborts]
    loads = [t.pipeline_s for t in aborts]
    spawn = [t.load_s / t.restarts - t.pipeline_s for t in aborts]
    beyond_stall = [t.to_error_s - STALL_TIMEOUT_S for t in stalls]
    return [
        judged(ABORT_TO_ERROR, workload.percentile(to_error, 99) * 1e3, "ms",
               spread(to_error), below=50,
               baseline=f"{spread(baseline['death_notice_s'])}: bare process SIGABRT -> its socket closes"),
        judged(RECOVERY, workload.percentile(recovery, 99), "s",
               f"{spread(recovery)}; the pipeline's load takes {spread(loads)}{extra_restarts(aborts)}", below=1,
               baseline=f"bare process: the pipeline loads in {baseline['load_seconds'] * 1e3:.0f} ms" if baseline else ""),
        Figure(SPAWN, spread(spawn) + " (a new interpreter, its imports, the channel)",
               workload.percentile(spawn, 50) * 1e3, "ms"),
        judged(STALL_TO_ERROR, max(beyond_stall), "s",
               spread(beyond_stall) + extra_restarts(stalls), below=0.5),
    ]


def http_only(reason: str) -> list[Figure]:
    """Figures that need the bench's own appliance (signals to its workers, /proc of its processes)."""
    return [not_measured(name, reason) for name in (ABORT_TO_ERROR, RECOVERY, SPAWN, STALL_TO_ERROR, FRONT_RSS,
                                                    WORKER_RSS)]
