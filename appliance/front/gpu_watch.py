"""The kernel log as the front watches it: polled once a second, each GPU reset logged and counted, each hang line
fed to the Arc sentinel (appliance.front.gpu_sentinel), and a mitigation the sentinel turns on handed back to the
Appliance, which restarts the card's models under it as a reload does.

A module of its own so that the sentinel stays a policy tested without processes and the Appliance keeps only the
config change a mitigation leads to; the poll, the log lines and the metrics of GPU incidents live here.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import Callable, Mapping

from appliance.config import Config
from appliance.config.replicas import model_name
from appliance.front.device_faults import sole_card
from appliance.front.gpu_sentinel import GpuSentinel
from appliance.front.metrics import Metrics
from appliance.host.gpu_events import GpuEvent
from appliance.host.kernel_log import KernelLog

log = logging.getLogger("openarc.server")  # the name these lines always had in the log

KMSG_POLL_INTERVAL_S = 1.0
# Test knob: read kernel log records from this file or FIFO instead of /dev/kmsg. Never set in production.
KMSG_PATH_ENV = "OPENARC_DEBUG_KMSG_PATH"


class GpuWatch:
    """The kernel log (shared with the supervisors, which read a failed worker's failure against it) and the
    sentinel; `on_mitigation` is called once for each mitigation the sentinel turns on."""

    def __init__(self, metrics: Metrics, on_mitigation: Callable[[], None]):
        self.metrics = metrics
        self.on_mitigation = on_mitigation
        self.sentinel = GpuSentinel()  # card-level mitigations (SDPA off after repeated hangs)
        # GPU resets and OOM kills, for the metrics and for classifying a worker's failure
        self.kernel_log = KernelLog(os.environ.get(KMSG_PATH_ENV, "/dev/kmsg"), on_reset=self.on_reset,
                                              on_event=self.on_event)

    def on_reset(self, event: GpuEvent) -> None:
        log.error("GPU %s on %s: %s", event.kind, event.bdf or "?", event.text)
        self.metrics.gpu_resets.labels(device=event.bdf or "unknown").inc()

    def on_event(self, event: GpuEvent) -> None:
        """A hang line of the kernel log: the sentinel counts it per card; a mitigation it turns on restarts that
        card's workers (gpu_sentinel)."""
        for mitigation in self.sentinel.observe(event):
            log.warning("GPU mitigation %s on %s: %s; restarting its models with sdpa_optimization: false",
                        mitigation.mitigation, mitigation.card, mitigation.reason)
            self.metrics.gpu_mitigations.labels(card=mitigation.card, mitigation=mitigation.mitigation).inc()
            self.on_mitigation()

    def mitigated(self, config: Config, supervisor) -> Config:
        """`config` with the mitigations in force on the cards the models of `supervisor`
        (appliance.front.supervisor.Supervisor) run on."""
        return self.sentinel.apply(config, model_cards(supervisor))

    async def watch(self) -> None:
        while True:
            self.kernel_log.update()
            await asyncio.sleep(KMSG_POLL_INTERVAL_S)

    def close(self) -> None:
        self.kernel_log.close()


def model_cards(supervisor) -> dict[str, frozenset[str]]:
    """The cards each model's workers run on (every replica's): each one's ready frame's PCI address, else the
    box's only card."""
    only = sole_card()
    return cards_by_model({key: sup.life.device_faults.card or only for key, sup in supervisor.units.items()})


def cards_by_model(unit_cards: Mapping[str, str | None]) -> dict[str, frozenset[str]]:
    """The known cards of each model, from each unit's (a model's own, or each replica's NAME@LABEL)."""
    found: dict[str, set[str]] = {}
    for key, card in unit_cards.items():
        found.setdefault(model_name(key), set()).update([card] if card else [])
    return {name: frozenset(cards) for name, cards in found.items()}
