"""Models on demand carried out: the bookkeeping the residency plan (appliance.front.residency) is made from, and
the one task that makes the plan and carries it out. The Supervisor (appliance.front.supervisor) calls it.

What it keeps, per model across its loads (a ModelSupervisor lives for one load): who wants it loaded (requests
waiting in Supervisor.ready_model, a load that must go on without its requester: a request that did not wait, a
`reload: restart`), when it was last used, its measured footprint, why its current load happened, and a failed
load's refusal until its backoff has passed; and the models leaving (unloaded, still draining: each holds its slot
until its worker is gone).

What it owns: the placer task (`_place`), woken by every change, so two decisions never race; and the chores it
starts, each load being watched and each drain. A drain (an unload through the API, an eviction, an idle unload, the
old worker of a restart reload) is a chore of its own, never its caller's task: it finishes whatever happens to the
caller (a client that hangs up on POST /openarc/models/NAME/unload), and Supervisor.stop() awaits it.

Nothing here is decided from a figure once and kept: a model that cannot fit is found again by every plan from the
limits and footprints of that moment (a reload that raises the budget, or declares the model's memory, lets it load).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config.devices import budget_device
from appliance.front import residency
from appliance.front.lifecycle import ModelState
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.request import RequestFailed
from appliance.host import device_memory, telemetry

if TYPE_CHECKING:
    from appliance.front.supervisor import Supervisor

log = logging.getLogger("openarc.supervisor")

# A request handed its model opens its request on it in the same step, or reserves a place in its queue first (an
# upload being read): the reserved place counts as busy. This grace covers a hand-out that does neither yet: until
# its request opens or reserves (RequestRouter.handouts), at most this long, the model counts as busy, so it is not
# evicted under that request. A request that opened leaves nothing behind it: the model is idle when it ends.
HANDOFF_GRACE_S = 5.0
# The key of a want no request waits on: a load that goes on without its requester (ready_wait_s ran out, or is 0;
# a restart reload). It stands until the model's load begins or is refused.
STANDING = "standing"


@dataclass
class Usage:
    """What the residency plan knows of a model across its loads (a ModelSupervisor lives for one load)."""

    last_used: float = 0.0               # monotonic: the model last went idle, was handed a request, or loaded
    measured: int | None = None          # its footprint measured at its last load (worker RSS, or VRAM on a GPU)
    load_reason: str = "start"           # why its current load happened (openarc_model_loads_total's reason)
    refusal: RequestFailed | None = None  # its last load failed: answered at once...
    retry_at: float = 0.0                # ... until then (the restart policy's backoff)

    def refused(self, now: float) -> bool:
        return self.refusal is not None and now < self.retry_at


class Placement:
    """Which models are resident, kept and carried out for the Supervisor."""

    def __init__(self, owner: Supervisor):
        self.owner = owner  # its models, config, metrics and new_model()
        self.usage: dict[str, Usage] = {}
        self.wants: dict[str, dict[object, tuple[float, str]]] = {}  # model -> its waiters' (arrival, load reason)
        self.leaving: set[ModelSupervisor] = set()  # unloaded, still draining: they hold their slot until gone
        self.impossible: dict[str, str] = {}  # the latest plan's: wanted models that cannot fit now, and why
        self.replan = asyncio.Event()  # something the residency plan looks at changed
        self.placer: asyncio.Task | None = None
        self.chores: set[asyncio.Task] = set()  # loads being watched
        self.drains: set[asyncio.Task] = set()  # unloads being drained: awaited by stop(), never cancelled

    @property
    def models(self) -> dict[str, ModelSupervisor]:
        return self.owner.models

    def track(self, sup: ModelSupervisor) -> None:
        """A new supervisor of the model: its usage outlives it, and its going idle is news for the plan."""
        self.usage.setdefault(sup.name, Usage())
        sup.router.on_idle = lambda: self._went_idle(sup.name)

    def _went_idle(self, name: str) -> None:
        self.usage[name].last_used = time.monotonic()
        self.replan.set()

    def handed(self, sup: ModelSupervisor) -> None:
        now = self.usage[sup.name].last_used = time.monotonic()
        sup.router.hand_out(now, HANDOFF_GRACE_S)

    def start(self) -> None:
        self.placer = asyncio.create_task(self._place(), name="residency")

    # --- wants ---------------------------------------------------------------------------------------------

    def want(self, name: str, waiter: object, reason: str) -> None:
        """A request waits for this unloaded model: answered at once (RequestFailed) if its last load failed lately
        or it cannot fit under the limits now, else counted for the residency plan."""
        refusal = self.refusal(name)
        if refusal is not None:
            raise refusal
        wants = self.wants.setdefault(name, {})
        if waiter not in wants:
            wants[waiter] = (time.monotonic(), reason)
            self.replan.set()

    def unwant(self, name: str, waiter: object) -> None:
        wants = self.wants.get(name, {})
        if wants.pop(waiter, None) is not None:
            if not wants:
                del self.wants[name]
            self.replan.set()

    def refusal(self, name: str) -> RequestFailed | None:
        """Why a request for this unloaded model is answered now instead of waiting for its load, if it is."""
        usage, now = self.usage[name], time.monotonic()
        if usage.refused(now):
            failure = usage.refusal
            return RequestFailed(failure.status, failure.kind, failure.message, failure.code, failure.hint,
                                 failure.retry_after and max(1.0, usage.retry_at - now))
        if name in self.impossible:
            source = self.footprint(name)[1]
            advice = ("raise the budget, or declare models[].memory if the measure was wrong, and reload"
                      if source == "measured" else "raise the budget and reload")
            return RequestFailed(503, "model_unavailable", f"model {name} cannot load here: {self.impossible[name]} "
                                 f"({source} footprint; {advice})")
        return None

    # --- the plan, made and carried out ----------------------------------------------------------------------

    def limits(self) -> residency.Limits:
        return residency.Limits(self.owner.config.server.max_loaded, self.owner.config.server.memory_budget_bytes)

    def views(self, now: float) -> list[residency.ModelView]:
        """Every model as the policy sees it now (reads only: a status or a 503's text may call it any time)."""
        views = []
        for name, sup in self.models.items():
            usage = self.usage[name]
            busy = self.busy(sup, now)
            # start() was called and its task has not run yet: it is loading, not wanted again
            state = ModelState.LOADING if sup.state is ModelState.UNLOADED and sup.life.task else sup.state
            # Waiters still in line for a model just refused are about to be answered: they do not want a load.
            wants = None if usage.refused(now) else self.wants.get(name)
            views.append(residency.ModelView(
                name, state, budget_device(sup.model.device), self.footprint(name)[0], busy,
                now if busy else usage.last_used, min(since for since, _ in wants.values()) if wants else None,
                sup.model.load == "at_start", sup.model.idle_unload_s))
        views += [residency.ModelView(f"{sup.name} (leaving)", ModelState.DRAINING, budget_device(sup.model.device),
                                      self.footprint(sup.name)[0]) for sup in self.leaving]
        return views

    def busy(self, sup: ModelSupervisor, now: float) -> int:
        """Requests running, queued, reserved (an upload being read holds its place) or waiting for the model; a
        request handed it that has not opened yet counts one, for at most HANDOFF_GRACE_S."""
        router = sup.router
        busy = len(router.running) + len(router.waiting) + router.reserved + router.awaiting_ready
        return busy + sum(now - at < HANDOFF_GRACE_S for at in router.handouts.values())

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
                plan = residency.plan(self.views(now), self.limits(), now)
                self._carry_out(plan)
            except Exception:  # a bug: loud in the log, and no loads or unloads until the next change
                log.exception("residency: planning failed")
                plan = residency.Plan(recheck_s=1.0)
            await self._until_replan(plan)

    def _carry_out(self, plan: residency.Plan) -> None:
        if plan.impossible != self.impossible:
            self.impossible = dict(plan.impossible)
            self.owner.changes.notify()  # their waiters answer now
        for name in plan.impossible:  # a standing want these cannot load
            self.unwant(name, STANDING)
        for names, reason in ((plan.idle, "idle"), (plan.evict, "evicted")):
            for name in names:
                self.begin_unload(name, reason)  # at once: the next plan sees it leaving
        if plan.load:
            reason = min((self.wants.get(plan.load) or {None: (0.0, "demand")}).values())[1]
            self.begin_load(self.models[plan.load], reason)

    async def _until_replan(self, plan: residency.Plan) -> None:
        """Until something the plan looks at changes (replan: a state, a want, a waiter counted, a model gone idle,
        a limit), or an idle deadline (recheck_s) or a hand-out's grace ends."""
        now = time.monotonic()
        graces = [at + HANDOFF_GRACE_S - now for sup in self.models.values() for at in sup.router.handouts.values()
                  if at + HANDOFF_GRACE_S > now]
        timeout = min([t for t in (plan.recheck_s, *graces) if t is not None], default=None)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.replan.wait(), timeout)

    def _chore(self, coro, name: str, into: set[asyncio.Task]) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        into.add(task)
        task.add_done_callback(into.discard)
        return task

    # --- loads -----------------------------------------------------------------------------------------------

    def begin_load(self, sup: ModelSupervisor, reason: str) -> None:
        usage = self.usage[sup.name]
        usage.load_reason, usage.refusal = reason, None
        self.unwant(sup.name, STANDING)  # the load it stood for begins
        self.owner.metrics.model_loads.labels(model=sup.name, reason=reason).inc()
        if reason != "start":
            waiting = len(self.wants.get(sup.name, ()))
            log.info("model %s: loading (%s%s)", sup.name, reason, f", {waiting} requests waiting" if waiting else "")
        sup.start()
        self._chore(self._loaded(sup), f"load:{sup.name}", self.chores)

    async def _loaded(self, sup: ModelSupervisor) -> None:
        """After a load: measure its footprint; an on-demand load that failed answers its waiters at once and
        leaves the model unloaded until the restart policy's backoff has passed (no loop of retries nobody asked
        for); a failed start of a load: at_start model keeps today's behaviour (restarts, then failed)."""
        await sup.life.lifecycle.wait_for({ModelState.READY, ModelState.RESTARTING, ModelState.FAILED,
                                           ModelState.DRAINING, ModelState.STOPPED}, None)
        usage = self.usage[sup.name]
        if sup.state is ModelState.READY:
            usage.last_used = time.monotonic()
            usage.measured = measure_footprint(sup) or usage.measured
            return
        on_demand = sup.model.load == "on_demand" or usage.load_reason in ("demand", "api")
        if sup.state is not ModelState.RESTARTING or not on_demand or sup.life.stopping:
            return
        if self.models.get(sup.name) is not sup:  # a reload replaced it meanwhile: its successor has its own settings
            return
        backoff = sup.life.last_backoff_s or sup.model.restart.backoff_initial_s
        self._refuse(sup.name, RequestFailed(
            503, "model_unavailable", f"model {sup.name} failed to load: {sup.life.last_error}; the next load is tried "
            f"after {backoff:g}s", hint=sup.life.last_hint, retry_after=max(1.0, backoff)), retry_s=backoff)
        self.swap_out(sup)
        await sup.stop(0)

    def _refuse(self, name: str, failure: RequestFailed, retry_s: float) -> None:
        usage = self.usage[name]
        usage.refusal, usage.retry_at = failure, time.monotonic() + retry_s
        self.unwant(name, STANDING)  # no retry nobody asked for
        self.owner.changed()  # its waiters answer now

    # --- unloads ---------------------------------------------------------------------------------------------

    def swap_out(self, old: ModelSupervisor, new: ModelSupervisor | None = None) -> ModelSupervisor:
        """Put an unloaded supervisor under old's name: `new` (a reload's new settings), else a fresh one that
        carries what outlives one load (its restart budget and counts, its last error). Requests from now on wait
        for the next load, not for old."""
        if new is None:
            new = self.owner.new_model(old.model)
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

    async def unload(self, name: str, reason: str) -> None:
        """Drain the model, then stop its worker. The drain is a chore: a caller that is cancelled (its client
        hung up) stops waiting for it, never the drain itself."""
        drain = self.begin_unload(name, reason)
        if drain is not None:
            await asyncio.shield(drain)

    def begin_unload(self, name: str, reason: str) -> asyncio.Task | None:
        """Put the model's next (unloaded) supervisor in place and start draining the old one; None: nothing
        loaded."""
        old = self.models[name]
        if old.state is ModelState.UNLOADED or old.life.stopping:
            return None
        self.owner.metrics.model_unloads.labels(model=name, reason=reason).inc()
        idle_s = time.monotonic() - self.usage[name].last_used
        why = {"idle": f"idle for idle_unload_s={old.model.idle_unload_s:g}s", "evicted": "evicted to make room for "
               "another model", "api": "asked through the API"}[reason]
        log.info("model %s: unloading (%s; last used %.1fs ago, %d requests to finish)", name, why, idle_s,
                 len(old.router.running) + len(old.router.waiting) + old.router.reserved)
        self.swap_out(old)
        return self.leave(old)

    def restart(self, old: ModelSupervisor, new: ModelSupervisor) -> asyncio.Task:
        """reload: restart: old drains while new waits, unloaded, for the placer to load it once there is room
        (old's slot counts until its worker is gone), so max_loaded and the budget hold through a reload."""
        self.swap_out(old, new)
        self.wants.setdefault(new.name, {})[STANDING] = (time.monotonic(), "reload")
        return self.leave(old)

    def leave(self, old: ModelSupervisor) -> asyncio.Task:
        self.leaving.add(old)
        self.owner.changed()
        return self._chore(self._drain_out(old), f"unload:{old.name}", self.drains)

    async def _drain_out(self, old: ModelSupervisor) -> None:
        try:
            await old.stop(self.owner.config.server.drain_timeout_s)
        finally:
            self.leaving.discard(old)
            self.owner.changed()
        current = self.models.get(old.name)
        if current is not None and current.state is ModelState.UNLOADED:
            self.owner.metrics.worker_rss.labels(model=old.name).set(0)  # its memory went with its worker
        log.info("model %s: unloaded", old.name)

    # --- status and stop -------------------------------------------------------------------------------------

    def status(self, name: str) -> dict:
        """The /openarc/status fields of models on demand."""
        sup, usage = self.models[name], self.usage[name]
        size, source = self.footprint(name)
        last_used = None if not usage.last_used else round(time.time() - (time.monotonic() - usage.last_used), 3)
        return {"load": sup.model.load, "idle_unload_s": sup.model.idle_unload_s,
                "memory": {"bytes": size, "source": source}, "last_used": last_used,
                "loaded_by": usage.load_reason if sup.state not in (ModelState.UNLOADED, ModelState.STOPPED) else None}

    def summary(self) -> dict:
        occupied = [m.name for m in self.models.values() if m.state in residency.OCCUPYING]
        return {"max_loaded": self.owner.config.server.max_loaded,
                "memory_budget": self.owner.config.server.memory_budget, "loaded": len(occupied) + len(self.leaving)}

    def tasks(self) -> list[asyncio.Task]:
        """The tasks whose death of a bug makes the server unhealthy: the placer and the leaving models' lives."""
        return [t for t in [self.placer, *(m.life.task for m in self.leaving)] if t]

    async def stop_placing(self) -> None:
        if self.placer:
            self.placer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.placer

    async def finish_chores(self) -> None:
        """The drains run to their end (each bounded by the drain timeout and the kill grace); load watchers go."""
        await asyncio.gather(*self.drains, return_exceptions=True)
        for task in list(self.chores):
            task.cancel()
        await asyncio.gather(*self.chores, return_exceptions=True)


def measure_footprint(sup: ModelSupervisor) -> int | None:
    """A loaded model's footprint on its device: the VRAM its worker holds on a GPU (DRM fdinfo), its RSS on the
    CPU; None when it cannot be read (a GPU without fdinfo memory keys)."""
    if sup.life.pid is None:
        return None
    if budget_device(sup.model.device).startswith("GPU"):
        return sum(device_memory.device_memory_used([sup.life.pid]).values()) or None
    return telemetry.process_rss_bytes(sup.life.pid) or None
