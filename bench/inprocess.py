"""The in-process side of the worker-kind benches (bench.embeddings, bench.transcription): the server's pipeline,
configured as its worker configures it, warm, in a bare process of its own; measured on demand, so baseline and
server take turns block by block (the idle one blocked on a read) and the load of a shared machine hits both alike.

The bench module runs `python -m bench.<module> --baseline MODEL_DIR` as that process, which calls `serve()`.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Awaitable, Callable

from bench.launcher import child_env


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
