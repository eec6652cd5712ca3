"""Parked workers: spare worker processes started ahead, with OpenVINO GenAI imported and nothing loaded, so that a
load (a switch between models on demand, a restart after a crash) costs the pipeline's construction, not an
interpreter's start and its imports (most of a small model's switch on a desktop CPU).

`spawn(spec)` is how every model worker comes to be: a parked one is handed the spec when there is one, else a
fresh process is started with it. A taken spare is replaced once the load that took it has ended (`loaded()`), off
the request's path and never beside a load competing for the same cores. A spare that dies while parked is
replaced quietly (with a backoff, so a broken interpreter is not a loop). Spares are in the ledger (role
`parked`) until taken or reaped; they never count against max_loaded or a memory budget: they hold no model, only
their interpreter's memory (docs/on-demand.md gives the figure).

A spare imports OpenVINO GenAI but opens no device: the device plugin is loaded by the pipeline's construction,
so one spare serves a model on any device, and a GPU's context is always a fresh process's own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from typing import Any

from appliance.config.card_env import card_env
from appliance.config.devices import gpu_pci_addresses

from appliance.front.worker_ledger import Ledger
from appliance.front.worker_process import WorkerProcess

log = logging.getLogger("openarc.supervisor")

RESPAWN_BACKOFF_S = (0.5, 30.0)  # a spare that died while parked: the first wait, and the most it doubles to


class ParkedWorkers:
    """Up to `count` spare workers, and every worker's spawn."""

    def __init__(self, count: int, ledger: Ledger):
        self.count = count
        self.ledger = ledger
        self.spares: dict[WorkerProcess, asyncio.Task] = {}  # each spare and the task that reaps it if it dies
        self.starting = 0
        self.loads = 0  # loads under way that took (or asked for) a worker: refills wait for them
        self.backoff = RESPAWN_BACKOFF_S[0]
        self.closed = False
        self.refilling: asyncio.Task | None = None
        self.gpu_pci: list[str] | None = None  # OpenVINO's GPU.N PCI addresses, read at the first GPU spawn

    async def spawn(self, spec: dict[str, Any]) -> WorkerProcess:
        """A worker loading `spec`: a spare handed it if one is parked, else a fresh process. loaded() must follow
        once its load has ended, whatever the outcome. A GPU worker is started fresh seeing its own card only
        (appliance.config.card_env): a spare's environment was fixed when it started."""
        self.loads += 1
        env, spec = await self._one_card(spec)
        while self.spares and not env:
            process, watch = next(iter(self.spares.items()))
            del self.spares[process]
            if process.hand(spec):
                watch.cancel()  # its life reaps it from now on
                self.backoff = RESPAWN_BACKOFF_S[0]  # it lived until it was needed
                return process
            # its channel is closed: it died just now, and its watch reaps it
        return await WorkerProcess.spawn(spec, env)

    async def _one_card(self, spec: dict[str, Any]) -> tuple[dict[str, str], dict[str, Any]]:
        if not str(spec.get("device", "")).startswith("GPU"):
            return {}, spec
        if self.gpu_pci is None:  # asked once, off the event loop (a child process imports OpenVINO)
            self.gpu_pci = await asyncio.to_thread(gpu_pci_addresses)
        return card_env(spec, self.gpu_pci, os.environ)

    def loaded(self) -> None:
        self.loads = max(0, self.loads - 1)
        self.refill()

    def refill(self) -> None:
        """Start spares up to `count`, one at a time, when no load is under way."""
        if self.closed or self.loads or self.refilling or len(self.spares) + self.starting >= self.count:
            return
        self.refilling = asyncio.create_task(self._start_one(), name="parked-worker")

    async def _start_one(self) -> None:
        self.starting += 1
        self.ledger.spawning += 1
        try:
            process = await WorkerProcess.spawn(None)
        except Exception as exc:  # EMFILE, ENOMEM: loads spawn fresh workers meanwhile
            log.warning("cannot start a parked worker: %s", exc)
            asyncio.get_running_loop().call_later(self._next_backoff(), self.refill)
            return
        finally:
            self.starting -= 1
            self.ledger.spawning -= 1
            self.refilling = None
        self.ledger.started(process.pid, "", self)
        if self.closed:
            await self._end(process)
            return
        self.spares[process] = asyncio.create_task(self._watch(process), name=f"parked:{process.pid}")
        self.refill()

    async def _watch(self, process: WorkerProcess) -> None:
        """A spare that exits while parked is reaped here and replaced after a backoff."""
        returncode = await process.proc.wait()
        self.spares.pop(process, None)
        process.channel.close()
        self.ledger.reaped(process.pid)
        if self.closed:
            return
        log.info("parked worker %d exited (status %s); starting another", process.pid, returncode)
        asyncio.get_running_loop().call_later(self._next_backoff(), self.refill)

    def _next_backoff(self) -> float:
        backoff, self.backoff = self.backoff, min(self.backoff * 2, RESPAWN_BACKOFF_S[1])
        return backoff

    async def _end(self, process: WorkerProcess) -> None:
        process.channel.close()  # EOF: it leaves; reap() kills it after the grace if it does not
        with contextlib.suppress(ProcessLookupError):
            await process.reap()
        self.ledger.reaped(process.pid)

    async def close(self) -> None:
        """The server stops: every spare leaves and is reaped."""
        self.closed = True
        if self.refilling:  # a spawn under way: it ends the spare it starts (closed)
            await asyncio.gather(self.refilling, return_exceptions=True)
        spares = list(self.spares)
        for process, watch in list(self.spares.items()):
            watch.cancel()
        self.spares.clear()
        await asyncio.gather(*(self._end(process) for process in spares), return_exceptions=True)

    def resize(self, count: int) -> None:
        """A reloaded server.parked_workers: spares beyond it leave now, missing ones start."""
        self.count = count
        for process in list(self.spares)[count:]:
            self.spares.pop(process).cancel()
            asyncio.create_task(self._end(process), name=f"parked-end:{process.pid}")
        self.refill()
