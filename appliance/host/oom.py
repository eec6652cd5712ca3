"""The kernel OOM killer and openarc's workers: tell its kills apart, and make workers its first choice.

A worker the OOM killer chose dies of SIGKILL, like one killed by anyone else. What sets it apart:
  - the `oom_kill` counter of its memory cgroup rose across its life: `memory.events` on cgroup v2,
    `memory.oom_control` on cgroup v1 (mm/memcontrol.c). The kernel raises it before it sends the SIGKILL
    (oom_kill.c __oom_kill_process: "Raise event before sending signal: task reaper must see this"), so it is
    already up when the front reaps the worker;
  - the kernel log's "Killed process PID" line (appliance.host.kernel_log.KernelLog), where the log is readable.
    It is printed just after the SIGKILL, so the front may reap the worker a moment before the line arrives.

An `OomWatch` is taken when a worker is spawned (which counter, its value then) and asked once the worker is
gone. The counter is per cgroup, not per process: under systemd the front and all workers share the service's
cgroup, so a SIGKILL from someone else after another worker's OOM kill would count as an OOM kill too. A
SIGKILL is required in any case, so a crash is never taken for an OOM kill.
"""

from __future__ import annotations

import logging
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

log = logging.getLogger("openarc.oom")

# oom_score_adj runs from -1000 (never) to 1000 (first). A worker holds a model's weights and can always be
# restarted; the front holds every client connection and restarts the workers, so it should be the last to go.
WORKER_OOM_SCORE_ADJ = 800
FRONT_OOM_SCORE_ADJ = -500

_OOM_KILL_LINE = re.compile(r"^oom_kill (\d+)$", re.MULTILINE | re.ASCII)


@dataclass(frozen=True)
class OomCounter:
    """The `oom_kill` counter of one memory cgroup."""

    path: Path  # memory.events (v2) or memory.oom_control (v1)

    def read(self) -> int | None:
        """The counter now, or None when the file is gone or has no oom_kill line (kernels before 4.13)."""
        try:
            match = _OOM_KILL_LINE.search(self.path.read_text())
        except OSError:
            return None
        return int(match[1]) if match else None


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, Path]]:
    """{"v2" | "v1": (root of the mount inside its hierarchy, mount point)} for the memory controller."""
    mounts: dict[str, tuple[str, Path]] = {}
    for line in mountinfo.splitlines():
        fields, _, rest = line.partition(" - ")
        fields, rest = fields.split(), rest.split()
        if len(fields) < 5 or len(rest) < 3:
            continue
        fstype, super_options = rest[0], rest[2].split(",")
        if fstype == "cgroup2":
            mounts.setdefault("v2", (fields[3], Path(_unescape_mount(fields[4]))))
        elif fstype == "cgroup" and "memory" in super_options:
            mounts.setdefault("v1", (fields[3], Path(_unescape_mount(fields[4]))))
    return mounts


def _unescape_mount(path: str) -> str:
    """mountinfo writes space, tab, newline and backslash as \\ooo octal."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), path)


def _process_cgroups(text: str) -> dict[str, str]:
    """{"v2" | "v1": cgroup path} of a /proc/PID/cgroup file ("0::/path" and "N:memory,...:/path")."""
    paths = {}
    for line in text.splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            paths["v2"] = path
        elif "memory" in controllers.split(","):
            paths["v1"] = path
    return paths


def _under_mount(mount_root: str, mount_point: Path, cgroup: str) -> Path | None:
    """Where cgroup `cgroup` is in the file system, given a mount of its hierarchy that starts at `mount_root`."""
    relative = os.path.relpath(cgroup, mount_root)
    if relative.startswith(".."):
        return None  # this mount does not show that cgroup
    return mount_point if relative == "." else mount_point / relative


def memory_cgroup_counter(pid: int | str, proc_root: str | Path = "/proc") -> OomCounter | None:
    """The oom_kill counter of the memory cgroup process `pid` is in, or None if there is none to read.

    cgroup v2 is asked first (memory.events exists only where the memory controller is enabled on v2), then
    the v1 memory hierarchy. Mount points come from our own mountinfo: the worker shares our mount namespace.
    """
    try:
        cgroups = _process_cgroups(Path(proc_root, str(pid), "cgroup").read_text())
        mounts = _cgroup_mounts(Path(proc_root, "self", "mountinfo").read_text())
    except OSError:
        return None
    for version, file_name in (("v2", "memory.events"), ("v1", "memory.oom_control")):
        if version in cgroups and version in mounts:
            directory = _under_mount(*mounts[version], cgroups[version])
            counter = OomCounter(directory / file_name) if directory else None
            if counter and counter.read() is not None:
                return counter
    return None


class OomKillLog(Protocol):
    """What the kernel log says about OOM kills (appliance.host.kernel_log.KernelLog)."""

    def oom_killed(self, pid: int) -> bool: ...


class OomWatch:
    """Taken when a worker is spawned, asked once it is gone: did the kernel OOM killer end it?"""

    def __init__(self, pid: int, counter: OomCounter | None):
        self.pid = pid
        self.counter = counter
        self.before = counter.read() if counter else None

    @classmethod
    def of(cls, pid: int, proc_root: str | Path = "/proc") -> OomWatch:
        return cls(pid, memory_cgroup_counter(pid, proc_root))

    def oom_killed(self, returncode: int, kernel_log: OomKillLog | None = None) -> bool:
        """Call after the worker was reaped with `returncode`."""
        if returncode != -signal.SIGKILL:
            return False
        after = self.counter.read() if self.counter else None
        if after is not None and self.before is not None and after > self.before:
            return True
        return kernel_log is not None and kernel_log.oom_killed(self.pid)


def set_oom_score_adj(value: int, pid: int | str = "self", proc_root: str | Path = "/proc") -> bool:
    """Set a process's oom_score_adj; False (and a log line) where that is not permitted.

    Raising it is always allowed. Lowering it below the floor a privileged writer set (systemd's
    OOMScoreAdjust=, podman's --oom-score-adj) takes CAP_SYS_RESOURCE: EACCES otherwise, which is fine.
    """
    try:
        Path(proc_root, str(pid), "oom_score_adj").write_text(f"{value}\n")
    except OSError as exc:
        log.info("cannot set oom_score_adj of %s to %d: %s", pid, value, exc.strerror or exc)
        return False
    return True
