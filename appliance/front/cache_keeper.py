"""The compiled-model cache's one pruner in the server: after the set of loaded models changes, once no load is in
progress (no compile is writing a blob), it carries out appliance.host.compile_cache's plan in a thread, with the
bound of server.cache_max_size and the models configured and loaded at that moment."""

from __future__ import annotations

import asyncio
import logging

from appliance.front.lifecycle import ModelState
from appliance.front.supervisor import Supervisor
from appliance.host import compile_cache
from appliance.sizes import format_size

log = logging.getLogger("openarc.cache")

LOADING = (ModelState.LOADING, ModelState.RESTARTING)


class CacheKeeper:
    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self.runtime = compile_cache.current_runtime()
        self.pruned_for: frozenset[str] | None = None  # the loaded models at the last prune

    async def run(self) -> None:
        while True:
            states = {name: sup.state for name, sup in self.supervisor.models.items()}
            loaded = frozenset(name for name, state in states.items() if state is ModelState.READY)
            if loaded != self.pruned_for and not any(state in LOADING for state in states.values()):
                self.pruned_for = loaded
                await asyncio.get_running_loop().run_in_executor(None, self.prune, loaded)
            await self.supervisor.changes.wait(None)

    def prune(self, loaded: frozenset[str]) -> None:
        config = self.supervisor.config
        cache_dir = config.ov_cache_dir()
        if not cache_dir:
            return
        try:
            bound = compile_cache.bound_bytes(*config.server.cache_bound, cache_dir)
            deleted = compile_cache.prune(cache_dir, bound, self.runtime, [m.name for m in config.models], loaded)
        except OSError as exc:  # a cache it cannot read or write costs the next loads their speed, never a request
            log.warning("could not prune the compiled-model cache %s: %s", cache_dir, exc)
            return
        for entry in deleted:
            log.info("compiled-model cache over its bound of %s: deleted %s (%s)", format_size(bound), entry.path,
                     format_size(entry.size))
