"""Which models are resident: the policy of models on demand, as one pure function.

`plan()` looks at every model as the Supervisor sees it at one moment (its state, how many requests it has, when it
was last used, its memory footprint, whether requests wait for it to load) and the server's limits (`max_loaded`,
`memory_budget`), and says what to do now: which model to load next, which idle models to evict first to make room
for it, which models have been idle for their `idle_unload_s`, and when to look again. It never starts, stops or
waits for anything: the Supervisor (appliance.front.supervisor) carries the plan out, and the tests here run it
without a process.

The rules, in the order they are applied:
- An occupied slot is a model with a worker, or about to have one: loading, ready, restarting (its worker comes
  back after the backoff) or draining (its worker is still there until the drain ends).
- A model idle (nothing running, queued or waiting) for its idle_unload_s is unloaded.
- Wanted models (a request or an API call waits for their load) are taken first come, first served; the head of the
  line is placed before any other, so a big model is not starved by small ones slipping past it.
- The head loads at once when it fits beside every occupied slot. When it fits only once some slots are freed, the
  least recently used ready models that are idle, not pinned (`load: at_start`) and not the head are evicted,
  as few as needed; the load starts once their drains have ended. A model with a request running, queued or waiting
  is never evicted: then the head waits (its requests are bounded by ready_wait_s).
- A model whose footprint alone exceeds its device's budget can never load: its waiters are answered at once.
- A model the placer places (`device: auto`, or bare `GPU` on a box with several cards: its `cards`) goes on the card
  where it fits with the fewest evictions, then where those evicted are stalest, then where the most room is left
  (appliance.front.cards says what a card's budget is). An eviction for it happens on the chosen card only: a model on another card is never evicted
  for it (unless max_loaded, which counts every card, is what is short).
- A draft model on another card than its main model (draft_model.device), or a split's other cards, count their
  measured share on those cards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from appliance.front.lifecycle import ModelState
from appliance.config.replicas import model_name, shown
from appliance.sizes import format_size

OCCUPYING = frozenset({ModelState.LOADING, ModelState.READY, ModelState.RESTARTING, ModelState.DRAINING})


@dataclass(frozen=True)
class ModelView:
    """One model as the policy sees it."""

    name: str
    state: ModelState
    device: str                     # the budget's key: "GPU.0" (bare GPU is GPU.0), "CPU", ...
    footprint: int | None = None    # bytes on its device: declared (models[].memory), else measured, else unknown
    busy: int = 0                   # requests running, queued, or waiting for this model
    last_used: float = 0.0          # monotonic seconds: its last request ended, or was handed to it, or it loaded
    wanted_since: float | None = None  # when the oldest request waiting for its load arrived (None: nobody waits)
    pinned: bool = False            # load: at_start: never evicted to make room for another model
    idle_unload_s: float = 0.0      # 0: never unloaded for idleness
    cards: tuple[str, ...] = ()     # the cards the placer may put it on (device: auto, or GPU with several cards)
    # bytes it holds on other devices (measured): its draft's card (draft_model.device), a split's other cards
    elsewhere: tuple[tuple[str, int], ...] = ()

    def needs(self) -> dict[str, int]:
        """Bytes it holds (or will hold) per device: on its own, and elsewhere."""
        needs = {self.device: self.footprint or 0}
        for device, size in self.elsewhere:
            needs[device] = needs.get(device, 0) + size
        return needs


@dataclass(frozen=True)
class Limits:
    max_loaded: int = 0                                     # 0: no limit
    memory_budget: dict[str, int] = field(default_factory=dict)  # device -> bytes; devices not named: no limit


@dataclass(frozen=True)
class Plan:
    load: str | None = None                  # start loading this model now
    device: str | None = None                # ... on this card (a placed model), or on its own device (None)
    placed: str | None = None                # why that card: the head's room on each card it may go on
    evict: tuple[str, ...] = ()              # drain and stop these first, to make room for `waits_for_room`
    idle: tuple[str, ...] = ()               # drain and stop these: idle for their idle_unload_s
    waits_for_room: str | None = None        # the head of the line, waiting for evictions or for a model to go idle
    impossible: dict[str, str] = field(default_factory=dict)  # wanted models that can never load here: why
    recheck_s: float | None = None           # look again after this long even if nothing changes (an idle deadline)

    @property
    def blocked(self) -> bool:
        """The head of the line waits for a busy model to go idle: nothing but a request ending will change that."""
        return self.waits_for_room is not None and not self.evict


def plan(models: list[ModelView], limits: Limits, now: float) -> Plan:
    idle, recheck = _idle_unloads(models, now)
    impossible = {m.name: reason for m in models if m.wanted_since is not None and m.state is ModelState.UNLOADED
                  and (reason := _never_fits(m, limits))}
    everyone = [m for m in models if m.state in OCCUPYING]
    wanted = [m for m in models if m.wanted_since is not None and m.state is ModelState.UNLOADED
              and m.name not in impossible]
    line = sorted(wanted, key=lambda m: (m.wanted_since, m.name))
    if not line:
        return Plan(idle=idle, impossible=impossible, recheck_s=recheck)
    head = line[0]
    # Slots being freed (draining, or unloaded for idleness by this plan) still hold memory until their drain ends.
    leaving = {m.name for m in models if m.state is ModelState.DRAINING} | set(idle)
    staying = [m for m in models if m.state in OCCUPYING and m.name not in leaving]
    choice = place(head, staying, everyone, limits)
    if choice is None:
        return Plan(idle=idle, impossible=impossible, recheck_s=recheck, waits_for_room=head.name)
    placed, evict, now_fits, why = choice
    load = head.name if not evict and now_fits else None  # else: wait for the evictions' (or drains') end
    return Plan(load=load, device=placed.device if head.cards and load else None, placed=why if head.cards else None,
                evict=evict, idle=idle, impossible=impossible, recheck_s=recheck,
                waits_for_room=None if load else head.name)


def place(head: ModelView, staying: list[ModelView], everyone: list[ModelView],
          limits: Limits) -> tuple[ModelView, tuple[str, ...], bool, str] | None:
    """Where `head` goes: (head on its card, the evictions on that card it needs first, whether it fits beside
    every occupied slot now (drains included), why that card); None when no card has room even after evictions.
    A model with one device has one choice; a placed one takes the card needing the fewest evictions, then one it
    fits on now, then the one whose evicted models were used least recently, then the one left with the most room
    (then the fewest bytes in use, the fewest models, the lowest index)."""
    options = []
    for card in head.cards or (head.device,):
        on = replace(head, device=card)
        evict = () if _fits(on, staying, limits) else _evictions(on, staying, limits)
        if evict or _fits(on, staying, limits):
            after = [m for m in staying if m.name not in evict]
            now_fits = not evict and _fits(on, everyone, limits)
            used = sum(m.needs().get(card, 0) for m in after)
            count = sum(card in m.needs() for m in after)  # unknown footprints: spread by count
            latest = max((m.last_used for m in staying if m.name in evict), default=0.0)  # evict the staler card's
            options.append(((len(evict), not now_fits, latest, -_room(on, after, limits), used, count, card), on,
                            evict, now_fits))
    if not options:
        return None
    _, on, evict, now_fits = min(options, key=lambda option: option[0])
    return on, evict, now_fits, _why_card(head, on.device, staying, limits, evict)


def _room(new: ModelView, occupied: list[ModelView], limits: Limits) -> float:
    """Bytes left on new's card once it loads beside `occupied` (infinite: the card has no budget)."""
    budget = limits.memory_budget.get(new.device)
    if budget is None:
        return math.inf
    return budget - sum(m.needs().get(new.device, 0) for m in occupied) - (new.footprint or 0)


def _why_card(head: ModelView, card: str, staying: list[ModelView], limits: Limits, evict: tuple[str, ...]) -> str:
    """Status's reason for a placed model's card: its room there and on the other cards it may go on."""
    def free(name: str) -> str:
        budget = limits.memory_budget.get(name)
        if budget is None:
            return f"{name}: no budget"
        used = sum(m.needs().get(name, 0) for m in staying)
        return f"{name}: {format_size(max(0, budget - used))} free of {format_size(budget)}"
    size = format_size(head.footprint) if head.footprint is not None else "unknown"
    evicted = f"; evicting {', '.join(evict)} there" if evict else ""
    return (f"placed on {card} (footprint {size}{evicted}); "
            + ", ".join(free(name) for name in head.cards or (head.device,)))


def _idle_unloads(models: list[ModelView], now: float) -> tuple[tuple[str, ...], float | None]:
    """The models idle for their idle_unload_s, and how long until the next one is due."""
    due, recheck = [], math.inf
    for m in models:
        if m.state is not ModelState.READY or m.busy or m.idle_unload_s <= 0:
            continue
        left = m.last_used + m.idle_unload_s - now
        if left <= 0:
            due.append(m.name)
        else:
            recheck = min(recheck, left)
    return tuple(due), None if recheck is math.inf else recheck


def _never_fits(model: ModelView, limits: Limits) -> str | None:
    """Why the model fits none of its cards even alone (its own device, or each card it may be placed on)."""
    reasons = []
    for card in model.cards or (model.device,):
        on = replace(model, device=card)
        over = [(device, need, limits.memory_budget[device]) for device, need in on.needs().items()
                if device in limits.memory_budget and need > limits.memory_budget[device]]
        if not over or model.footprint is None:
            return None
        reasons += [f"server.memory_budget {device}: {format_size(budget)}" for device, _, budget in over]
    return f"its footprint ({format_size(model.footprint)}) exceeds {' and '.join(dict.fromkeys(reasons))}"


def _fits(new: ModelView, occupied: list[ModelView], limits: Limits) -> bool:
    slots, short = _short(new, occupied, limits)
    return not (slots or short)


def _short(new: ModelView, occupied: list[ModelView], limits: Limits) -> tuple[bool, set[str]]:
    """(short of a slot, the devices short of memory) to load `new` beside `occupied`. An unknown footprint
    counts 0: only max_loaded bounds it."""
    slots = bool(limits.max_loaded) and len(occupied) + 1 > limits.max_loaded
    short = {device for device, need in new.needs().items() if device in limits.memory_budget
             and sum(m.needs().get(device, 0) for m in occupied) + need > limits.memory_budget[device]}
    return slots, short


def _evictions(head: ModelView, staying: list[ModelView], limits: Limits) -> tuple[str, ...]:
    """The fewest least recently used idle models whose leaving makes room for `head`; () when none would. A model
    whose leaving frees nothing that is short (memory on another card while slots are plenty) is left alone."""
    candidates = sorted((m for m in staying if m.state is ModelState.READY and not m.busy and not m.pinned
                         and m.name != head.name), key=lambda m: (m.last_used, m.name))
    remaining = list(staying)
    chosen = []
    for victim in candidates:
        slots, short = _short(head, remaining, limits)
        if not (slots or short):
            break
        if slots or short & set(victim.needs()):
            remaining.remove(victim)
            chosen.append(victim.name)
    return tuple(chosen) if _fits(head, remaining, limits) else ()


def why_waiting(head: ModelView, models: list[ModelView], limits: Limits, may_see: Callable[[str], bool]) -> str:
    """For the 503 of a request that waited in vain: what holds its model's load back. Only the models the caller
    may see (`may_see`, by model name: its key's allow-list) are named; the others are counted."""
    occupied = [m for m in models if m.state in OCCUPYING]
    named = [m for m in occupied if may_see(model_name(m.name))]
    held = [f"{shown(m.name)} ({m.state.value}{', busy' if m.busy else ''}{', pinned' if m.pinned else ''})"
            for m in named]
    if hidden := len(occupied) - len(named):
        held.append(f"{hidden} other model{'s' if hidden > 1 else ''}")
    held = ", ".join(held) or "none"
    bounds = [f"max_loaded {limits.max_loaded}"] if limits.max_loaded else []
    bounds += [f"memory_budget {card}: {format_size(limits.memory_budget[card])}"  # (a placed model's: each card's)
               for card in head.cards or (head.device,) if card in limits.memory_budget]
    return (f"no room to load model {shown(head.name)} ({', '.join(bounds) or 'no limit'}): loaded {held}; none of them "
            "can be evicted (only an idle model that is not load: at_start can)")
