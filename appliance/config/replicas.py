"""Replicas: `device: [GPU.0, GPU.1]` serves one model by one worker per listed device, under one name.

Pure functions of the config (the front's residency owner, check-config and doctor share them). A model's *units*
are what residency counts, supervises and places: a model with one device is one unit under its own name; a
replicated model is one unit per listed device, keyed `NAME@LABEL` (a model's name never holds '@'), each a copy of
the model's config with that one device. The label names the replica in /openarc/status and in the `device` label of
the replica metrics: the device itself, or `DEVICE#INDEX` where a device is listed more than once (`[CPU, CPU]`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from appliance.config.devices import DEVICE_PATTERN, PLACED, budget_device

if TYPE_CHECKING:
    from appliance.config import ModelConfig

KEY_SEPARATOR = "@"
# Plugins a replica may be: one device each (a composite device is several, placed by OpenVINO, not by the router).
COMPOSITE_PREFIXES = ("AUTO", "MULTI", "HETERO", "BATCH")


@dataclass(frozen=True)
class Unit:
    key: str  # the residency name: the model's name, or NAME@LABEL for a replica
    model: ModelConfig  # the model's config with one device
    replica: str | None = None  # the replica's label (None: the model is not replicated)

    @property
    def name(self) -> str:
        """The model's name, as clients and the metrics' `model` label know it."""
        return self.model.name


def devices_of(device: str | list[str]) -> list[str]:
    """A device key as a list: one device, or a replicated model's devices."""
    return list(device) if isinstance(device, list) else [device]


def replicated(model: ModelConfig) -> bool:
    return isinstance(model.device, list) and len(model.device) > 1


def replica_label(devices: list[str], index: int) -> str:
    device = devices[index]
    return device if devices.count(device) == 1 else f"{device}#{index}"


def units(model: ModelConfig) -> list[Unit]:
    """The units one configured model is served by."""
    devices = devices_of(model.device)
    if not devices:  # an empty list: its problem is reported
        return []
    if not replicated(model):
        return [Unit(model.name, dataclasses.replace(model, device=devices[0]))]
    # A replica's card is the one listed, never the placer's choice: bare GPU is GPU.0 (as device_problems reads
    # it), not "any card" as a lone bare-GPU model on a box of several cards is; else [GPU, GPU.1] could put both
    # replicas on GPU.1 once GPU.0 is full.
    return [Unit(f"{model.name}{KEY_SEPARATOR}{replica_label(devices, i)}",
                 dataclasses.replace(model, device=budget_device(device)), replica_label(devices, i))
            for i, device in enumerate(devices)]


def all_units(models: list[ModelConfig | None]) -> list[Unit]:
    """Every unit of the models that were built (None: a model whose problems are reported)."""
    return [unit for model in models if model is not None for unit in units(model)]


def shown(key: str) -> str:
    """A unit's key as a client reads it in an error: the model's name, and which replica (`twin (replica CPU#0)`);
    never NAME@LABEL, which reads as a model name that no route takes."""
    name, _, label = key.partition(KEY_SEPARATOR)
    return f"{name} (replica {label})" if label else name


def model_name(key: str) -> str:
    """The model a unit key belongs to."""
    return key.split(KEY_SEPARATOR, 1)[0]


def device_problems(device: str | list[str]) -> list[str]:
    """What is wrong with a model's `device` value, one phrase each (empty: nothing)."""
    if not isinstance(device, list):
        return [] if device == PLACED or DEVICE_PATTERN.match(device) else [
            "an OpenVINO device name such as CPU, GPU, GPU.0 or AUTO (names are upper case), or auto (the placer "
            "picks the card with room)"]
    if not device:
        return ["a device name, or a list of at least one (one replica per listed device)"]
    problems = []
    for item in device:
        if DEVICE_PATTERN.match(item) is None:
            problems.append(f"a list of OpenVINO device names such as GPU.0, GPU.1 or CPU; {item!r} is not one")
        elif item.startswith(COMPOSITE_PREFIXES):
            problems.append(f"one device per replica; {item!r} is a composite device (list its devices instead, "
                            "or give it alone as a string)")
    cards = [budget_device(d) for d in device if d != "CPU" and not d.startswith(COMPOSITE_PREFIXES)]
    twice = sorted({d for d in cards if cards.count(d) > 1})
    if twice:
        problems.append(f"each card once ({', '.join(twice)} listed twice; bare GPU is GPU.0): two replicas on "
                        "one card each hold the model's weights and KV cache there; only CPU may repeat")
    return problems
