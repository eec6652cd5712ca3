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
import itertools
import time
from collections.abc import Callable
from typing import Any

from appliance.host.kernel_log import KernelLog
from appliance.config import Config
from appliance.front import residency
from appliance.front.lifecycle import Changes, ModelState, best_rank
from appliance.front.request import RequestFailed, shutting_down
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.placement import STANDING, Placement
from appliance.front.residency_states import Event, Phase
from appliance.config.launch_spec import worker_spec
from appliance.config.replicas import KEY_SEPARATOR, all_units, model_name, shown
from appliance.front.replica_choice import AffinityMemory, ReplicaView, choose, prefix_chain

log = logging.getLogger("openarc.supervisor")


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: KernelLog | None = None):
        self.metrics = metrics
        # Every model exists from here on, before start() and before the front listens: a request that arrives
        # first (under socket activation, one that waited in the backlog) finds it coming up and waits, not a 404.
        self.placement = Placement(config, metrics, kernel_log)
        self.replicas = ReplicaRouter()  # which replica of a replicated model takes each request

    @property
    def config(self) -> Config:
        return self.placement.config

    @property
    def units(self) -> dict[str, ModelSupervisor]:
        """Every model's supervisors by residency name: a model's own, or one per replica (NAME@DEVICE)."""
        return self.placement.models

    @property
    def models(self) -> dict[str, ModelSupervisor]:
        """Every model by the name clients use; a replicated model by its best replica (one that admits requests if
        any, else by lifecycle.BEST_FIRST, as openarc_model_state), which speaks for its kind, settings and state."""
        def rank(sup: ModelSupervisor) -> tuple[bool, int]:
            return not sup.life.admits(), best_rank(sup.state)
        names = dict.fromkeys(model_name(key) for key in self.units)
        return {name: min(self.units_of(name), key=rank) for name in names}  # ties: the first in config order

    def units_of(self, name: str) -> list[ModelSupervisor]:
        """The supervisors serving a model: its own, or its replicas' in the config's order ([] for no model). A
        replica's key (NAME@DEVICE) is no model's name: [] too, so no route reaches one replica by it (a client
        would load, unload or be served by a replica alone, under a name /v1/models never shows).

        Units a reload removed (draining under their keys) speak for the model only while it has no others: a
        reload that changes a model's units (`device: CPU` -> `[CPU, CPU]`: one key leaves, two come) has its
        requests wait for the new units, as a `reload: restart` does, not fail on the old one's drain; a model
        the config dropped, or a server that stops, still answers its 503 under its name."""
        if KEY_SEPARATOR in name:
            return []
        ours = [sup for key, sup in self.units.items() if model_name(key) == name]
        staying = [sup for sup in ours if self.placement.phases.get(sup.name) not in (Phase.LEAVING, Phase.GONE)]
        return staying or ours

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
        wanted = {unit.key: unit for unit in all_units(config.models)}  # a replicated model: one unit per replica
        removed = [key for key in self.units if key not in wanted]
        changed = [key for key, sup in self.units.items() if key in wanted and
                   (wanted[key].model != sup.model or worker_spec(wanted[key].model, config) != sup.configured_spec
                    or sup.state is ModelState.FAILED)]
        added = [unit for key, unit in wanted.items() if key not in self.units]
        for name in changed:  # new settings: a load that failed may work now, and the old footprint may be wrong
            usage = self.placement.usage[name]
            usage.refusal = usage.measured = None
        self.placement.configure(config)
        for unit in added:
            if self.placement.add(unit).state is not ModelState.UNLOADED:
                self.placement.send(unit.key, Event.LOAD, reason="reload")
        await asyncio.gather(*(self.placement.remove(key) for key in removed),
                             *(self.placement.reload(wanted[key]) for key in changed))
        return sorted({model_name(key) for key in [*removed, *changed, *(unit.key for unit in added)]})

    def replacing(self, unit: str) -> bool:
        """Whether a side-by-side reload's new supervisor loads beside the unit (a model's, or a replica's key),
        until it takes over: its worker started with the model's adapters as they were then."""
        return unit in self.placement.replacements

    def get(self, name: str) -> ModelSupervisor | None:
        return self.models.get(name)

    async def ready_model(self, name: str, may_see: Callable[[str], bool], reason: str = "demand",
                          body: Any = None) -> ModelSupervisor | None:
        """The model's supervisor once it can take a request (a replicated model's: the replica that takes it, as
        appliance.front.replica_choice decides from `body`'s prefix); None when there is no such model.

        A model that is loading, restarting or being replaced is waited for up to its ready_wait_s (counted in
        openarc_requests_waiting), then its 503 is raised; a failed or draining one raises at once. An unloaded one
        is wanted (the residency plan loads it, `reason` says why) and waited for the same way (ready_wait_s 0: the
        request is answered 503 at once and the load begins without it). A client that hangs up cancels the wait
        (the front runs with aiohttp's handler cancellation). `may_see`: the models the caller's key may see, by
        name (the only ones a 503 names)."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        waited_from = loop.time()
        counted: ModelSupervisor | None = None
        waiter, wanted = object(), set()
        try:
            while sups := self.units_of(name):
                if any(sup.life.admits() for sup in sups):
                    sup = self.replicas.choose(sups, body) if len(sups) > 1 else sups[0]
                    if reason != "api":  # a load through the API opens no request: nothing to protect
                        self.placement.handed(sup)
                    return sup
                if deadline is None:
                    deadline = loop.time() + sups[0].model.ready_wait_s
                remaining = deadline - loop.time()
                unloaded, refusals = self._want_unloaded(sups, waiter, reason)
                wanted.update(sup.name for sup in unloaded)
                coming = [sup for sup in sups if sup.life.coming_up()]
                if refusals and not unloaded and not coming:
                    raise refusals[0]  # no replica may still serve it: the refusal of the first
                if unloaded and remaining <= 0:
                    for sup in unloaded:
                        if not sup.model.ready_wait_s and sup.life.task is None:  # no request waits for its load:
                            self.placement.want(sup.name, STANDING, reason)  # it begins without one
                    raise self._unloaded_refusal(unloaded[0].name, unloaded[0], may_see)
                if not unloaded and (remaining <= 0 or not coming):
                    raise (coming or sups)[0].life.unavailable()
                counted = self._count_waiter(counted, sups[0])  # the current supervisor, across a replacement
                await self.changes.wait(remaining)
            return None
        finally:
            self._count_waiter(counted, None)
            for key in wanted:
                self.placement.unwant(key, waiter)
            if deadline is not None:  # it had to wait
                self.metrics.model_load_wait.labels(model=name).observe(loop.time() - waited_from)

    def _want_unloaded(self, sups: list[ModelSupervisor], waiter: object,
                       reason: str) -> tuple[list[ModelSupervisor], list[RequestFailed]]:
        """Want every unloaded unit of a model (a replicated model: each replica): those wanted, and the refusals of
        those whose last load failed lately. A replica's refusal answers the request only when no other replica
        may serve it: one replica that cannot load leaves the requests to those that can."""
        wanted, refusals = [], []
        for sup in sups:
            if sup.state is not ModelState.UNLOADED:
                continue
            try:
                self.placement.want(sup.name, waiter, reason)
            except RequestFailed as refusal:
                refusals.append(refusal)
            else:
                wanted.append(sup)
        return wanted, refusals

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

    def _unloaded_refusal(self, name: str, sup: ModelSupervisor, may_see: Callable[[str], bool]) -> RequestFailed:
        """The 503 of a request that waited ready_wait_s (or not at all) for an unloaded model, whose load goes on
        without it: what holds its load back, if anything does."""
        views = self.placement.views(time.monotonic())
        head = next(v for v in views if v.name == name)
        retry = max(1.0, sup.model.restart.backoff_initial_s)
        if not sup.model.ready_wait_s:
            return RequestFailed(503, "model_unavailable", f"model {shown(name)} is unloaded and is being loaded now "
                                 "(ready_wait_s is 0: requests do not wait for a load); retry shortly", retry_after=retry)
        return RequestFailed(503, "model_unavailable", f"model {shown(name)} is unloaded and waited "
                             f"{sup.model.ready_wait_s:g}s for room to load: "
                             + residency.why_waiting(head, views, self.placement.limits(), may_see), retry_after=retry)

    async def unload(self, name: str, reason: str) -> bool:
        """Drain the model (every replica of it), then stop its workers; it stays unloaded until a request or a load.
        False: no such model. The drain finishes even when the caller stops waiting for it (Placement.unload)."""
        keys = [sup.name for sup in self.units_of(name)]
        if not keys:
            return False
        await asyncio.gather(*(self.placement.unload(key, reason) for key in keys))
        if any(self.placement.phases.get(key, Phase.GONE) in (Phase.LEAVING, Phase.GONE) for key in keys):
            raise shutting_down()  # the server stopped (or a reload removed the model) while it drained
        return True

    def status(self, name: str) -> dict[str, Any]:
        """A model's /openarc/status entry; a replicated model's names each replica (device, pid, state, queue)."""
        sups, head = self.units_of(name), self.models[name]
        view = {**head.status(), **self.placement.status(head.name), "name": name}
        if len(sups) > 1:
            # a replica that failed its golden-answer check speaks for the model, whichever replica is its head
            view.update(canary_failure=next((f for f in map(ModelSupervisor.canary_failure, sups) if f), None),
                        device=[sup.model.device for sup in sups],
                        requests_running=sum(len(sup.router.running) for sup in sups),
                        requests_waiting=sum(sup.router.queued() for sup in sups),
                        replicas=[{"device": self.metrics.replicas.get(sup.name, (name, sup.model.device))[1],
                                   "state": sup.state.value, "pid": sup.life.pid,
                                   "requests_running": len(sup.router.running),
                                   "requests_waiting": sup.router.queued(), "restarts": sup.life.restarts,
                                   "requests_routed": self.replicas.routed.get(sup.name, 0),
                                   "last_error": sup.life.last_error, "canary_failure": sup.canary_failure()}
                                  for sup in sups])
        return view

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


class ReplicaRouter:
    """Carries out appliance.front.replica_choice for every replicated model: each replica's memory of the prefixes
    it was sent (forgotten with its worker: a new process has an empty KV cache), and the turn counter."""

    def __init__(self):
        self.memories: dict[str, tuple[int | None, AffinityMemory]] = {}  # unit key -> (its worker's pid, memory)
        self.turns = itertools.count()
        self.routed: dict[str, int] = {}  # unit key -> requests it was chosen for (/openarc/status)

    def memory(self, sup: ModelSupervisor) -> AffinityMemory:
        pid, memory = self.memories.get(sup.name, (None, None))
        if memory is None or pid != sup.life.pid:
            memory = AffinityMemory()
            self.memories[sup.name] = (sup.life.pid, memory)
        return memory

    def choose(self, sups: list[ModelSupervisor], body: Any) -> ModelSupervisor:
        """The replica that takes a request for `body` (one of `sups` admits requests), which remembers its prefix."""
        chain = prefix_chain(body)
        views = [ReplicaView(sup.name, sup.life.admits(), len(sup.router.running), sup.router.queued(),
                             self.memory(sup).matched(chain) if sup.life.admits() else 0) for sup in sups]
        model = sups[0].model
        bound = max(1, model.effective_max_running // 2)  # half a batch waiting: a prefill elsewhere costs less
        key = choose(views, bound, next(self.turns), model.replica_routing == "round_robin")
        sup = next(sup for sup in sups if sup.name == key)
        self.memory(sup).remember(chain)
        self.routed[sup.name] = self.routed.get(sup.name, 0) + 1
        return sup
