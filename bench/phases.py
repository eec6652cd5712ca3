"""The HTTP workload, as raw measurements per server: latency, SSE rate, aggregate throughput.

Every phase is cut into blocks, and the servers and the in-process baseline take turns block by block (the order
reversed every other block), so a machine whose load drifts during the run treats them all alike. Every count is
what the server really produced: its usage, else the chunks that carried text.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from bench import client, workload
from bench.client import Unexpected
from bench.launcher import child_env
from bench.workload import Plan, chat_body, split

BASELINE_REPLY_TIMEOUT_S = 900  # only catches a hang: a block takes seconds


@dataclass
class Server:
    name: str
    base: str
    model: str
    pid: int | None = None  # its main process (--peer-pid): memory, CPU and the SIGABRT trial


class Spend:
    """CPU time of the load generator over the blocks of one phase: it shares the cores with what it measures."""

    def __init__(self):
        self.cpu = self.wall = 0.0
        self.requests = 0

    def add(self, cpu: float, wall: float, requests: int) -> None:
        self.cpu, self.wall, self.requests = self.cpu + cpu, self.wall + wall, self.requests + requests

    def text(self) -> str:
        if not self.requests or not self.wall:
            return ""
        return f"{self.cpu / self.requests * 1e3:.2f} ms CPU/request, {self.cpu / self.wall:.0%} of a core"


@dataclass
class Counts:
    """Tokens asked for and produced, reply by reply, and what the server sent that the bench did not understand."""

    asked: int
    produced: list[int | None] = field(default_factory=list)  # None: the server did not say (no usage)
    failed: list[str] = field(default_factory=list)
    unexpected: Unexpected = field(default_factory=Unexpected)
    deviations: dict[str, int] = field(default_factory=dict)  # dialect deviations from OpenAI's API, by kind

    def merge_unexpected(self, other: Unexpected) -> None:
        for sample in other.samples:
            self.unexpected.add(sample)
        self.unexpected.count += other.count - len(other.samples)

    @property
    def short(self) -> list[int]:
        return [n for n in self.produced if n is not None and n < self.asked]

    @property
    def uncounted(self) -> int:
        return sum(n is None for n in self.produced)

    def comparable(self) -> bool:
        """Every reply produced exactly what was asked: the in-process baseline did the same work."""
        return bool(self.produced) and not self.failed and all(n == self.asked for n in self.produced)

    def problems(self) -> str:
        """'' when every reply was complete, else what went wrong, in words."""
        notes = []
        if self.short:
            notes.append(f"{len(self.short)} of {len(self.produced)} replies stopped early "
                         f"(median {statistics.median(self.short):g} of {self.asked} tokens)")
        if self.uncounted:
            notes.append(f"{self.uncounted} replies without usage (tokens not counted)")
        if self.failed:
            notes.append(f"{len(self.failed)} failed ({self.failed[0][:80]})")
        if self.unexpected.count:
            notes.append(f"{self.unexpected.count} unexpected chunks")
        return "; ".join(notes)


@dataclass
class Latency:
    counts: Counts
    seconds: list[float] = field(default_factory=list)
    spend: Spend = field(default_factory=Spend)


@dataclass
class Streaming:
    counts: Counts
    rates: list[float] = field(default_factory=list)
    spend: Spend = field(default_factory=Spend)


@dataclass
class Aggregate:
    clients: int
    counts: Counts
    tokens: int = 0
    seconds: float = 0.0
    spend: Spend = field(default_factory=Spend)
    cpu: dict[str, float] = field(default_factory=dict)  # share of one core per process, while it ran

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


CpuProbe = Callable[[Server], Awaitable["CpuWatch | None"]]


class InProcess:
    """The in-process baseline (bench/baseline.py) in a bare process of its own, measuring block by block on command.

    `results` fills up as the phases run, under the keys the figures read (latencies_s, stream_tokens_per_s,
    aggregate_tokens_per_s, ...)."""

    def __init__(self, proc: asyncio.subprocess.Process, loaded: dict):
        self.proc = proc
        self.results: dict = dict(loaded, aggregate_tokens_per_s={}, aggregate_cpu={})

    @classmethod
    async def start(cls, model_path, device: str, properties: dict | None = None) -> InProcess:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "bench.baseline", str(model_path), "--device", device,
            "--properties", json.dumps(properties or {}), env=child_env(),
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, limit=1 << 24)
        baseline = cls(proc, {})
        baseline.results.update(await baseline._reply())
        return baseline

    async def call(self, op: str, **arguments) -> dict:
        self.proc.stdin.write((json.dumps({"op": op, **arguments}) + "\n").encode())
        await self.proc.stdin.drain()
        return await self._reply()

    async def _reply(self) -> dict:
        line = await asyncio.wait_for(self.proc.stdout.readline(), BASELINE_REPLY_TIMEOUT_S)
        if not line:
            raise RuntimeError(f"the in-process baseline exited ({await self.proc.wait()})")
        return json.loads(line)

    async def finish(self, death_trials: int) -> dict:
        """Memory after the same work, and the fault figures' floor; the process then exits."""
        self.results.update(await self.call("finish", death_trials=death_trials))
        await self.proc.wait()
        return self.results

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def alternate(servers: list[Server], blocks: int, run_block: Callable[[Server | None, int], Awaitable[None]],
                    baseline: InProcess | None = None) -> None:
    """run_block(server, block_index) for every block, the servers and the baseline (server None) taking turns,
    the order reversed every other block."""
    turns: list[Server | None] = [*servers, *([None] if baseline else [])]
    for index in range(blocks):
        for who in turns if index % 2 == 0 else turns[::-1]:
            await run_block(who, index)


async def warm(session: aiohttp.ClientSession, server: Server, plan: Plan) -> None:
    for i in range(plan.warmup):
        await client.completion_tokens(session, server.base, chat_body(server.model, i, workload.OVERHEAD_TOKENS))


async def latency(session: aiohttp.ClientSession, servers: list[Server], plan: Plan, tokens: int,
                  baseline: InProcess | None = None) -> dict[str, Latency]:
    """One non-streaming request at a time over a kept-alive connection, timed from send to parsed body."""
    found = {s.name: Latency(Counts(tokens)) for s in servers}
    sizes = split(plan.overhead_requests, plan.blocks)
    in_process: list[float] = []
    step_loop: list[float] = []
    generated: list[int] = []
    if baseline:
        await baseline.call("warm", tokens=tokens, requests=plan.warmup)
        key = "fixed_latencies_s" if tokens == workload.FIXED_COST_TOKENS else "latencies_s"
        baseline.results[key], baseline.results["step_" + key] = in_process, step_loop
        baseline.results[f"generated_{tokens}"] = generated

    async def run_block(server: Server | None, index: int) -> None:
        if server is None:
            done = await baseline.call("latency", tokens=tokens, requests=sizes[index])
            in_process.extend(done["seconds"])
            step_loop.extend(done["step_seconds"])
            generated.extend(done["generated"])
            return
        seen = found[server.name]
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(sizes[index]):
            started = time.perf_counter()
            reply = await client.complete(session, server.base, chat_body(server.model, i, tokens))
            elapsed = time.perf_counter() - started
            _count(seen.counts, reply.status, reply.error, reply.tokens, reply.unexpected, reply)
            if reply.status == 200 and not reply.error:
                seen.seconds.append(elapsed)
        seen.spend.add(time.process_time() - cpu, time.perf_counter() - wall, sizes[index])

    await alternate(servers, len(sizes), run_block, baseline)
    return found


async def streaming(session: aiohttp.ClientSession, servers: list[Server], plan: Plan,
                    baseline: InProcess | None = None) -> dict[str, Streaming]:
    """The rate an SSE client receives tokens: tokens / time from the request to the last token."""
    found = {s.name: Streaming(Counts(workload.STREAM_TOKENS)) for s in servers}
    for server in servers:  # the first stream warms the longer KV cache
        await client.stream(session, server.base, chat_body(server.model, 0, workload.STREAM_TOKENS, stream=True))
    sizes = split(plan.stream_requests, plan.blocks)
    in_process: list[float] = []
    callback: list[float] = []
    if baseline:
        baseline.results["stream_tokens_per_s"] = in_process
        baseline.results["stream_callback_tokens_per_s"] = callback

    async def run_block(server: Server | None, index: int) -> None:
        if server is None:
            done = await baseline.call("stream", requests=sizes[index], warm_first=index == 0)
            in_process.extend(done["rates"])
            callback.extend(done["callback_rates"])
            return
        seen = found[server.name]
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(sizes[index]):
            got = await client.stream(session, server.base, chat_body(server.model, i, workload.STREAM_TOKENS, stream=True))
            error = got.error or (None if got.done else {"message": got.broken or "no [DONE]"})
            _count(seen.counts, got.status, error, got.tokens, got.unexpected, got)
            rate = workload.stream_rate(got.started, got.token_times, got.tokens)
            if rate is not None and not error:
                seen.rates.append(rate)
        seen.spend.add(time.process_time() - cpu, time.perf_counter() - wall, sizes[index])

    await alternate(servers, len(sizes), run_block, baseline)
    return found


async def concurrency(session: aiohttp.ClientSession, servers: list[Server], plan: Plan,
                      cpu_probe: CpuProbe | None = None, baseline: InProcess | None = None) -> dict[str, list[Aggregate]]:
    """N clients each send requests back to back: aggregate tokens per second, for each N."""
    found: dict[str, list[Aggregate]] = {s.name: [] for s in servers}
    for clients in workload.CONCURRENCY_LEVELS:
        level = {s.name: Aggregate(clients, Counts(workload.CONCURRENCY_TOKENS)) for s in servers}
        for server in servers:
            await _clients(session, server, clients, 1, Counts(workload.CONCURRENCY_TOKENS))  # warm this batch size

        in_process = {"tokens": 0, "planned": 0, "seconds": 0.0, "cpu_seconds": 0.0}

        async def run_block(server: Server | None, index: int) -> None:
            if server is None:
                done = await baseline.call("aggregate", clients=clients, rounds=plan.rounds_per_client,
                                           warm_first=index == 0)
                for key in in_process:
                    in_process[key] += done[key]
                return
            seen = level[server.name]
            watch = await cpu_probe(server) if cpu_probe else None
            cpu, wall = time.process_time(), time.perf_counter()
            seen.tokens += await _clients(session, server, clients, plan.rounds_per_client, seen.counts)
            elapsed = time.perf_counter() - wall
            seen.seconds += elapsed
            seen.spend.add(time.process_time() - cpu, elapsed, clients * plan.rounds_per_client)
            if watch:
                for name, share in watch.shares(elapsed).items():
                    seen.cpu[name] = seen.cpu.get(name, 0.0) + share * elapsed

        await alternate(servers, plan.blocks, run_block, baseline)
        if baseline:
            baseline.results["aggregate_tokens_per_s"][str(clients)] = in_process["tokens"] / in_process["seconds"]
            baseline.results["aggregate_cpu"][str(clients)] = in_process["cpu_seconds"] / in_process["seconds"]
            baseline.results.setdefault("aggregate_short", {})[str(clients)] = in_process["planned"] - in_process["tokens"]
        for name, aggregate in level.items():
            aggregate.cpu = {k: v / aggregate.seconds for k, v in aggregate.cpu.items()} if aggregate.seconds else {}
            found[name].append(aggregate)
    return found


async def _clients(session: aiohttp.ClientSession, server: Server, clients: int, rounds: int, counts: Counts) -> int:
    async def one_client(c: int) -> int:
        produced = 0
        for _ in range(rounds):
            reply = await client.complete(session, server.base, chat_body(server.model, c, workload.CONCURRENCY_TOKENS))
            _count(counts, reply.status, reply.error, reply.tokens, reply.unexpected, reply)
            produced += reply.tokens or 0
        return produced

    return sum(await asyncio.gather(*(one_client(c) for c in range(clients))))


def _count(counts: Counts, status: int, error: dict | None, tokens: int | None, unexpected: Unexpected,
           seen: client.Reply | client.Stream | None = None) -> None:
    counts.merge_unexpected(unexpected)
    if status != 200 or error:
        counts.failed.append(f"{status}: {(error or {}).get('message', '')}")
        return
    counts.produced.append(tokens)
    for deviation in dialect_deviations(seen, tokens, counts.asked) if seen else ():
        counts.deviations[deviation] = counts.deviations.get(deviation, 0) + 1


def dialect_deviations(seen: client.Reply | client.Stream, tokens: int | None, asked: int) -> list[str]:
    """Where a successful reply departs from OpenAI's dialect in ways a client acts on (a policy, tested alone)."""
    found = []
    if seen.finish_reason is None:
        found.append("no finish_reason")
    elif tokens == asked and seen.finish_reason == "stop":  # the bench's model never stops by itself
        found.append("finish_reason 'stop' on a reply cut by max_tokens")
    if seen.reasoning:
        found.append("text in reasoning_content for a plain model")
    return found


class CpuWatch:
    """CPU time of named processes (and the load generator itself) between two readings."""

    def __init__(self, pids: dict[str, list[int]]):
        self.pids = pids
        self.start = {name: cpu_seconds(p) for name, p in pids.items()}
        self.client = time.process_time()

    def shares(self, elapsed: float) -> dict[str, float]:
        shares = {name: (cpu_seconds(p) - self.start[name]) / elapsed for name, p in self.pids.items()}
        shares["client"] = (time.process_time() - self.client) / elapsed
        return shares


def cpu_seconds(pids: list[int]) -> float:
    """utime + stime of processes (0 for one that is gone)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """A process and its descendants, now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        todo += children.get(current, [])
    return tree


def equal_work_counts(counts: Counts) -> list[int] | None:
    """The server's tokens reply by reply, where it produced fewer than asked but every reply succeeded and was
    counted: what the baseline generates again for a comparison of equal work. None when the work was already
    equal, or cannot be known."""
    if counts.comparable() or counts.failed or counts.uncounted or not counts.produced:
        return None
    return [n for n in counts.produced if n is not None]


async def equal_work(baseline: InProcess, measured, name: str) -> None:
    """Where the server `name` stopped early, the baseline generates what it produced, reply by reply, and keeps the
    figures under results["equal_work"] (latencies_s, stream_tokens_per_s, aggregate_tokens_per_s by clients)."""
    found: dict = {}
    latency = equal_work_counts(measured.latency[name].counts)
    if latency:
        found["latencies_s"] = (await baseline.call("latency", tokens=latency, requests=len(latency)))["seconds"]
        found["latency_tokens"] = statistics.median(latency)
    stream = equal_work_counts(measured.streaming[name].counts)
    if stream:
        found["stream_tokens_per_s"] = (await baseline.call("stream", requests=len(stream), warm_first=True,
                                                            tokens=stream))["rates"]
    for level in measured.concurrency[name]:
        counts = equal_work_counts(level.counts)
        if counts:
            done = await baseline.call("aggregate", clients=level.clients, rounds=max(1, len(counts) // level.clients),
                                       warm_first=True, tokens=counts)
            found.setdefault("aggregate_tokens_per_s", {})[str(level.clients)] = done["tokens"] / done["seconds"]
    baseline.results["equal_work"] = found
