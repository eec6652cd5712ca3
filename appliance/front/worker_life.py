"""A model's worker from spawn to reaped, again and again: start it, await its ready, time its stalls, end it,
reap it, and restart it after a backoff, or give up (failed). Like gunicorn's arbiter, this is where the model's
state lives: its Lifecycle (appliance.front.lifecycle), the current worker (`current`), the restart budget, and
what the last exit was. Requests are the RequestRouter's (appliance.front.routing); the life attaches the ready
worker's channel to it and detaches it, failing every request, when the worker's life ends.

Every way a worker's life can end becomes one Exit, which `_on_exit()` turns into state, metrics, a log line and a
backoff: the one exit path. Requests never wait on a worker that cannot answer: when the worker's channel reaches
EOF (the kernel closes it the instant the process dies) or the stall timer fires, every request is failed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from dataclasses import dataclass, replace
from typing import Any, Callable

from appliance.config import ModelConfig
from appliance.front.canary import Canary
from appliance.golden.compare import ERROR, LOAD, Difference
from appliance.front.device_faults import DeviceFaults
from appliance.front.lifecycle import (CRASH_REASONS, FINAL_REASONS, Exit, ExitReason, Lifecycle, ModelState,
                                       RestartBudget, describe, describe_exit)
from appliance.front.metrics import Metrics, ModelMetrics
from appliance.front.request import RequestFailed
from appliance.front.routing import RequestRouter
from appliance.front.parked import ParkedWorkers
from appliance.front.worker_ledger import Ledger
from appliance.front.worker_process import SHUTDOWN_GRACE_S, WorkerProcess
from appliance.host import faults
from appliance.host.kernel_log import KernelLog
from appliance.ipc import ProtocolError
from appliance.config.model_checks import served_path_check
from appliance.config import window
from appliance.config.replicas import shown
from appliance.config.kinds import GENERATIVE_KINDS

log = logging.getLogger("openarc.supervisor")  # the same name as appliance.front.supervisor: one source in the log

# How long a worker asked to leave (stop()) has before it is SIGKILLed, counted from the ask.
LEAVE_GRACE_S = SHUTDOWN_GRACE_S


@dataclass
class CurrentWorker:
    """One worker's life: its process, when it became ready, and why the front ended it (if the front did)."""

    process: WorkerProcess | None = None
    ready_at: float | None = None
    ending: Exit | None = None  # set by whoever decided that this worker must end, before the process is reaped


class WorkerLife:
    """One model's successive workers, and the model's state."""

    def __init__(self, model: ModelConfig, spec: dict[str, Any], metrics: Metrics, series: ModelMetrics,
                 load_gate: asyncio.Semaphore, router: RequestRouter,
                 on_frame: Callable[[dict[str, Any]], None],
                 on_state: Callable[[ModelState, ModelState], None],
                 kernel_log: KernelLog | None = None, ledger: Ledger | None = None,
                 spawner: ParkedWorkers | None = None, canary: Canary | None = None, name: str | None = None):
        # name: the model's, or a replica's unit key (its log lines and its ledger entry say which replica)
        self.model, self.name, self.spec = model, name or model.name, spec
        self.canary = canary  # checks a loaded worker's answers against the golden record before it is READY
        self.metrics, self.series = metrics, series
        self.load_gate = load_gate
        self.ledger = ledger or Ledger()  # the residency owner's: every worker process from spawn to reaped
        self.spawner = spawner or ParkedWorkers(0, self.ledger)  # a parked spare handed the spec, else a fresh one
        self.router = router
        self._on_frame = on_frame  # a ready worker's frames, routed by the ModelSupervisor
        self._on_state = on_state  # gauges and the Supervisor's waiters follow every state change
        self.device_faults = DeviceFaults(model, kernel_log)
        self.lifecycle = Lifecycle(self.name, self._state_changed)
        self.current = CurrentWorker()
        self.stop_requested = asyncio.Event()
        self.drained = False  # stop() has waited out its drain: nothing more is admitted, reserved or not
        self.task: asyncio.Task | None = None
        self.budget = RestartBudget(model.restart)
        self.restarts = 0
        self.crashes = 0
        self.last_error: str | None = None  # the operator's: the log and /openarc/status
        # the same as a client's error body says it: without the worker's own text (describe_exit)
        self.last_error_shown: str | None = None
        self.last_hint: str | None = None
        self.last_exit: Exit | None = None
        self.load_seconds: float | None = None  # the worker's own measure of its last load
        self.pipeline_load_seconds: float | None = None  # the part of it that built the pipeline (no imports)
        self.last_backoff_s: float | None = None  # the wait before the latest restart (doubles with each crash in a row)
        self.formats: dict[str, Any] | None = None  # the chat formats the worker reported when it became ready
        self.spawned_at: float | None = None  # the latest worker exists: spawned, or a parked one handed the model
        self.parked = False  # ... and it was a parked one

    # --- state -----------------------------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self.lifecycle.state

    @property
    def pid(self) -> int | None:
        return self.current.process.pid if self.current.process else None

    @property
    def checking(self) -> bool:
        """The worker has loaded and the canary checks it (appliance.front.canary): the model is still LOADING."""
        return self.state is ModelState.LOADING and self.current.ready_at is not None

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def enter(self, state: ModelState, error: str | None = None, hint: str | None = None,
              shown: str | None = None) -> None:
        """Enter `state`, with the error that brought it (`shown`: as a client reads it, if not the same)."""
        if error is not None:
            self.last_error, self.last_error_shown, self.last_hint = error, shown or error, hint
        self.lifecycle.enter(state)

    def carry_error(self, old: WorkerLife) -> None:
        """The last error of the life this one follows under its name (appliance.front.placement)."""
        self.last_error, self.last_error_shown, self.last_hint = old.last_error, old.last_error_shown, old.last_hint
        self.last_exit = old.last_exit

    def _state_changed(self, old: ModelState, new: ModelState) -> None:
        """Every state change, once: the log line here, gauges and waiters in `on_state`."""
        reason = f" ({self.last_error})" if new in (ModelState.FAILED, ModelState.RESTARTING) and self.last_error else ""
        log.info("model %s: %s -> %s%s", self.name, old.value, new.value, reason)
        self._on_state(old, new)

    def admits(self, reserved: bool = False) -> bool:
        """Whether a request is taken now; one that holds a reserved place also while the drain waits for it."""
        if reserved and self.state is ModelState.DRAINING and not self.drained:
            return True
        return self.state is ModelState.READY and not self.stopping

    def coming_up(self) -> bool:
        """Loading, restarting, or not started yet: a request may wait for it (a draining or failed one, not)."""
        return not self.stopping and self.state in (ModelState.LOADING, ModelState.RESTARTING, ModelState.STOPPED)

    def unavailable(self) -> RequestFailed:
        """Why a request cannot be admitted now."""
        if self.state is ModelState.FAILED:
            return RequestFailed(503, "model_failed", f"model {shown(self.name)} is failed: {self.last_error_shown}",
                                 hint=self.last_hint)
        if self.stopping:
            return self._unloading()
        return RequestFailed(503, "model_unavailable", f"model {shown(self.name)} is {self.state.value}; retry shortly",
                             retry_after=self._retry_after())

    def _unloading(self) -> RequestFailed:
        """The 503 of a request this model's drain refuses or ends: the model unloads (an unload, a reload, or the
        server's stop, whose new requests the routes refuse as shutting down first) and may load again."""
        return RequestFailed(503, "model_unavailable", f"model {shown(self.name)} is unloading; retry shortly",
                             retry_after=self._retry_after())

    def _retry_after(self) -> float:
        return max(1.0, self.model.restart.backoff_initial_s)

    # --- start and stop --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Run workers (and restart them) until stop()."""
        self.task = asyncio.create_task(self.run(), name=f"model:{self.name}")
        self.task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # run() guards every life; this is a last resort
            log.error("model %s: its supervisor task died", self.name, exc_info=task.exception())

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain: let running, queued and reserved requests finish up to the timeout, then end the worker: asked to
        leave, SIGKILLed after LEAVE_GRACE_S if it does not (a worker wedged in the driver, or stopped, must not
        hold its memory forever); a worker still loading has no request to lose and is killed at once."""
        self.stop_requested.set()
        if self.state is not ModelState.STOPPED:
            self.enter(ModelState.DRAINING)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(drain_timeout_s):  # (not wait_for: lifecycle.Changes.wait says why)
                await self.router.idle.wait()
        self.drained = True
        self.router.fail_all(self._unloading())
        if self.current.process:
            if self.current.ready_at is None:
                self.end_worker(Exit(ExitReason.STOPPED))
            else:
                self.current.ending = self.current.ending or Exit(ExitReason.STOPPED)
                self.current.process.ask_to_leave()
        if self.task:
            done, _ = await asyncio.wait([self.task], timeout=LEAVE_GRACE_S)
            if not done and self.current.process:  # (no process: a load waiting for the gate ends on its own)
                log.warning("model %s: worker %s did not leave within %gs of being asked; killing it", self.name,
                            self.pid, LEAVE_GRACE_S)
                self.end_worker(Exit(ExitReason.STOPPED))
            await asyncio.gather(self.task, return_exceptions=True)
        if self.state is ModelState.DRAINING:
            self.enter(ModelState.STOPPED)

    # --- one worker after another ----------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve and restart the worker until stopped or failed: one loop, one exit path."""
        while not self.stopping:
            self.enter(ModelState.LOADING)
            backoff = self._on_exit(await self._one_life())
            if backoff is None or self.stopping:
                return
            with contextlib.suppress(TimeoutError):  # the backoff, cut short by a stop
                async with asyncio.timeout(backoff):
                    await self.stop_requested.wait()
            if self.stopping:
                return
            self.restarts += 1
            self.series.worker_restarts.inc()

    async def _one_life(self) -> Exit:
        """One worker from spawn to reaped, whatever happens in between; never raises."""
        self.current = CurrentWorker()
        problem = served_path_check(self.model)
        if problem:  # check-config's check: a directory that cannot load gets no worker, and says why
            return Exit(ExitReason.LOAD_ERROR, detail=": ".join(problem))
        try:
            async with self.load_gate:
                if self.stopping:
                    return Exit(ExitReason.STOPPED)
                spawned = time.monotonic()
                self.ledger.spawning += 1
                try:
                    self.current.process = await self.spawner.spawn(self.spec)
                except Exception as exc:  # EMFILE, ENOMEM, EACCES, a missing interpreter: nothing to reap
                    self.spawner.loaded()
                    return Exit(ExitReason.SPAWN_ERROR, detail=f"cannot start the worker: {describe(exc)}")
                finally:
                    if self.current.process:
                        self.ledger.started(self.current.process.pid, self.name, self)
                    self.ledger.spawning -= 1
                self.spawned_at = time.monotonic()  # a switch's stages (appliance.front.switches)
                self.parked = self.current.process.parked
                handed = " (a parked one, handed the model)" if self.current.process.parked else ""
                window_line = f"; {window.describe(self.spec['window'])}" if self.model.kind in GENERATIVE_KINDS else ""
                log.info("model %s: worker %d started%s%s", self.name, self.pid, handed, window_line)
                try:
                    ready = await self._await_ready(spawned)
                finally:
                    self.spawner.loaded()  # a spare it took is replaced now, off the load's path
            if ready:
                await self._serve()
            return await self._reap()
        except Exception as exc:  # a bug in the supervision itself: log it whole, kill the worker, restart
            log.exception("model %s: supervising worker %s failed", self.name, self.pid)
            self.end_worker(Exit(ExitReason.SUPERVISOR_ERROR, detail=f"internal error in the front: {describe(exc)}"))
            self.router.detach(self._worker_gone())
            return await self._reap()

    async def _await_ready(self, spawned: float) -> bool:
        if self.stopping:  # stopped while it spawned: a loading worker has no request to lose
            self.end_worker(Exit(ExitReason.STOPPED))
            return False
        try:
            async with asyncio.timeout(self.model.load_timeout_s):  # (not wait_for: lifecycle.Changes.wait says why)
                message = await self.current.process.channel.recv()
        except TimeoutError:
            self.end_worker(Exit(ExitReason.LOAD_TIMEOUT,
                                 detail=f"model load took longer than load_timeout_s={self.model.load_timeout_s:g}"))
            return False
        except ProtocolError as exc:
            self.end_worker(Exit(ExitReason.PROTOCOL_ERROR,
                                 detail=f"the worker sent a malformed frame while loading: {exc}"))
            return False
        if message is None:
            return False  # it died while loading: _reap() tells how
        if message["op"] == "fatal":  # the worker says why it cannot load, then exits
            self.end_worker(Exit(ExitReason.LOAD_ERROR, detail=f"{message['kind']}: {message['message']}",
                                 hint=message.get("hint"), public=bool(message.get("public"))), kill=False)
            return False
        if message["op"] != "ready":
            self.end_worker(Exit(ExitReason.PROTOCOL_ERROR, detail=f"the worker sent {message['op']!r} before 'ready'"))
            return False
        self.load_seconds = message["load_seconds"]
        self.pipeline_load_seconds = message.get("pipeline_load_seconds")
        loads = self.series.model_load  # by where the compiled model came from (a worker that does not say: compiled)
        loads.get(message.get("load_source"), loads["compiled"]).observe(time.monotonic() - spawned)
        if self.stopping:  # stopped while it loaded: it has been asked to leave, and serves nothing
            return False
        self.current.ready_at = time.monotonic()
        self.formats = message.get("formats") or {}
        self.device_faults.card = message.get("device_bdf") or self.device_faults.card
        return True

    async def _serve(self) -> None:
        """Hand the worker's frames on until its channel ends; the monitor ends a worker that stalls."""
        if self.canary:  # the golden record read off the event loop, so wants() below finds it read
            await self.canary.refresh()
        channel = self.current.process.channel
        self.router.attach(channel)
        monitor = asyncio.create_task(self._monitor())
        # A model with a golden record stays LOADING while its probes run on this worker (no request is admitted,
        # its waiters wait, a side-by-side replacement is not switched to); READY only once they pass, or warn.
        vetting = asyncio.create_task(self._vet()) if self.canary and self.canary.wants(self.model) else None
        if vetting is None:
            self.enter(ModelState.READY)
        try:
            while (message := await channel.recv()) is not None:
                self._on_frame(message)
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:
            self.end_worker(Exit(ExitReason.PROTOCOL_ERROR, detail=f"the worker sent a malformed frame: {describe(exc)}"))
        finally:
            monitor.cancel()
            if vetting:
                vetting.cancel()
            # Leave READY before anything awaits, so no request is admitted to a worker that is gone.
            self._leave_ready()
            self.router.detach(self._worker_gone())

    async def _vet(self) -> None:
        """The canary's check of the worker that just loaded: READY when it passes (or under warn); under gate a
        worker that answers otherwise is ended, and the model refused with the difference as its error."""
        try:
            difference = await self.canary.check(self.model, self.router, self.load_seconds)
        except Exception as exc:  # a bug in the check must not leave the model loading for good
            log.exception("model %s: the canary check failed", self.name)
            difference = Difference(ERROR, f"model {shown(self.name)}: the check itself failed: {describe(exc)}")
        if self.stopping or self.state is not ModelState.LOADING:
            return  # stopped while checked: the probes it cut short say nothing of the model
        self.canary.judge(self.name, difference)
        if difference is not None and self.canary.mode == "gate":
            self.end_worker(Exit(ExitReason.CANARY_FAILED, detail=str(difference)))
        else:
            self.router.first_output = None  # the probes' output is no client's: a switch ends at a client's first
            self.enter(ModelState.READY)

    def _worker_gone(self) -> RequestFailed:
        return RequestFailed(503, "worker_crash", f"the worker of model {shown(self.name)} died; it is being restarted",
                             retry_after=self._retry_after())

    def _leave_ready(self) -> None:
        if self.state is ModelState.READY:
            self.enter(ModelState.RESTARTING)

    def end_worker(self, ending: Exit, kill: bool = True) -> None:
        """The front decided this worker's life is over: record why (once), leave READY, and kill it."""
        if self.current.ending is None:
            self.current.ending = ending
        self._leave_ready()
        if kill and self.current.process:
            self.current.process.signal(signal.SIGKILL)

    async def _monitor(self) -> None:
        """Kill a worker that stops making progress while it has work (what a GPU hang looks like).

        It sleeps until the stall deadline of the oldest progress, not on a polling tick."""
        stall = self.model.stall_timeout_s
        while True:
            overdue = time.monotonic() - self.router.last_progress
            if self.router.running and overdue > stall:
                break
            await asyncio.sleep(stall - overdue if self.router.running else stall)
        log.error("model %s: no progress for %.1fs, killing worker %s", self.name, stall, self.pid)
        self.end_worker(Exit(ExitReason.STALL, detail=f"worker made no progress for stall_timeout_s={stall:g}; killed"))
        self.router.fail_all(RequestFailed(
            504, "stall", f"model {shown(self.name)} made no progress for {stall:g}s; its worker was killed and is "
                          "restarting", retry_after=self.model.restart.backoff_initial_s))

    # --- the one exit path -----------------------------------------------------------------------------------

    async def _reap(self) -> Exit:
        """Wait for the worker process, and describe how its life ended."""
        current = self.current
        returncode = await current.process.reap() if current.process else None
        if current.process:
            self.ledger.reaped(current.process.pid)
            log.info("model %s: worker %d reaped (exit status %s)", self.name, current.process.pid, returncode)
        self.current = CurrentWorker()
        served = time.monotonic() - current.ready_at if current.ready_at is not None else 0.0
        ending = current.ending or self.unasked_exit(current.process, returncode)
        return replace(ending, returncode=returncode, ever_ready=current.ready_at is not None, served_s=served)

    def unasked_exit(self, process: WorkerProcess | None, returncode: int | None) -> Exit:
        """Nobody in the front asked this worker to go: its exit status, its memory cgroup's OOM counter and the
        kernel log tell why."""
        if self.stopping:
            return Exit(ExitReason.STOPPED)
        if process and returncode is not None and process.oom_watch.oom_killed(returncode,
                                                                               self.device_faults.kernel_log):
            return Exit(ExitReason.OOM_KILL)
        return self.device_faults.crash(returncode)

    def _on_exit(self, exit: Exit) -> float | None:
        """The one place a worker's end becomes state, metrics and a log line: the backoff before the next
        start, or None when there is none (stopping, or the model is now failed)."""
        self.last_exit = exit
        self.metrics.worker_exits.labels(model=self.model.name, reason=exit.reason.value).inc()
        if exit.reason is ExitReason.STOPPED or self.stopping:
            log.info("model %s: worker ended (%s)", self.name, exit.reason.value)
            return None
        if exit.reason in FINAL_REASONS:  # a restart would answer the same: refused until a reload
            self.enter(ModelState.FAILED, describe_exit(exit), shown=describe_exit(exit, for_client=True))
            return None
        fault = faults.classify_exit(exit.returncode or 0, during_load=not exit.ever_ready,
                                     oom_killed=exit.reason is ExitReason.OOM_KILL)
        if exit.reason in CRASH_REASONS:
            self.crashes += 1
            self.metrics.worker_crashes.labels(model=self.model.name, signal=faults.signal_name(exit.returncode or 0),
                                               reason=exit.reason.value).inc()
            hint = exit.hint or fault.hint
        else:
            hint = exit.hint
        self.last_error, self.last_hint = describe_exit(exit), hint
        self.last_error_shown = describe_exit(exit, for_client=True)
        log.error("model %s: %s%s", self.name, self.last_error, f" (hint: {hint})" if hint else "")
        backoff = self.budget.record_failure(time.monotonic(), exit.served_s)
        if backoff is None:
            used_up = (f"restart budget used up ({self.model.restart.max_failures} failures "
                       f"within {self.model.restart.window_s:g}s); last: ")
            self.enter(ModelState.FAILED, used_up + self.last_error, hint, shown=used_up + self.last_error_shown)
            if not exit.ever_ready and self.canary and self.canary.wants(self.model):  # it never got to its check
                self.canary.judge(self.name, Difference(LOAD, f"model {shown(self.name)} did not load: {self.last_error}"))
            return None
        self.enter(ModelState.RESTARTING)
        self.last_backoff_s = backoff
        return backoff
