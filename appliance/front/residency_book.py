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
from dataclasses import dataclass, field

from appliance.config import Config, ModelConfig
from appliance.config.devices import DEVICE_IN_STRING, budget_device
from appliance.config.replicas import shown
from appliance.front import cards, residency
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
    # what its worker held on other cards at its last load: its draft's card, a split's other cards
    measured_elsewhere: dict[str, int] = field(default_factory=dict)
    placed: str | None = None            # why the placer put its current load on its card (None: not placed)
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
    cards: tuple[cards.Card, ...]  # the GPU cards a placed model may go on
    asked: dict[str, str]  # model -> its device as configured

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
            return RequestFailed(503, "model_unavailable", f"model {shown(name)} cannot load here: {self.impossible[name]} "
                                 f"({source} footprint; {advice})")
        return None

    # --- the plan, made and carried out ----------------------------------------------------------------------

    def limits(self) -> residency.Limits:
        return residency.Limits(self.config.server.max_loaded,
                                cards.budgets(self.cards, self.config.server.memory_budget_bytes))

    def view_devices(self, sup: ModelSupervisor) -> dict:
        """The device fields of a model's view: its device, the cards it may be placed on, what it holds on the
        other devices it names (its draft's, a split's)."""
        device = budget_device(sup.model.device)
        others = other_devices(sup.model)
        return {"device": device, "cards": cards.placeable(self.asked.get(sup.name, sup.model.device), self.cards),
                "elsewhere": tuple((d, size) for d, size in self.usage[sup.name].measured_elsewhere.items()
                                   if d in others)}

    def card_now(self, model: ModelConfig, current: str | None = None) -> tuple[str, str] | None:
        """(card, why) for a placed model's load the plan did not place (a load at start, a reload's new
        settings): the card it is on now, else the one the placer would choose now; None: its device is fixed."""
        choices = cards.placeable(self.asked.get(model.name, model.device), self.cards)
        if not choices:
            return None
        if current in choices:
            return current, f"placed on {current}, where the model was before its reload"
        head = residency.ModelView(model.name, ModelState.UNLOADED, model.device, self.footprint(model.name)[0],
                                   cards=choices)
        occupied = [v for v in self.views(time.monotonic()) if v.state in residency.OCCUPYING]
        chosen = residency.place(head, occupied, occupied, self.limits())
        return (chosen[0].device, chosen[3]) if chosen else (choices[0], f"placed on {choices[0]}: no card has room")

    def placement_status(self, name: str) -> dict:
        """Where the model is and why: /openarc/status's `placement`."""
        sup, usage = self.models[name], self.usage[name]
        asked = self.asked.get(name, sup.model.device)
        if not cards.placeable(asked, self.cards):
            return {"device": sup.model.device, "why": f"device: {asked} as configured"}
        if sup.state not in (ModelState.UNLOADED, ModelState.STOPPED) and usage.placed:
            return {"device": sup.model.device, "why": usage.placed}
        before = f" (last on {sup.model.device})" if sup.model.device != asked else ""
        return {"device": None, "why": f"device: {asked}: the placer picks one of "
                                       f"{', '.join(cards.placeable(asked, self.cards))} at its next load{before}"}

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
                name, state, footprint=self.footprint(name)[0], busy=busy, last_used=now if busy else usage.last_used,
                wanted_since=min(since for since, _ in wants.values()) if wants else None,
                pinned=sup.model.load == "at_start", idle_unload_s=sup.model.idle_unload_s, **self.view_devices(sup)))
        views += [residency.ModelView(f"{sup.name} (replacement)", ModelState.LOADING,
                                      footprint=self.footprint(sup.name, sup)[0], **self.view_devices(sup))
                  for sup in self.replacements.values()]
        views += [residency.ModelView(f"{sup.name} (leaving)", ModelState.DRAINING,
                                      footprint=self.footprint(sup.name, sup)[0], **self.view_devices(sup))
                  for sup in self.swapped_out()]
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

    def measure(self, sup: ModelSupervisor) -> None:
        """A load just ended ready: its footprint, and what it holds on other cards, as measured now."""
        usage = self.usage[sup.name]
        main, elsewhere = measure_footprint(sup, self.cards)
        usage.measured = main or usage.measured
        usage.measured_elsewhere = elsewhere or usage.measured_elsewhere


def other_devices(model: ModelConfig) -> set[str]:
    """The devices a model holds memory on besides its own: its draft's, a split's other cards (budget keys)."""
    named = DEVICE_IN_STRING.findall(model.device)
    if model.draft_model and model.draft_model.device:
        named += DEVICE_IN_STRING.findall(model.draft_model.device)
    return {budget_device(name) for name in named} - {budget_device(model.device)}


def measure_footprint(sup: ModelSupervisor, known: tuple[cards.Card, ...]) -> tuple[int | None, dict[str, int]]:
    """A loaded model's footprint on its device, and on its other cards: the VRAM its worker holds on a GPU (DRM
    fdinfo, per card), its RSS on the CPU; None when it cannot be read (a GPU without fdinfo memory keys)."""
    if sup.life.pid is None:
        return None, {}
    device = budget_device(sup.model.device)
    if not device.startswith("GPU"):
        return telemetry.process_rss_bytes(sup.life.pid) or None, {}
    names = {card.bdf: card.name for card in known if card.bdf}
    # its own card: as its worker's ready frame said it, else (a split names no single card) as sysfs has it
    own = sup.life.device_faults.card or next((bdf for bdf, name in names.items() if name == device), None)
    others = other_devices(sup.model)
    fallback = next(iter(others)) if len(others) == 1 else None  # a card sysfs does not show: the one other device
    return split_by_card(device_memory.device_memory_used([sup.life.pid]), own, names, fallback)


def split_by_card(used: dict[str, int], own: str | None, names: dict[str, str],
                  fallback: str | None = None) -> tuple[int | None, dict[str, int]]:
    """(bytes on the worker's own card, {device: bytes} on its other cards) from its fdinfo per card (PCI address ->
    bytes). Another card is named as sysfs names it, else `fallback`; where neither names it, or its own card is
    unknown, the bytes count on its own card (the safe side for the card it was given)."""
    if own not in used:
        return sum(used.values()) or None, {}
    main, elsewhere = used[own], {}
    for pdev, size in used.items():
        if pdev == own:
            continue
        name = names.get(pdev, fallback)
        if name is None:
            main += size
        else:
            elsewhere[name] = elsewhere.get(name, 0) + size
    return main or None, elsewhere
