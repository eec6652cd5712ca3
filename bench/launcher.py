"""The bench's own appliance: `python -m appliance serve` on a free loopback port, with two copies of one model.

`demo` serves the performance figures; `victim` takes the signals of the fault figures, so its restarts never
disturb a performance figure (they run one after the other anyway).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import aiohttp
import yaml

from bench.baseline import no_core_dumps

REPO = Path(__file__).resolve().parent.parent
PERF_MODEL = "demo"
FAULT_MODEL = "victim"
STALL_TIMEOUT_S = 0.5
# A restart policy that survives 50+ deliberate crashes; the backoff is part of every recovery figure.
RESTART = {"backoff_initial_s": 0.05, "backoff_max_s": 0.05, "max_failures": 1000, "window_s": 600}
READY_TIMEOUT_S = 120  # only catches a hang: the demo model loads in well under a second
STOP_TIMEOUT_S = 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def appliance_config(model_path: Path, port: int, device: str = "CPU", runtime_config: dict | None = None) -> dict:
    common = {"path": str(model_path), "device": device, "runtime_config": runtime_config or {}}
    return {"server": {"host": "127.0.0.1", "port": port},
            "models": [{"name": PERF_MODEL, **common, "max_running": 16, "max_queue": 64},
                       {"name": FAULT_MODEL, **common, "max_running": 4,
                        "stall_timeout_s": STALL_TIMEOUT_S, "restart": RESTART}]}


def child_env() -> dict[str, str]:
    """The environment of the processes the bench starts: they import this source tree."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}


class OwnAppliance:
    def __init__(self, model_path: Path, workdir: Path, models: list[dict] | None = None, device: str = "CPU",
                 runtime_config: dict | None = None, server: dict | None = None):
        """`models`: the config's models instead of the two copies of `model_path` (another bench's own);
        `server`: settings added to the config's `server` (bench.clients' model_aliases)."""
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.config_path = workdir / "appliance.yaml"
        config = appliance_config(model_path, self.port, device, runtime_config)
        if models is not None:
            config["models"] = models
        config["server"].update(server or {})
        self.config = config
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = workdir / "appliance.log"
        self.proc: subprocess.Popen | None = None

    def max_running(self, model: str) -> int | None:
        return next((m.get("max_running", 8) for m in self.config["models"] if m["name"] == model), None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def start(self, session: aiohttp.ClientSession) -> None:
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "serve", "--config", str(self.config_path)],
                                         env=child_env(), stdout=log, stderr=subprocess.STDOUT, preexec_fn=no_core_dumps)
        deadline = asyncio.get_running_loop().time() + READY_TIMEOUT_S
        while asyncio.get_running_loop().time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the appliance exited with {self.proc.returncode}; see {self.log_path}")
            try:
                async with session.get(self.base + "/ready") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
        raise RuntimeError(f"the appliance was not ready after {READY_TIMEOUT_S}s; see {self.log_path}")

    async def worker_pid(self, session: aiohttp.ClientSession, model: str) -> int:
        async with session.get(self.base + "/openarc/status") as response:
            status = await response.json()
        return next(m["pid"] for m in status["models"] if m["name"] == model)

    def stop(self) -> None:
        """SIGTERM (the appliance drains and ends its workers, which also die with it), SIGKILL if it hangs."""
        if self.proc is None:
            return
        self.proc.terminate()  # a no-op once it has exited
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.proc.wait()
