"""The kernel log as openarc reads it: /dev/kmsg records, a non-blocking watcher that turns them into GPU events
(gpu_events.py says which lines are which and counts resets), the OOM killer's "Killed process" lines, and
`KernelLog`, which keeps both to answer a supervisor asking about a worker that just failed.

Kept apart from the other readers because it is the one that holds a file open and is polled: the front's GPU watch
polls it every second, `openarc doctor` reads the whole ring once. The source is a parameter (`/dev/kmsg` by
default) so the tests feed it regular files and FIFOs; it needs no root where kernel.dmesg_restrict allows reading.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from appliance.host.gpu_events import RESET_WINDOW_US, GpuEvent, ResetDeduper, detect_gpu_event

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------------------
# /dev/kmsg records: Documentation/ABI/testing/dev-kmsg
# "prefix,seq,timestamp_us,flags[,more fields];text\n" then " KEY=value\n" lines.
_KMSG_HEADER = re.compile(r"(?P<prefix>\d+),(?P<seq>\d+),(?P<ts>\d+),(?P<flags>[^,;]*)(?:,[^;]*)?;(?P<text>.*)",
                          re.ASCII)
_KMSG_ESCAPE = re.compile(rb"\\x([0-9a-fA-F]{2})")


@dataclass(frozen=True)
class KmsgRecord:
    facility: int  # 0 = kernel; writes to /dev/kmsg from user space get facility >= 1
    level: int  # 3 err, 4 warn, 5 notice, 6 info
    seq: int
    ts_us: int  # microseconds since boot
    flags: str  # "-" or "c" (continuation fragment)
    text: str  # \xNN unescaped, so it may hold newlines
    props: dict[str, str] = field(default_factory=dict)  # SUBSYSTEM=, DEVICE=, ...


def _unescape(text: str) -> str:
    """printk escapes non-printable bytes and '\\' as \\xNN (dev-kmsg ABI)."""
    raw = _KMSG_ESCAPE.sub(lambda match: bytes([int(match[1], 16)]), text.encode("utf-8", "surrogateescape"))
    return raw.decode("utf-8", "replace")


def parse_kmsg_record(raw: str) -> KmsgRecord | None:
    """One record as one read() of /dev/kmsg returns it, or None if it is not one."""
    header, *continuation = raw.rstrip("\n").split("\n")
    match = _KMSG_HEADER.fullmatch(header)
    if not match:
        return None
    prefix = int(match["prefix"])
    props = dict(line[1:].split("=", 1) for line in continuation if line.startswith(" ") and "=" in line)
    return KmsgRecord(
        facility=prefix >> 3,
        level=prefix & 7,
        seq=int(match["seq"]),
        ts_us=int(match["ts"]),
        flags=match["flags"],
        text=_unescape(match["text"]),
        props={key: _unescape(value) for key, value in props.items()},
    )


# A /dev/kmsg read must hold a whole record (else EINVAL); records are at most ~8 KiB.
_KMSG_READ_SIZE = 16384
_KMSG_MAX_READS_PER_POLL = 4096


class KmsgWatcher:
    """Non-blocking reader of a kmsg-format source that reports GPU events as they come.

    It starts at the end (SEEK_END) so messages from before the start are not counted; `from_start` reads the
    whole ring buffer first (what `openarc doctor` looks for boot messages in).
    If the source cannot be opened or read (EPERM under kernel.dmesg_restrict, missing in
    a container) it says so once in the log and `poll` returns [] from then on.
    """

    def __init__(self, path: str | Path = "/dev/kmsg", *, window_us: int = RESET_WINDOW_US, from_start: bool = False):
        self.path = str(path)
        self.from_start = from_start  # a one-off read (doctor's), not the reset watch: no warning when unreadable
        self.unavailable: str | None = None  # why the source is not read, once known
        self.overruns = 0  # EPIPE count: records lost because we read too slowly
        self._pending = b""
        self._dedupe = ResetDeduper(window_us)
        self._fd: int | None = None  # set first: _open() may give up and close() at once
        self._fd = self._open()

    def _open(self) -> int | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as err:
            self._give_up(f"cannot open {self.path}: {err.strerror}")
            return None
        with contextlib.suppress(OSError):  # a FIFO cannot seek (ESPIPE) and holds nothing old anyway
            os.lseek(fd, 0, os.SEEK_SET if self.from_start else os.SEEK_END)
        return fd

    def _give_up(self, reason: str) -> None:
        if not self.from_start:
            log.warning("GPU reset detection from the kernel log is off: %s", reason)
        self.unavailable = reason
        self.close()

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> KmsgWatcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def poll(self) -> list[GpuEvent]:
        """GPU events of the kernel's records that arrived since the last poll."""
        return [event for record in self.poll_records() if (event := self.gpu_event(record))]

    def gpu_event(self, record: KmsgRecord) -> GpuEvent | None:
        """The GPU event a record reports, counted by the reset rule; only the kernel's own records count."""
        event = detect_gpu_event(record.text) if record.facility == 0 else None
        return self._dedupe.admit(event, record.ts_us) if event else None

    def poll_records(self) -> list[KmsgRecord]:
        """All records that arrived since the last poll (poll() uses this)."""
        if self._fd is None:
            return []
        raw_records, self._pending = _split_kmsg_records(self._pending + self._read_available())
        return [record for raw in raw_records if (record := parse_kmsg_record(raw))]

    def _read_available(self) -> bytes:
        chunks = []
        for _ in range(_KMSG_MAX_READS_PER_POLL):
            try:
                chunk = os.read(self._fd, _KMSG_READ_SIZE)
            except BlockingIOError:
                break
            except BrokenPipeError:
                # dev-kmsg: the ring overwrote records we had not read; the next read
                # continues with the oldest record still there.
                self.overruns += 1
                log.warning("kernel log overrun on %s: some records were lost", self.path)
                continue
            except OSError as err:
                self._give_up(f"cannot read {self.path}: {err.strerror}")
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks)


def _split_kmsg_records(buffer: bytes) -> tuple[list[str], bytes]:
    """Whole records in `buffer` and the unfinished rest.

    /dev/kmsg returns one record per read, but a regular file or FIFO with the same format
    returns several at once: a record is a header line plus the " KEY=value" lines after it.
    """
    complete, newline, rest = buffer.rpartition(b"\n")
    if not newline:
        return [], buffer
    records: list[list[str]] = []
    for line in complete.decode("utf-8", "replace").split("\n"):
        if line.startswith(" ") and records:
            records[-1].append(line)
        elif line and not line.startswith(" "):
            records.append([line])
    return ["\n".join(lines) + "\n" for lines in records], rest


# ---------------------------------------------------------------------------------------
# OOM kills: mm/oom_kill.c __oom_kill_process() pr_err("%s: Killed process %d (%s) total-vm:...",
# message) with message "Out of memory" or "Memory cgroup out of memory" (kernels before 5.0 printed
# "Killed process %d (%s) ..." alone).
_OOM_KILLED = re.compile(r"(?:[\w ]+: )?Killed process (?P<pid>\d+) \(", re.ASCII)


def oom_killed_pid(record: KmsgRecord) -> int | None:
    """The pid the kernel OOM killer killed, if the record says so; user-space records never count."""
    match = _OOM_KILLED.match(record.text) if record.facility == 0 else None
    return int(match["pid"]) if match else None


# How long a GPU event in the kernel log explains a worker's failure: a hang is declared ~2.5-8 s after the
# stuck submission and the reset sequence takes up to ~10 s more (see RESET_WINDOW_US).
GPU_TROUBLE_RECENT_S = 30.0
_OOM_KILLS_KEPT = 256


class KernelLog:
    """What the front read from the kernel log, kept to answer questions about a worker that just failed:
    "was there a GPU hang or reset lately?" and "did the OOM killer kill this pid?".

    The front calls update() every second; each question reads what arrived since, so a line written just before
    the failure is seen. `on_reset` is called once per counted reset (the log line and the metric), `on_event` for
    every GPU line.
    """

    def __init__(self, path: str | Path = "/dev/kmsg", *, on_reset: Callable[[GpuEvent], None] | None = None,
                 on_event: Callable[[GpuEvent], None] | None = None, clock: Callable[[], float] = time.monotonic):
        self.watcher = KmsgWatcher(path)
        self.on_reset = on_reset
        self.on_event = on_event  # every GPU line, context lines (fence timeouts) too: the GPU sentinel's
        self.clock = clock
        self._gpu_trouble: dict[str | None, tuple[float, GpuEvent]] = {}  # bdf -> (when seen, last event)
        self._oom_killed: collections.deque[int] = collections.deque(maxlen=_OOM_KILLS_KEPT)

    def update(self) -> None:
        now = self.clock()
        for record in self.watcher.poll_records():
            if event := self.watcher.gpu_event(record):
                self._gpu_trouble[event.bdf] = (now, event)
                if self.on_event:
                    self.on_event(event)
                if event.counts_as_reset and self.on_reset:
                    self.on_reset(event)
            elif (pid := oom_killed_pid(record)) is not None:
                self._oom_killed.append(pid)

    def gpu_trouble(self, within_s: float = GPU_TROUBLE_RECENT_S, bdf: str | None = None) -> GpuEvent | None:
        """The latest GPU hang/reset/wedge line seen in the last `within_s` seconds: of the card at PCI address
        `bdf` (or a line that names no card, which may be its), or of any card when `bdf` is None (unknown)."""
        self.update()
        since = self.clock() - within_s
        recent = [(seen, event) for seen, event in self._gpu_trouble.values()
                  if seen >= since and (bdf is None or event.bdf in (bdf, None))]
        return max(recent, key=lambda item: item[0])[1] if recent else None

    def oom_killed(self, pid: int) -> bool:
        self.update()
        return pid in self._oom_killed

    def close(self) -> None:
        self.watcher.close()

    def __enter__(self) -> KernelLog:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
