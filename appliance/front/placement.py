"""The one owner of every model's supervisors and their workers: residency as one state machine, carried out.

Only this code creates, starts, replaces, retires or forgets a ModelSupervisor (and so a worker). Every path reaches
it as a message, a method that runs to its end without awaiting (nothing interleaves inside it): a request's want
(Supervisor.ready_model), the load and unload API, the idle timer and evictions (the placer's plan), `reload:
side_by_side` and `reload: restart`, a load that failed, a removal, the server's stop. Each becomes an Event of the
name's state machine (appliance.front.residency_states): its table says the next phase and the acts, which `_step`
carries out in order. Events from a supervisor are handed to the table only while that supervisor still holds the
role the event is about, so a late event (a replacement that became ready after an unload overtook its reload)
changes nothing.

What it holds, per name: its phase; `models[name]`, the supervisor serving the name (unloaded when not loaded:
requests wait for its load); `replacements[name]`, a side-by-side reload's supervisor loading beside it (it counts
against max_loaded and memory_budget like any load); and `leaving`, every supervisor draining or stopping with why
(each holds its slot until its worker is gone). The ledger (appliance.front.worker_ledger) has every worker
process from spawn to reaped; /openarc/status shows it, the leaving ones with why.

What the plan is made from, per model across its loads (a ModelSupervisor lives for one load): who wants it loaded
(requests waiting in Supervisor.ready_model, a load that goes on without its requester: a request that did not wait,
a `reload: restart`), when it was last used, its measured footprint, why its current load happened, and a failed
load's refusal until its backoff has passed. The placer task (`_place`), woken by every change, makes the plan
(appliance.front.residency) and carries it out, so two decisions never race. A drain is a chore of its own, never
its caller's task: it finishes whatever happens to the caller, and stop() awaits it.

With OPENARC_DEBUG_INVARIANTS=1 the invariants (appliance.front.invariants) are checked after every step and every
plan; a violation is logged as an error ("BUG: residency invariant"), never raised.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

from appliance.config import Config, ModelConfig
from appliance.config.replicas import Unit, all_units, model_name, shown
from appliance.front import cards, invariants, residency
from appliance.front.canary import Canary
from appliance.front.lifecycle import Changes, ModelState
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.parked import ParkedWorkers
from appliance.front.request import RequestFailed
from appliance.front.residency_book import HANDOFF_GRACE_S, STANDING, ResidencyBook, Usage
from appliance.front.residency_states import Act, Event, Phase, step
from appliance.front.switches import SwitchClock, finish
from appliance.front.worker_ledger import Ledger
from appliance.host import gpus
from appliance.host.kernel_log import KernelLog

log = logging.getLogger("openarc.supervisor")

UNLOAD_WHY = {"idle": "idle for idle_unload_s={:g}s", "evicted": "evicted to make room for another model",
              "api": "asked through the API"}


class Placement(ResidencyBook):
    """Every model's supervisors, their workers and which models are resident: one owner."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: KernelLog | None = None,
                 host_gpus: list[gpus.GpuInfo] | None = None):
        self.config = config
        self.gpus = gpus.list_gpus() if host_gpus is None else host_gpus  # the cards a placed model may go on
        self.cards = cards.cards_of(self.gpus, config.server.memory_budget_bytes)
        self.metrics = metrics
        self.kernel_log = kernel_log
        self.load_gate = asyncio.Semaphore(config.server.load_concurrency)
        self.changes = Changes()  # some model changed state: waiters look again
        self.canary = Canary(lambda: self.config, metrics)  # every model's check before READY (server.canary)
        self.ledger = Ledger()
        self.parked = ParkedWorkers(config.server.parked_workers, self.ledger)  # spares every worker spawn may take
        self.phases: dict[str, Phase] = {}
        self.models: dict[str, ModelSupervisor] = {}
        self.replacements: dict[str, ModelSupervisor] = {}  # loading beside the model they will replace
        self.leaving: dict[ModelSupervisor, str] = {}  # draining or stopping, and why: they hold their slot until gone
        self.usage: dict[str, Usage] = {}
        self.asked: dict[str, str] = {}  # model -> its device as configured (auto, or GPU on several cards: placed)
        # model name -> the LoRA adapters its workers serve (its config's and those loaded at runtime): one dict
        # shared by every supervisor of the model, its replicas' and its next loads' (a ModelSupervisor lives for
        # one load), so a runtime adapter lasts while the server runs; a reload starts from the config's again
        self.adapters: dict[str, dict[str, dict]] = {}
        self.wants: dict[str, dict[object, tuple[float, str]]] = {}  # model -> its waiters' (arrival, load reason)
        self.impossible: dict[str, str] = {}  # the latest plan's: wanted models that cannot fit now, and why
        self.evicting_for: dict[str, float] = {}  # the head of the line -> when evictions to make room for it began
        self.switches: dict[ModelSupervisor, SwitchClock] = {}  # loads on demand under way, by their supervisor
        self.last_switch: dict[str, dict] = {}  # model -> the last switch's stages (/openarc/status)
        self.replan = asyncio.Event()  # something the residency plan looks at changed
        self.placer: asyncio.Task | None = None
        self.chores: set[asyncio.Task] = set()  # loads and replacements being watched
        self.watches: dict[ModelSupervisor, asyncio.Task] = {}  # each replacement's watch (reload() awaits it)
        self.drains: dict[ModelSupervisor, asyncio.Task] = {}  # awaited by stop(), never cancelled
        self.inbox: collections.deque[tuple[str, Event, dict[str, Any]]] = collections.deque()
        self.stepping = False
        self.checking = os.environ.get(invariants.DEBUG_INVARIANTS_ENV) == "1"
        self.limits_lowered = False  # a reload changed the limits: over them is allowed until once within
        for unit in all_units(config.models):
            self.add(unit)

    # --- supervisors, made here only ---------------------------------------------------------------------------

    def _new(self, model: ModelConfig, key: str | None = None) -> ModelSupervisor:
        sup = ModelSupervisor(model, self.config, self.metrics, self.load_gate, self._supervisor_changed,
                              self.kernel_log, self.ledger, self.parked, self.canary, key)
        self.usage.setdefault(sup.name, Usage())
        sup.router.on_idle = lambda: self._went_idle(sup.name)
        sup.router.on_first_output = lambda: self._switch_done(sup)
        if "adapters" in sup.spec:  # a kind that takes adapters
            sup.spec["adapters"] = self.adapters.setdefault(model.name, sup.spec["adapters"])
        return sup

    def add(self, unit: Unit) -> ModelSupervisor:
        """A configured model's (or one replica's: appliance.config.replicas) first supervisor: unloaded when on
        demand, else stopped until its load at start."""
        model = unit.model
        if unit.replica is not None:
            self.metrics.add_replica(unit.key, unit.name, unit.replica)
        else:
            self.metrics.add_model(unit.key)
        sup = self.models[unit.key] = self._new(model, unit.key)
        self.asked[unit.key] = model.device
        self.phases[unit.key] = Phase.ABSENT
        if model.load == "on_demand":
            sup.life.lifecycle.enter(ModelState.UNLOADED)
        return sup

    def _fresh(self, old: ModelSupervisor, model: ModelConfig) -> ModelSupervisor:
        """An unloaded supervisor to follow `old` under its name, with `model`'s settings, carrying what outlives
        one load (its restart budget and counts, its last error; not after a failure: unloading resets it)."""
        new = self._new(model, old.name)
        if old.state is not ModelState.FAILED:
            new.life.budget = old.life.budget
            new.life.carry_error(old.life)
        new.life.restarts, new.life.crashes = old.life.restarts, old.life.crashes
        new.life.last_backoff_s = old.life.last_backoff_s
        new.series.draft = old.series.draft  # /openarc/status's draft totals count since the model was configured
        new.life.load_seconds = old.life.load_seconds
        new.life.lifecycle.enter(ModelState.UNLOADED)
        return new

    def _supervisor_changed(self, sup: ModelSupervisor, new: ModelState) -> None:
        """A supervisor's state changed: waiters look again, the plan is made again; the current one's ready or
        failed is an event of its name."""
        self.changed()
        if self.models.get(sup.name) is sup:
            event = {ModelState.READY: Event.LOADED, ModelState.FAILED: Event.GAVE_UP}.get(new)
            if event is not None:
                self.send(sup.name, event)

    def changed(self) -> None:
        self.changes.notify()
        self.replan.set()

    def _went_idle(self, name: str) -> None:
        self.usage[name].last_used = time.monotonic()
        self.replan.set()

    def handed(self, sup: ModelSupervisor) -> None:
        now = self.usage[sup.name].last_used = time.monotonic()
        sup.router.hand_out(now, HANDOFF_GRACE_S)

    def start(self) -> None:
        for name, sup in list(self.models.items()):
            if sup.state is not ModelState.UNLOADED:
                self.send(name, Event.LOAD, reason="start")
        self.placer = asyncio.create_task(self._place(), name="residency")
        self.parked.refill()  # once the loads at start have ended

    # --- the state machine, carried out --------------------------------------------------------------------

    def send(self, name: str, event: Event, **context: Any) -> None:
        """One message to the owner: its step runs now, or right after the step under way (an act whose state
        change sends another), never inside it."""
        self.inbox.append((name, event, context))
        if self.stepping:
            return
        self.stepping = True
        try:
            while self.inbox:
                self._step(*self.inbox.popleft())
        finally:
            self.stepping = False
        self.check()

    def _step(self, name: str, event: Event, context: dict[str, Any]) -> None:
        phase = self.phases.get(name, Phase.GONE)
        move = step(phase, event)
        if move is None:
            log.error("BUG: residency: model %s in phase %s: %s is not a transition; nothing changes", name,
                      phase.value, event.value)
            return
        if move.phase is Phase.GONE:
            self.phases.pop(name, None)
        else:
            self.phases[name] = move.phase
        for act in move.acts:
            getattr(self, f"_act_{act.value}")(name, **context)
        self.changed()

    def _act_start(self, name: str, reason: str = "demand", device: str | None = None, placed: str | None = None,
                   **_) -> None:
        sup, usage = self.models[name], self.usage[name]
        if device is None and (chosen := self.card_now(sup.model)) is not None:  # a load at start: placed here
            device, placed = chosen
        sup = self._placed_on(sup, device)
        usage.load_reason, usage.refusal = reason, None
        usage.placed = placed if device else None
        self.unwant(name, STANDING)  # the load it stood for begins
        self.metrics.model_loads.labels(model=self.metrics.model_of(name), reason=reason).inc()
        if reason != "start":
            waiting = len(self.wants.get(name, ()))
            log.info("model %s: loading (%s%s)", name, reason, f", {waiting} requests waiting" if waiting else "")
        if reason in ("demand", "api"):  # a switch: its stages are timed
            now = time.monotonic()
            wanted = min((since for since, _ in self.wants.get(name, {}).values()), default=now)
            self.switches[sup] = SwitchClock(wanted, self.evicting_for.get(name), now)
        self.evicting_for.pop(name, None)
        sup.start()
        self._chore(self._loaded(sup), f"load:{name}")

    def _placed_on(self, sup: ModelSupervisor, device: str | None) -> ModelSupervisor:
        """The placer chose a card for this unloaded (never started) supervisor: a fresh one with that device serves
        the name (its settings, its worker's spec, its card's faults all follow the device)."""
        if device is None or device == sup.model.device:
            return sup
        placed = self._fresh(sup, dataclasses.replace(sup.model, device=device))
        placed.reports, sup.reports = sup.reports, False
        self.models[sup.name] = placed
        self.metrics.set_state(sup.name, placed.state.value)
        self._chore(sup.stop(0), f"drop:{sup.name}")  # never started: no worker, no slot, nothing to drain
        return placed

    def _act_retire(self, name: str, why: str, drain_s: float | None = None, **_) -> None:
        old = self.models[name]
        newest = self.replacements.get(name, old)  # an unload during a reload: the next load has the new settings
        old.reports = False
        self.models[name] = self._fresh(old, newest.model)
        # the name's queue gauges are the fresh one's from now on (as /openarc/status's are): the old one's last
        # figures (a speech still draining, say) would otherwise stay on them until the name's next request
        self.models[name].router.publish_queue()
        self._leave(old, why, drain_s)

    def _act_adopt(self, name: str, new: ModelSupervisor, **_) -> None:
        old = self.models[name]
        new.life.lifecycle.enter(ModelState.UNLOADED)
        self._switch(old, new)
        self._chore(old.stop(0), f"drop:{name}")  # never started: no worker, no slot, nothing to drain

    def _act_swap_in_new(self, name: str, new: ModelSupervisor, **_) -> None:
        old = self.models[name]
        new.life.lifecycle.enter(ModelState.UNLOADED)
        self._switch(old, new)
        self._leave(old, "reload: restart", None)

    def _act_want(self, name: str, **_) -> None:
        self.wants.setdefault(name, {})[STANDING] = (time.monotonic(), "reload")

    def _act_start_replacement(self, name: str, new: ModelSupervisor, **_) -> None:
        self.replacements[name] = new
        new.reports = False
        self.metrics.set_state(name, self.models[name].state.value)  # creating the new one's series reset it
        self.metrics.model_loads.labels(model=self.metrics.model_of(name), reason="reload").inc()
        self.usage[name].load_reason = "reload"
        new.start()
        self.watches[new] = self._chore(self._replacement_loaded(new), f"reload:{name}")

    def _act_drop_replacement(self, name: str, why: str, **_) -> None:
        dropped = self.replacements.pop(name, None)
        if dropped is not None:
            self._leave(dropped, f"{invariants.DROPPED}: {why}", 0)

    def _act_promote(self, name: str, **_) -> None:
        old, new = self.models[name], self.replacements.pop(name)
        self._switch(old, new)
        self.measure(new)
        self._leave(old, invariants.REPLACED, None)

    def _act_stop_in_place(self, name: str, why: str, drain_s: float | None = None, **_) -> None:
        sup = self.models[name]
        self.leaving[sup] = why
        self.drains[sup] = self._drain_chore(self._stop_in_place(sup, drain_s), f"stop:{name}", sup)

    def _act_forget(self, name: str, **_) -> None:
        self.models.pop(name, None)
        self.wants.pop(name, None)
        if not any(model_name(key) == model_name(name) for key in self.models):  # its last unit: the model is gone
            self.adapters.pop(model_name(name), None)

    def _switch(self, old: ModelSupervisor, new: ModelSupervisor) -> None:
        """From now on `new` serves the name: requests, gauges, and waiters (woken to look again)."""
        old.reports, new.reports = False, True
        self.models[new.name] = new
        # a reload's new settings serve their config's adapters: a runtime one they lack is unloaded, and its series
        # go as an unload's do (the units share one dict otherwise: nothing differs)
        for adapter in set(old.spec.get("adapters") or ()) - set(new.spec.get("adapters") or ()):
            new.series.drop_adapter(adapter)
        self.metrics.set_state(new.name, new.state.value)
        new.router.publish_queue()
        log.info("model %s: switched to its new worker%s", new.name, f" {new.life.pid}" if new.life.pid else "")

    def _leave(self, old: ModelSupervisor, why: str, drain_s: float | None) -> None:
        """`old` drains (up to drain_s, the server's drain timeout when None) and its worker is reaped; it holds its
        slot until then."""
        old.reports = False
        self._switch_done(old)  # a load no request used: its stages end at its ready
        self.switches.pop(old, None)
        self.leaving[old] = why
        self.drains[old] = self._drain_chore(self._drain_out(old, drain_s), f"unload:{old.name}", old)

    async def _drain_out(self, old: ModelSupervisor, drain_s: float | None) -> None:
        try:
            await old.stop(self.config.server.drain_timeout_s if drain_s is None else drain_s)
        finally:
            self.leaving.pop(old, None)
            self.changed()
            self.check()
        current = self.models.get(old.name)
        if current is not None and current.state is ModelState.UNLOADED:
            old.series.worker_rss.set(0)  # its memory went with its worker
        if old.life.task is not None:
            log.info("model %s: unloaded", old.name)

    async def _stop_in_place(self, sup: ModelSupervisor, drain_s: float | None) -> None:
        """A removed model, or every model as the server stops: drained under its name (its callers get 503
        "shutting down", not 404), then forgotten."""
        try:
            await sup.stop(self.config.server.drain_timeout_s if drain_s is None else drain_s)
        finally:
            self.leaving.pop(sup, None)
            if self.models.get(sup.name) is sup:
                self.send(sup.name, Event.DRAINED)

    def _chore(self, coro, name: str) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        self.chores.add(task)
        task.add_done_callback(self.chores.discard)
        return task

    def _drain_chore(self, coro, name: str, sup: ModelSupervisor) -> asyncio.Task:
        task = asyncio.create_task(coro, name=name)
        task.add_done_callback(lambda _: self.drains.pop(sup, None) if self.drains.get(sup) is task else None)
        return task

    # --- messages from the rest of the front ---------------------------------------------------------------

    def begin_unload(self, name: str, reason: str) -> list[asyncio.Task]:
        """Unload the model (the API, an eviction, the idle timer): its supervisors leave, a fresh unloaded one
        serves its name. The drains to await; none when nothing is loaded."""
        phase = self.phases.get(name)
        if phase not in (Phase.LOADING, Phase.READY, Phase.FAILED, Phase.REPLACING):
            return []
        old, replacement = self.models[name], self.replacements.get(name)
        self.metrics.model_unloads.labels(model=self.metrics.model_of(name), reason=reason).inc()
        idle_s = time.monotonic() - self.usage[name].last_used
        why = UNLOAD_WHY[reason].format(old.model.idle_unload_s)
        log.info("model %s: unloading (%s; last used %.1fs ago, %d requests to finish)", name, why, idle_s,
                 len(old.router.running) + len(old.router.waiting) + old.router.reserved)
        self.send(name, Event.UNLOAD, why=f"unloaded: {why}", reason=reason)
        return [self.drains[sup] for sup in (old, replacement) if sup in self.drains]

    async def unload(self, name: str, reason: str) -> None:
        """Drain the model, then stop its worker. The drain is a chore: a caller that is cancelled (its client
        hung up) stops waiting for it, never the drain itself."""
        drains = self.begin_unload(name, reason)
        if drains:
            await asyncio.shield(asyncio.gather(*drains, return_exceptions=True))

    async def reload(self, unit: Unit) -> None:
        """New settings for a configured model (Supervisor.apply): side by side, the new worker loads while the old
        one serves and the switch comes when it is ready (a new worker that cannot load is dropped and the old one
        goes on serving); restart, the old one drains first and requests wait for the new one, which the placer
        loads once the old one's slot is free; unloaded, the new settings apply at its next load. Returns once
        the switch is done and the old worker gone (or the replacement was overtaken)."""
        model, name, old = unit.model, unit.key, self.models[unit.key]
        self.asked[name] = model.device
        if self.adapters.get(model.name) is old.spec.get("adapters"):  # the first of its units the reload reaches:
            self.adapters.pop(model.name, None)  # its new settings start from the config's adapters
        chosen = self.card_now(model, old.model.device)
        new = self._new(dataclasses.replace(model, device=chosen[0]) if chosen else model, name)
        if chosen:
            self.usage[name].placed = chosen[1]
        new.reports = False
        self.metrics.set_state(name, old.state.value)  # creating the new one's series reset it
        self.send(name, Event.RELOAD_RESTART if model.reload == "restart" else Event.RELOAD_SIDE_BY_SIDE, new=new,
                  why="overtaken by a newer reload")
        watch = self.watches.get(new)
        if watch is not None:
            await asyncio.shield(watch)
        elif old in self.drains:
            await asyncio.shield(self.drains[old])

    async def _replacement_loaded(self, new: ModelSupervisor) -> None:
        """A replacement's load, watched: ready, the switch; else it is dropped. Only while it is still the
        name's replacement (an unload or a newer reload may have overtaken it: then it is already leaving)."""
        name = new.name
        try:
            await new.life.lifecycle.wait_for({ModelState.READY, ModelState.FAILED, ModelState.DRAINING}, None)
        finally:
            self.watches.pop(new, None)
        if self.replacements.get(name) is not new:
            return
        old = self.models[name]
        if new.state is ModelState.READY:
            self.send(name, Event.REPLACEMENT_READY)
            if old in self.drains:
                await asyncio.shield(self.drains[old])
            return
        log.error("model %s: its new settings do not load (%s); still serving the previous ones", name,
                  new.life.last_error)
        self.send(name, Event.REPLACEMENT_FAILED, why="its new settings did not load")
        if self.models[name].state is ModelState.FAILED:
            self.send(name, Event.GAVE_UP)

    async def remove(self, name: str) -> None:
        """A model the config no longer has: drained under its name (its callers get 503, not 404), then gone."""
        sup = self.models[name]
        self.send(name, Event.REMOVE, why="removed from the config")
        if sup in self.drains:
            await asyncio.shield(self.drains[sup])

    async def _loaded(self, sup: ModelSupervisor) -> None:
        """After a load: measure its footprint; an on-demand load that failed answers its waiters at once and
        leaves the model unloaded until the restart policy's backoff has passed (no loop of retries nobody asked
        for); a failed start of a load: at_start model keeps today's behaviour (restarts, then failed)."""
        await sup.life.lifecycle.wait_for({ModelState.READY, ModelState.RESTARTING, ModelState.FAILED,
                                           ModelState.DRAINING, ModelState.STOPPED}, None)
        usage = self.usage[sup.name]
        clock = self.switches.get(sup)
        if sup.state is ModelState.READY:
            usage.last_used = time.monotonic()
            self.measure(sup)
            if clock is not None:
                clock.mark_ready(sup.life)
                # no request waits: none wants the model, and none was handed it or opened on it (a waiter handed
                # the model as it came up has left the wants already: its first output ends the switch)
                if sup.router.first_output is not None or not (self.wants.get(sup.name)
                                                               or self.busy(sup, time.monotonic())):
                    self._switch_done(sup)
            return
        self.switches.pop(sup, None)
        on_demand = sup.model.load == "on_demand" or usage.load_reason in ("demand", "api")
        if sup.state is not ModelState.RESTARTING or not on_demand or sup.life.stopping:
            return
        if self.models.get(sup.name) is not sup:  # unloaded or replaced meanwhile: its successor has its own load
            return
        backoff = sup.life.last_backoff_s or sup.model.restart.backoff_initial_s
        self._refuse(sup.name, RequestFailed(
            503, "model_unavailable", f"model {shown(sup.name)} failed to load: {sup.life.last_error_shown}; the next "
            f"load is tried after {backoff:g}s", hint=sup.life.last_hint, retry_after=max(1.0, backoff)), retry_s=backoff)
        self.send(sup.name, Event.REFUSED, why="its load failed", drain_s=0)

    def _switch_done(self, sup: ModelSupervisor) -> None:
        """A switch's last mark (its first output, or its ready when no request waited): switches.finish()."""
        clock = self.switches.get(sup)
        if clock is None or clock.ready is None:
            return  # not a switch, or its first output came before _loaded read the ready marks: it ends there
        del self.switches[sup]
        self.last_switch[sup.name] = finish(clock, sup.router.first_output, sup.name, sup.model.name,
                                            self.metrics.model_switch)

    def _refuse(self, name: str, failure: RequestFailed, retry_s: float) -> None:
        usage = self.usage[name]
        usage.refusal, usage.retry_at = failure, time.monotonic() + retry_s
        self.unwant(name, STANDING)  # no retry nobody asked for
        self.changed()  # its waiters answer now

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
            self.check()
            await self._until_replan(plan)

    def _carry_out(self, plan: residency.Plan) -> None:
        if plan.impossible != self.impossible:
            self.impossible = dict(plan.impossible)
            self.changes.notify()  # their waiters answer now
        for name in plan.impossible:  # a standing want these cannot load
            self.unwant(name, STANDING)
        if plan.evict and plan.waits_for_room:
            self.evicting_for.setdefault(plan.waits_for_room, time.monotonic())
        for names, reason in ((plan.idle, "idle"), (plan.evict, "evicted")):
            for name in names:
                self.begin_unload(name, reason)  # at once: the next plan sees it leaving
        if plan.load:
            reason = min((self.wants.get(plan.load) or {None: (0.0, "demand")}).values())[1]
            self.send(plan.load, Event.LOAD, reason=reason, device=plan.device, placed=plan.placed)

    async def _until_replan(self, plan: residency.Plan) -> None:
        """Until something the plan looks at changes (replan: a state, a want, a waiter counted, a model gone idle,
        a limit), or an idle deadline (recheck_s) or a hand-out's grace ends."""
        now = time.monotonic()
        graces = [at + HANDOFF_GRACE_S - now for sup in self.models.values() for at in sup.router.handouts.values()
                  if at + HANDOFF_GRACE_S > now]
        timeout = min([t for t in (plan.recheck_s, *graces) if t is not None], default=None)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):  # (not wait_for: lifecycle.Changes.wait says why)
                await self.replan.wait()

    # --- invariants, status and stop ---------------------------------------------------------------------------

    def check(self) -> None:
        """The invariants, after a step (OPENARC_DEBUG_INVARIANTS=1): a violation is logged, never raised."""
        if self.checking:
            found, within_limits = invariants.violations(self, self.limits_lowered)
            self.limits_lowered = self.limits_lowered and not within_limits
            for violation in found:
                log.error("BUG: residency invariant: %s", violation)

    def configure(self, config: Config) -> None:
        """A reloaded config: its limits apply to the next plan at once (what was loaded when they were lowered
        leaves as the plan decides, not at once)."""
        before = self.limits()
        self.config = config
        self.cards = cards.cards_of(self.gpus, config.server.memory_budget_bytes)
        self.parked.resize(config.server.parked_workers)
        self.limits_lowered = self.limits_lowered or self.limits() != before
        self.changed()  # waiters on the config's settings too (the cache keeper's bound) look again

    def role(self, sup: ModelSupervisor) -> str | None:
        """What `sup` is to its name: serving, replacement, leaving; None: the owner does not hold it (a bug)."""
        if sup in self.leaving:
            return "leaving"
        if self.models.get(sup.name) is sup:
            return "serving"
        if self.replacements.get(sup.name) is sup:
            return "replacement"
        return None

    def supervisors(self) -> list[ModelSupervisor]:
        """Every supervisor the owner holds, once."""
        return list(dict.fromkeys([*self.models.values(), *self.replacements.values(), *self.leaving]))

    def workers(self) -> list[dict]:
        """Every worker process the front has (the ledger), with what it is to its model: /openarc/status."""
        owners = {sup.life: sup for sup in self.supervisors()}
        rows = []
        for entry in sorted(self.ledger.entries.values(), key=lambda e: e.started):
            if entry.owner is self.parked:
                rows.append({"pid": entry.pid, "model": None, "role": "parked", "state": None, "why": None})
                continue
            sup = owners.get(entry.owner)
            role = self.role(sup) if sup is not None else None
            # a replica's worker under its model's name (a key's allow-list names models), with its own device
            rows.append({"pid": entry.pid, "model": model_name(entry.model), "role": role or "untracked",
                         **({"device": sup.model.device} if sup is not None and entry.model != sup.model.name else {}),
                         "state": sup.state.value if sup is not None else None,
                         "why": self.leaving.get(sup) if role == "leaving" else None})
        return rows

    def status(self, name: str) -> dict:
        """The /openarc/status fields of models on demand."""
        sup, usage = self.models[name], self.usage[name]
        size, source = self.footprint(name)
        last_used = None if not usage.last_used else round(time.time() - (time.monotonic() - usage.last_used), 3)
        return {"load": sup.model.load, "idle_unload_s": sup.model.idle_unload_s,
                "memory": {"bytes": size, "source": source}, "last_used": last_used,
                "loaded_by": usage.load_reason if sup.state not in (ModelState.UNLOADED, ModelState.STOPPED) else None,
                "placement": self.placement_status(name),
                "last_switch": self.last_switch.get(name)}

    def occupied(self) -> int:
        """Slots held now: serving models with a worker (or about to have one), replacements, and those leaving."""
        return sum(v.state in residency.OCCUPYING for v in self.views(time.monotonic()))

    def summary(self) -> dict:
        return {"max_loaded": self.config.server.max_loaded, "memory_budget": self.config.server.memory_budget,
                "loaded": self.occupied(), "workers": self.workers()}

    def tasks(self) -> list[asyncio.Task]:
        """The tasks whose death of a bug makes the server unhealthy: the placer and every held model's life."""
        return [t for t in [self.placer, *(m.life.task for m in self.supervisors())] if t]

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain and stop every model: the served ones, replacements loading, and those leaving (their drains,
        already under way, are awaited to their end); load watchers go."""
        if self.placer:
            self.placer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.placer
        for name in list(self.phases):
            self.send(name, Event.STOP, why="the server stops", drain_s=drain_timeout_s)
        while self.drains:
            await asyncio.gather(*list(self.drains.values()), return_exceptions=True)
        await self.parked.close()
        for task in list(self.chores):
            task.cancel()
        await asyncio.gather(*self.chores, return_exceptions=True)

