"""All models of this process, the front's only door to them: starting and stopping them, applying a reloaded
config model by model (a changed model is replaced side by side or restarted), waiting for a model that is
coming up, and carrying out the residency plan (appliance.front.residency): loading models on demand, evicting idle
ones to make room, unloading those idle for their idle_unload_s. Each model's own life is its ModelSupervisor's
(appliance.front.model_supervisor): its worker's life (appliance.front.worker_life) and its requests
(appliance.front.routing).

Residency, mechanically: an unloaded model is a ModelSupervisor in state `unloaded` that was never started; loading it
is starting it. Unloading swaps a fresh unloaded supervisor in under the model's name (so new requests wait for the
next load instead of being refused) and drains the old one beside it; the old one holds its slot until its worker
is gone. The residency plan is made and carried out by one task (`_place`), woken by every change, so two decisions
never race.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from appliance.host import telemetry
from appliance.config import Config, ModelConfig, budget_device, worker_spec
from appliance.front import residency
from appliance.front.lifecycle import Changes, ModelState
from appliance.front.request import RequestFailed
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor

log = logging.getLogger("openarc.supervisor")


def _count_waiter(counted: ModelSupervisor | None, current: ModelSupervisor | None) -> ModelSupervisor | None:
    """Move one waiting request's count from the supervisor it was counted on to `current`."""
    if counted is not current:
        for sup, step in ((counted, -1), (current, 1)):
            if sup is not None:
                sup.router.awaiting_ready += step
                sup.router.publish_queue()
    return current


# A request handed its model may still be reading its upload, decoding its audio or fetching its images before it
# opens its request on the model: for this long after a hand-out the model counts as busy, so it is not evicted under
# that request (its open() would find it draining).
HANDOFF_GRACE_S = 5.0
# Models that a request, an API call or a reload loaded (the others loaded with the server): they do not hold /ready.
ON_DEMAND_REASONS = ("demand", "api")


@dataclass
class Usage:
    """What the residency plan knows of a model across its loads (a ModelSupervisor lives for one load)."""

    last_used: float = 0.0               # monotonic: the model last had a request, or finished loading
    handed_at: float = -HANDOFF_GRACE_S  # monotonic: a request was last handed this model (ready_model)
    measured: int | None = None          # its footprint measured at its last load (worker RSS, or VRAM on a GPU)
    load_reason: str = "start"           # why its current load happened (openarc_model_loads_total's reason)
    refusal: RequestFailed | None = None  # a failed on-demand load, or a model too large to load: answered at once
    retry_at: float = 0.0                # ... until then (the restart policy's backoff)


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: telemetry.KernelLog | None = None):
        self.config = config
        self.metrics = metrics
        self.kernel_log = kernel_log
        self.load_gate = asyncio.Semaphore(config.server.load_concurrency)
        self.changes = Changes()  # some model changed state
        self.replan = asyncio.Event()  # something the residency plan looks at changed
        self.usage: dict[str, Usage] = {}
        self.wants: dict[str, dict[object, tuple[float, str]]] = {}  # model -> its waiters' (arrival, load reason)
        self.leaving: set[ModelSupervisor] = set()  # unloaded, still draining: they hold their slot until gone
        self.placer: asyncio.Task | None = None
        self.chores: set[asyncio.Task] = set()  # the placer's loads being watched and unloads being drained
        # Every model exists from here on, before start() and before the front listens: a request that arrives
        # first (under socket activation, one that waited in the backlog) finds it coming up and waits, not a 404.
        self.models: dict[str, ModelSupervisor] = {model.name: self._new_model(model, config) for model in config.models}
        for sup in self.models.values():
            if sup.model.load == "on_demand":
                sup.life.lifecycle.enter(ModelState.UNLOADED)
        self.replacements: set[ModelSupervisor] = set()  # loading beside the model they will replace

    def start(self) -> None:
        for sup in self.models.values():
            if sup.state is not ModelState.UNLOADED:
                self._begin_load(sup, "start")
        self.placer = asyncio.create_task(self._place(), name="residency")

    def _new_model(self, model: ModelConfig, config: Config) -> ModelSupervisor:
        self.usage.setdefault(model.name, Usage())
        return ModelSupervisor(model, config, self.metrics, self.load_gate, self._changed, self.kernel_log)

    def _changed(self) -> None:
        self.changes.notify()
        self.replan.set()

    def _start_model(self, model: ModelConfig) -> None:
        sup = self._new_model(model, self.config)
        self.models[model.name] = sup
        if model.load == "on_demand":
            sup.life.lifecycle.enter(ModelState.UNLOADED)
        else:
            self._begin_load(sup, "reload")

    async def _stop_model(self, name: str, drain_timeout_s: float) -> None:
        # The model stays listed while it drains: its callers get 503 "shutting down", not 404.
        await self.models[name].stop(drain_timeout_s)
        del self.models[name]

    async def apply(self, config: Config) -> list[str]:
        """Bring the running models in line with a new config (SIGHUP): start added ones, replace changed ones
        (_replace) and failed ones (a reload is how an operator retries a model whose restart budget ran out,
        after fixing what failed it), stop removed ones after draining them, and leave every other model and its
        worker alone."""
        wanted = {m.name: m for m in config.models}
        removed = [name for name in self.models if name not in wanted]
        changed = [name for name, sup in self.models.items() if name in wanted and
                   (wanted[name] != sup.model or worker_spec(wanted[name], config) != sup.spec
                    or sup.state is ModelState.FAILED)]
        added = [model for name, model in wanted.items() if name not in self.models]
        for name in changed:  # new settings: a load that failed or could never fit may work now
            self.usage[name].refusal = None
        self.config = config
        for model in added:
            self._start_model(model)
        drain_s = config.server.drain_timeout_s
        await asyncio.gather(*(self._stop_model(name, drain_s) for name in removed),
                             *(self._replace(wanted[name], config) for name in changed))
        return sorted([*removed, *changed, *(model.name for model in added)])

    async def _replace(self, model: ModelConfig, config: Config) -> None:
        """Swap a changed model's supervisor for a new one without its name ever answering 404.

        side_by_side: the new worker loads while the old one serves; the switch comes when it is ready, then the
        old one drains (a new worker that cannot load is dropped and the old one goes on serving). restart: the
        old one drains first and requests wait for the new one (ready_wait_s)."""
        old = self.models[model.name]
        new = self._new_model(model, config)
        new.reports = False
        self.metrics.set_state(model.name, old.state.value)  # creating the new one's series reset it
        if old.state is ModelState.UNLOADED:  # nothing loaded to replace: the new settings apply at its next load
            new.life.lifecycle.enter(ModelState.UNLOADED)
            self._switch(old, new)
            await old.stop(0)
            return
        self.metrics.model_loads.labels(model=model.name, reason="reload").inc()
        self.usage[model.name].load_reason = "reload"
        if model.reload == "restart":
            self.models[model.name] = new  # requests now wait for the new one while the old one drains
            self.changes.notify()
            await old.stop(config.server.drain_timeout_s)
            self._switch(old, new)
            new.start()
            return
        self.replacements.add(new)
        new.start()
        try:
            await new.life.lifecycle.wait_for({ModelState.READY, ModelState.FAILED, ModelState.DRAINING}, None)
        finally:
            self.replacements.discard(new)
        if new.life.stopping:  # the server is shutting down
            return
        if new.state is not ModelState.READY:
            log.error("model %s: its new settings do not load (%s); still serving the previous ones",
                      model.name, new.life.last_error)
            await new.stop(0)
            return
        self._switch(old, new)
        await old.stop(config.server.drain_timeout_s)

    def _switch(self, old: ModelSupervisor, new: ModelSupervisor) -> None:
        """From now on `new` serves the name: requests, gauges, and waiters (woken to look again)."""
        old.reports, new.reports = False, True
        self.models[new.name] = new
        self.metrics.set_state(new.name, new.state.value)
        new.router.publish_queue()
        log.info("model %s: switched to its new worker%s", new.name, f" {new.life.pid}" if new.life.pid else "")
        self.changes.notify()

    def get(self, name: str) -> ModelSupervisor | None:
        return self.models.get(name)

    async def ready_model(self, name: str, reason: str = "demand") -> ModelSupervisor | None:
        """The model's supervisor once it can take a request; None when there is no such model.

        A model that is loading, restarting or being replaced is waited for up to its ready_wait_s (counted in
        openarc_requests_waiting), then its 503 is raised; a failed or draining one raises at once. An unloaded one
        is wanted (the residency plan loads it, `reason` says why) and waited for the same way. A client that hangs
        up cancels the wait (the front runs with aiohttp's handler cancellation)."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        waited_from = loop.time()
        counted: ModelSupervisor | None = None
        waiter = object()
        try:
            while (sup := self.models.get(name)) is not None:
                if sup.life.admits():
                    self.usage[name].last_used = self.usage[name].handed_at = time.monotonic()
                    return sup
                if deadline is None:
                    deadline = loop.time() + sup.model.ready_wait_s
                remaining = deadline - loop.time()
                if sup.state is ModelState.UNLOADED:
                    self._want(name, waiter, reason)
                    if remaining <= 0:
                        raise self._unloaded_refusal(name, sup)
                elif remaining <= 0 or not sup.life.coming_up():
                    raise sup.life.unavailable()
                counted = _count_waiter(counted, sup)  # the model's current supervisor, across a replacement
                await self.changes.wait(remaining)
            return None
        finally:
            _count_waiter(counted, None)
            self._unwant(name, waiter)
            if deadline is not None:  # it had to wait
                self.metrics.model_load_wait.labels(model=name).observe(loop.time() - waited_from)

    def _want(self, name: str, waiter: object, reason: str) -> None:
        """A request waits for this unloaded model: answered at once if its last load failed lately or it can never
        fit (RequestFailed), else counted for the residency plan."""
        usage = self.usage[name]
        if self._refused(name):
            retry = usage.refusal.retry_after and max(1.0, usage.retry_at - time.monotonic())
            raise RequestFailed(usage.refusal.status, usage.refusal.kind, usage.refusal.message, usage.refusal.code,
                                usage.refusal.hint, retry)
        wants = self.wants.setdefault(name, {})
        if waiter not in wants:
            wants[waiter] = (time.monotonic(), reason)
            self.replan.set()

    def _refused(self, name: str) -> bool:
        """Its last load on demand failed within the backoff, or it can never fit: no load now, whoever waits."""
        usage = self.usage[name]
        return usage.refusal is not None and time.monotonic() < usage.retry_at

    def _unwant(self, name: str, waiter: object) -> None:
        wants = self.wants.get(name, {})
        if wants.pop(waiter, None) is not None and not wants:
            del self.wants[name]
            self.replan.set()

    def _unloaded_refusal(self, name: str, sup: ModelSupervisor) -> RequestFailed:
        """The 503 of a request that waited ready_wait_s for an unloaded model: what held its load back."""
        views = self._views(time.monotonic())
        head = next(v for v in views if v.name == name)
        return RequestFailed(503, "model_unavailable", f"model {name} is unloaded and waited "
                             f"{sup.model.ready_wait_s:g}s for room to load: " + residency.why_waiting(head, views, self.limits()),
                             retry_after=max(1.0, sup.model.restart.backoff_initial_s))

    # --- residency: the plan (appliance.front.residency) carried out ------------------------------------------

    def limits(self) -> residency.Limits:
        return residency.Limits(self.config.server.max_loaded, self.config.server.memory_budget_bytes)

    def _views(self, now: float) -> list[residency.ModelView]:
        views = []
        for name, sup in self.models.items():
            usage = self.usage[name]
            busy = len(sup.router.running) + len(sup.router.waiting) + sup.router.awaiting_ready
            busy += now - usage.handed_at < HANDOFF_GRACE_S  # a request about to open on it
            if busy:
                usage.last_used = now  # in use now; once idle, the time its last request ended
            elif sup.state is ModelState.READY:
                usage.last_used = max(usage.last_used, min(sup.router.last_progress, now))
            # start() was called and its task has not run yet: it is loading, not wanted again
            state = ModelState.LOADING if sup.state is ModelState.UNLOADED and sup.life.task else sup.state
            # Waiters still in line for a model just refused are about to be answered: they do not want a load.
            wants = None if self._refused(name) else self.wants.get(name)
            views.append(residency.ModelView(
                name, state, budget_device(sup.model.device), self.footprint(name)[0], busy, usage.last_used,
                min(since for since, _ in wants.values()) if wants else None, sup.model.load == "at_start",
                sup.model.idle_unload_s))
        views += [residency.ModelView(f"{sup.name} (leaving)", ModelState.DRAINING, budget_device(sup.model.device),
                                      self.footprint(sup.name)[0]) for sup in self.leaving]
        return views

    def footprint(self, name: str) -> tuple[int | None, str]:
        """The model's memory on its device and where the figure comes from: declared, measured or unknown."""
        declared = self.models[name].model.memory_bytes if name in self.models else None
        if declared is not None:
            return declared, "declared"
        measured = self.usage[name].measured
        return (measured, "measured") if measured is not None else (None, "unknown")

    async def _place(self) -> None:
        """Make the residency plan and carry it out, again whenever something it looks at changes."""
        while True:
            self.replan.clear()
            now = time.monotonic()
            try:
                plan = residency.plan(self._views(now), self.limits(), now)
                self._carry_out(plan)
            except Exception:  # a bug: loud in the log, and no loads or unloads until the next change
                log.exception("residency: planning failed")
                plan = residency.Plan(recheck_s=1.0)
            await self._until_replan(plan)

    def _chore(self, coro, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self.chores.add(task)
        task.add_done_callback(self.chores.discard)

    def _carry_out(self, plan: residency.Plan) -> None:
        for name, reason in plan.impossible.items():
            self._refuse(name, RequestFailed(503, "model_unavailable", f"model {name} cannot load here: {reason}"),
                         retry_s=float("inf"))
        for names, reason in ((plan.idle, "idle"), (plan.evict, "evicted")):
            for name in names:
                old = self._begin_unload(name, reason)  # at once: the next plan sees it leaving
                if old is not None:
                    self._chore(self._drain_out(old), f"unload:{name}")
        if plan.load:
            wants = self.wants.get(plan.load) or {None: (0.0, "demand")}
            self._begin_load(self.models[plan.load], min(wants.values())[1])

    async def _until_replan(self, plan: residency.Plan) -> None:
        """Until something the plan looks at changes: a state, a want (replan), an idle deadline (recheck_s), or a
        busy model going idle when that is what the plan waits for (a load that needs room, an idle timer)."""
        watch = [self.replan.wait()]
        if plan.waits_for_room or any(sup.model.idle_unload_s for sup in self.models.values()):
            watch += [sup.router.idle.wait() for sup in self.models.values()
                      if sup.state is ModelState.READY and not sup.router.idle.is_set()]
        # A model whose hand-out grace ends may become evictable or start its idle countdown then.
        now = time.monotonic()
        graces = [u.handed_at + HANDOFF_GRACE_S - now for u in self.usage.values() if u.handed_at + HANDOFF_GRACE_S > now]
        timeout = min([t for t in (plan.recheck_s, *graces) if t is not None], default=None)
        tasks = [asyncio.ensure_future(w) for w in watch]
        try:
            await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()

    def _begin_load(self, sup: ModelSupervisor, reason: str) -> None:
        usage = self.usage[sup.name]
        usage.load_reason, usage.refusal = reason, None
        self.metrics.model_loads.labels(model=sup.name, reason=reason).inc()
        if reason != "start":
            waiting = len(self.wants.get(sup.name, ()))
            log.info("model %s: loading (%s%s)", sup.name, reason, f", {waiting} requests waiting" if waiting else "")
        sup.start()
        self._chore(self._loaded(sup), f"load:{sup.name}")

    async def _loaded(self, sup: ModelSupervisor) -> None:
        """After a load: measure its footprint; an on-demand load that failed answers its waiters at once and
        leaves the model unloaded until the restart policy's backoff has passed (no loop of retries nobody asked
        for); a failed start keeps today's behaviour (restarts, then failed)."""
        await sup.life.lifecycle.wait_for({ModelState.READY, ModelState.RESTARTING, ModelState.FAILED,
                                      ModelState.DRAINING, ModelState.STOPPED}, None)
        usage = self.usage[sup.name]
        if sup.state is ModelState.READY:
            usage.last_used = time.monotonic()
            usage.measured = measure_footprint(sup) or usage.measured
            return
        if sup.state is not ModelState.RESTARTING or usage.load_reason not in ON_DEMAND_REASONS or sup.life.stopping:
            return
        backoff = sup.life.last_backoff_s or sup.model.restart.backoff_initial_s
        self._refuse(sup.name, RequestFailed(
            503, "model_unavailable", f"model {sup.name} failed to load: {sup.life.last_error}; the next load is tried "
            f"after {backoff:g}s", hint=sup.life.last_hint, retry_after=max(1.0, backoff)), retry_s=backoff)
        self._swap_out(sup)
        await sup.stop(0)

    def _refuse(self, name: str, failure: RequestFailed, retry_s: float) -> None:
        usage = self.usage[name]
        usage.refusal, usage.retry_at = failure, time.monotonic() + retry_s
        self._changed()  # its waiters answer now

    def _swap_out(self, old: ModelSupervisor) -> ModelSupervisor:
        """Put a fresh unloaded supervisor under old's name, carrying what outlives one load (its restart budget
        and counts, its last error): requests from now on wait for the next load, not for old."""
        new = self._new_model(old.model, self.config)
        if old.state is not ModelState.FAILED:  # unloading a failed model is a manual reset
            new.life.budget = old.life.budget
            new.life.last_error, new.life.last_hint = old.life.last_error, old.life.last_hint
            new.life.last_exit = old.life.last_exit
        new.life.restarts, new.life.crashes = old.life.restarts, old.life.crashes
        new.life.last_backoff_s = old.life.last_backoff_s
        new.series.draft = old.series.draft  # /openarc/status's draft totals count since the model was configured
        new.life.load_seconds = old.life.load_seconds
        old.reports = False
        new.life.lifecycle.enter(ModelState.UNLOADED)
        self.models[old.name] = new
        return new

    async def unload(self, name: str, reason: str) -> bool:
        """Drain the model, then stop its worker; it stays unloaded until a request or a load. False: no such model."""
        if name not in self.models:
            return False
        old = self._begin_unload(name, reason)
        if old is not None:
            await self._drain_out(old)
        return True

    def _begin_unload(self, name: str, reason: str) -> ModelSupervisor | None:
        """Put the model's next (unloaded) supervisor in place and return the one to drain; None: nothing loaded."""
        old = self.models[name]
        if old.state is ModelState.UNLOADED or old.life.stopping:
            return None
        self.metrics.model_unloads.labels(model=name, reason=reason).inc()
        idle_s = time.monotonic() - self.usage[name].last_used
        why = {"idle": f"idle for idle_unload_s={old.model.idle_unload_s:g}s", "evicted": "evicted to make room for "
               "another model", "api": "asked through the API"}[reason]
        log.info("model %s: unloading (%s; last used %.1fs ago, %d requests to finish)", name, why, idle_s,
                 len(old.router.running) + len(old.router.waiting))
        self._swap_out(old)
        self.leaving.add(old)
        self._changed()
        return old

    async def _drain_out(self, old: ModelSupervisor) -> None:
        try:
            await old.stop(self.config.server.drain_timeout_s)
        finally:
            self.leaving.discard(old)
            self._changed()
        current = self.models.get(old.name)
        if current is not None and current.state is ModelState.UNLOADED:
            self.metrics.worker_rss.labels(model=old.name).set(0)  # its memory went with its worker
        log.info("model %s: unloaded", old.name)

    def residency_status(self, name: str) -> dict:
        """The /openarc/status fields of models on demand."""
        sup, usage = self.models[name], self.usage[name]
        size, source = self.footprint(name)
        last_used = None if not usage.last_used else round(time.time() - (time.monotonic() - usage.last_used), 3)
        return {"load": sup.model.load, "idle_unload_s": sup.model.idle_unload_s,
                "memory": {"bytes": size, "source": source}, "last_used": last_used,
                "loaded_by": usage.load_reason if sup.state not in (ModelState.UNLOADED, ModelState.STOPPED) else None}

    def residency_summary(self) -> dict:
        occupied = [m.name for m in self.models.values() if m.state in residency.OCCUPYING]
        return {"max_loaded": self.config.server.max_loaded, "memory_budget": self.config.server.memory_budget,
                "loaded": len(occupied) + len(self.leaving)}

    def _serves(self, sup: ModelSupervisor, settled: tuple[ModelState, ...]) -> bool:
        """Whether the model is where /ready (or the start) wants it: `settled`, unloaded, or loaded on demand (a
        request's load or its failure is that request's business, not the whole server's)."""
        return (sup.state in settled or sup.state is ModelState.UNLOADED
                or self.usage[sup.name].load_reason in ON_DEMAND_REASONS)

    def all_ready(self) -> bool:
        return all(self._serves(m, (ModelState.READY,)) for m in self.models.values())

    def all_failed(self) -> bool:
        return bool(self.models) and all(m.state is ModelState.FAILED for m in self.models.values())

    def settled(self) -> bool:
        """Every model has finished its first load, one way or the other (an on-demand one has none to finish)."""
        return all(self._serves(m, (ModelState.READY, ModelState.FAILED)) for m in self.models.values())

    def healthy(self) -> bool:
        """No model's supervising task has died of a bug (a failed model is a state, not a dead task)."""
        tasks = [m.life.task for m in (*self.models.values(), *self.leaving) if m.life.task] + [t for t in [self.placer] if t]
        return all(not t.done() or t.cancelled() or t.exception() is None for t in tasks)

    async def stop(self, drain_timeout_s: float) -> None:
        if self.placer:
            self.placer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.placer
        await asyncio.gather(*(self._stop_model(name, drain_timeout_s) for name in list(self.models)),
                             *(sup.stop(0) for sup in list(self.replacements)),
                             *(sup.stop(drain_timeout_s) for sup in list(self.leaving)))
        for task in list(self.chores):
            task.cancel()


def measure_footprint(sup: ModelSupervisor) -> int | None:
    """A loaded model's footprint on its device: the VRAM its worker holds on a GPU (DRM fdinfo), its RSS on the
    CPU; None when it cannot be read (a GPU without fdinfo memory keys)."""
    if sup.life.pid is None:
        return None
    if budget_device(sup.model.device).startswith("GPU"):
        return sum(telemetry.device_memory_used([sup.life.pid]).values()) or None
    return telemetry.process_rss_bytes(sup.life.pid) or None
