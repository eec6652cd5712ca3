"""All models of this process, the front's only door to them: starting and stopping them, applying a reloaded
config model by model (a changed model is replaced side by side or restarted), and waiting for a model that is
coming up. Every model's supervisors (appliance.front.model_supervisor) are owned by its Placement
(appliance.front.placement): the one code that creates, replaces, retires and forgets them, as the state machine of
appliance.front.residency_states says, and that carries out the residency plan (appliance.front.residency). This
module asks it, and reads what it holds; the dependency runs one way (Placement never imports this module).

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
from appliance.config import Config
from appliance.front import residency
from appliance.front.lifecycle import Changes, ModelState
from appliance.front.request import RequestFailed, shutting_down
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.placement import STANDING, Placement
from appliance.front.residency_states import Event, Phase
from appliance.config.launch_spec import worker_spec

log = logging.getLogger("openarc.supervisor")


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: KernelLog | None = None):
        self.metrics = metrics
        # Every model exists from here on, before start() and before the front listens: a request that arrives
        # first (under socket activation, one that waited in the backlog) finds it coming up and waits, not a 404.
        self.placement = Placement(config, metrics, kernel_log)

    @property
    def config(self) -> Config:
        return self.placement.config

    @property
    def models(self) -> dict[str, ModelSupervisor]:
        return self.placement.models

    @property
    def changes(self) -> Changes:
        return self.placement.changes

    def start(self) -> None:
        self.placement.start()

    async def apply(self, config: Config) -> list[str]:
        """Bring the running models in line with a new config (SIGHUP): start added ones, replace changed ones
        (Placement.reload) and failed ones (a reload is how an operator retries a model whose restart budget ran
        out, after fixing what failed it), stop removed ones after draining them, and leave every other model and
        its worker alone. New limits (max_loaded, memory_budget) are planned with at once."""
        wanted = {m.name: m for m in config.models}
        removed = [name for name in self.models if name not in wanted]
        changed = [name for name, sup in self.models.items() if name in wanted and
                   (wanted[name] != sup.model or worker_spec(wanted[name], config) != sup.spec
                    or sup.state is ModelState.FAILED)]
        added = [model for name, model in wanted.items() if name not in self.models]
        for name in changed:  # new settings: a load that failed may work now, and the old footprint may be wrong
            usage = self.placement.usage[name]
            usage.refusal = usage.measured = None
        self.placement.configure(config)
        for model in added:
            if self.placement.add(model).state is not ModelState.UNLOADED:
                self.placement.send(model.name, Event.LOAD, reason="reload")
        await asyncio.gather(*(self.placement.remove(name) for name in removed),
                             *(self.placement.reload(wanted[name]) for name in changed))
        return sorted([*removed, *changed, *(model.name for model in added)])

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
        if self.placement.phases.get(name, Phase.GONE) in (Phase.LEAVING, Phase.GONE):
            raise shutting_down()  # the server stopped (or a reload removed the model) while it drained
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
        return all(not t.done() or t.cancelled() or t.exception() is None for t in self.placement.tasks())

    async def stop(self, drain_timeout_s: float) -> None:
        """Drain and stop every model: the served ones, replacements loading, and those leaving (their drains,
        already under way, are awaited to their end)."""
        await self.placement.stop(drain_timeout_s)
