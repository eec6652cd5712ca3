"""One card per worker: the environment a GPU worker starts with so that it sees its own card only, and the device
name it then loads on. A pure function; appliance.front.parked applies it where it spawns a worker.

What the GPU runtime honours (the source): OpenVINO's GPU plugin reaches the cards through OpenCL, and Intel's
compute runtime (NEO, github.com/intel/compute-runtime) serves both OpenCL and Level Zero from one device discovery,
shared/source/os_interface/device_factory.cpp: `DeviceFactory::prepareDeviceEnvironments` discovers the cards, sorts
them (`sortNeoDevices`: by PCI address) and applies ZE_AFFINITY_MASK (`parseAffinityMask`) before either API lists
a device. A worker started with ZE_AFFINITY_MASK=N therefore sees one root device, the N-th Intel GPU in PCI order,
which OpenVINO then names GPU.0; it cannot open another card, whatever its config or a bug says.

OpenVINO's own GPU.N order is not always the driver's (an integrated GPU is listed first), so the mask is made from
the PCI addresses OpenVINO reports for its GPU.0, GPU.1, ... (DEVICE_PCI_INFO, read once in a child process by
appliance.config.devices.gpu_pci_addresses): the card's index among them sorted by address. Where they are unknown,
where the worker names more than one card (a composite device, a draft model on another card), or where the
operator's environment already sets ZE_AFFINITY_MASK (a container or pod given its cards), nothing is added: the
worker sees what the front sees and loads on its GPU.N as before.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

MASK_ENV = "ZE_AFFINITY_MASK"
ONE_GPU = re.compile(r"GPU(?:\.(\d+))?", re.ASCII)


def _card(device: str | None) -> int | None:
    found = ONE_GPU.fullmatch(device or "")
    return int(found.group(1) or 0) if found else None


def card_env(spec: dict[str, Any], gpu_pci: list[str], environ: Mapping[str, str]) -> tuple[dict[str, str],
                                                                                          dict[str, Any]]:
    """(what to add to the worker's environment, the spec it is then given). `gpu_pci`: the PCI address of
    OpenVINO's GPU.0, GPU.1, ... in order; `environ`: the front's environment."""
    card = _card(spec.get("device"))
    draft = spec.get("draft_model")
    if card is None or card >= len(gpu_pci) or MASK_ENV in environ or len(set(gpu_pci)) != len(gpu_pci):
        return {}, spec
    if draft is not None and _card(draft.get("device")) != card:  # a draft elsewhere needs that card too
        return {}, spec
    index = sorted(gpu_pci).index(gpu_pci[card])
    seen = {**spec, "device": "GPU.0"}
    if draft is not None:
        seen["draft_model"] = {**draft, "device": "GPU.0"}
    return {MASK_ENV: str(index)}, seen
