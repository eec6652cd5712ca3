"""All models of this process, the front's only door to them: starting and stopping them, applying a reloaded
config model by model (a changed model is replaced side by side or restarted), and waiting for a model that is
coming up. Which models are resident (loads on demand, evictions, idle unloads, the bookkeeping they are decided
from) is its Placement's (appliance.front.placement), which carries out the residency plan
(appliance.front.residency). Each model's own life is its ModelSupervisor's (appliance.front.model_supervisor): its
worker's life (appliance.front.worker_life) and its requests (appliance.front.routing).

Residency, mechanically: an unloaded model is a ModelSupervisor in state `unloaded` that was never started; loading it
is starting it. Unloading swaps a fresh unloaded supervisor in under the model's name (so new requests wait for the
next load instead of being refused) and drains the old one beside it; the old one holds its slot until its worker
is gone.
"""

from __future__ import annotations

import asyncio
import logging
import time

from appliance.host.kernel_log import KernelLog
from appliance.config import Config, ModelConfig
from appliance.front import residency
from appliance.front.lifecycle import Changes, ModelState
from appliance.front.request import RequestFailed
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.placement import STANDING, Placement
from appliance.config.launch_spec import worker_spec

log = logging.getLogger("openarc.supervisor")


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: KernelLog | None = None):
        self.config = config
        self.metrics = metrics
        self.kernel_log = kernel_log
        self.load_gate = asyncio.Semaphore(config.server.load_concurrency)
        self.changes = Changes()  # some model changed state
        self.placement = Placement(self)
        # Every model exists from here on, before start() and before the front listens: a request that arrives
        # first (under socket activation, one that waited in the backlog) finds it coming up and waits, not a 404.
        self.models: dict[str, ModelSupervisor] = {}
        for model in config.models:
            self._add_model(model)
        self.replacements: set[ModelSupervisor] = set()  # loading beside the model they will replace

    def start(self) -> None:
        for sup in self.models.values():
            if sup.state is not ModelState.UNLOADED:
                self.placement.begin_load(sup, "start")
        self.placement.start()

    def new_model(self, model: ModelConfig) -> ModelSupervisor:
        sup = ModelSupervisor(model, self.config, self.metrics, self.load_gate, self.changed, self.kernel_log)
        self.placement.track(sup)
        return sup

    def changed(self) -> None:
        self.changes.notify()
        self.placement.replan.set()

    def _add_model(self, model: ModelConfig) -> ModelSupervisor:
        sup = self.models[model.name] = self.new_model(model)
        if model.load == "on_demand":
            sup.life.lifecycle.enter(ModelState.UNLOADED)
        return sup

    async def _stop_model(self, name: str, drain_timeout_s: float) -> None:
        # The model stays listed while it drains: its callers get 503 "shutting down", not 404.
        await self.models[name].stop(drain_timeout_s)
        del self.models[name]

    async def apply(self, config: Config) -> list[str]:
        """Bring the running models in line with a new config (SIGHUP): start added ones, replace changed ones
        (_replace) and failed ones (a reload is how an operator retries a model whose restart budget ran out,
        after fixing what failed it), stop removed ones after draining them, and leave every other model and its
        worker alone. New limits (max_loaded, memory_budget) are planned with at once."""
        wanted = {m.name: m for m in config.models}
        removed = [name for name in self.models if name not in wanted]
        changed = [name for name, sup in self.models.items() if name in wanted and
                   (wanted[name] != sup.model or worker_spec(wanted[name], config) != sup.spec
                    or sup.state is ModelState.FAILED)]
        added = [model for name, model in wanted.items() if name not in self.models]
        for name in changed:  # new settings: a load that failed may work now, and the old footprint may be wrong
            usage = self.placement.usage[name]
            usage.refusal = usage.measured = None
        self.config = config
        for name in removed:
            self.placement.wants.pop(name, None)
        self.placement.replan.set()
        for model in added:
            if self._add_model(model).state is not ModelState.UNLOADED:
                self.placement.begin_load(self.models[model.name], "reload")
        drain_s = config.server.drain_timeout_s
        await asyncio.gather(*(self._stop_model(name, drain_s) for name in removed),
                             *(self._replace(wanted[name], config) for name in changed))
        return sorted([*removed, *changed, *(model.name for model in added)])

    async def _replace(self, model: ModelConfig, config: Config) -> None:
        """Swap a changed model's supervisor for a new one without its name ever answering 404.

        side_by_side: the new worker loads while the old one serves; the switch comes when it is ready, then the
        old one drains (a new worker that cannot load is dropped and the old one goes on serving). restart: the
        old one drains first and requests wait for the new one (ready_wait_s), which the placer loads once the old
        one's slot is free (Placement.restart)."""
        old = self.models[model.name]
        new = self.new_model(model)
        new.reports = False
        self.metrics.set_state(model.name, old.state.value)  # creating the new one's series reset it
        if old.state is ModelState.UNLOADED:  # nothing loaded to replace: the new settings apply at its next load
            new.life.lifecycle.enter(ModelState.UNLOADED)
            self._switch(old, new)
            await old.stop(0)
            return
        if model.reload == "restart":
            drain = self.placement.restart(old, new)
            self._switch(old, new)
            await asyncio.shield(drain)
            return
        self.metrics.model_loads.labels(model=model.name, reason="reload").inc()
        self.placement.usage[model.name].load_reason = "reload"
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
        is wanted (the residency plan loads it, `reason` says why) and waited for the same way (ready_wait_s 0: the
        request is answered 503 at once and the load begins without it). A client that hangs up cancels the wait
        (the front runs with aiohttp's handler cancellation)."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        waited_from = loop.time()
        counted: ModelSupervisor | None = None
        waiter = object()
        try:
            while (sup := self.models.get(name)) is not None:
                if sup.life.admits():
                    if reason != "api":  # a load through the API opens no request: nothing to protect
                        self.placement.handed(sup)
                    return sup
                if deadline is None:
                    deadline = loop.time() + sup.model.ready_wait_s
                remaining = deadline - loop.time()
                if sup.state is ModelState.UNLOADED:
                    self.placement.want(name, waiter, reason)
                    if remaining <= 0:
                        if not sup.model.ready_wait_s and sup.life.task is None:  # no request waits for its load:
                            self.placement.want(name, STANDING, reason)  # it begins without one
                        raise self._unloaded_refusal(name, sup)
                elif remaining <= 0 or not sup.life.coming_up():
                    raise sup.life.unavailable()
                counted = self._count_waiter(counted, sup)  # the model's current supervisor, across a replacement
                await self.changes.wait(remaining)
            return None
        finally:
            self._count_waiter(counted, None)
            self.placement.unwant(name, waiter)
            if deadline is not None:  # it had to wait
                self.metrics.model_load_wait.labels(model=name).observe(loop.time() - waited_from)

    def _count_waiter(self, counted: ModelSupervisor | None, current: ModelSupervisor | None) -> ModelSupervisor | None:
        """Move one waiting request's count from the supervisor it was counted on to `current`: the model is busy
        with it, which the plan hears at once."""
        if counted is not current:
            for sup, step in ((counted, -1), (current, 1)):
                if sup is not None:
                    sup.router.awaiting_ready += step
                    sup.router.publish_queue()
            self.placement.replan.set()
        return current

    def _unloaded_refusal(self, name: str, sup: ModelSupervisor) -> RequestFailed:
        """The 503 of a request that waited ready_wait_s (or not at all) for an unloaded model, whose load goes on
        without it: what holds its load back, if anything does."""
        views = self.placement.views(time.monotonic())
        head = next(v for v in views if v.name == name)
        retry = max(1.0, sup.model.restart.backoff_initial_s)
        if not sup.model.ready_wait_s:
            return RequestFailed(503, "model_unavailable", f"model {name} is unloaded and is being loaded now "
                                 "(ready_wait_s is 0: requests do not wait for a load); retry shortly", retry_after=retry)
        return RequestFailed(503, "model_unavailable", f"model {name} is unloaded and waited "
                             f"{sup.model.ready_wait_s:g}s for room to load: "
                             + residency.why_waiting(head, views, self.placement.limits()), retry_after=retry)

    async def unload(self, name: str, reason: str) -> bool:
        """Drain the model, then stop its worker; it stays unloaded until a request or a load. False: no such model.
        The drain finishes even when the caller stops waiting for it (Placement.unload)."""
        if name not in self.models:
            return False
        await self.placement.unload(name, reason)
        return True

    def _serves(self, sup: ModelSupervisor, settled: tuple[ModelState, ...]) -> bool:
        """Whether the model is where /ready (or the start) wants it: `settled`, unloaded, or `load: on_demand`
        (its load, or its failure, is its own requests' business, not the whole server's; decided by its config,
        not by why it last loaded, so a reload changes nothing here)."""
        return sup.model.load == "on_demand" or sup.state in settled or sup.state is ModelState.UNLOADED

    def all_ready(self) -> bool:
        return all(self._serves(m, (ModelState.READY,)) for m in self.models.values())

    def all_failed(self) -> bool:
        return bool(self.models) and all(m.state is ModelState.FAILED for m in self.models.values())

    def settled(self) -> bool:
        """Every model has finished its first load, one way or the other (an on-demand one has none to finish)."""
        return all(self._serves(m, (ModelState.READY, ModelState.FAILED)) for m in self.models.values())

    def healthy(self) -> bool:
        """No model's supervising task has died of a bug (a failed model is a state, not a dead task)."""
        tasks = [m.life.task for m in self.models.values() if m.life.task] + self.placement.tasks()
        return all(not t.done() or t.cancelled() or t.exception() is None for t in tasks)

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain and stop every model: the served ones, replacements loading, and those leaving (their drains,
        already under way, are awaited to their end)."""
        await self.placement.stop_placing()
        await asyncio.gather(*(self._stop_model(name, drain_timeout_s) for name in list(self.models)),
                             *(sup.stop(0) for sup in list(self.replacements)),
                             self.placement.finish_chores())
