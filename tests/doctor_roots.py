"""Recorded machine roots for `openarc doctor` tests: a box's sysfs, procfs, /dev, /etc and package files built
under a tmp dir from the recorded pieces in tests/fixtures/doctor and tests/fixtures/gpu (see their READMEs), laid out
as the kernel and the distribution lay them out, so doctor reads them exactly as it reads `/`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from appliance.host.gpus import parse_uevent

FIXTURES = Path(__file__).parent / "fixtures"
DOCTOR = FIXTURES / "doctor"
REPO = Path(__file__).resolve().parent.parent

# Per card: its PCI uevent, its BAR file, its boot kernel log and what OpenVINO listed on it.
CARDS = {
    "a770": ("gpu/sysfs/a770-le.uevent", "resource-a770-rebar.txt", "kmsg-a770-i915-boot.kmsg",
             "openvino-devices-a770.json"),
    "b580": ("gpu/sysfs/b580.uevent", "resource-b580-rebar.txt", "kmsg-b580-xe-boot.kmsg",
             "openvino-devices-b580.json"),
}


def _write(root: Path, path: str, text: str) -> Path:
    target = root / path.lstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(text)
    return target


def _pci_device(root: Path, uevent: str, resource: str, bound: bool, card: int = 0) -> None:
    """A display-class PCI function under /sys/devices, /sys/bus/pci/devices, and (driver bound) its DRM minors."""
    props = parse_uevent(uevent)
    vendor, device = (int(part, 16) for part in props["PCI_ID"].split(":"))
    bdf = props["PCI_SLOT_NAME"]
    pci_dir = root / "sys/devices/pci0000:00/0000:00:01.0" / bdf
    pci_dir.mkdir(parents=True)
    (pci_dir / "vendor").write_text(f"0x{vendor:04x}\n")
    (pci_dir / "device").write_text(f"0x{device:04x}\n")
    (pci_dir / "class").write_text("0x030000\n")
    (pci_dir / "resource").write_text(resource)
    (pci_dir / "uevent").write_text(uevent if bound else "".join(
        line + "\n" for line in uevent.splitlines() if not line.startswith("DRIVER=")))
    (root / "sys/bus/pci/devices").mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../../devices/pci0000:00/0000:00:01.0/{bdf}", root / "sys/bus/pci/devices" / bdf)
    if not bound:
        return
    os.symlink(f"../../../../bus/pci/drivers/{props['DRIVER']}", pci_dir / "driver")
    (root / "sys/class/drm").mkdir(parents=True, exist_ok=True)
    for minor in (f"card{card}", f"renderD{128 + card}"):
        (pci_dir / "drm" / minor).mkdir(parents=True)
        os.symlink("../..", pci_dir / "drm" / minor / "device")  # as the kernel links a minor to its PCI device
        os.symlink(f"../../devices/pci0000:00/0000:00:01.0/{bdf}/drm/{minor}", root / "sys/class/drm" / minor)


def build_cards_root(root: Path, *uevents: str, vram: dict[int, int] | None = None) -> Path:
    """A box's sysfs with several Arc cards (recorded uevents under tests/fixtures/gpu/sysfs), card N the N-th
    given; `vram` writes card N's xe tile0/physical_vram_size_bytes (a backport driver's: mainline has none)."""
    for card, uevent in enumerate(uevents):
        resource = (DOCTOR / "resource-b580-rebar.txt").read_text()
        _pci_device(root, (FIXTURES / "gpu/sysfs" / uevent).read_text(), resource, True, card)
    for card, size in (vram or {}).items():
        _write(root, f"/sys/class/drm/card{card}/device/tile0/physical_vram_size_bytes", f"{size}\n")
    return root


def _dev_dri(root: Path, listing: str, card: int) -> None:
    """/dev/dri nodes with the modes and groups of a recorded `ls -ln /dev/dri` (as plain files: a test cannot
    mknod, and doctor reads only their mode and owner)."""
    for line in listing.splitlines():
        parts = line.split()
        if len(parts) < 9 or not parts[0].startswith("c"):
            continue
        name = parts[-1].replace("0", str(card)) if parts[-1] == "card0" else parts[-1].replace("128", str(128 + card))
        node = _write(root, f"/dev/dri/{name}", "")
        bits = parts[0][1:10]
        node.chmod(sum(1 << (8 - i) for i, c in enumerate(bits) if c != "-"))
        os.chown(node, int(parts[2]), int(parts[3]))


def build_root(root: Path, card: str = "a770", *, kernel: str = "6.8.0-51-generic", bound: bool = True,
               resource: str | None = None, runtime: bool = True, unit: bool = True, kmsg_dropin: bool = True,
               status: str = "proc-self-status-alice.txt", openvino: str | None = None) -> Path:
    """A box with one Arc card: by default healthy (card bound, ReBAR on, runtime installed, the shipped unit with
    the kernel-log drop-in, its user in `render`)."""
    uevent, bar, kmsg, listing = CARDS[card]
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o755)  # it stands for /
    _pci_device(root, (FIXTURES / uevent).read_text(), (DOCTOR / (resource or bar)).read_text(), bound)
    _write(root, "/proc/sys/kernel/osrelease", kernel + "\n")
    _write(root, "/proc/self/status", (DOCTOR / status).read_text())
    _write(root, "/etc/passwd", (DOCTOR / "passwd").read_text())
    _write(root, "/etc/group", (DOCTOR / "group").read_text())
    _write(root, "/dev/kmsg", (DOCTOR / kmsg).read_text() if bound else "")
    if bound:
        _dev_dri(root, (DOCTOR / "dev-dri.ls").read_text(), 0)
    if runtime:
        _write(root, "/var/lib/dpkg/status", (DOCTOR / "dpkg-status-compute-runtime.txt").read_text())
        _write(root, "/etc/OpenCL/vendors/intel.icd", (DOCTOR / "intel.icd").read_text())
        for library in ("intel-opencl/libigdrcl.so", "libOpenCL.so.1", "libze_loader.so.1", "libze_intel_gpu.so.1"):
            _write(root, f"/usr/lib/x86_64-linux-gnu/{library}", "")
    firmware = {"a770": "/lib/firmware/i915/dg2_guc_70.bin.zst", "b580": "/lib/firmware/xe/bmg_guc_70.bin.zst"}
    _write(root, firmware[card], "")
    if unit:
        shutil.copy(REPO / "units/openarc.service", _write(root, "/etc/systemd/system/openarc.service", ""))
        if kmsg_dropin:
            shutil.copy(REPO / "units/openarc-kmsg.conf",
                        _write(root, "/etc/systemd/system/openarc.service.d/kmsg.conf", ""))
    _write(root, "/openvino-devices.json", (DOCTOR / (openvino or listing)).read_text())
    return root


def add_model(root: Path, name: str = "qwen", mode: int = 0o755) -> str:
    """An OpenVINO IR chat model directory under /var/lib/openarc/models (the file names its kind needs)."""
    path = f"/var/lib/openarc/models/{name}"
    for stem in ("openvino_model", "openvino_tokenizer", "openvino_detokenizer"):
        for ext in ("xml", "bin"):
            _write(root, f"{path}/{stem}.{ext}", "<net/>" if ext == "xml" else "").chmod(0o644)
    _write(root, f"{path}/config.json", '{"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}')
    for part in ("var", "var/lib", "var/lib/openarc", "var/lib/openarc/models"):
        (root / part).chmod(0o755)
    (root / path.lstrip("/")).chmod(mode)
    return path
