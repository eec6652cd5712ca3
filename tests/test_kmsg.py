"""The kernel log: kmsg records, KmsgWatcher and KernelLog (appliance.host.kernel_log) on regular files, FIFOs and
the real /dev/kmsg; i915/xe hang lines and reset counting (appliance.host.gpu_events)."""

import errno
import logging
import os
import uuid
from pathlib import Path

import pytest

from appliance.host.kernel_log import GPU_TROUBLE_RECENT_S, KernelLog, KmsgWatcher, oom_killed_pid, parse_kmsg_record
from appliance.host.gpu_events import RESET_WINDOW_US, ResetDeduper, detect_gpu_event
from conftest import run_as_nobody

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def summary(event):
    """The fields a test compares, or None for no event."""
    if event is None:
        return None
    return event.kind, event.bdf, event.engine, event.comm, event.pid, event.counts_as_reset


# --- records ------------------------------------------------------------------------------

def test_abi_example_records():
    raw = fixture("kmsg/dev-kmsg-abi-example.kmsg").splitlines(keepends=True)
    first = parse_kmsg_record("".join(raw[:3]))
    assert (first.facility, first.level, first.seq, first.ts_us, first.flags) == (0, 7, 160, 424069, "-")
    assert first.text == "pci_root PNP0A03:00: host bridge window [io  0x0000-0x0cf7] (ignored)"
    assert first.props == {"SUBSYSTEM": "acpi", "DEVICE": "+acpi:PNP0A03:00"}
    udevd = parse_kmsg_record(raw[4])
    assert (udevd.facility, udevd.level, udevd.text) == (3, 6, "udevd[80]: starting version 181")


def test_extra_fields_and_escapes():
    records = fixture("kmsg/extra-fields-and-escapes.kmsg").splitlines(keepends=True)
    hang = parse_kmsg_record("".join(records[:3]))
    assert (hang.seq, hang.flags) == (40001, "-")  # ",caller=T4242" is ignored
    assert hang.text.endswith("in my\\proc\tx [4242]")
    assert hang.props["DEVICE"] == "+pci:0000:03:00.0"
    fragment = parse_kmsg_record(records[4])
    assert (fragment.flags, fragment.text) == ("c", "printk fragment \u2713 done")


@pytest.mark.parametrize("raw", ["", "hello world\n", "6,1,2;missing flags\n", " SUBSYSTEM=pci\n"])
def test_non_records_are_none(raw):
    assert parse_kmsg_record(raw) is None


def test_escaped_newlines_of_the_xe_wedge_message():
    (line,) = [line for line in fixture("kmsg/xe-b580-wedge-gt.kmsg").splitlines() if "CRITICAL" in line]
    record = parse_kmsg_record(line + "\n")
    assert record.text.splitlines()[1] == "IOCTLs and executions are blocked. Only a rebind may clear the failure"
    assert summary(detect_gpu_event(record.text)) == ("wedged", "0000:03:00.0", None, None, None, True)


# --- single lines -------------------------------------------------------------------------

ELK, MTL, B60 = "0000:00:02.0", "0000:00:02.0", "0000:0b:00.0"
DMESG_EXPECTED = {
    "i915-elkhartlake-openvino9884.txt": [
        ("reset", ELK, "rcs0", None, None, True),
        ("hang", ELK, None, "python3", 4403, False),
        ("hang", ELK, "render", "python3", 4403, True),
    ],
    "i915-mtl-llamacpp16684.txt": [
        ("fence_timeout", MTL, None, None, None, False),
        ("hang", MTL, "render", "llama-server", 1808332, True),
        ("hang", MTL, None, "llama-server", 1808332, False),
    ],
    "i915-dg2-ccsmode-fix.txt": [("fence_timeout", "0000:03:00.0", None, "clpeak", 2387, False)],
    "i915-nixos-heartbeat.txt": [
        ("hang", ELK, None, None, None, True),
        ("hang", ELK, None, None, None, False),
        ("reset", ELK, "rcs0", None, None, True),
    ],
    "i915-clearlinux2907-guc-reset.txt": [
        ("reset", ELK, None, None, None, True),
        ("reset", ELK, "rcs0", None, None, True),
    ],
    "xe-b60-vllm55425.txt": [
        ("reset", B60, "ccs", None, None, True),
        ("hang", B60, None, "<proc>", None, True),
    ],
    # GuC load failure at probe is not a reset; the wedge after it is. The third line is
    # dmesg's indented continuation of the wedge record.
    "xe-b580-guc-load-wedged.txt": [None, ("wedged", "0000:03:00.0", None, None, None, True), None],
}


def test_every_dmesg_fixture_has_expectations():
    assert sorted(path.name for path in (FIXTURES / "dmesg").iterdir()) == sorted(DMESG_EXPECTED)


@pytest.mark.parametrize("name", sorted(DMESG_EXPECTED))
def test_real_kernel_lines(name):
    lines = fixture(f"dmesg/{name}").splitlines()
    assert [summary(detect_gpu_event(line)) for line in lines] == DMESG_EXPECTED[name]


def test_event_details():
    hang = detect_gpu_event("i915 0000:03:00.0: [drm] GPU HANG: ecode 12:10:85dffffb, in python3 [4242]")
    assert (hang.driver, hang.engine, hang.detail) == ("i915", "compute", "12:10:85dffffb")
    backport = detect_gpu_event("i915 0000:03:00.0: [drm] GPU HANG: ecode 12:10:85dffffb, ccs0 in python3 [4242]")
    assert (backport.engine, backport.comm, backport.pid) == ("ccs0", "python3", 4242)
    reset = detect_gpu_event("i915 0000:00:02.0: [drm] GT0: Resetting chip for stopped heartbeat on rcs0")
    assert reset.detail == "stopped heartbeat on rcs0"
    timeout = detect_gpu_event(
        "xe 0000:03:00.0: [drm] GT0: Timedout job: seqno=4294967250, lrc_seqno=4294967250, guc_id=4, flags=0x0"
        " in python3 [5120]"
    )
    assert (timeout.driver, timeout.comm, timeout.pid, timeout.detail) == ("xe", "python3", 5120, "seqno=4294967250")


@pytest.mark.parametrize(
    "line",
    [
        "NET: Registered protocol family 10",
        "reset started",  # no drm prefix: not a GPU line
        "amdgpu 0000:03:00.0: [drm] GPU reset begin!",
        "xe 0000:03:00.0: [drm] GT0: ccs_mode 1",
        "i915 0000:03:00.0: [drm] *ERROR* GT0: load failed: status = 0x80007134",
    ],
)
def test_other_lines_are_not_gpu_events(line):
    assert detect_gpu_event(line) is None


# --- counting -----------------------------------------------------------------------------

HANG = "i915 0000:03:00.0: [drm] GPU HANG: ecode 12:10:85dffffb, in python3 [4242]"
GUILTY = "i915 0000:03:00.0: [drm] python3[4242] context reset due to GPU hang"


def test_dedupe_window_is_per_device_and_fixed():
    dedupe = ResetDeduper()
    other_card = HANG.replace("0000:03:00.0", "0000:07:00.0")
    stream = [(HANG, 0), (GUILTY, 1), (HANG, RESET_WINDOW_US - 1), (other_card, 5), (HANG, RESET_WINDOW_US),
              (HANG, 2 * RESET_WINDOW_US - 1)]
    counted = [dedupe.admit(detect_gpu_event(line), ts).counts_as_reset for line, ts in stream]
    assert counted == [True, False, False, True, True, False]


# --- KmsgWatcher --------------------------------------------------------------------------

def append(path: Path, text: str) -> None:
    with open(path, "a") as file:
        file.write(text)


def replay(tmp_path: Path, *names: str):
    source = tmp_path / "kmsg"
    source.write_text(fixture("kmsg/dev-kmsg-abi-example.kmsg"))  # old records, before the watcher
    with KmsgWatcher(source) as watcher:
        for name in names:
            append(source, fixture(f"kmsg/{name}"))
        return watcher.poll()


def test_i915_guc_hang_sequence_counts_once(tmp_path):
    events = replay(tmp_path, "i915-a770-guc-hang.kmsg")
    assert [(event.kind, event.counts_as_reset) for event in events] == [
        ("fence_timeout", False), ("hang", True), ("hang", False), ("hang", False),
    ]
    assert [event.ts_us for event in events] == [912345678, 914120331, 914120502, 914131977]
    assert {event.bdf for event in events} == {"0000:03:00.0"}


@pytest.mark.parametrize("name", ["xe-b580-wedge-gt.kmsg", "xe-b580-wedge-tile.kmsg"])
def test_xe_timeout_reset_wedge_sequence_counts_once(tmp_path, name):
    events = replay(tmp_path, name)
    assert [(event.kind, event.counts_as_reset) for event in events] == [
        ("reset", True), ("hang", False), ("hang", False), ("hang", False), ("reset", False), ("reset", False),
        ("reset", False), ("reset", False), ("wedged", False), ("wedged", False),
    ]
    assert summary(events[0]) == ("reset", "0000:03:00.0", "ccs", None, None, True)
    assert (events[1].comm, events[1].pid) == ("python3", 5120)


def test_tile_and_gt_prefixes_give_the_same_events(tmp_path):
    def key(event):
        return summary(event), event.detail, event.ts_us
    (tmp_path / "gt").mkdir()
    (tmp_path / "tile").mkdir()
    gt = replay(tmp_path / "gt", "xe-b580-wedge-gt.kmsg")
    tile = replay(tmp_path / "tile", "xe-b580-wedge-tile.kmsg")
    assert [key(event) for event in gt] == [key(event) for event in tile]


def test_two_hangs_far_apart_count_twice(tmp_path):
    events = replay(tmp_path, "i915-a770-guc-hang.kmsg", "xe-b580-wedge-gt.kmsg")
    assert sum(event.counts_as_reset for event in events) == 2


def test_user_space_records_are_not_gpu_events(tmp_path):
    # The facility-1 record is what `echo ... > /dev/kmsg` would produce.
    events = replay(tmp_path, "extra-fields-and-escapes.kmsg")
    assert [summary(event) for event in events] == [("hang", "0000:03:00.0", "compute", "my\\proc\tx", 4242, True)]


def test_old_records_are_skipped_and_each_record_is_read_once(tmp_path):
    source = tmp_path / "kmsg"
    source.write_text(fixture("kmsg/i915-a770-guc-hang.kmsg"))
    with KmsgWatcher(source) as watcher:
        assert watcher.poll() == []
        append(source, fixture("kmsg/xe-b580-wedge-gt.kmsg"))
        assert len(watcher.poll()) == 10
        assert watcher.poll() == []


# --- KernelLog: what a failing worker is checked against -------------------------------------

class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def kernel_log(tmp_path: Path) -> tuple[KernelLog, Path, Clock, list]:
    """A KernelLog on a file that already holds old records; appended records are what the kernel logs next."""
    source = tmp_path / "kmsg"
    source.write_text(fixture("kmsg/dev-kmsg-abi-example.kmsg") + fixture("kmsg/oom-kill-global.kmsg"))
    clock, resets = Clock(), []
    return KernelLog(source, on_reset=resets.append, clock=clock), source, clock, resets


@pytest.mark.parametrize("name", ["i915-a770-guc-hang.kmsg", "xe-b580-wedge-gt.kmsg", "xe-b580-wedge-tile.kmsg"])
def test_a_gpu_hang_explains_failures_for_a_while_after_it_was_read(tmp_path, name):
    log, source, clock, resets = kernel_log(tmp_path)
    with log:
        assert log.gpu_trouble() is None
        append(source, fixture(f"kmsg/{name}"))
        clock.now += 5  # the worker fails 5 s after the last poll: the question reads the new records itself
        trouble = log.gpu_trouble()
        assert trouble is not None and trouble.bdf == "0000:03:00.0"
        assert [event.counts_as_reset for event in resets] == [True]  # the metric and log line, once
        clock.now += GPU_TROUBLE_RECENT_S - 0.1
        assert log.gpu_trouble() == trouble
        clock.now += 0.2
        assert log.gpu_trouble() is None
        assert len(resets) == 1


def test_oom_kills_of_the_kernel_are_remembered_by_pid(tmp_path):
    log, source, _, _ = kernel_log(tmp_path)
    with log:
        assert not log.oom_killed(31337)  # killed before the front started: not ours to explain
        append(source, fixture("kmsg/oom-kill-memcg-v1.kmsg") + fixture("kmsg/oom-kill-global.kmsg"))
        assert log.oom_killed(9734) and log.oom_killed(31337)
        assert not log.oom_killed(4040)  # a user-space record claiming a kill
        assert log.gpu_trouble() is None


def test_oom_kill_lines():
    records = [parse_kmsg_record(line + "\n") for line in fixture("kmsg/oom-kill-global.kmsg").splitlines()]
    assert [oom_killed_pid(record) for record in records] == [None, None, 31337, None, None]
    older_kernel = parse_kmsg_record("3,1,2,-;Killed process 77 (python3) total-vm:1024kB, anon-rss:512kB\n")
    assert oom_killed_pid(older_kernel) == 77


def test_fifo_with_records_split_across_writes(tmp_path):
    fifo = tmp_path / "kmsg.fifo"
    os.mkfifo(fifo)
    stream = fixture("kmsg/xe-b580-wedge-gt.kmsg").encode()
    cut = stream.index(b"reset queued") + 3  # inside a record's text
    with KmsgWatcher(fifo) as watcher:
        writer = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        try:
            os.write(writer, stream[:cut])
            first = watcher.poll()
            os.write(writer, stream[cut:])
            second = watcher.poll()
        finally:
            os.close(writer)
        assert watcher.poll() == []  # writer gone: EOF, no error
        assert watcher.unavailable is None
    assert first[-1].detail == "trying reset from guc_exec_queue_timedout_job"
    assert second[0].detail == "reset queued"
    assert len(first) + len(second) == 10


def test_missing_source_is_reported_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.host.kernel_log"):
        watcher = KmsgWatcher(tmp_path / "no-such-kmsg")
        assert [watcher.poll(), watcher.poll(), watcher.poll_records()] == [[], [], []]
    assert "No such file or directory" in watcher.unavailable
    assert len(caplog.records) == 1


def test_unreadable_source_is_reported_once(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="appliance.host.kernel_log"):
        watcher = KmsgWatcher(tmp_path)  # a directory opens, but read() fails (EISDIR or EINVAL)
        assert [watcher.poll(), watcher.poll()] == [[], []]
    assert watcher.unavailable.startswith(f"cannot read {tmp_path}: ")
    assert len(caplog.records) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_real_dev_kmsg_refused_to_an_unprivileged_user():
    # kernel.dmesg_restrict=1 (or no CAP_SYSLOG) makes open(/dev/kmsg) fail with EPERM.
    code = (
        "from appliance.host.kernel_log import KmsgWatcher\n"
        "watcher = KmsgWatcher()\n"
        "print(watcher.poll(), watcher.poll(), watcher.unavailable)\n"
    )
    result = run_as_nobody(code, "host/kernel_log", "host/gpu_events", "host/telemetry")
    restricted = Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1"
    assert result.returncode == 0, result.stderr
    if restricted:
        assert result.stdout == "[] [] cannot open /dev/kmsg: Operation not permitted\n"
        assert result.stderr.count("GPU reset detection from the kernel log is off") == 1
    else:
        assert result.stdout == "[] [] None\n"


def test_overrun_is_counted_and_reading_goes_on(tmp_path, monkeypatch, caplog):
    # EPIPE only comes from the real /dev/kmsg after its ring overwrote unread records;
    # forcing that here would wipe the machine's kernel log, so one read fails on purpose.
    source = tmp_path / "kmsg"
    source.touch()
    real_read = os.read
    failures = iter([BrokenPipeError(errno.EPIPE, "Broken pipe")])

    def read_after_an_overrun(fd, size):
        failure = next(failures, None) if os.fstat(fd).st_ino == source.stat().st_ino else None
        if failure:
            raise failure
        return real_read(fd, size)

    with KmsgWatcher(source) as watcher:
        append(source, fixture("kmsg/i915-a770-guc-hang.kmsg"))
        monkeypatch.setattr(os, "read", read_after_an_overrun)
        with caplog.at_level(logging.WARNING, logger="appliance.host.kernel_log"):
            events = watcher.poll()
    assert watcher.overruns == 1 and watcher.unavailable is None
    assert sum(event.counts_as_reset for event in events) == 1
    assert "overrun" in caplog.text


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK | os.W_OK), reason="needs read and write access to /dev/kmsg")
def write_kmsg(text: str) -> None:
    kmsg = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        os.write(kmsg, f"<7>{text}\n".encode())  # user facility, debug level: no GPU event
    finally:
        os.close(kmsg)


def test_real_dev_kmsg_starts_at_the_end_and_sees_new_records():
    earlier, marker = (f"openarc-test: kmsg watcher probe {uuid.uuid4()}" for _ in range(2))
    write_kmsg(earlier)
    with KmsgWatcher() as watcher:
        old = watcher.poll_records()
        write_kmsg(marker)
        new = watcher.poll_records()
        assert watcher.poll() == []
    assert earlier not in {record.text for record in old + new}  # what was there before the start is skipped
    mine = [record for record in new if record.text == marker]
    assert [(record.facility, record.level) for record in mine] == [(1, 7)]
