"""The compiled-model cache's one pruner in the server: whenever what a prune depends on changes (the models loaded,
the models configured, server.cache_dir and server.cache_max_size as a reload leaves them), once no load is in
progress (no compile is writing a blob), it carries out appliance.host.compile_cache's plan in a thread."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from appliance.front.lifecycle import ModelState
from appliance.front.supervisor import Supervisor
from appliance.config.replicas import model_name
from appliance.host import compile_cache
from appliance.sizes import format_size

log = logging.getLogger("openarc.cache")

LOADING = (ModelState.LOADING, ModelState.RESTARTING)


@dataclass(frozen=True)
class PruneInputs:
    """What one prune reads: a prune with the same inputs as the last one has nothing to do."""
    cache_dir: str | None
    bound: tuple[float | None, int | None]  # server.cache_bound
    configured: tuple[str, ...]
    loaded: frozenset[str]


class CacheKeeper:
    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.runtime = compile_cache.current_runtime()
        self.pruned_for: PruneInputs | None = None

    def inputs(self) -> PruneInputs | None:
        """What a prune would read now; None while any worker loads (a replica's too: its compile writes blobs)."""
        units = self.supervisor.units.values()
        if any(sup.state in LOADING for sup in units):
            return None
        config = self.supervisor.config
        return PruneInputs(config.ov_cache_dir(), config.server.cache_bound, tuple(m.name for m in config.models),
                           frozenset(model_name(sup.name) for sup in units if sup.state is ModelState.READY))

    async def run(self) -> None:
        while True:
            inputs = self.inputs()
            if inputs is None or inputs == self.pruned_for:
                await self.supervisor.changes.wait(None)
                continue
            self.pruned_for = inputs
            # then look again before waiting: a change while the prune ran woke nobody
            await asyncio.get_running_loop().run_in_executor(None, self.prune, inputs)

    def prune(self, inputs: PruneInputs) -> None:
        if not inputs.cache_dir:
            return
        try:
            bound = compile_cache.bound_bytes(*inputs.bound, inputs.cache_dir)
            deleted = compile_cache.prune(inputs.cache_dir, bound, self.runtime, inputs.configured, inputs.loaded)
        except OSError as exc:  # a cache it cannot read or write costs the next loads their speed, never a request
            log.warning("could not prune the compiled-model cache %s: %s", inputs.cache_dir, exc)
            return
        for entry in deleted:
            log.info("compiled-model cache over its bound of %s: deleted %s (%s)", format_size(bound), entry.path,
                     format_size(entry.size))
