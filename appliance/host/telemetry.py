"""What the host's readers share, and a process's resident memory.

`read_text` (a file that may vanish under us: processes and fds do) and `BDF` (a PCI address as the kernel prints
it) serve every reader; `process_rss_bytes` is the one reader too small for a module of its own, used by the worker's
telemetry frame, placement and the bench. The readers themselves, one concern each:
  - device_memory.py: the GPU memory a process holds (DRM fdinfo, OpenVINO's statistics);
  - gpus.py: the GPU cards in sysfs and what their PCI ids are;
  - gpu_events.py: which i915/xe kernel lines report a hang, reset or wedge, and how resets are counted;
  - kernel_log.py: reading /dev/kmsg (GPU events, OOM kills) for the front and doctor.
Every reader takes its root (`/proc`, `/sys`, `/dev/kmsg`) as a parameter so the tests can point it at recorded
samples (tests/fixtures/gpu). Nothing here needs root: fdinfo of our own workers, sysfs attributes and /dev/kmsg
(when kernel.dmesg_restrict allows it) are readable by the service user.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

# PCI address as the kernel prints it (pci_name(): "%04x:%02x:%02x.%d").
BDF = r"[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]"


def read_text(path: Path | str) -> str | None:
    """File contents, or None when it is gone or unreadable (processes and fds vanish)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            return file.read()
    except OSError:
        return None


# ---------------------------------------------------------------------------------------
# Process memory: proc(5) /proc/PID/statm (pages) or /proc/PID/status VmRSS (kB).
_VM_RSS = re.compile(r"^VmRSS:\s*(\d+)\s*kB", re.MULTILINE | re.ASCII)


def process_rss_bytes(pid: int, proc_root: str | Path = "/proc") -> int:
    """Resident set size of a process in bytes; 0 once the process is gone."""
    statm = (read_text(Path(proc_root, str(pid), "statm")) or "").split()
    if len(statm) >= 2 and statm[1].isascii() and statm[1].isdigit():
        return int(statm[1]) * os.sysconf("SC_PAGE_SIZE")
    match = _VM_RSS.search(read_text(Path(proc_root, str(pid), "status")) or "")
    return int(match[1]) * 1024 if match else 0
