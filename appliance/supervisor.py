"""One supervisor per model: spawns its worker, routes requests to it, reaps it, times it out and restarts it.

Every state change goes through ModelSupervisor._enter(); every way a worker can end goes through _worker_ended().
Requests never wait on a worker that cannot answer: when the worker's channel reaches EOF (the kernel closes it
the instant the process dies) or the stall timer fires, every request of the model is failed at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
import itertools
import json
import logging
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

from appliance import faults
from appliance.config import Config, ModelConfig
from appliance.ipc import AsyncChannel
from appliance.metrics import Metrics

log = logging.getLogger("openarc.supervisor")

MONITOR_INTERVAL_S = 0.05
SHUTDOWN_GRACE_S = 3.0
PACKAGE_PARENT = str(Path(__file__).resolve().parent.parent)


class ModelState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPED = "stopped"


class RequestFailed(Exception):
    """A request that ends in an error; the front turns it into an OpenAI error body with `status`."""

    def __init__(self, status: int, kind: str, message: str, code: str | None = None,
                 hint: str | None = None, retry_after: float | None = None):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.code = code or kind
        self.hint, self.retry_after = hint, retry_after


@dataclass
class Event:
    op: str            # tokens | done
    text: str = ""
    n: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass
class Request:
    """A request's life in the front: waiting in the queue, then running in the worker."""

    id: int
    frame: dict[str, Any]
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.monotonic)
    dispatched: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    ended: bool = False


class WorkerProcess:
    """A worker OS process and the front's end of its channel."""

    def __init__(self, proc: asyncio.subprocess.Process, channel: AsyncChannel):
        self.proc = proc
        self.channel = channel
        self.pid = proc.pid

    @classmethod
    async def spawn(cls, spec: dict[str, Any]) -> WorkerProcess:
        front_end, worker_end = socket.socketpair()
        env = dict(os.environ)
        # The worker imports the very code the front runs, installed or from a source tree.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (PACKAGE_PARENT, env.get("PYTHONPATH")) if p)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "appliance.worker", "--fd", str(worker_end.fileno()), "--spec", json.dumps(spec),
                pass_fds=(worker_end.fileno(),), env=env, stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True)  # a terminal's Ctrl-C reaches the front only; the front stops workers
        finally:
            worker_end.close()
        return cls(proc, await AsyncChannel.open(front_end))

    def signal(self, sig: int) -> None:
        try:
            os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    async def end(self) -> int:
        """Ask the worker to leave (it os._exit()s, no destructors), SIGKILL it after a grace period."""
        self.channel.send({"op": "shutdown"})
        try:
            return await asyncio.wait_for(self.proc.wait(), SHUTDOWN_GRACE_S)
        except asyncio.TimeoutError:
            self.signal(signal.SIGKILL)
            return await self.proc.wait()
        finally:
            self.channel.close()


class RestartBudget:
    """Exponential backoff per consecutive crash, reset after `window_s` of service; failed after too many."""

    def __init__(self, policy):
        self.policy = policy
        self.failures: collections.deque[float] = collections.deque()
        self.consecutive = 0

    def record_failure(self, now: float, served_s: float) -> float | None:
        """Returns the backoff before the next start, or None when the budget is used up."""
        if served_s >= self.policy.window_s:
            self.consecutive = 0
        self.consecutive += 1
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.window_s:
            self.failures.popleft()
        if len(self.failures) >= self.policy.max_failures:
            return None
        return min(self.policy.backoff_initial_s * 2 ** (self.consecutive - 1), self.policy.backoff_max_s)


class ModelSupervisor:
    def __init__(self, model: ModelConfig, config: Config, metrics: Metrics, load_gate: asyncio.Semaphore):
        self.model = model
        self.name = model.name
        self.metrics = metrics
        self.load_gate = load_gate
        self.spec = worker_spec(model, config)
        self.state = ModelState.STOPPED
        self.worker: WorkerProcess | None = None
        self.restarts = 0
        self.crashes = 0
        self.last_error: str | None = None
        self.last_hint: str | None = None
        self.budget = RestartBudget(model.restart)
        self.running: dict[int, Request] = {}
        self.waiting: collections.deque[Request] = collections.deque()
        self.ids = itertools.count(1)
        self.last_progress = time.monotonic()
        self.stop_requested = asyncio.Event()
        # why the worker ended, when it was not a crash: "stall", "stop", "load_timeout" (the front killed it) or
        # "fatal" (it reported a load error and left)
        self._ended_by: str | None = None
        self.series = metrics.for_model(self.name)

    # --- state -------------------------------------------------------------------------------------

    def _enter(self, state: ModelState, error: str | None = None, hint: str | None = None) -> None:
        """The one place a model changes state: metrics, log and waiters follow from here."""
        if error is not None:
            self.last_error, self.last_hint = error, hint
        if state is not self.state:
            log.info("model %s: %s -> %s%s", self.name, self.state.value, state.value, f" ({error})" if error else "")
        self.state = state
        self.metrics.set_state(self.name, state.value)

    @property
    def pid(self) -> int | None:
        return self.worker.pid if self.worker else None

    def status(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "pid": self.pid, "device": self.model.device,
                "pipeline": self.model.pipeline, "restarts": self.restarts, "crashes": self.crashes,
                "last_error": self.last_error, "hint": self.last_hint,
                "requests_running": len(self.running), "requests_waiting": len(self.waiting)}

    # --- lifecycle -----------------------------------------------------------------------------------

    async def run(self) -> None:
        """Start, serve, and restart the worker until stopped or failed."""
        first = True
        while not self.stopping:
            self._enter(ModelState.LOADING if first else ModelState.RESTARTING)
            if not first:
                self.restarts += 1
                self.series.worker_restarts.inc()
            first = False
            backoff = await self._run_one_worker()
            if self.stopping:
                break
            if backoff is None:
                self._enter(ModelState.FAILED, f"restart budget used up ({self.model.restart.max_failures} failures "
                                               f"within {self.model.restart.window_s:g}s); last: {self.last_error}",
                            self.last_hint)
                return
            self._enter(ModelState.RESTARTING)  # also after a failed load, which never was READY
            await self._sleep_unless_stopping(backoff)
        self._enter(ModelState.STOPPED)

    async def _run_one_worker(self) -> float | None:
        """One worker's whole life; returns the backoff before the next one, or None if the model failed."""
        started = time.monotonic()
        async with self.load_gate:
            if self.stopping:
                return 0.0
            self.worker = await WorkerProcess.spawn(self.spec)
            ready = await self._await_ready(started)
        served = 0.0
        if ready:
            ready_at = time.monotonic()
            await self._serve()
            served = time.monotonic() - ready_at
        return self._worker_ended(await self.worker.proc.wait(), served)

    async def _await_ready(self, started: float) -> bool:
        try:
            message = await asyncio.wait_for(self.worker.channel.recv(), self.model.load_timeout_s)
        except asyncio.TimeoutError:
            self._ended_by = "load_timeout"
            self.worker.signal(signal.SIGKILL)
            self.last_error = f"model load took longer than load_timeout_s={self.model.load_timeout_s:g}"
            return False
        if message is None or message.get("op") != "ready":
            if message and message.get("op") == "fatal":  # the worker says why it cannot load, then exits
                self._ended_by = "fatal"
                self.last_error, self.last_hint = message["message"], message.get("hint")
            return False
        self.series.model_load.observe(time.monotonic() - started)
        self._enter(ModelState.READY)
        return True

    async def _serve(self) -> None:
        """Route worker frames until the channel ends; the monitor fails everything if the worker stalls."""
        monitor = asyncio.create_task(self._monitor())
        try:
            while (message := await self.worker.channel.recv()) is not None:
                self._on_frame(message)
        finally:
            monitor.cancel()
            # Leave READY before anything awaits, so no request is admitted to a worker that is gone.
            self._enter(ModelState.STOPPED if self.stopping else ModelState.RESTARTING)
            self._fail_all_requests()

    def _worker_ended(self, returncode: int, served_s: float) -> float | None:
        """Account for a worker that is gone, and decide what happens next."""
        ended_by, self._ended_by = self._ended_by, None
        self.worker = None
        if self.stopping and ended_by in (None, "stop"):
            return 0.0
        if ended_by == "stall":
            self.last_error = f"worker made no progress for stall_timeout_s={self.model.stall_timeout_s:g}; killed"
            self.last_hint = None
        elif ended_by is None:  # nobody asked it to go: a crash
            fault = faults.classify_exit(returncode, during_load=served_s == 0.0)
            self.crashes += 1
            self.metrics.worker_crashes.labels(model=self.name, signal=faults.signal_name(returncode)).inc()
            self.last_error, self.last_hint = f"worker exited: {faults.signal_name(returncode)}", fault.hint
            log.error("model %s: worker exited with %s%s", self.name, faults.signal_name(returncode), fault.hint_suffix)
        return self.budget.record_failure(time.monotonic(), served_s)

    async def _monitor(self) -> None:
        """Kill a worker that stops making progress while it has work (what a GPU hang looks like)."""
        while True:
            await asyncio.sleep(MONITOR_INTERVAL_S)
            if self.running and time.monotonic() - self.last_progress > self.model.stall_timeout_s:
                log.error("model %s: no progress for %.1fs, killing worker %s", self.name,
                          self.model.stall_timeout_s, self.pid)
                self._ended_by = "stall"
                self._fail_all_requests(RequestFailed(
                    504, "stall", f"model {self.name} made no progress for {self.model.stall_timeout_s:g}s; "
                                  "its worker was killed and is restarting", retry_after=self.model.restart.backoff_initial_s))
                self.worker.signal(signal.SIGKILL)
                return

    @property
    def stopping(self) -> bool:
        return self.stop_requested.is_set()

    async def _sleep_unless_stopping(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop_requested.wait(), seconds)

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain: let running and queued requests finish up to the timeout, then end the worker."""
        self.stop_requested.set()
        deadline = time.monotonic() + drain_timeout_s
        while (self.running or self.waiting) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        self._fail_all_requests(RequestFailed(503, "shutting_down", "the server is shutting down", retry_after=1))
        if self.worker:
            self._ended_by = "stop"
            await self.worker.end()

    # --- requests ------------------------------------------------------------------------------------

    def open(self, frame: dict[str, Any]) -> Request:
        """Admit a request or refuse it at once: nothing waits on a model that cannot serve it."""
        if self.state is not ModelState.READY or self.stopping:
            raise self._unavailable()
        if len(self.running) >= self.model.effective_max_running and len(self.waiting) >= self.model.max_queue:
            raise RequestFailed(429, "overloaded", f"model {self.name} has {len(self.waiting)} requests queued "
                                                   f"(max_queue={self.model.max_queue}); retry later", retry_after=1)
        req = Request(next(self.ids), frame)
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
            self.worker.channel.send({"op": "cancel", "id": req.id})
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
                    item = Event("tokens", text=item.text + following.text, n=item.n + following.n)
                else:
                    pending = following
                    break
            if isinstance(item, RequestFailed):
                raise item
            yield item
            if item.op == "done":
                return

    def _unavailable(self) -> RequestFailed:
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
                self.worker.channel.send({"op": "generate", **req.frame})
            except ValueError as exc:  # a frame that cannot be encoded must not hold a slot forever
                self._finish(req, RequestFailed(500, "internal", f"cannot pass the request to its worker: {exc}"))
        self.series.requests_running.set(len(self.running))
        self.series.requests_waiting.set(len(self.waiting))

    def _on_frame(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op == "batch":  # everything one engine step produced
            for frame in message["frames"]:
                self._on_frame(frame)
            return
        if op == "telemetry":
            self._on_telemetry(message)
            return
        self.last_progress = time.monotonic()
        req = self.running.get(message.get("id"))
        if req is None:
            return  # a late frame for a request its caller already closed
        if op == "tokens":
            self._on_tokens(req, message)
        elif op == "done":
            self.series.prompt_tokens.inc(message["prompt_tokens"])
            self._finish(req, Event("done", finish_reason=message["finish_reason"],
                                    prompt_tokens=message["prompt_tokens"], completion_tokens=message["completion_tokens"]))
        elif op == "error":
            status = 400 if message["kind"] == "invalid_request" else 500
            self._finish(req, RequestFailed(status, message["kind"], message["message"], message.get("code"),
                                            message.get("hint")))

    def _on_tokens(self, req: Request, message: dict[str, Any]) -> None:
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
            self.series.ttft.observe(now - req.submitted)
        elif message["n"]:
            self.series.itl.observe((now - req.last_token) / message["n"])
        req.last_token = now
        self.series.generation_tokens.inc(message["n"])
        req.events.put_nowait(Event("tokens", text=message["text"], n=message["n"]))

    def _on_telemetry(self, message: dict[str, Any]) -> None:
        self.series.worker_rss.set(message.get("rss_bytes", 0))
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


def worker_spec(model: ModelConfig, config: Config) -> dict[str, Any]:
    """What a worker needs to know, as JSON on its command line."""
    return {"name": model.name, "path": model.path, "device": model.device, "pipeline": model.pipeline,
            "properties": model.ov_properties(config.ov_cache_dir()), "scheduler_config": model.scheduler_config,
            "max_context": model.max_context, "default_max_tokens": model.default_max_tokens,
            "log_level": config.server.log_level}


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics):
        self.config = config
        self.metrics = metrics
        self.load_gate = asyncio.Semaphore(config.server.load_concurrency)
        self.models: dict[str, ModelSupervisor] = {}
        self.tasks: dict[str, asyncio.Task] = {}

    def start(self) -> None:
        for model in self.config.models:
            self._start_model(model)

    def _start_model(self, model: ModelConfig) -> None:
        sup = ModelSupervisor(model, self.config, self.metrics, self.load_gate)
        self.models[model.name] = sup
        self.tasks[model.name] = asyncio.create_task(sup.run(), name=f"model:{model.name}")

    async def _stop_model(self, name: str, drain_timeout_s: float) -> None:
        # The model stays listed while it drains: its callers get 503 "shutting down", not 404.
        await self.models[name].stop(drain_timeout_s)
        await asyncio.gather(self.tasks[name], return_exceptions=True)
        del self.models[name], self.tasks[name]

    async def apply(self, config: Config) -> list[str]:
        """Bring the running models in line with a new config (SIGHUP): stop removed ones, restart changed ones
        after draining them, start added ones, and leave every unchanged model and its worker alone."""
        wanted = {m.name: m for m in config.models}
        changed = [name for name, sup in self.models.items()
                   if name not in wanted or wanted[name] != sup.model or worker_spec(wanted[name], config) != sup.spec]
        await asyncio.gather(*(self._stop_model(name, config.server.drain_timeout_s) for name in changed))
        self.config = config
        started = [model for name, model in wanted.items() if name not in self.models]
        for model in started:
            self._start_model(model)
        return sorted(set(changed) | {model.name for model in started})

    def get(self, name: str) -> ModelSupervisor | None:
        return self.models.get(name)

    def all_ready(self) -> bool:
        return all(m.state is ModelState.READY for m in self.models.values())

    def all_failed(self) -> bool:
        return bool(self.models) and all(m.state is ModelState.FAILED for m in self.models.values())

    def settled(self) -> bool:
        """Every model has finished its first load, one way or the other."""
        return all(m.state in (ModelState.READY, ModelState.FAILED) for m in self.models.values())

    def healthy(self) -> bool:
        """No model's supervising task has died of a bug (a failed model is a state, not a dead task)."""
        return all(not t.done() or t.cancelled() or t.exception() is None for t in self.tasks.values())

    async def stop(self, drain_timeout_s: float) -> None:
        await asyncio.gather(*(self._stop_model(name, drain_timeout_s) for name in list(self.models)))
