"""A worker OS process as the front sees it: spawned fresh (never forked), its channel, and its reaping."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from appliance import ipc
from appliance.host import oom
from appliance.ipc import AsyncChannel

SHUTDOWN_GRACE_S = 3.0
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


class WorkerProcess:
    """A worker OS process and the front's end of its channel."""

    def __init__(self, proc: asyncio.subprocess.Process, channel: AsyncChannel):
        self.proc = proc
        self.channel = channel
        self.pid = proc.pid
        self.parked = False  # started parked (appliance.front.parked) and handed its model
        self.oom_watch = oom.OomWatch.of(proc.pid)  # asked once it is gone: was it the kernel OOM killer?

    @classmethod
    async def spawn(cls, spec: dict[str, Any] | None, extra_env: dict[str, str] | None = None) -> WorkerProcess:
        """A worker for `spec`; None: a parked one (appliance.front.parked), handed its spec later (hand()).
        `extra_env`: added to its environment (appliance.config.card_env: the one card it may see)."""
        front_end, worker_end = socket.socketpair()
        model = ["--spec", json.dumps(spec)] if spec is not None else ["--parked"]
        env = {**os.environ, **(extra_env or {})}
        # The worker imports the very code the front runs, installed or from a source tree.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "appliance.worker", "--fd", str(worker_end.fileno()), *model,
                pass_fds=(worker_end.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C reaches the front only; the front stops workers
        except BaseException:
            front_end.close()
            raise
        finally:
            worker_end.close()
        return cls(proc, await AsyncChannel.open(front_end))

    def hand(self, spec: dict[str, Any]) -> bool:
        """A parked worker's model: it loads it now. False: its channel is closed (it is gone)."""
        self.parked = True
        return self.channel.send(ipc.frame("spec", spec=spec))

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def ask_to_leave(self) -> None:
        """Ask the worker to leave (it os._exit()s, no destructors); reap() SIGKILLs it after a grace period."""
        self.channel.send(ipc.frame("shutdown"))

    async def reap(self) -> int:
        try:
            async with asyncio.timeout(SHUTDOWN_GRACE_S):  # (not wait_for: lifecycle.Changes.wait says why)
                return await self.proc.wait()
        except TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.proc.wait()
        finally:
            self.channel.close()
