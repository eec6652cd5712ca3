"""The devices OpenVINO lists, with each GPU's name, driver version, memory and PCI address, asked in a child
process: neither the front nor the CLI imports OpenVINO, and a broken GPU runtime must not take doctor down."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from appliance.host.doctor import Check, fail, ok, skip
from appliance.host.doctor.box import RECORDED_OPENVINO, Box

QUERY_TIMEOUT_S = 60.0

# Run by `python -c`: one JSON line, {"openvino": version, "devices": [{name, full_name, driver_version,
# memory_bytes, pci}]}. Properties a device lacks (the CPU has no driver version) are left out.
QUERY = r"""
import json, openvino
core = openvino.Core()
devices = []
for name in core.available_devices:
    device = {"name": name}
    for key, prop in (("full_name", "FULL_DEVICE_NAME"), ("driver_version", "GPU_DRIVER_VERSION"),
                      ("memory_bytes", "GPU_DEVICE_TOTAL_MEM_SIZE")):
        try:
            value = core.get_property(name, prop)
            device[key] = int(value) if key == "memory_bytes" else str(value)
        except Exception:
            pass
    try:
        pci = core.get_property(name, "DEVICE_PCI_INFO")
        device["pci"] = f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.{pci.function:x}"
    except Exception:
        pass
    devices.append(device)
print(json.dumps({"openvino": openvino.get_version(), "devices": devices}))
"""


def query(box: Box) -> dict[str, Any]:
    """OpenVINO's device listing, or {"error": why}. A recorded root answers from its recorded listing (no GPU here
    to ask), or {"skipped": why} without one."""
    if box.recorded:
        text = box.read(RECORDED_OPENVINO)
        if not text:
            return {"skipped": f"the recorded root holds no {RECORDED_OPENVINO}"}
        try:
            return json.loads(text)
        except ValueError as exc:
            return {"error": f"{RECORDED_OPENVINO} of the recorded root is not JSON ({exc})"}
    try:
        done = subprocess.run([sys.executable, "-c", QUERY], capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"OpenVINO did not list its devices within {QUERY_TIMEOUT_S:g} s (a hung GPU driver?)"}
    except OSError as exc:
        return {"error": f"cannot start {sys.executable}: {exc}"}
    try:
        return json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": " ".join(done.stderr.split()[-40:]) or f"the query exited with status {done.returncode}"}


def _describe(device: dict[str, Any]) -> str:
    parts = [device.get("full_name") or "?"]
    if device.get("driver_version"):
        parts.append(f"driver {device['driver_version']}")
    if device.get("memory_bytes"):
        parts.append(f"{device['memory_bytes'] / (1 << 30):.1f} GiB")
    if device.get("pci"):
        parts.append(device["pci"])
    return f"{device['name']}: {', '.join(parts)}"


def checks(listing: dict[str, Any]) -> list[Check]:
    name = "openvino devices"
    if "skipped" in listing:
        return [skip(name, listing["skipped"])]
    if "error" in listing:
        return [fail(name, f"OpenVINO could not list its devices: {listing['error']}",
                     "reinstall openarc's environment (make serve), then `/opt/openarc/venv/bin/python -c "
                     "\"import openvino; print(openvino.Core().available_devices)\"`")]
    devices = listing.get("devices", [])
    gpus = [device for device in devices if device["name"].startswith("GPU")]
    version = listing.get("openvino", "?")
    if not gpus:
        listed = ", ".join(device["name"] for device in devices) or "nothing"
        return [fail(name, f"OpenVINO {version} lists no GPU (only {listed})",
                     "fix the render-node and compute-runtime checks above; then `clinfo -l` must list the Arc "
                     "card, and OpenVINO lists it as GPU")]
    return [ok(name, f"OpenVINO {version}: " + "; ".join(_describe(device) for device in gpus))]
