"""What the worker-kind benches (bench.embeddings, bench.transcription) share: their command line, their own
appliance serving the kind's demo model, and the in-process side: the server's pipeline, configured as its worker
configures it, warm, in a bare process of its own, measured on demand, so baseline and server take turns block by
block (the idle one blocked on a read) and the load of a shared machine hits both alike; each figure is the median
of its blocks.

A bench module defines a SideBench and its baseline function; `python -m bench.<stem> --baseline MODEL_DIR` runs
that function as the in-process side, which calls `serve()`.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Awaitable, Callable

import aiohttp

from bench import report
from bench.launcher import OwnAppliance, child_env



def serve(run_phase: Callable[[str, int], float]) -> None:
    """The baseline process's loop: say ready, then answer each stdin line `PHASE ROUNDS` with one line, the rate
    `run_phase(phase, rounds)` measured."""
    print("ready", flush=True)
    for line in sys.stdin:
        phase, rounds = line.split()
        print(run_phase(phase, int(rounds)), flush=True)


class InProcess:
    """The bench's handle on its baseline process."""

    def __init__(self, module: str, model_path: Path):
        self.proc = subprocess.Popen([sys.executable, "-m", module, "--baseline", str(model_path)],
                                     env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the in-process baseline did not start")

    def rates(self, phases: tuple[str, ...], rounds: int) -> dict[str, float]:
        out = {}
        for phase in phases:
            self.proc.stdin.write(f"{phase} {rounds}\n")
            self.proc.stdin.flush()
            out[phase] = float(self.proc.stdout.readline())
        return out

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


async def alternate(blocks: int, inprocess: Callable[[], dict[str, float]],
                    server: Callable[[], Awaitable[dict[str, float]]]) -> dict[str, list[float]]:
    """`blocks` turns of the in-process side, then the server; every rate of each, by name (inprocess_*,
    server_*)."""
    samples: dict[str, list[float]] = {}
    for _ in range(blocks):
        for name, value in inprocess().items():
            samples.setdefault(f"inprocess_{name}", []).append(value)
        for name, value in (await server()).items():
            samples.setdefault(f"server_{name}", []).append(value)
    return samples


@dataclass
class SideBench:
    stem: str                       # python -m bench.<stem>; results in <stem>.{md,json}
    kind: str                       # the worker kind whose demo model is served and measured
    served: dict                    # the served model's config entry, but its path
    phases: tuple[str, ...]         # what the in-process side measures each block
    sizes: tuple[tuple[int, int], tuple[int, int]]  # (rounds, blocks) for --quick, then for a full run
    server_rates: Callable[[aiohttp.ClientSession, str, int], Awaitable[dict[str, float]]]  # (session, base, rounds)
    figures: Callable[[dict[str, float]], list[report.Figure]]  # from the medians of every rate
    # figures measured after the side by side, in an appliance of their own (bench.images' swap), given --quick
    more: Callable[[bool], Awaitable[list[report.Figure]]] | None = None

    async def measure(self, quick: bool) -> tuple[dict, list[report.Figure]]:
        rounds, blocks = self.sizes[0] if quick else self.sizes[1]
        with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
            from appliance.demo.catalog import build_demo_model
            model = build_demo_model(Path(tmp) / self.kind, self.kind)
            app = OwnAppliance(model, Path(tmp), models=[{**self.served, "kind": self.kind, "path": str(model)}])
            baseline_process = InProcess(f"bench.{self.stem}", model)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
                await app.start(session)
                try:
                    await self.server_rates(session, app.base, 1)  # warm
                    samples = await alternate(blocks, lambda: baseline_process.rates(self.phases, rounds),
                                              lambda: self.server_rates(session, app.base, rounds))
                finally:
                    app.stop()
                    baseline_process.stop()
        medians = {name: statistics.median(values) for name, values in samples.items()}
        return {"when": report.now(), "rounds": rounds, "blocks": blocks, "quick": quick, **report.machine(),
                "samples": samples}, self.figures(medians)

    def main(self, argv: list[str] | None, doc: str, baseline: Callable[[str], None]) -> None:
        parser = argparse.ArgumentParser(prog=f"python -m bench.{self.stem}", description=doc.splitlines()[0])
        parser.add_argument("--quick", action="store_true", help="a few rounds: checks the bench, measures nothing")
        parser.add_argument("--out", type=Path, default=report.RESULTS, help=f"where {self.stem}.{{json,md}} go")
        parser.add_argument("--baseline", metavar="DIR", help=argparse.SUPPRESS)  # the in-process side's own process
        args = parser.parse_args(argv)
        if args.baseline:
            baseline(args.baseline)
            return
        meta, results = asyncio.run(self.measure(args.quick))
        if self.more is not None:
            results += asyncio.run(self.more(args.quick))
        print(report.write_side_bench(args.out, self.stem, meta, results, ("name", "measured", "target", "verdict")),
              end="", flush=True)
