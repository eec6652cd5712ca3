"""The Arc sentinel: acts on the card-level failure with published evidence. On an Arc A770, OpenVINO's fused
attention kernels (SDPA) hang the card again and again (fence timeouts, each followed by a reset; 291 in three days
for one user, none on the B580 beside it; GPU_ENABLE_SDPA_OPTIMIZATION=false stopped them: SearchSavior/OpenArc
#153). After `MITIGATION_EVENTS` such incidents on one card within `MITIGATION_WINDOW_S`, that card's GPU models with
`gpu_mitigations: auto` are restarted with `sdpa_optimization: false`; a model whose config says sdpa_optimization
(or GPU_ENABLE_SDPA_OPTIMIZATION in runtime_config) keeps it.

The decision (`decide`) and the config it leads to (`mitigated_config`) are pure functions; `GpuSentinel` keeps the
events and what is in force; appliance.front.gpu_watch feeds it the kernel log's lines, and the Appliance carries
a new config out through Supervisor.apply, as a reload does.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from appliance.config import Config, ModelConfig
from appliance.host import gpu_events

SDPA_OFF = "sdpa_off"
SDPA_PROPERTY = "GPU_ENABLE_SDPA_OPTIMIZATION"
# Incidents on one card within the window that turn the mitigation on: 3 in an hour is far above a one-off reset
# and well below the ~4 an hour of the A770 report.
MITIGATION_EVENTS = 3
MITIGATION_WINDOW_S = 3600.0
# Kernel lines of one incident (fence timeout, GPU HANG, guilty context, reset; xe: timed-out job, engine reset,
# GT reset) arrive within seconds: lines on a card closer than this to the incident's first are the same incident
# (the kernel log's reset window, gpu_events.RESET_WINDOW_US).
INCIDENT_GAP_S = gpu_events.RESET_WINDOW_US / 1e6
# The kernel log's kinds that are a hang of the card (context lines such as dumps are not).
HANG_KINDS = ("fence_timeout", "hang", "reset", "wedged")


@dataclass(frozen=True)
class CardEvent:
    card: str  # the PCI address the kernel line names
    at: float  # seconds, on the sentinel's clock


@dataclass(frozen=True)
class Mitigation:
    card: str
    mitigation: str  # sdpa_off
    reason: str


def incidents(events: Iterable[CardEvent]) -> dict[str, list[float]]:
    """Per card, the start times of its incidents: lines within INCIDENT_GAP_S of an incident's first are its."""
    starts: dict[str, list[float]] = {}
    for event in sorted(events, key=lambda event: event.at):
        card = starts.setdefault(event.card, [])
        if not card or event.at - card[-1] >= INCIDENT_GAP_S:
            card.append(event.at)
    return starts


def decide(events: Iterable[CardEvent], now: float, in_force: Mapping[str, set[str]],
           threshold: int = MITIGATION_EVENTS, window_s: float = MITIGATION_WINDOW_S) -> list[Mitigation]:
    """The mitigations to turn on now: SDPA off for each card with `threshold` incidents within the last
    `window_s` seconds, unless already in force there."""
    found = []
    for card, starts in sorted(incidents(events).items()):
        recent = [start for start in starts if now - start <= window_s]
        if len(recent) >= threshold and SDPA_OFF not in in_force.get(card, set()):
            found.append(Mitigation(card, SDPA_OFF, f"{len(recent)} fence timeouts or GPU hangs on {card} within "
                                                    f"{window_s / 60:g} min"))
    return found


def explicit_sdpa(model: ModelConfig) -> bool:
    """Whether the config itself says how SDPA runs for this model: that always wins over a mitigation."""
    return model.sdpa_optimization is not None or SDPA_PROPERTY in model.runtime_config


def mitigated_model(model: ModelConfig) -> ModelConfig:
    """The model as its worker restarts under the SDPA mitigation (restart, not side by side: two copies of a model
    do not belong on a card that keeps hanging)."""
    if model.gpu_mitigations == "off" or not model.is_gpu or explicit_sdpa(model):
        return model
    return dataclasses.replace(model, sdpa_optimization=False, reload="restart")


def mitigated_cards(cards: Iterable[str], in_force: Mapping[str, set[str]]) -> list[str]:
    """Those of a model's cards where the SDPA mitigation is in force."""
    return sorted(card for card in cards if SDPA_OFF in in_force.get(card, set()))


def mitigated_config(config: Config, model_cards: Mapping[str, Iterable[str]], in_force: Mapping[str, set[str]],
                     mitigated: set[str] = frozenset()) -> Config:
    """`config` with the SDPA mitigation applied to each model with a worker on a card where it is in force
    (model_cards: the cards each model's workers run on, where known; a replicated model's replicas are on several,
    and a hang on any of them mitigates the model: its config is one for all its replicas) and to the models it was
    applied to before (`mitigated`)."""
    def applies(model: ModelConfig) -> bool:
        return model.name in mitigated or bool(mitigated_cards(model_cards.get(model.name, ()), in_force))
    models = [mitigated_model(model) if applies(model) else model for model in config.models]
    return dataclasses.replace(config, models=models)


class GpuSentinel:
    """The kernel's hang lines per card, the mitigations in force, and the models they were applied to."""

    def __init__(self, threshold: int = MITIGATION_EVENTS, window_s: float = MITIGATION_WINDOW_S,
                 clock: Callable[[], float] = time.monotonic):
        self.threshold, self.window_s, self.clock = threshold, window_s, clock
        self.events: list[CardEvent] = []
        self.in_force: dict[str, set[str]] = {}  # card -> mitigations
        self.reasons: dict[tuple[str, str], str] = {}  # (card, mitigation) -> why it was turned on
        self.mitigated: dict[str, str | None] = {}  # model -> its card: restarted under a mitigation, kept on reloads

    def observe(self, event: gpu_events.GpuEvent) -> list[Mitigation]:
        """A GPU line of the kernel log; the mitigations it turns on (each once per card)."""
        if event.kind not in HANG_KINDS or not event.bdf:
            return []
        # the kernel's own timestamp where the line has one: when it happened, not when it was read
        now = event.ts_us / 1e6 if event.ts_us is not None else self.clock()
        self.events = [e for e in self.events if now - e.at <= self.window_s] + [CardEvent(event.bdf, now)]
        new = decide(self.events, now, self.in_force, self.threshold, self.window_s)
        for mitigation in new:
            self.in_force.setdefault(mitigation.card, set()).add(mitigation.mitigation)
            self.reasons[(mitigation.card, mitigation.mitigation)] = mitigation.reason
        return new

    def apply(self, config: Config, model_cards: Mapping[str, Iterable[str]]) -> Config:
        """The config with the mitigations in force; remembers which models it changed, and for which card."""
        mitigated = mitigated_config(config, model_cards, self.in_force, set(self.mitigated))
        for old, new in zip(config.models, mitigated.models):
            if new != old:
                self.mitigated.setdefault(new.name, next(iter(mitigated_cards(model_cards.get(new.name, ()),
                                                                              self.in_force)), None))
        return mitigated

    def status(self) -> list[dict]:
        """What /openarc/status shows: each mitigation in force, why, and the models it applies to."""
        return [{"card": card, "mitigation": mitigation, "reason": self.reasons.get((card, mitigation)),
                 "models": sorted(name for name, on in self.mitigated.items() if on == card)}
                for card, mitigations in sorted(self.in_force.items()) for mitigation in sorted(mitigations)]
