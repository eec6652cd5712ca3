"""How much GPU memory a process holds, from two sources: the kernel's DRM fdinfo per client (VRAM in use, and the
system memory a discrete card's buffers were evicted to), and OpenVINO's GPU_MEMORY_STATISTICS (the plugin's own
count, for a card whose driver prints no memory lines in fdinfo).

Kept apart from the kernel log and sysfs readers because it answers one question, asked every few seconds by each
worker (its telemetry frame) and by placement: a process's device memory. Readers take their `/proc` root as a
parameter so the tests point them at recorded samples (tests/fixtures/gpu).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from appliance.host.telemetry import read_text
from appliance.sizes import parse_size


# ---------------------------------------------------------------------------------------
# DRM fdinfo: Documentation/gpu/drm-usage-stats.rst, drivers/gpu/drm/drm_file.c,
# i915/i915_drm_client.c, xe/xe_drm_client.c.

# drm_file.c drm_fdinfo_print_size(): "", " KiB", " MiB" (the largest unit dividing exactly): appliance.sizes reads
# them as the config's sizes.

# Key families, matched against the whole key.
_FDINFO_KEYS = {
    # device-local memory: i915 regions local<N>, xe regions vram<N>; drm-memory- is the
    # deprecated alias of drm-resident-.
    "resident": re.compile(r"drm-resident-(?:local|vram)\d+", re.ASCII),
    "memory": re.compile(r"drm-memory-(?:local|vram)\d+", re.ASCII),
    "total": re.compile(r"drm-total-(?:local|vram)\d+", re.ASCII),
    # system memory a client's buffers sit in: i915 system<N> (never stolen-system<N>), xe system and gtt. On a
    # discrete card a model's buffers land here when the driver evicts them from VRAM (the eviction cliff).
    "system_resident": re.compile(r"drm-resident-(?:system\d*|gtt)", re.ASCII),
    "system_memory": re.compile(r"drm-memory-(?:system\d*|gtt)", re.ASCII),
}


@dataclass(frozen=True)
class DrmClient:
    pid: int
    driver: str  # i915 | xe
    pdev: str  # PCI BDF of the card
    client_id: int
    client_name: str | None
    vram_resident_bytes: int | None  # None: no device-local memory lines (iGPU, old kernel)
    vram_total_bytes: int | None
    system_resident_bytes: int | None = None  # None: no system-memory lines


def parse_fdinfo(text: str) -> dict[str, str]:
    """`key:<whitespace>value` lines -> dict; the first `:` splits, both sides are trimmed."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    return fields


def _sum_sizes(fields: Mapping[str, str], family: str) -> int | None:
    sizes = [parse_size(value) for key, value in fields.items() if _FDINFO_KEYS[family].fullmatch(key)]
    known = [size for size in sizes if size is not None]
    return sum(known) if known else None


def drm_client_from_fdinfo(fields: Mapping[str, str], pid: int) -> DrmClient | None:
    """One DRM client from parsed fdinfo, or None for fds that are not DRM clients."""
    try:
        driver, pdev, client_id = fields["drm-driver"], fields["drm-pdev"], int(fields["drm-client-id"])
    except (KeyError, ValueError):
        return None
    resident = next(
        (size for family in ("resident", "memory", "total") if (size := _sum_sizes(fields, family)) is not None),
        None,
    )
    return DrmClient(
        pid=pid,
        driver=driver,
        pdev=pdev,
        client_id=client_id,
        client_name=fields.get("drm-client-name"),
        vram_resident_bytes=resident,
        vram_total_bytes=_sum_sizes(fields, "total"),
        system_resident_bytes=next((size for family in ("system_resident", "system_memory")
                                    if (size := _sum_sizes(fields, family)) is not None), None),
    )


def _unique_clients(clients: Iterable[DrmClient]) -> list[DrmClient]:
    """Each (pdev, client-id) once: dup'ed fds and forked children share one client."""
    unique: dict[tuple[str, int], DrmClient] = {}
    for client in clients:
        unique.setdefault((client.pdev, client.client_id), client)
    return list(unique.values())


def read_drm_clients(pid: int, proc_root: str | Path = "/proc") -> list[DrmClient]:
    """DRM clients held by a process; fds that are not DRM clients are skipped."""
    fdinfo_dir = Path(proc_root, str(pid), "fdinfo")
    try:
        fds = sorted(os.listdir(fdinfo_dir), key=lambda name: int(name) if name.isascii() and name.isdigit() else -1)
    except OSError:
        return []  # the process is gone, or not ours to read
    texts = (read_text(fdinfo_dir / fd) for fd in fds)
    return _unique_clients(filter(None, (drm_client_from_fdinfo(parse_fdinfo(text or ""), pid) for text in texts)))


def device_memory_used(pids: Iterable[int], proc_root: str | Path = "/proc") -> dict[str, int]:
    """Resident device memory per card (pdev -> bytes) summed over the unique clients of `pids`."""
    used: dict[str, int] = {}
    for client in _unique_clients(client for pid in pids for client in read_drm_clients(pid, proc_root)):
        if client.vram_resident_bytes is not None:
            used[client.pdev] = used.get(client.pdev, 0) + client.vram_resident_bytes
    return used


def device_memory_regions(pids: Iterable[int], proc_root: str | Path = "/proc") -> dict[str, int]:
    """Where the buffers of `pids`' unique DRM clients are resident: {"vram": bytes, "system": bytes}, the regions
    some client reported ({} for a process with no GPU memory lines: not on a GPU, or an old kernel)."""
    regions: dict[str, int] = {}
    for client in _unique_clients(client for pid in pids for client in read_drm_clients(pid, proc_root)):
        for region, size in (("vram", client.vram_resident_bytes), ("system", client.system_resident_bytes)):
            if size is not None:
                regions[region] = regions.get(region, 0) + size
    return regions


# ---------------------------------------------------------------------------------------
# OpenVINO GPU_MEMORY_STATISTICS (intel_gpu plugin.cpp / engine::get_memory_statistics):
# map<string, uint64> of current bytes with keys unknown, cl_mem, usm_host, usm_shared,
# usm_device. Python may hand it over as a dict or as the string ov::Any prints:
# openvino/core/any.hpp Write<std::map> gives "{cl_mem:4718592000,usm_host:8388608}", and ""
# for an empty map (before any model is compiled).
_STAT_ENTRY = re.compile(r"([A-Za-z_]\w*)\s*[:=\s]\s*(\d+)", re.ASCII)


def parse_gpu_memory_statistics(value: Mapping[str, int | str] | str | None) -> int:
    """Bytes the OpenVINO GPU plugin holds in this process: the sum over all allocation types."""
    if isinstance(value, Mapping):
        return sum(int(amount) for amount in value.values())
    return sum(int(amount) for _, amount in _STAT_ENTRY.findall(value or ""))
