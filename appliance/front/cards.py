"""The cards a model may be placed on, and each card's budget: pure functions of what sysfs shows
(appliance.host.gpus) and of server.memory_budget, so the tests run them over recorded two-card roots.

A model is placed by the placer (appliance.front.residency chooses the card, appliance.front.placement starts the
worker there) when its device is `auto`, or bare `GPU` on a box with several cards; any other device is the user's
choice and stays as written (bare GPU on a box with one card is that card, as it always was).

Card names are OpenVINO's: GPU.0, GPU.1, ... OpenVINO's GPU plugin numbers an integrated GPU 0 and the others in
the order the driver lists them ("Other GPUs' order is not predefined and depends on the GPU driver": the GPU
device page of the OpenVINO docs, Device Naming Convention). This module takes the Intel cards in PCI address order
(an integrated GPU sits at 0000:00:02.0, so it comes first, as OpenVINO puts it): right on the boxes we know of, but
a guess. So a card's budget is what server.memory_budget says for its name; only a card without one falls back to
the VRAM size its driver shows in sysfs (backport drivers only: mainline i915 and xe have none), and the docs tell
the owner of a mixed box (an A770 beside a B580) to set each card's budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config.devices import PLACED
from appliance.host.gpus import INTEL_VENDOR_ID, GpuInfo


@dataclass(frozen=True)
class Card:
    name: str               # OpenVINO's name: GPU.0, GPU.1, ...
    budget: int | None      # bytes the placer may fill: server.memory_budget's, else the VRAM sysfs shows, else None
    label: str              # what status shows of it: "Intel Arc B580 at 0000:03:00.0", or the name alone
    bdf: str | None = None  # its PCI address (how a worker's fdinfo names it), where sysfs shows the card


def cards_of(gpus: list[GpuInfo], budgets: dict[str, int]) -> tuple[Card, ...]:
    """Every GPU card the placer knows: the Intel cards sysfs shows, in PCI address order as GPU.0, GPU.1, ...,
    and any GPU.N server.memory_budget names beyond them (a container that sees no sysfs of its cards)."""
    intel = sorted((gpu for gpu in gpus if gpu.vendor_id == INTEL_VENDOR_ID), key=lambda gpu: gpu.bdf or gpu.card)
    cards = {f"GPU.{index}": Card(f"GPU.{index}", budgets.get(f"GPU.{index}", gpu.memory_total_bytes),
                                  f"{gpu.name} at {gpu.bdf}" if gpu.bdf else gpu.name, gpu.bdf)
             for index, gpu in enumerate(intel)}
    for name, budget in budgets.items():
        if name.startswith("GPU.") and name not in cards:
            cards[name] = Card(name, budget, name)
    return tuple(sorted(cards.values(), key=lambda card: int(card.name.split(".")[1])))


def placeable(device: str, cards: tuple[Card, ...]) -> tuple[str, ...]:
    """The cards a model with this configured device may be placed on; () when its device is fixed."""
    if device == PLACED:  # the placer picks the card (the CPU where the box has no GPU)
        return tuple(card.name for card in cards) or ("CPU",)
    if device == "GPU" and len(cards) > 1:
        return tuple(card.name for card in cards)
    return ()


def budgets(cards: tuple[Card, ...], configured: dict[str, int]) -> dict[str, int]:
    """server.memory_budget with each card's own budget where the config names none for it."""
    return {**{card.name: card.budget for card in cards if card.budget is not None}, **configured}
