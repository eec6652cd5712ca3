"""Per Intel GPU card: kernel driver (i915 or xe), PCI id and generation, the kernel against the generation's
minimum, Resizable BAR (the VRAM BAR's size against the VRAM), GuC/HuC firmware. `card_facts` gathers them from a
`Box`; `checks` judges them for `openarc doctor`, and the running server's /openarc/status shows the same facts
(`status_view`).

Sources: sysfs PCI attributes (Documentation/ABI/testing/sysfs-bus-pci; `resource` is pci-sysfs.c resource_show,
one "0x%016llx 0x%016llx 0x%016llx" line of start, end and flags per resource), the PCI id table of
appliance.host.gpus, the firmware lines of i915 intel_uc_fw.c / intel_uc.c and xe xe_uc_fw.c / xe_guc.c.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from appliance.host import gpu_events, gpus, telemetry
from appliance.host.kernel_log import KmsgRecord
from appliance.host.doctor import Check, fail, ok, skip, warn
from appliance.host.doctor.box import Box, kernel_version

GiB = 1 << 30
MiB = 1 << 20

# The oldest kernel that drives a generation out of the box, and the driver that does. Sources: DG2 left i915's
# force_probe in Linux 6.2 (drm/i915 "Remove DG2 from force_probe", Intel's Arc Linux guide); Battlemage is driven
# by xe from Linux 6.12 (drm/xe BMG enablement, Intel's B-series Linux guide; openvino #33133).
GENERATIONS = {
    "DG2": {"name": "Alchemist (DG2)", "kernel": (6, 2), "driver": "i915"},
    "BMG": {"name": "Battlemage (BMG)", "kernel": (6, 12), "driver": "xe"},
}
# The BAR through which the CPU sees VRAM: i915 GEN12_LMEM_BAR and xe LMEM_BAR are both BAR 2 on DG2 and BMG.
VRAM_BAR = 2
# With Resizable BAR off the firmware leaves the VRAM BAR at its 256 MiB default.
SMALL_BAR = 256 * MiB
REBAR_FIX = ("enable \"Re-Size BAR Support\" and \"Above 4G Decoding\" in the BIOS/UEFI setup (and turn CSM off), "
             "then reboot; `sudo lspci -vv -s {bdf} | grep -A2 'Resizable BAR'` shows the BAR's size")
FIRMWARE_FIX = ("sudo apt install linux-firmware (Fedora: linux-firmware; or copy {path} from "
                "https://git.kernel.org/pub/scm/linux/kernel/git/firmware/linux-firmware.git), then reboot")
# GuC firmware each driver loads per generation (i915 intel_uc_fw.c, xe xe_uc_fw.c tables).
GUC_FILES = {("i915", "DG2"): "i915/dg2_guc_70.bin", ("xe", "BMG"): "xe/bmg_guc_70.bin",
             ("xe", "DG2"): "xe/dg2_guc_70.bin"}
FIRMWARE_DIRS = ("/lib/firmware", "/usr/lib/firmware")

# Firmware lines (after the drm prefix): i915 "GuC firmware i915/dg2_guc_70.bin version 70.36.0", xe "Using GuC
# firmware from xe/bmg_guc_70.bin version 70.36.0"; failures "... fetch failed ...", xe "Failed to load GuC
# firmware ...", xe_guc.c "load failed: status = ...", i915 "GuC initialization failed ...".
_FW_LOADED = re.compile(r"(?:Using )?(?P<fw>GuC|HuC) firmware (?:from )?(?P<path>\S+) version (?P<version>[\d.]+)",
                        re.ASCII)
_FW_FAILED = re.compile(r"(?:\*ERROR\* )?(?:(?P<fw>GuC|HuC) firmware (?P<path>\S+): fetch failed.*"
                        r"|Failed to load (?P<fw2>GuC|HuC) firmware.*|(?P<fw3>GuC|HuC) initialization failed.*"
                        r"|load failed: status.*)")


@dataclass
class CardFacts:
    bdf: str
    name: str
    pci_id: str  # "8086:56a0"
    family: str  # DG2 | BMG | other
    variant: str | None
    driver: str | None  # i915 | xe | None (no driver bound)
    render_node: str | None  # "/dev/dri/renderD128"
    kernel: str | None  # uname -r
    vram_bytes: int | None  # sysfs where the driver has it, else OpenVINO's GPU_DEVICE_TOTAL_MEM_SIZE
    vram_bar_bytes: int | None
    firmware: dict[str, str] = field(default_factory=dict)  # "GuC" -> "70.36.0" | "missing: ..." | "failed: ..."
    firmware_source: str = "kernel log"  # or why the kernel log was not read
    openvino_name: str | None = None  # GPU.0, GPU.1 (bare GPU when it is the only one), where OpenVINO said

    @property
    def generation(self) -> dict[str, Any] | None:
        return GENERATIONS.get(self.family)

    @property
    def rebar(self) -> str:
        """on | off | partial | unknown."""
        bar, vram = self.vram_bar_bytes, self.vram_bytes
        if bar is None:
            return "unknown"
        if bar <= SMALL_BAR:
            return "off"
        if vram is None:
            return "on" if bar >= 4 * GiB else "partial"
        return "on" if bar >= vram * 0.95 else "partial"


def _pci_dirs(box: Box) -> list[Path]:
    """Intel display-class PCI functions (class 0x03xxxx), by address."""
    base = box.path("/sys/bus/pci/devices")
    found = []
    for name in box.listdir("/sys/bus/pci/devices"):
        device = base / name
        text = (telemetry.read_text(device / "class") or "").strip()
        vendor = (telemetry.read_text(device / "vendor") or "").strip()
        if text.startswith("0x03") and vendor == "0x8086":
            found.append(device)
    return found


def read_bar_size(resource_text: str | None, index: int = VRAM_BAR) -> int | None:
    """Size of BAR `index` from a sysfs `resource` file (start end flags per line); None if unused or unreadable."""
    lines = (resource_text or "").splitlines()
    if len(lines) <= index:
        return None
    try:
        start, end, _flags = (int(part, 16) for part in lines[index].split())
    except ValueError:
        return None
    return end - start + 1 if end > start else None


def _openvino_device(listing: dict[str, Any] | None, bdf: str) -> dict[str, Any]:
    """What OpenVINO listed for the card at `bdf` ({} when it did not, or told no PCI address)."""
    return next((device for device in (listing or {}).get("devices", []) if device.get("pci") == bdf), {})


def firmware_from_log(records: list[KmsgRecord], bdf: str) -> dict[str, str]:
    """What the kernel log says of the card's GuC/HuC firmware: a version, or why it did not load (latest wins)."""
    firmware: dict[str, str] = {}
    for record in records:
        parsed = gpu_events.drm_message(record.text)
        if not parsed or parsed[1] != bdf:
            continue
        message = parsed[2]
        if loaded := _FW_LOADED.match(message.removeprefix("*ERROR* ")):
            firmware[loaded["fw"]] = loaded["version"]
        elif failed := _FW_FAILED.match(message):
            kind = failed["fw"] or failed["fw2"] or failed["fw3"] or "GuC"
            firmware[kind] = f"failed: {message.removeprefix('*ERROR* ')}"
    return firmware


def _firmware_file(box: Box, relative: str) -> str | None:
    for directory in FIRMWARE_DIRS:
        for suffix in ("", ".zst", ".xz"):
            if box.path(f"{directory}/{relative}{suffix}").exists():
                return f"{directory}/{relative}{suffix}"
    return None


def card_facts(box: Box, listing: dict[str, Any] | None = None) -> list[CardFacts]:
    """Every Intel GPU on the PCI bus, bound to a driver or not (a Battlemage card under an old kernel has none)."""
    records, unreadable = box.kernel_log()
    facts = []
    for device in _pci_dirs(box):
        vendor, device_id = gpus.read_hex(device / "vendor"), gpus.read_hex(device / "device")
        if vendor is None or device_id is None:
            continue
        family, variant, name, _warning = gpus.gpu_identity(vendor, device_id)
        driver_link = device / "driver"
        driver = os.path.basename(os.readlink(driver_link)) if driver_link.is_symlink() else None
        renders = sorted(path.name for path in device.glob("drm/renderD*"))
        card_dirs = sorted(device.glob("drm/card*"))
        vram = gpus.probe_memory_total(card_dirs[0]) if card_dirs else None
        bdf = device.name
        openvino = _openvino_device(listing, bdf)
        facts.append(CardFacts(
            bdf=bdf, name=name, pci_id=f"{vendor:04x}:{device_id:04x}", family=family, variant=variant,
            driver=driver, render_node=f"/dev/dri/{renders[0]}" if renders else None, kernel=box.kernel_release(),
            vram_bytes=vram or openvino.get("memory_bytes"), openvino_name=openvino.get("name"),
            vram_bar_bytes=read_bar_size(telemetry.read_text(device / "resource")),
            firmware=firmware_from_log(records, bdf) if driver else {},
            firmware_source="kernel log" if not unreadable else f"kernel log unreadable ({unreadable})"))
    return facts


def _size(size: int | None) -> str:
    return "unknown" if size is None else f"{size / GiB:.1f} GiB" if size >= GiB else f"{size // MiB} MiB"


def driver_check(card: CardFacts) -> Check:
    """The kernel driver and the kernel against the generation's minimum."""
    name = f"card {card.bdf} driver"
    generation = card.generation
    what = f"{card.name} [{card.pci_id}]"
    if generation is None:
        return skip(name, f"{what} is not an Arc (DG2/BMG) card; driver {card.driver or 'none'}")
    need = generation["kernel"]
    have = kernel_version(card.kernel)
    need_text = f"{need[0]}.{need[1]}"
    if have is not None and have < need:
        return fail(name, f"{what} is {generation['name']}, which needs Linux {need_text} or newer; this kernel is "
                          f"{card.kernel} (driver: {card.driver or 'none bound'})",
                    f"install a kernel >= {need_text} (Ubuntu 24.04: sudo apt install linux-generic-hwe-24.04; "
                    "Debian: the backports kernel), then reboot")
    if card.driver is None:
        return fail(name, f"{what}: no kernel driver is bound (kernel {card.kernel})",
                    f"sudo modprobe {generation['driver']}; if it stays unbound, see `sudo dmesg | grep -i "
                    f"{generation['driver']}`")
    if card.driver != generation["driver"]:
        return warn(name, f"{what} runs on {card.driver}; {generation['name']} is supported on "
                          f"{generation['driver']} (xe on DG2 is force_probe only)",
                    f"remove {card.driver}.force_probe= / {generation['driver']}.force_probe=! from the kernel "
                    "command line (/etc/default/grub), sudo update-grub, reboot")
    return ok(name, f"{what}, {generation['name']}, driver {card.driver}, kernel {card.kernel} "
                    f"(needs {need_text}+)")


def rebar_check(card: CardFacts) -> Check:
    name = f"card {card.bdf} resizable BAR"
    if card.generation is None:
        return skip(name, f"{card.name} is not a discrete Arc card")
    bar, vram, state = _size(card.vram_bar_bytes), _size(card.vram_bytes), card.rebar
    fix = REBAR_FIX.format(bdf=card.bdf)
    if state == "off":
        return fail(name, f"Resizable BAR is off: the VRAM BAR is {bar} for {vram} of VRAM (Arc needs ReBAR; "
                          "without it loads and transfers crawl)", fix)
    if state == "partial":
        return warn(name, f"the VRAM BAR is {bar} for {vram} of VRAM: only part of it is CPU-visible", fix)
    if state == "unknown":
        return skip(name, f"BAR {VRAM_BAR} of {card.bdf} not readable from sysfs")
    return ok(name, f"VRAM BAR {bar} for {vram} of VRAM")


def firmware_check(box: Box, card: CardFacts) -> Check:
    name = f"card {card.bdf} firmware"
    if card.generation is None or card.driver is None:
        return skip(name, "no Arc card with a driver bound")
    guc = card.firmware.get("GuC")
    huc = card.firmware.get("HuC")
    huc_text = f"; HuC {huc}" if huc and not huc.startswith("failed") else ""
    expected = GUC_FILES.get((card.driver, card.family))
    if guc and guc.startswith("failed"):
        return fail(name, f"GuC firmware did not load: {guc[len('failed: '):]}",
                    FIRMWARE_FIX.format(path=expected or "the GuC firmware"))
    if guc:
        return ok(name, f"GuC {guc}{huc_text} (kernel log)")
    present = _firmware_file(box, expected) if expected else None
    if expected and not present:
        return fail(name, f"no GuC firmware {expected} under /lib/firmware, and the {card.firmware_source} does not "
                          "show it loaded", FIRMWARE_FIX.format(path=expected))
    return ok(name, f"GuC firmware file {present or '?'} present; its load is not in the {card.firmware_source}")


def checks(box: Box, facts: list[CardFacts]) -> list[Check]:
    if not facts:
        return [fail("cards", "no Intel GPU on the PCI bus (sysfs lists no Intel display device)",
                     "check the card is seated and powered: `lspci -nn | grep -Ei 'vga|display'`; in a VM, pass "
                     "the GPU through")]
    found = []
    for card in facts:
        found += [driver_check(card), rebar_check(card), firmware_check(box, card)]
    return found


def status_view(facts: list[CardFacts], mitigations: dict[str, list[str]] | None = None) -> list[dict[str, Any]]:
    """The per-card facts /openarc/status shows: what doctor checks, plus the mitigations in force on each card."""
    view = []
    for card in facts:
        entry = {key: value for key, value in asdict(card).items() if key not in ("firmware_source", "openvino_name")}
        entry.update(generation=(card.generation or {}).get("name"), rebar=card.rebar,
                     mitigations=sorted((mitigations or {}).get(card.bdf, [])))
        view.append(entry)
    return view
