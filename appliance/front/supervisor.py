"""All models of this process, the front's only door to them: starting and stopping them, applying a reloaded
config model by model (a changed model is replaced side by side or restarted), and waiting for a model that is
coming up. Each model's own life is its ModelSupervisor's (appliance.front.model_supervisor): its worker's life
(appliance.front.worker_life) and its requests (appliance.front.routing).
"""

from __future__ import annotations

import asyncio
import logging

from appliance.host import telemetry
from appliance.config import Config, ModelConfig
from appliance.front.lifecycle import Changes, ModelState
from appliance.front.metrics import Metrics
from appliance.config import worker_spec
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


class Supervisor:
    """All models of this process; the front's only door to them."""

    def __init__(self, config: Config, metrics: Metrics, kernel_log: telemetry.KernelLog | None = None):
        self.config = config
        self.metrics = metrics
        self.kernel_log = kernel_log
        self.load_gate = asyncio.Semaphore(config.server.load_concurrency)
        self.changes = Changes()  # some model changed state
        # Every model exists from here on, before start() and before the front listens: a request that arrives
        # first (under socket activation, one that waited in the backlog) finds it coming up and waits, not a 404.
        self.models: dict[str, ModelSupervisor] = {model.name: self._new_model(model, config) for model in config.models}
        self.replacements: set[ModelSupervisor] = set()  # loading beside the model they will replace

    def start(self) -> None:
        for sup in self.models.values():
            sup.start()

    def _new_model(self, model: ModelConfig, config: Config) -> ModelSupervisor:
        return ModelSupervisor(model, config, self.metrics, self.load_gate, self.changes.notify, self.kernel_log)

    def _start_model(self, model: ModelConfig) -> None:
        sup = self._new_model(model, self.config)
        self.models[model.name] = sup
        sup.start()

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

    async def ready_model(self, name: str) -> ModelSupervisor | None:
        """The model's supervisor once it can take a request; None when there is no such model.

        A model that is loading, restarting or being replaced is waited for up to its ready_wait_s (counted in
        openarc_requests_waiting), then its 503 is raised; a failed or draining one raises at once. A client that
        hangs up cancels the wait (the front runs with aiohttp's handler cancellation)."""
        loop = asyncio.get_running_loop()
        deadline: float | None = None
        counted: ModelSupervisor | None = None
        try:
            while (sup := self.models.get(name)) is not None:
                if sup.life.admits():
                    return sup
                if deadline is None:
                    deadline = loop.time() + sup.model.ready_wait_s
                remaining = deadline - loop.time()
                if remaining <= 0 or not sup.life.coming_up():
                    raise sup.life.unavailable()
                counted = _count_waiter(counted, sup)  # the model's current supervisor, across a replacement
                await self.changes.wait(remaining)
            return None
        finally:
            _count_waiter(counted, None)

    def all_ready(self) -> bool:
        return all(m.state is ModelState.READY for m in self.models.values())

    def all_failed(self) -> bool:
        return bool(self.models) and all(m.state is ModelState.FAILED for m in self.models.values())

    def settled(self) -> bool:
        """Every model has finished its first load, one way or the other."""
        return all(m.state in (ModelState.READY, ModelState.FAILED) for m in self.models.values())

    def healthy(self) -> bool:
        """No model's supervising task has died of a bug (a failed model is a state, not a dead task)."""
        tasks = [m.life.task for m in self.models.values() if m.life.task]
        return all(not t.done() or t.cancelled() or t.exception() is None for t in tasks)

    async def stop(self, drain_timeout_s: float) -> None:
        await asyncio.gather(*(self._stop_model(name, drain_timeout_s) for name in list(self.models)),
                             *(sup.stop(0) for sup in list(self.replacements)))
