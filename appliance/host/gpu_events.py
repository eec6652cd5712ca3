"""GPU hangs, resets and wedges in i915 and xe kernel log lines: which line reports which event (a table of the
drivers' messages, each with its source), and the rule that counts one reset per hang however many lines it prints.

Pure functions of text and timestamps, kept apart from reading the kernel log (kernel_log.py) so the detection and
the counting rule are tested on recorded lines alone, and `openarc doctor` can read a card's `[drm]` lines with them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from appliance.host.telemetry import BDF


# ---------------------------------------------------------------------------------------
# GPU hang / reset / wedge lines of i915 and xe.
#
# drm_print.h: "<driver> <BDF>: [drm] " then "*ERROR* " for drm_err; xe_gt_printk.h adds
# "GT<n>: ", xe_tile_printk.h (2025) "Tile<n>: " before it. The prefix is taken off first,
# "*ERROR* " is kept so the catch-all row can require it.
_DRM_PREFIX = re.compile(
    rf"(?P<driver>i915|xe) (?P<bdf>{BDF}): \[drm\] (?P<error>\*ERROR\* )?(?:Tile\d+: )?(?:GT\d+: )?", re.ASCII
)
_DMESG_TIME = re.compile(r"\[\s*\d+\.\d+\] ", re.ASCII)  # dmesg's "[40906.406659] ", for pasted lines
_ERR = r"(?:\*ERROR\* )?"

# (pattern, kind, counts_as_reset). First match wins; patterns are anchored at the message
# start. counts_as_reset marks the lines that stand for a hang/reset themselves; the others
# (fence timeouts, guilty-context notes, dumps, xe reset-worker progress) are context.
_KMSG_EVENTS = (
    # i915 gt/intel_gt_requests.c; the timeline is comm[pid] or, on some paths, the BDF.
    (rf"Fence expiration time out (?P<driver>i915)-(?P<bdf>{BDF}):(?:(?P<comm>[^:\[]+)\[(?P<pid>\d+)\]|.*):[0-9a-f]+!",
     "fence_timeout", False),
    # i915_gpu_error.c error_msg(): ecode GRAPHICS_VER:uabi-class-mask:instdone-hash; the
    # intel-gpu-i915-backports DKMS driver adds "<engine> in".
    (r"GPU HANG: ecode (?P<detail>\d+:(?P<class_mask>[0-9a-f]+):[0-9a-f]+)"
     r"(?:, (?:(?P<engine>\w+) )?in (?P<comm>.+) \[(?P<pid>\d+)\])?", "hang", True),
    # i915 gt/intel_reset.c mark_guilty()
    (r"(?P<comm>.+)\[(?P<pid>\d+)\] context reset due to GPU hang", "hang", False),
    # i915 gt/intel_reset.c: full GT reset, then the execlists engine reset.
    (r"Resetting chip for (?P<detail>.+)", "reset", True),
    (r"Resetting (?P<engine>[a-z]+\d+) for (?P<detail>.+)", "reset", True),
    # i915 GuC "*ERROR* GT0: GUC: Engine reset failed on 0:0 (rcs0) ..."; xe_gt.c "reset failed (%pe)"
    (rf"{_ERR}(?P<detail>(?:GUC: Engine )?reset failed.*)", "reset", True),
    # i915_gpu_error.c, 2025+ and older wording
    (r"GPU (?:error state|crash dump) saved to (?P<detail>\S+)", "hang", False),
    # i915 backports / xe pagefault handler
    (r"(?P<detail>page fault @ 0x[0-9a-f]+|Fault response: Unsuccessful.*)", "hang", False),
    # xe_guc_submit.c guc_exec_queue_timedout_job(); " in comm [pid]" only in the newest.
    (r"Timedout job: (?P<detail>seqno=[^,]*).*?(?: in (?P<comm>.+?)(?: \[(?P<pid>\d+)\])?)?$", "hang", True),
    # xe_guc_submit.c: GuC reports it reset an engine.
    (r"Engine reset: engine_class=(?P<engine>\w+)", "reset", True),
    # xe_gt.c reset worker
    (r"reset started", "reset", True),
    (r"(?P<detail>trying reset from \S+|reset queued|reset done)", "reset", False),
    # xe_devcoredump.c
    (r"(?P<detail>Xe device coredump has been created|Check your \S+)", "hang", False),
    # xe_device.c xe_device_declare_wedged()
    (rf"{_ERR}CRITICAL: Xe has declared device (?P<bdf>{BDF}) as wedged", "wedged", True),
    # drm_drv.c drm_dev_wedged_event()
    (r"device wedged, (?P<detail>needs recovery)", "wedged", True),
    (r"device wedged, (?P<detail>but recovered through reset)", "reset", True),
    # catch-all of the reference: any drm_err about a reset
    (r"\*ERROR\* (?P<detail>.*\breset\b.*)", "reset", True),
)
_COMPILED_KMSG_EVENTS = tuple((re.compile(pattern), kind, counts) for pattern, kind, counts in _KMSG_EVENTS)

# i915 uabi engine classes as bits of the ecode mask (i915_gpu_error.c, drm/i915_drm.h).
_ENGINE_CLASS_BITS = {0x1: "render", 0x2: "copy", 0x4: "video", 0x8: "video-enhance", 0x10: "compute"}
_ENGINE_NAME = re.compile(r"\b(?:rcs|bcs|vcs|vecs|ccs)\d+\b", re.ASCII)


@dataclass(frozen=True)
class GpuEvent:
    kind: str  # hang | reset | wedged | fence_timeout
    bdf: str | None
    driver: str | None
    engine: str | None
    comm: str | None
    pid: int | None
    detail: str | None  # reset reason, ecode, recovery methods ...
    counts_as_reset: bool  # see ResetDeduper
    text: str  # the line it came from
    ts_us: int | None = None  # kmsg timestamp, set by KmsgWatcher (kernel_log.py)


def _engine_from_mask(mask_hex: str | None) -> str | None:
    mask = int(mask_hex, 16) if mask_hex else 0
    names = [name for bit, name in _ENGINE_CLASS_BITS.items() if mask & bit]
    return "+".join(names) or None


def _event_from_match(match: re.Match, kind: str, counts: bool, prefix: re.Match | None, line: str) -> GpuEvent:
    groups = {**(prefix.groupdict() if prefix else {}), **{k: v for k, v in match.groupdict().items() if v}}
    detail = groups.get("detail")
    engine_in_detail = _ENGINE_NAME.search(detail or "")
    engine = groups.get("engine") or _engine_from_mask(groups.get("class_mask"))
    return GpuEvent(
        kind=kind,
        bdf=groups.get("bdf"),
        driver=groups.get("driver"),
        engine=engine or (engine_in_detail[0] if engine_in_detail else None),
        comm=groups.get("comm"),
        pid=int(groups["pid"]) if groups.get("pid") else None,
        detail=detail,
        counts_as_reset=counts,
        text=line,
    )


def _drm_split(text: str) -> tuple[str, re.Match | None, str]:
    """(the line, its drm prefix, the message after it with `*ERROR* ` kept) of a record's first line or a dmesg
    line (its "[seconds] " stamp taken off)."""
    line = _DMESG_TIME.sub("", text.split("\n", 1)[0], count=1)
    prefix = _DRM_PREFIX.match(line)
    return line, prefix, (prefix["error"] or "") + line[prefix.end():] if prefix else line


def drm_message(text: str) -> tuple[str, str, str] | None:
    """(driver, PCI address, message) of an i915/xe `[drm]` line, the message without its prefixes (`*ERROR* ` kept,
    `Tile0: GT0: ` taken off); None for other lines."""
    _line, prefix, message = _drm_split(text)
    return (prefix["driver"], prefix["bdf"], message) if prefix else None


def detect_gpu_event(text: str) -> GpuEvent | None:
    """The i915/xe hang, reset or wedge a kernel log line reports, or None.

    Accepts the record text of /dev/kmsg and dmesg lines with their "[seconds] " stamp.
    Only the first line of a multi-line record is looked at. Lines that do not name a
    PCI device (no drm prefix, no BDF in the message) are never GPU events.
    """
    line, prefix, message = _drm_split(text)
    for pattern, kind, counts in _COMPILED_KMSG_EVENTS:
        match = pattern.match(message)
        if match and (prefix or match.groupdict().get("bdf")):
            return _event_from_match(match, kind, counts, prefix, line)
    return None


# Counting resets. One hang shows up as several lines (i915 GuC: fence timeout, GPU HANG,
# guilty context, error state; xe: engine reset, timed-out job, coredump, GT reset, wedge),
# and no line order can be relied on (GuC and execlists paths differ). The rule:
#  1. only lines whose table row says counts_as_reset can count (the hang/reset/wedge lines
#     themselves, never the context lines);
#  2. the first such line for a device counts and opens a window of RESET_WINDOW_US on the
#     kmsg clock; later countable lines for that device inside the window are the same
#     sequence and are passed on with counts_as_reset=False.
# The window is fixed, not extended, so a card that keeps hanging is still counted once per
# window. 30 s covers the sequences seen: xe timeout -> GT reset -> wedge takes ~10.5 s, i915
# fence timeout -> GPU HANG up to 8 s (llama.cpp#16684).
RESET_WINDOW_US = 30_000_000


class ResetDeduper:
    """Applies the counting rule above; `admit` returns the event with counts_as_reset final."""

    def __init__(self, window_us: int = RESET_WINDOW_US):
        self.window_us = window_us
        self._window_start: dict[str | None, int] = {}

    def admit(self, event: GpuEvent, ts_us: int) -> GpuEvent:
        if not event.counts_as_reset:
            return replace(event, ts_us=ts_us)
        start = self._window_start.get(event.bdf)
        is_new = start is None or ts_us - start >= self.window_us
        if is_new:
            self._window_start[event.bdf] = ts_us
        return replace(event, ts_us=ts_us, counts_as_reset=is_new)
