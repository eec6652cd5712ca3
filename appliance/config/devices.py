"""OpenVINO device names as the config writes them: which are valid, which GPUs and plugins a name reaches, which
memory budget a model's device counts against, and what this host's OpenVINO offers.

Pure functions of the strings (check-config, the placer, doctor and `openarc pull` share them), apart from
`available_devices`, which asks OpenVINO in a child process so that its caller never imports it.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

from appliance.config.validator import ConfigError

# OpenVINO device names are case sensitive ("cpu" is not registered): accept the plugin names and their
# composite forms, reject anything else here rather than as a C++ exception at load time.
DEVICE_PATTERN = re.compile(r"^(CPU|NPU|GPU(\.\d+)?|(AUTO|MULTI|HETERO|BATCH)(:[A-Z0-9.,:]+)?)$", re.ASCII)

# The device that asks the placer to choose the card (appliance.front.cards): lower case, so that it is never
# taken for OpenVINO's own AUTO plugin (which picks a device per compiled model, not per card with room).
PLACED = "auto"

# A GPU a device string names: "GPU.1", or bare "GPU" (OpenVINO's name for GPU.0), also inside composite
# devices ("HETERO:GPU.1,CPU").
GPU_IN_DEVICE = re.compile(r"\bGPU(?:\.(\d+))?\b", re.ASCII)

# The plugins a device string names (inside composites too: "HETERO:GPU.1,CPU").
DEVICE_IN_STRING = re.compile(r"\b(CPU|NPU|GPU(?:\.\d+)?)\b", re.ASCII)


def missing_devices(device: str, available: list[str]) -> list[str]:
    """The devices `device` names that OpenVINO's `available_devices` lacks. One GPU is listed as bare "GPU",
    several as "GPU.0", "GPU.1"...: bare GPU is any GPU, and GPU.0 is the lone one."""
    def present(name: str) -> bool:
        return (name in available or (name == "GPU" and any(a.startswith("GPU") for a in available))
                or (name == "GPU.0" and "GPU" in available))
    return [name for name in DEVICE_IN_STRING.findall(device) if not present(name)]


def available_devices() -> list[str]:
    """OpenVINO's device list (Core().available_devices), read in a child process: the front never imports
    OpenVINO, and a broken GPU runtime must not take this process down."""
    return _ask_openvino("import json, openvino; print(json.dumps(openvino.Core().available_devices))")


# Each GPU's PCI address, in OpenVINO's GPU.N order (appliance.config.card_env maps them to the driver's order).
PCI_CODE = """import json, openvino
core, found = openvino.Core(), []
for name in core.available_devices:
    if name.startswith("GPU"):
        pci = core.get_property(name, "DEVICE_PCI_INFO")
        found.append([int(name.partition(".")[2] or 0), f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.{pci.function:x}"])
print(json.dumps([address for _, address in sorted(found)]))"""


def gpu_pci_addresses() -> list[str]:
    """The PCI address of OpenVINO's GPU.0, GPU.1, ... in that order; [] where there is no GPU or it cannot be
    read (asked in a child process, as available_devices)."""
    try:
        return _ask_openvino(PCI_CODE)
    except ConfigError:
        return []


def _ask_openvino(code: str):
    """What `code`, run by a child Python, prints as JSON on its last line."""
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except (subprocess.SubprocessError, OSError) as exc:
        raise ConfigError(f"cannot list OpenVINO's devices: {exc}") from None
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        detail = " ".join(done.stderr.split()[-40:]) or f"exit status {done.returncode}"
        raise ConfigError(f"cannot list OpenVINO's devices: {detail}") from None


def gpu_indices(device: str) -> set[int | None]:
    """The GPUs a device string names: an index, or None for bare GPU."""
    return {int(index) if index else None for index in GPU_IN_DEVICE.findall(device)}


def budget_device(device: str) -> str:
    """The server.memory_budget key a model's device counts against: bare GPU is GPU.0; a composite device
    (AUTO:GPU,CPU or HETERO:GPU.1,CPU) counts against the first device it names."""
    first = device.split(":", 1)[-1].split(",")[0]
    return "GPU.0" if first == "GPU" else first
