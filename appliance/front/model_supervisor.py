"""One supervisor per model: spawns its worker, routes requests to it, reaps it, times it out and restarts it.

Every state change goes through the model's Lifecycle (appliance.front.lifecycle, with its table of legal moves);
every way a worker's life can end becomes one Exit, which ModelSupervisor._on_exit() turns into state, metrics,
a log line and a backoff. Requests never wait on a worker that cannot answer: when the worker's channel reaches
EOF (the kernel closes it the instant the process dies) or the stall timer fires, every request of the model is
failed at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import signal
import time
from typing import Any, AsyncIterator, Callable

from appliance import ipc
from appliance.host import faults, telemetry
from appliance.config import Config, ModelConfig, worker_spec
from appliance.ipc import ProtocolError
from appliance.front.lifecycle import (CRASH_REASONS, Exit, ExitReason, Lifecycle, ModelState, RestartBudget, describe,
                                 describe_exit)
from appliance.front.metrics import Metrics
from appliance.front.request import Event, Request, RequestFailed
from appliance.front.worker_process import WorkerProcess

log = logging.getLogger("openarc.supervisor")  # the same name as appliance.front.supervisor: one source in the log

# What a result frame's "counts" may add to the model's counters (ModelMetrics fields).
RESULT_COUNTERS = frozenset({"prompt_tokens", "embedding_inputs", "audio_seconds"})


# Worker error kinds that are the request's fault: HTTP 400.
CLIENT_ERROR_KINDS = ("invalid_request", "invalid_grammar")


class ModelSupervisor:
    """One model: its lifecycle, its worker, and the requests routed to it."""

    def __init__(self, model: ModelConfig, config: Config, metrics: Metrics, load_gate: asyncio.Semaphore,
                 on_change: Callable[[], None] = lambda: None, kernel_log: telemetry.KernelLog | None = None):
        self.model = model
        self.kernel_log = kernel_log  # the front's: GPU resets and OOM kills, to tell why a worker failed
        self.name = model.name
        self.metrics = metrics
        self.load_gate = load_gate
        self.spec = worker_spec(model, config)
        self.series = metrics.for_model(self.name, model.kind)
        self._on_change = on_change  # the Supervisor's "some model changed state" signal
        self.lifecycle = Lifecycle(self.name, self._state_changed)
        self.task: asyncio.Task | None = None
        self.worker: WorkerProcess | None = None
        self.budget = RestartBudget(model.restart)
        self.restarts = 0
        self.crashes = 0
        self.last_error: str | None = None
        self.last_hint: str | None = None
        self.last_exit: Exit | None = None
        self.load_seconds: float | None = None  # the worker's own measure of its last load
        self.running: dict[int, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.awaiting_ready = 0  # requests waiting for this model to become ready (Supervisor.ready_model)
        self.ids = itertools.count(1)
        self.idle = asyncio.Event()
        self.idle.set()
        self.last_progress = time.monotonic()
        self.stop_requested = asyncio.Event()
        # Set by whoever decided that the current worker must end (the front), before the process is reaped.
        self._ending: Exit | None = None
        self._ready_at: float | None = None
        self.formats: dict[str, Any] | None = None  # the chat formats the worker reported when it became ready
        # False while this is a replacement not yet switched to, and once replaced: the model's gauges show the
        # supervisor that serves its name (Supervisor._replace).
        self.reports = True

    # --- state -------------------------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        return self.lifecycle.state

    def _enter(self, state: ModelState, error: str | None = None, hint: str | None = None) -> None:
        if error is not None:
            self.last_error, self.last_hint = error, hint
        self.lifecycle.enter(state)

    def _state_changed(self, old: ModelState, new: ModelState) -> None:
        """Every state change, once: log, metrics, and the waiters of the whole Supervisor."""
        reason = f" ({self.last_error})" if new in (ModelState.FAILED, ModelState.RESTARTING) and self.last_error else ""
        log.info("model %s: %s -> %s%s", self.name, old.value, new.value, reason)
        if self.reports:
            self.metrics.set_state(self.name, new.value)
        self._on_change()

    @property
    def pid(self) -> int | None:
        return self.worker.pid if self.worker else None

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.model.kind, "state": self.state.value, "pid": self.pid,
                "device": self.model.device, "pipeline": self.model.pipeline if self.model.kind == "llm" else None,
                "restarts": self.restarts, "crashes": self.crashes,
                "last_error": self.last_error, "hint": self.last_hint,
                "last_exit": self.last_exit.reason.value if self.last_exit else None,
                "load_seconds": self.load_seconds,
                # chat formats: as the worker resolved them (configured, else detected), or as configured until then
                "tool_parser": (self.formats or {}).get("tool_parser", self.model.tool_parser),
                "reasoning_parser": (self.formats or {}).get("reasoning_parser", self.model.reasoning_parser),
                "requests_running": len(self.running), "requests_waiting": len(self.waiting) + self.awaiting_ready}

    # --- lifecycle -----------------------------------------------------------------------------------

    def start(self) -> None:
        self.task = asyncio.create_task(self.run(), name=f"model:{self.name}")
        self.task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:  # run() guards every life; this is a last resort
            log.error("model %s: its supervisor task died", self.name, exc_info=task.exception())

    async def run(self) -> None:
        """Start, serve and restart the worker until stopped or failed: one loop, one exit path."""
        while not self.stopping:
            self._enter(ModelState.LOADING)
            backoff = self._on_exit(await self._one_life())
            if backoff is None or self.stopping:
                return
            await self._sleep_unless_stopping(backoff)
            if self.stopping:
                return
            self.restarts += 1
            self.series.worker_restarts.inc()

    async def _one_life(self) -> Exit:
        """One worker from spawn to reaped, whatever happens in between; never raises."""
        self._ending, self._ready_at = None, None
        try:
            async with self.load_gate:
                if self.stopping:
                    return Exit(ExitReason.STOPPED)
                spawned = time.monotonic()
                try:
                    self.worker = await WorkerProcess.spawn(self.spec)
                except Exception as exc:  # EMFILE, ENOMEM, EACCES, a missing interpreter: nothing to reap
                    return Exit(ExitReason.SPAWN_ERROR, detail=f"cannot start the worker: {describe(exc)}")
                ready = await self._await_ready(spawned)
            if ready:
                await self._serve()
            return await self._reap()
        except Exception as exc:  # a bug in the supervision itself: log it whole, kill the worker, restart
            log.exception("model %s: supervising worker %s failed", self.name, self.pid)
            self._end_worker(ExitReason.SUPERVISOR_ERROR, f"internal error in the front: {describe(exc)}")
            self._fail_all_requests()
            return await self._reap()

    async def _await_ready(self, spawned: float) -> bool:
        try:
            message = await asyncio.wait_for(self.worker.channel.recv(), self.model.load_timeout_s)
        except asyncio.TimeoutError:
            self._end_worker(ExitReason.LOAD_TIMEOUT,
                             f"model load took longer than load_timeout_s={self.model.load_timeout_s:g}")
            return False
        except ProtocolError as exc:
            self._end_worker(ExitReason.PROTOCOL_ERROR, f"the worker sent a malformed frame while loading: {exc}")
            return False
        if message is None:
            return False  # it died while loading: _reap() tells how
        if message["op"] == "fatal":  # the worker says why it cannot load, then exits
            self._end_worker(ExitReason.LOAD_ERROR, f"{message['kind']}: {message['message']}", message.get("hint"),
                             kill=False)
            return False
        if message["op"] != "ready":
            self._end_worker(ExitReason.PROTOCOL_ERROR, f"the worker sent {message['op']!r} before 'ready'")
            return False
        self.load_seconds = message["load_seconds"]
        self.series.model_load.observe(time.monotonic() - spawned)
        if self.stopping:  # stopped while it loaded: it has been asked to leave, and serves nothing
            return False
        self._ready_at = time.monotonic()
        self.formats = message.get("formats") or {}
        self._enter(ModelState.READY)
        return True

    async def _serve(self) -> None:
        """Route worker frames until the channel ends; the monitor ends a worker that stalls."""
        monitor = asyncio.create_task(self._monitor())
        try:
            while (message := await self.worker.channel.recv()) is not None:
                self._on_frame(message)
        except (ProtocolError, KeyError, TypeError, ValueError) as exc:
            self._end_worker(ExitReason.PROTOCOL_ERROR, f"the worker sent a malformed frame: {describe(exc)}")
        finally:
            monitor.cancel()
            # Leave READY before anything awaits, so no request is admitted to a worker that is gone.
            self._leave_ready()
            self._fail_all_requests()

    def _leave_ready(self) -> None:
        if self.state is ModelState.READY:
            self._enter(ModelState.RESTARTING)

    def _end_worker(self, reason: ExitReason, detail: str, hint: str | None = None, kill: bool = True) -> None:
        """The front decided this worker's life is over: record why (once), leave READY, and kill it."""
        if self._ending is None:
            self._ending = Exit(reason, detail=detail, hint=hint)
        self._leave_ready()
        if kill and self.worker:
            self.worker.signal(signal.SIGKILL)

    async def _reap(self) -> Exit:
        """Wait for the worker process, and describe how its life ended."""
        worker, self.worker = self.worker, None
        returncode = await worker.reap() if worker else None
        served = time.monotonic() - self._ready_at if self._ready_at is not None else 0.0
        ending = self._ending or self._unasked_exit(worker, returncode)
        return Exit(ending.reason, returncode, ending.detail, ending.hint, self._ready_at is not None, served)

    def _unasked_exit(self, worker: WorkerProcess | None, returncode: int | None) -> Exit:
        """Nobody in the front asked this worker to go: its exit status, its memory cgroup's OOM counter and the
        kernel log tell why."""
        if self.stopping:
            return Exit(ExitReason.STOPPED)
        if worker and returncode is not None and worker.oom_watch.oom_killed(returncode, self.kernel_log):
            return Exit(ExitReason.OOM_KILL)
        trouble = self._gpu_trouble()
        if trouble:  # whatever the worker died of, it died of the reset (the runtime aborts on a lost context)
            fault = faults.classify_exit(returncode or 0, gpu_reset_seen=True, pci_family=gpu_family(trouble))
            return Exit(ExitReason.DEVICE_LOST, detail=describe_gpu_trouble(trouble), hint=fault.hint)
        if returncode == faults.EXIT_DEVICE_LOST:
            return Exit(ExitReason.DEVICE_LOST)
        return Exit(ExitReason.CRASH)

    def _gpu_trouble(self) -> telemetry.GpuEvent | None:
        """The GPU hang or reset the kernel logged lately, for a model on a GPU."""
        if self.kernel_log is None or "GPU" not in self.model.device.upper():
            return None
        return self.kernel_log.gpu_trouble()

    def _on_exit(self, exit: Exit) -> float | None:
        """The one place a worker's end becomes state, metrics and a log line: the backoff before the next
        start, or None when there is none (stopping, or the model is now failed)."""
        self.last_exit = exit
        self.metrics.worker_exits.labels(model=self.name, reason=exit.reason.value).inc()
        self.series.kv_cache_usage.set(0)  # its cache went with it
        if exit.reason is ExitReason.STOPPED or self.stopping:
            log.info("model %s: worker ended (%s)", self.name, exit.reason.value)
            return None
        fault = faults.classify_exit(exit.returncode or 0, during_load=not exit.ever_ready,
                                     oom_killed=exit.reason is ExitReason.OOM_KILL)
        if exit.reason in CRASH_REASONS:
            self.crashes += 1
            self.metrics.worker_crashes.labels(model=self.name, signal=faults.signal_name(exit.returncode or 0),
                                               reason=exit.reason.value).inc()
            hint = exit.hint or fault.hint
        else:
            hint = exit.hint
        self.last_error, self.last_hint = describe_exit(exit), hint
        log.error("model %s: %s%s", self.name, self.last_error, f" (hint: {hint})" if hint else "")
        backoff = self.budget.record_failure(time.monotonic(), exit.served_s)
        if backoff is None:
            self._enter(ModelState.FAILED, f"restart budget used up ({self.model.restart.max_failures} failures "
                                           f"within {self.model.restart.window_s:g}s); last: {self.last_error}", hint)
            return None
        self._enter(ModelState.RESTARTING)
        return backoff

    async def _monitor(self) -> None:
        """Kill a worker that stops making progress while it has work (what a GPU hang looks like).

        It sleeps until the stall deadline of the oldest progress, not on a polling tick."""
        stall = self.model.stall_timeout_s
        while True:
            overdue = time.monotonic() - self.last_progress
            if self.running and overdue > stall:
                break
            await asyncio.sleep(stall - overdue if self.running else stall)
        log.error("model %s: no progress for %.1fs, killing worker %s", self.name, stall, self.pid)
        self._end_worker(ExitReason.STALL, f"worker made no progress for stall_timeout_s={stall:g}; killed")
        self._fail_all_requests(RequestFailed(
            504, "stall", f"model {self.name} made no progress for {stall:g}s; its worker was killed and is "
                          "restarting", retry_after=self.model.restart.backoff_initial_s))

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop_requested.wait(), seconds)

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain: let running and queued requests finish up to the timeout, then end the worker."""
        self.stop_requested.set()
        if self.state is not ModelState.STOPPED:
            self._enter(ModelState.DRAINING)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.idle.wait(), drain_timeout_s)
        self._fail_all_requests(RequestFailed(503, "shutting_down", "the server is shutting down", retry_after=1))
        if self.worker:
            self._ending = self._ending or Exit(ExitReason.STOPPED)
            self.worker.ask_to_leave()
        if self.task:
            await asyncio.gather(self.task, return_exceptions=True)
        if self.state is ModelState.DRAINING:
            self._enter(ModelState.STOPPED)

    # --- requests ------------------------------------------------------------------------------------

    def admits(self) -> bool:
        return self.state is ModelState.READY and not self.stopping

    def coming_up(self) -> bool:
        """Loading, restarting, or not started yet: a request may wait for it (a draining or failed one, not)."""
        return not self.stopping and self.state in (ModelState.LOADING, ModelState.RESTARTING, ModelState.STOPPED)

    def open(self, frame: dict[str, Any], op: str = "generate") -> Request:
        """Admit a request or refuse it at once: nothing waits on a model that cannot serve it.
        `frame`: the fields of its ipc `op` (generate for an LLM, request for the one-answer kinds) but the id."""
        if self.state is not ModelState.READY or self.stopping:
            raise self.unavailable()
        if len(self.running) >= self.model.effective_max_running and len(self.waiting) >= self.model.max_queue:
            raise RequestFailed(429, "overloaded", f"model {self.name} has {len(self.waiting)} requests queued "
                                                   f"(max_queue={self.model.max_queue}); retry later", retry_after=1)
        req = Request(next(self.ids), frame, op)
        req.frame["id"] = req.id
        self.waiting.append(req)
        self._dispatch()
        return req

    def close(self, req: Request) -> None:
        """The caller is done with a request (finished, failed or disconnected): cancel it if it is still live."""
        if req.ended:
            return
        req.ended = True
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.running.pop(req.id, None) is not None and self.worker:
            self.worker.channel.send(ipc.frame("cancel", id=req.id))
        self._dispatch()

    async def events(self, req: Request) -> AsyncIterator[Event]:
        """Yield a request's events until done; a failure is raised as RequestFailed.

        Token events that queued up while the caller was busy (writing to a slow client, say) come out merged,
        so a caller that falls behind catches up with one write instead of many.
        """
        pending: Event | RequestFailed | None = None
        while True:
            item, pending = pending or await req.events.get(), None
            while isinstance(item, Event) and item.op == "tokens" and not req.events.empty():
                following = req.events.get_nowait()
                if isinstance(following, Event) and following.op == "tokens":
                    logprobs = (item.logprobs or []) + (following.logprobs or []) if item.logprobs is not None else None
                    item = Event("tokens", text=item.text + following.text, n=item.n + following.n, logprobs=logprobs)
                else:
                    pending = following
                    break
            if isinstance(item, RequestFailed):
                raise item
            yield item
            if item.op in ("done", "result"):
                return

    def unavailable(self) -> RequestFailed:
        if self.state is ModelState.FAILED:
            return RequestFailed(503, "model_failed", f"model {self.name} is failed: {self.last_error}", hint=self.last_hint)
        if self.stopping:
            return RequestFailed(503, "shutting_down", "the server is shutting down", retry_after=1)
        return RequestFailed(503, "model_unavailable", f"model {self.name} is {self.state.value}; retry shortly",
                             retry_after=max(1.0, self.model.restart.backoff_initial_s))

    def _dispatch(self) -> None:
        while self.waiting and len(self.running) < self.model.effective_max_running and self.worker:
            req = self.waiting.popleft()
            if not self.running:
                self.last_progress = time.monotonic()  # an idle worker's stall clock starts now
            req.dispatched = time.monotonic()
            self.running[req.id] = req
            self.series.queue_time.observe(req.dispatched - req.submitted)
            try:
                self.worker.channel.send(ipc.frame(req.op, **req.frame))
            except (ValueError, ProtocolError) as exc:  # a frame that cannot be sent must not hold a slot forever
                self._finish(req, RequestFailed(500, "internal", f"cannot pass the request to its worker: {exc}"))
        self.publish_queue()
        if self.running or self.waiting:
            self.idle.clear()
        else:
            self.idle.set()

    def publish_queue(self) -> None:
        if not self.reports:
            return
        self.series.requests_running.set(len(self.running))
        self.series.requests_waiting.set(len(self.waiting) + self.awaiting_ready)

    def _on_frame(self, message: dict[str, Any]) -> None:
        """One frame from a ready worker (checked against ipc.OPS by the channel; a batch's frames here)."""
        op = message["op"]
        if op == "batch":  # everything one engine step produced
            for frame in message["frames"]:
                self._on_frame(ipc.check(frame))
            return
        if op == "telemetry":
            self._on_telemetry(message)
            return
        if op == "fatal":  # an internal error after loading: the worker has failed its requests and exits
            self._end_worker(ExitReason.WORKER_ERROR, f"{message['kind']}: {message['message']}", message.get("hint"),
                             kill=False)
            return
        if op not in ("tokens", "done", "result", "error", "progress"):
            raise ProtocolError(f"a ready worker sent {op!r}")
        self.last_progress = time.monotonic()
        req = self.running.get(message.get("id"))
        if req is None:
            return  # a late frame for a request its caller already closed
        if op == "tokens":
            self._on_tokens(req, message)
        elif op == "done":
            self.series.prompt_tokens.inc(message["prompt_tokens"])
            self._finish(req, Event("done", finish_reason=message["finish_reason"],
                                    prompt_tokens=message["prompt_tokens"], completion_tokens=message["completion_tokens"],
                                    reasoning_tokens=message.get("reasoning_tokens")))
        elif op == "result":
            counts = message.get("counts", {})
            for name in RESULT_COUNTERS.intersection(counts):
                getattr(self.series, name).inc(counts[name])
            self._finish(req, Event("result", result=message["result"], prompt_tokens=counts.get("prompt_tokens", 0)))
        elif op == "error":
            self._finish(req, self._request_error(message))

    def _request_error(self, message: dict[str, Any]) -> RequestFailed:
        """A request's error frame. A device out-of-memory next to a kernel-logged GPU hang was the hang (a hung
        kernel also ends in CL_OUT_OF_RESOURCES): the device context is lost, so the worker is ended too."""
        kind, code, hint, retryable = message["kind"], message["code"], message.get("hint"), message["retryable"]
        trouble = self._gpu_trouble() if kind == "device_oom" else None
        if trouble:
            fault = faults.classify_error(message["message"], device=self.model.device,
                                          pci_family=gpu_family(trouble), gpu_reset_seen=True)
            kind, code, hint, retryable = fault.kind, fault.code, fault.hint, fault.retryable
            self._end_worker(ExitReason.DEVICE_LOST, describe_gpu_trouble(trouble), hint)
        status = 400 if kind in CLIENT_ERROR_KINDS else 500
        # A fault that a retry on this model may get past (a scheduler out-of-memory, a lost device the restart
        # replaces) tells the client when to try again.
        retry_after = max(1.0, self.model.restart.backoff_initial_s) if retryable else None
        return RequestFailed(status, kind, message["message"], code, hint, retry_after)

    def _on_tokens(self, req: Request, message: dict[str, Any]) -> None:
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
            self.series.ttft.observe(now - req.submitted)
        elif message["n"]:
            self.series.itl.observe((now - req.last_token) / message["n"])
        req.last_token = now
        self.series.generation_tokens.inc(message["n"])
        req.events.put_nowait(Event("tokens", text=message["text"], n=message["n"], logprobs=message.get("logprobs")))

    def _on_telemetry(self, message: dict[str, Any]) -> None:
        self.series.worker_rss.set(message.get("rss_bytes", 0))
        if "kv_cache_usage_ratio" in message:
            self.series.kv_cache_usage.set(message["kv_cache_usage_ratio"])
        for device, used in (message.get("device_memory_used_bytes") or {}).items():
            self.metrics.device_memory_used.labels(device=device).set(used)
        for device, total in (message.get("device_memory_total_bytes") or {}).items():
            self.metrics.device_memory_total.labels(device=device).set(total)

    def _finish(self, req: Request, outcome: Event | RequestFailed) -> None:
        self.running.pop(req.id, None)
        req.ended = True
        req.events.put_nowait(outcome)
        self._dispatch()

    def _fail_all_requests(self, failure: RequestFailed | None = None) -> None:
        """Fail every running and queued request at once: used when the worker is gone or stuck."""
        if failure is None:
            failure = RequestFailed(503, "worker_crash", f"the worker of model {self.name} died; it is being restarted",
                                    retry_after=max(1.0, self.model.restart.backoff_initial_s))
        for req in list(self.running.values()) + list(self.waiting):
            req.ended = True
            req.events.put_nowait(failure)
        self.running.clear()
        self.waiting.clear()
        self._dispatch()



def gpu_family(event: telemetry.GpuEvent) -> str | None:
    """The family ("DG2", "BMG") of the card a kernel GPU event names, for its known-issue hint."""
    return next((gpu.family for gpu in telemetry.list_gpus() if gpu.bdf == event.bdf), None)


def describe_gpu_trouble(event: telemetry.GpuEvent) -> str:
    return f"GPU {event.kind} on {event.bdf or 'an unnamed card'} in the kernel log: {event.text}"
