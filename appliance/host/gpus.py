"""The GPU cards sysfs shows: each DRM card's PCI address, id, driver, render node, VRAM size, and what the id is
(family, variant, marketing name) from Intel's device tables.

Kept apart because it reads the machine's hardware, not a process: the worker names its card, the front tells a
card's family in a fault's hint, and `openarc doctor` reports each card. Readers take their `/sys` root as a
parameter so the tests point them at recorded trees (tests/fixtures/gpu).
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

from appliance.host.telemetry import BDF, read_text

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# sysfs: /sys/class/drm/cardN/device/{vendor,device} ("0x%04x\n"), device/driver symlink,
# device/drm/renderD*, device/uevent (pci_uevent: PCI_SLOT_NAME=...).
INTEL_VENDOR_ID = 0x8086


def parse_uevent(text: str) -> dict[str, str]:
    """KEY=value pairs of a sysfs uevent file; lines without '=' are skipped."""
    pairs = (line.strip().split("=", 1) for line in text.splitlines() if "=" in line)
    return {key: value for key, value in pairs}


# PCI device id -> marketing name (None: id known, name not published), per variant.
# Sources: intel/compute-runtime shared/source/dll/devices/devices_base.inl and
# bmg/definitions/device_ids_configs_bmg.h; kernel include/drm/intel/pciids.h.
_INTEL_GPUS: dict[str, dict[int, str | None]] = {
    "DG2-G10": {0x56A0: "Arc A770", 0x56A1: "Arc A750", 0x56A2: "Arc A580", 0x5690: "Arc A770M",
                0x5691: "Arc A730M", 0x5692: "Arc A550M", 0x56BE: "Arc A750E", 0x56BF: "Arc A580E"},
    "DG2-G11": {0x56A5: "Arc A380", 0x56A6: "Arc A310 LP", 0x5693: "Arc A370M", 0x5694: "Arc A350M",
                0x5695: None, 0x56B0: "Arc Pro A30M", 0x56B1: "Arc Pro A40/A50", 0x56BA: "Arc A380E",
                0x56BB: "Arc A310E", 0x56BC: "Arc A370E", 0x56BD: "Arc A350E"},
    "DG2-G12": {0x5696: "Arc A570M", 0x5697: "Arc A530M", 0x56A3: None, 0x56A4: None,
                0x56B2: "Arc Pro A60M", 0x56B3: "Arc Pro A60"},
    "DG2": {0x56C0: "Data Center GPU Flex 170", 0x56C1: "Data Center GPU Flex 140",
            0x56C2: "Data Center GPU Flex 170V", 0x56AF: "Arc A760A",
            **{device_id: None for device_id in range(0x4F80, 0x4F89)}},
    "BMG-G21": {0xE20B: "Arc B580", 0xE209: "Arc B580", 0xE20C: "Arc B570", 0xE211: "Arc Pro B60",
                0xE212: "Arc Pro B50", 0xE202: None, 0xE20D: None, 0xE210: None, 0xE215: None, 0xE216: None},
    "BMG-G31": {0xE220: None, 0xE221: None, 0xE222: None, 0xE223: None},
}
_VARIANT_BY_ID = {device_id: variant for variant, ids in _INTEL_GPUS.items() for device_id in ids}

# Family of ids missing from the table, by id range (reference §5).
_FAMILY_RANGES = (("DG2", 0xFF00, {0x5600, 0x4F00}), ("BMG", 0xFFF0, {0xE200, 0xE210, 0xE220}))


@dataclass(frozen=True)
class GpuInfo:
    card: str  # "card0"
    bdf: str | None
    vendor_id: int
    device_id: int
    driver: str | None  # i915 | xe | ... (basename of device/driver)
    render_node: str | None  # "renderD128"
    family: str  # DG2 | BMG | other
    variant: str | None  # DG2-G10, BMG-G21, ...
    name: str
    memory_total_bytes: int | None  # from sysfs where the driver has it (see probe_memory_total)
    warning: str | None  # e.g. an Intel id missing from the table


def gpu_identity(vendor_id: int, device_id: int) -> tuple[str, str | None, str, str | None]:
    """(family, variant, name, warning) for a PCI id."""
    if vendor_id != INTEL_VENDOR_ID:
        return "other", None, f"PCI {vendor_id:04x}:{device_id:04x}", None
    variant = _VARIANT_BY_ID.get(device_id)
    if variant:
        name = _INTEL_GPUS[variant][device_id] or f"{variant} (0x{device_id:04x})"
        return variant.split("-")[0], variant, f"Intel {name}", None
    family = next((name for name, mask, values in _FAMILY_RANGES if device_id & mask in values), "other")
    warning = (f"Intel GPU device id 0x{device_id:04x} is not in openarc's table "
               f"(family by id range: {family}); please report it")
    return family, None, f"Intel GPU 0x{device_id:04x}", warning


def read_hex(path: Path) -> int | None:
    text = read_text(path)
    try:
        return int(text.strip(), 16) if text else None
    except ValueError:
        return None


def _card_bdf(device_dir: Path) -> str | None:
    slot = parse_uevent(read_text(device_dir / "uevent") or "").get("PCI_SLOT_NAME")
    if slot:
        return slot
    resolved = os.path.basename(os.path.realpath(device_dir))
    return resolved if re.fullmatch(BDF, resolved) else None


def probe_memory_total(card_dir: Path) -> int | None:
    """VRAM size from sysfs, where the driver has it: xe tileN/physical_vram_size_bytes (xe_tile_sysfs.c; some
    kernels make it root-only), the i915 backports' lmem_total_bytes. Upstream i915 has neither."""
    tiles = sorted(card_dir.glob("device/tile*/physical_vram_size_bytes"))
    texts = [(read_text(path) or "").strip() for path in tiles]
    sizes = [int(text) for text in texts if text.isascii() and text.isdigit()]
    if sizes:
        return sum(sizes)
    lmem = (read_text(card_dir / "lmem_total_bytes") or "").strip()
    return int(lmem) if lmem.isascii() and lmem.isdigit() else None


def _gpu_info(card_dir: Path) -> GpuInfo | None:
    device_dir = card_dir / "device"
    vendor_id, device_id = read_hex(device_dir / "vendor"), read_hex(device_dir / "device")
    if vendor_id is None or device_id is None:
        return None
    driver_link = device_dir / "driver"
    render_nodes = sorted(path.name for path in device_dir.glob("drm/renderD*"))
    family, variant, name, warning = gpu_identity(vendor_id, device_id)
    return GpuInfo(
        card=card_dir.name,
        bdf=_card_bdf(device_dir),
        vendor_id=vendor_id,
        device_id=device_id,
        driver=os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None,
        render_node=render_nodes[0] if render_nodes else None,
        family=family,
        variant=variant,
        name=name,
        memory_total_bytes=probe_memory_total(card_dir),
        warning=warning,
    )


def list_gpus(sys_root: str | Path = "/sys") -> list[GpuInfo]:
    """DRM cards with a PCI device, in card order; logs a warning for unknown Intel ids."""
    drm_class = Path(sys_root, "class", "drm")
    try:
        cards = [name for name in os.listdir(drm_class) if re.fullmatch(r"card\d+", name, re.ASCII)]
    except OSError:
        return []
    gpus = [gpu for name in sorted(cards, key=lambda card: int(card[4:])) if (gpu := _gpu_info(drm_class / name))]
    for gpu in gpus:
        if gpu.warning:
            log.warning("%s: %s", gpu.card, gpu.warning)
    return gpus
