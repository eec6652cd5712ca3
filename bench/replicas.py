"""`python -m bench.replicas [--quick]`: replicas, two workers of one model behind one name against one worker with
all the cores, and session affinity against round robin.

Its own appliance serves the demo model three ways on the CPU: `one`, one worker with every core
(INFERENCE_NUM_THREADS = the host's cores); `two`, `device: [CPU, CPU]` with half the cores each and the default
routing (affinity: a conversation stays on the replica holding its prefix); `two-rr`, the same with
`replica_routing: round_robin`. Each is driven alone (the others idle) by the same clients, each a multi-turn
conversation (a system prompt and a history growing by a question and its answer a turn), turn after turn, streamed.
Figures per side: aggregate tokens/s (completion tokens over the phase's wall time) and the median time to first
token of later turns (turn 2 on), where a conversation's prefix is in some replica's cache or not. Meant for a
many-core host: on a few cores, two replicas share them with the clients and with each other. Results in
bench/results/replicas.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import client, report
from bench.launcher import OwnAppliance

LAYERS = {True: 2, False: 12}
CLIENTS = {True: 4, False: 16}
TURNS = {True: 2, False: 5}
ANSWER_TOKENS = {True: 4, False: 32}
SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: keep changes small and explain each." for i in range(8))
SIDES = ("one", "two", "two-rr")


def models(path: Path, cores: int) -> list[dict]:
    half = max(1, cores // 2)
    common = {"path": str(path), "max_context": 2048, "max_running": 16, "max_queue": 64}
    return [{"name": "one", **common, "runtime_config": {"INFERENCE_NUM_THREADS": cores}},
            {"name": "two", **common, "device": ["CPU", "CPU"], "runtime_config": {"INFERENCE_NUM_THREADS": half}},
            {"name": "two-rr", **common, "device": ["CPU", "CPU"], "replica_routing": "round_robin",
             "runtime_config": {"INFERENCE_NUM_THREADS": half}}]


async def conversation(session: aiohttp.ClientSession, base: str, model: str, number: int, quick: bool,
                       later: list[float]) -> int:
    """One client's conversation; the tokens it received. Later turns' times to first token go to `later`."""
    history, tokens = [{"role": "system", "content": f"Project {number}. {SYSTEM}"}], 0
    for turn in range(1, TURNS[quick] + 1):
        history.append({"role": "user", "content": f"Step {turn}: what is the next change to make?"})
        body = {"model": model, "messages": history, "max_tokens": ANSWER_TOKENS[quick], "stream": True,
                "temperature": 0}
        got = await client.stream(session, base, body)
        if got.status != 200 or got.error or not got.token_times:
            raise RuntimeError(f"{model}: {got.status}: {got.error or got.broken or 'no content'}")
        if turn > 1:
            later.append(got.token_times[0] - got.started)
        tokens += len(got.token_times)
        history.append({"role": "assistant", "content": f"Change {turn} of project {number} is done."})
    return tokens


async def drive(session: aiohttp.ClientSession, base: str, model: str, quick: bool) -> tuple[float, list[float]]:
    """All clients at once on one side: (aggregate tokens/s, later turns' times to first token)."""
    later: list[float] = []
    started = time.monotonic()
    tokens = await asyncio.gather(*(conversation(session, base, model, c, quick, later)
                                    for c in range(CLIENTS[quick])))
    return sum(tokens) / (time.monotonic() - started), later


async def measure(quick: bool) -> tuple[dict, list[report.Figure]]:
    from appliance.demo.catalog import build_demo_model
    cores = os.cpu_count() or 2
    results: dict[str, tuple[float, list[float]]] = {}
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        model = build_demo_model(Path(tmp) / "llm", "llm", eos_after=0, max_new_tokens=4096, layers=LAYERS[quick])
        app = OwnAppliance(model, Path(tmp), models=models(model, cores))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await app.start(session)
            try:
                await every_replica_ready(session, app.base)
                for side in SIDES:
                    if not quick:  # a warm-up: threads up, every replica's first request served (other prompts)
                        await drive(session, app.base, side, True)
                    results[side] = await drive(session, app.base, side, quick)
            finally:
                app.stop()
    meta = {"when": report.now(), "quick": quick, "layers": LAYERS[quick], "clients": CLIENTS[quick],
            "turns": TURNS[quick], "cores": cores, "load_average": report.load_average(), **report.machine()}
    return meta, figures(results) + [headline(results, quick)]


async def every_replica_ready(session: aiohttp.ClientSession, base: str, timeout_s: float = 300) -> None:
    """/ready answers once one replica of each model serves; the bench waits for all of them."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        async with session.get(base + "/openarc/status") as response:
            status = await response.json()
        states = [r["state"] for m in status["models"] for r in m.get("replicas", [m])]
        if all(state == "ready" for state in states):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"replicas not ready after {timeout_s:g}s: {states}")


def figures(results: dict[str, tuple[float, list[float]]]) -> list[report.Figure]:
    out = []
    for side, (rate, later) in results.items():
        out.append(report.Figure(f"Aggregate tokens/s, {side}", f"{rate:,.1f} tokens/s", rate, "tokens/s"))
        median = statistics.median(later) * 1000
        out.append(report.Figure(f"TTFT later turns, {side} (median; lowest-highest)",
                                 f"{median:,.1f} ms ({min(later) * 1000:,.1f}-{max(later) * 1000:,.1f})", median, "ms"))
    return out


HEADLINE = "Replicas: two with half the cores each / one with all, aggregate tokens/s; later-turn TTFT affinity / round robin"


def headline(results: dict[str, tuple[float, list[float]]], quick: bool) -> report.Figure:
    """The main bench's row: aggregate tokens/s of two replicas over one worker, and the later turns' median time to
    first token with affinity against round robin."""
    (one, _), (two, affine), (_, robin) = (results[side] for side in SIDES)
    affine_ms, robin_ms = (statistics.median(x) * 1000 for x in (affine, robin))
    return report.Figure(HEADLINE, f"{two:,.1f} / {one:,.1f} tokens/s ({two / one:.2f}x); later turns "
                                   f"{affine_ms:,.1f} ms with affinity / {robin_ms:,.1f} ms round robin",
                         two / one, "x", f"{CLIENTS[quick]} clients, {TURNS[quick]} turns each, {LAYERS[quick]}-layer "
                                         "demo model on the CPU (python -m bench.replicas)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 4 clients of 2 turns: checks the "
                                                             "bench, measures nothing")
    parser.add_argument("--out", type=Path, default=report.RESULTS, help="where replicas.{json,md} go")
    args = parser.parse_args(argv)
    meta, figures_ = asyncio.run(measure(args.quick))
    print(report.write_side_bench(args.out, "replicas", meta, figures_, ("name", "measured")), end="", flush=True)


if __name__ == "__main__":
    main()
