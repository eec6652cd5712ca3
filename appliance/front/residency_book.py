"""What the residency plan is made from, kept per model across its loads (a ModelSupervisor lives for one load):
who wants it loaded, when it was last used, its footprint (declared or measured), why its current load happened, a
failed load's refusal until its backoff has passed; and the views of every model the policy
(appliance.front.residency) reads, with the limits it reads them against.

Kept apart from the owner (appliance.front.placement), which carries the plan out: this half only reads and keeps
books (a status or a 503's text may call it any time); the owner is the one writer of who is resident. The owner
inherits it, so both halves see the one set of books.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from appliance.config import Config
from appliance.config.devices import budget_device
from appliance.front import residency
from appliance.front.lifecycle import ModelState
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.request import RequestFailed
from appliance.host import device_memory, telemetry

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


class ResidencyBook:
    """The books the residency plan is made from; appliance.front.placement.Placement keeps and acts on them."""

    config: Config
    models: dict[str, ModelSupervisor]
    replacements: dict[str, ModelSupervisor]
    leaving: dict[ModelSupervisor, str]
    usage: dict[str, Usage]
    wants: dict[str, dict[object, tuple[float, str]]]  # model -> its waiters' (arrival, load reason)
    impossible: dict[str, str]  # the latest plan's: wanted models that cannot fit now, and why
    replan: asyncio.Event

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
        return residency.Limits(self.config.server.max_loaded, self.config.server.memory_budget_bytes)

    def views(self, now: float) -> list[residency.ModelView]:
        """Every model as the policy sees it now (reads only: a status or a 503's text may call it any time): the
        serving ones, the replacements loading (they hold a slot), and those leaving (until their worker is gone)."""
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
        views += [residency.ModelView(f"{sup.name} (replacement)", ModelState.LOADING, budget_device(sup.model.device),
                                      self.footprint(sup.name, sup)[0]) for sup in self.replacements.values()]
        views += [residency.ModelView(f"{sup.name} (leaving)", ModelState.DRAINING, budget_device(sup.model.device),
                                      self.footprint(sup.name, sup)[0]) for sup in self.swapped_out()]
        return views

    def swapped_out(self) -> list[ModelSupervisor]:
        """The leaving supervisors that no longer serve their name (one stopping under its name is in models)."""
        return [sup for sup in self.leaving if self.models.get(sup.name) is not sup]

    def busy(self, sup: ModelSupervisor, now: float) -> int:
        """Requests running, queued, reserved (an upload being read holds its place) or waiting for the model; a
        request handed it that has not opened yet counts one, for at most HANDOFF_GRACE_S."""
        router = sup.router
        busy = len(router.running) + len(router.waiting) + router.reserved + router.awaiting_ready
        return busy + sum(now - at < HANDOFF_GRACE_S for at in router.handouts.values())

    def footprint(self, name: str, sup: ModelSupervisor | None = None) -> tuple[int | None, str]:
        """The model's memory on its device (as `sup`'s settings declare it, the serving one's by default) and
        where the figure comes from: declared, measured or unknown."""
        sup = sup or self.models.get(name)
        declared = sup.model.memory_bytes if sup is not None else None
        if declared is not None:
            return declared, "declared"
        measured = self.usage[name].measured
        return (measured, "measured") if measured is not None else (None, "unknown")


def measure_footprint(sup: ModelSupervisor) -> int | None:
    """A loaded model's footprint on its device: the VRAM its worker holds on a GPU (DRM fdinfo), its RSS on the
    CPU; None when it cannot be read (a GPU without fdinfo memory keys)."""
    if sup.life.pid is None:
        return None
    if budget_device(sup.model.device).startswith("GPU"):
        return sum(device_memory.device_memory_used([sup.life.pid]).values()) or None
    return telemetry.process_rss_bytes(sup.life.pid) or None
