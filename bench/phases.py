"""The HTTP workload, as raw measurements per server: latency, SSE rate, aggregate throughput.

With several servers (--peer) every phase is cut into blocks and the servers take turns block by block (the
order reversed every other block), so a machine whose load drifts during the run treats them alike. Every
count is what the server really produced: its usage, else the chunks that carried text.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import aiohttp

from bench import client, workload
from bench.client import Unexpected
from bench.workload import Plan, chat_body, split


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


async def alternate(servers: list[Server], blocks: int, run_block: Callable[[Server, int], Awaitable[None]]) -> None:
    """run_block(server, block_index) for every block, servers taking turns (the order reversed every other block)."""
    for index in range(blocks):
        for server in servers if index % 2 == 0 else servers[::-1]:
            await run_block(server, index)


async def warm(session: aiohttp.ClientSession, server: Server, plan: Plan) -> None:
    for i in range(plan.warmup):
        await client.completion_tokens(session, server.base, chat_body(server.model, i, workload.OVERHEAD_TOKENS))


async def latency(session: aiohttp.ClientSession, servers: list[Server], plan: Plan, tokens: int) -> dict[str, Latency]:
    """One non-streaming request at a time over a kept-alive connection, timed from send to parsed body."""
    found = {s.name: Latency(Counts(tokens)) for s in servers}
    sizes = split(plan.overhead_requests, plan.blocks)

    async def run_block(server: Server, index: int) -> None:
        seen = found[server.name]
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(sizes[index]):
            started = time.perf_counter()
            reply = await client.complete(session, server.base, chat_body(server.model, i, tokens))
            elapsed = time.perf_counter() - started
            _count(seen.counts, reply.status, reply.error, reply.tokens, reply.unexpected)
            if reply.status == 200 and not reply.error:
                seen.seconds.append(elapsed)
        seen.spend.add(time.process_time() - cpu, time.perf_counter() - wall, sizes[index])

    await alternate(servers, len(sizes), run_block)
    return found


async def streaming(session: aiohttp.ClientSession, servers: list[Server], plan: Plan) -> dict[str, Streaming]:
    """The rate an SSE client receives tokens, after the first one."""
    found = {s.name: Streaming(Counts(workload.STREAM_TOKENS)) for s in servers}
    for server in servers:  # the first stream warms the longer KV cache
        await client.stream(session, server.base, chat_body(server.model, 0, workload.STREAM_TOKENS, stream=True))
    sizes = split(plan.stream_requests, plan.blocks)

    async def run_block(server: Server, index: int) -> None:
        seen = found[server.name]
        cpu, wall = time.process_time(), time.perf_counter()
        for i in range(sizes[index]):
            got = await client.stream(session, server.base, chat_body(server.model, i, workload.STREAM_TOKENS, stream=True))
            error = got.error or (None if got.done else {"message": got.broken or "no [DONE]"})
            _count(seen.counts, got.status, error, got.tokens, got.unexpected)
            rate = workload.stream_rate(got.started, got.token_times, got.tokens)
            if rate is not None and not error:
                seen.rates.append(rate)
        seen.spend.add(time.process_time() - cpu, time.perf_counter() - wall, sizes[index])

    await alternate(servers, len(sizes), run_block)
    return found


async def concurrency(session: aiohttp.ClientSession, servers: list[Server], plan: Plan,
                      cpu_probe: CpuProbe | None = None) -> dict[str, list[Aggregate]]:
    """N clients each send requests back to back: aggregate tokens per second, for each N."""
    found: dict[str, list[Aggregate]] = {s.name: [] for s in servers}
    for clients in workload.CONCURRENCY_LEVELS:
        level = {s.name: Aggregate(clients, Counts(workload.CONCURRENCY_TOKENS)) for s in servers}
        for server in servers:
            await _clients(session, server, clients, 1, Counts(workload.CONCURRENCY_TOKENS))  # warm this batch size

        async def run_block(server: Server, _index: int) -> None:
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

        await alternate(servers, plan.blocks, run_block)
        for name, aggregate in level.items():
            aggregate.cpu = {k: v / aggregate.seconds for k, v in aggregate.cpu.items()} if aggregate.seconds else {}
            found[name].append(aggregate)
    return found


async def _clients(session: aiohttp.ClientSession, server: Server, clients: int, rounds: int, counts: Counts) -> int:
    async def one_client(c: int) -> int:
        produced = 0
        for _ in range(rounds):
            reply = await client.complete(session, server.base, chat_body(server.model, c, workload.CONCURRENCY_TOKENS))
            _count(counts, reply.status, reply.error, reply.tokens, reply.unexpected)
            produced += reply.tokens or 0
        return produced

    return sum(await asyncio.gather(*(one_client(c) for c in range(clients))))


def _count(counts: Counts, status: int, error: dict | None, tokens: int | None, unexpected: Unexpected) -> None:
    counts.merge_unexpected(unexpected)
    if status != 200 or error:
        counts.failed.append(f"{status}: {(error or {}).get('message', '')}")
    else:
        counts.produced.append(tokens)


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
