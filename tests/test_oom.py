"""appliance.host.oom: a worker killed by the kernel OOM killer is told apart from any other death.

The counter is found on recorded cgroup layouts of other hosts (tests/fixtures/cgroup, see its README) and on
this machine's real cgroups; the kills are real kernel OOM kills in a small memory cgroup (tests/memcg.py), seen
through the counter and through the kernel log; oom_score_adj is read from a real front and its worker.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from appliance.host import oom
from appliance.host.faults import LOAD_OOM_KILL_HINT, OOM_KILL_HINT
from appliance.host.oom import OomCounter, OomWatch, memory_cgroup_counter
from appliance.host.kernel_log import KernelLog, KmsgWatcher, oom_killed_pid
from appliance.worker.main import LOAD_HOG_ENV
from conftest import model_entry, pid_alive, run_as_nobody, wait_until
from memcg import MemoryCgroup

CGROUP_FIXTURES = Path(__file__).parent / "fixtures" / "cgroup"
PID = 4242
MiB = 1 << 20


def fake_host(tmp_path: Path, layout: str, counter_dir: str, counter_file: str, counter_fixture: str) -> Path:
    """A /proc with our mountinfo and process PID's cgroup file of a recorded layout; its cgroup mounts under
    tmp_path, holding one counter file. Returns the fake /proc."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / str(PID)).mkdir()
    mountinfo = (CGROUP_FIXTURES / f"{layout}.mountinfo").read_text()
    (proc / "self" / "mountinfo").write_text(mountinfo.replace(" /sys/fs/cgroup", f" {tmp_path}/sys/fs/cgroup"))
    shutil.copy(CGROUP_FIXTURES / f"{layout}.cgroup", proc / str(PID) / "cgroup")
    directory = tmp_path / "sys/fs/cgroup" / counter_dir
    directory.mkdir(parents=True)
    shutil.copy(CGROUP_FIXTURES / counter_fixture, directory / counter_file)
    return proc


@pytest.mark.parametrize(("layout", "counter_dir", "counter_file", "counter_fixture", "count"), [
    ("v2-systemd-host", "system.slice/openarc.service", "memory.events", "v2-memory.events", 2),
    ("v2-container-no-cgroupns", "container", "memory.events", "v2-memory.events", 2),
    ("v1-hybrid-build-machine", "memory/process_api/68c3b02d2b7588582649ef214ec5ae4e", "memory.oom_control",
     "v1-memory.oom_control", 0),
])
def test_counter_of_recorded_cgroup_layouts(tmp_path, layout, counter_dir, counter_file, counter_fixture, count):
    proc = fake_host(tmp_path, layout, counter_dir, counter_file, counter_fixture)
    counter = memory_cgroup_counter(PID, proc)
    assert counter == OomCounter(tmp_path / "sys/fs/cgroup" / counter_dir / counter_file)
    assert counter.read() == count


def test_no_counter_where_the_cgroup_is_not_mounted_or_has_no_memory_controller(tmp_path):
    # The hybrid host's v2 hierarchy has no memory.events, and its v1 memory cgroup is not there either.
    proc = fake_host(tmp_path, "v1-hybrid-build-machine", "unified", "cgroup.procs", "v2-systemd-host.cgroup")
    assert memory_cgroup_counter(PID, proc) is None
    assert memory_cgroup_counter(PID + 1, proc) is None  # no such process


def test_counter_of_this_process_on_this_machine():
    counter = memory_cgroup_counter(os.getpid())
    assert counter is not None, "every process here is in a memory cgroup (v1 or v2)"
    own = {line.split(":", 2)[1]: line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()}
    cgroup = own[""] if counter.path.name == "memory.events" else own["memory"]
    assert str(counter.path.parent).endswith(cgroup.rstrip("/"))
    assert isinstance(counter.read(), int)


# --- real kernel OOM kills ----------------------------------------------------------------------------

ALLOCATE_ON_ENTER = "import sys; sys.stdin.readline(); hog = b'x' * (512 << 20); print('survived')"


def start_in(cgroup: MemoryCgroup, code: str = ALLOCATE_ON_ENTER) -> tuple[subprocess.Popen, OomWatch]:
    """A Python child moved into `cgroup`, watched from then on; it waits for a line on stdin."""
    child = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    cgroup.procs_file.write_text(str(child.pid))
    return child, OomWatch.of(child.pid)


def go(child: subprocess.Popen) -> int:
    out, _ = child.communicate("go\n", timeout=60)
    return child.returncode


def test_real_oom_kill_is_told_apart_from_other_deaths():
    with MemoryCgroup(96 * MiB) as cgroup:
        victim, watch = start_in(cgroup)
        assert watch.counter is not None and watch.counter.path.parent == cgroup.path
        assert go(victim) == -signal.SIGKILL
        assert watch.oom_killed(victim.returncode)

        # The same cgroup, after that kill: a SIGKILL from someone else, and a crash, are not OOM kills.
        killed, killed_watch = start_in(cgroup)
        killed.kill()
        killed.communicate(timeout=60)
        assert killed.returncode == -signal.SIGKILL and not killed_watch.oom_killed(killed.returncode)
        aborted, aborted_watch = start_in(cgroup, "import os, sys; sys.stdin.readline(); os.abort()")
        assert go(aborted) == -signal.SIGABRT and not aborted_watch.oom_killed(aborted.returncode)


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="the kernel log is not readable here")
def test_real_oom_kill_is_seen_in_the_kernel_log_where_there_is_no_counter():
    with KernelLog() as kernel_log, MemoryCgroup(96 * MiB) as cgroup:
        victim, _ = start_in(cgroup)
        assert go(victim) == -signal.SIGKILL
        no_counter = OomWatch(victim.pid, None)
        assert no_counter.oom_killed(victim.returncode, kernel_log)
        assert not OomWatch(victim.pid + 1, None).oom_killed(victim.returncode, kernel_log)


# --- oom_score_adj ---------------------------------------------------------------------------------------

def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def test_workers_are_the_oom_killers_first_choice_and_the_front_its_last(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})
    front, worker = app.proc.pid, app.worker_pid("demo")
    assert oom_score_adj(worker) == oom.WORKER_OOM_SCORE_ADJ
    # Lowering takes CAP_SYS_RESOURCE (which even root lacks on this build machine); without it the front keeps
    # what it was started with, and says so in its log.
    if has_cap_sys_resource():
        assert oom_score_adj(front) == oom.FRONT_OOM_SCORE_ADJ
    else:
        assert oom_score_adj(front) == oom_score_adj(os.getpid())
        assert f"cannot set oom_score_adj of self to {oom.FRONT_OOM_SCORE_ADJ}: Permission denied" in app.logs()
    assert app.model_status("demo")["state"] == "ready"


def has_cap_sys_resource() -> bool:
    CAP_SYS_RESOURCE = 24  # linux/capability.h
    effective = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("CapEff:"))
    return bool(int(effective.split()[1], 16) >> CAP_SYS_RESOURCE & 1)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to another user")
def test_lowering_oom_score_adj_without_privilege_is_refused_quietly():
    code = ("from appliance.host.oom import set_oom_score_adj; "
            "print(set_oom_score_adj(-500), open('/proc/self/oom_score_adj').read().strip(), "
            "set_oom_score_adj(900), open('/proc/self/oom_score_adj').read().strip())")
    result = run_as_nobody(code, "host/oom")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", str(oom_score_adj(os.getpid())), "True", "900"]


# --- a real front whose worker the kernel OOM killer ends --------------------------------------------------

def test_worker_oom_killed_while_loading_is_reported_with_the_host_ram_hint(appliance_factory, demo_model):
    # The front and its worker share a 512 MiB memory cgroup, as under systemd's MemoryMax=; the worker touches
    # 1 GiB while loading. The long backoff keeps the model waiting after the first kill, so the front stays up.
    model = model_entry("big", demo_model, restart={"backoff_initial_s": 60, "backoff_max_s": 60,
                                                    "max_failures": 5, "window_s": 600})
    with MemoryCgroup(512 * MiB) as cgroup:
        app = appliance_factory({"models": [model]}, env={LOAD_HOG_ENV: "1024"}, wait_ready=False,
                                prefix=cgroup.shell_prefix())
        status = wait_until(lambda: crashed(app, "big"), 120, "crashed")
        assert app.proc.pid in cgroup.pids() and app.proc.poll() is None  # the front, in the cgroup, survived
        assert status["state"] == "restarting"
        assert status["last_exit"] == "oom_kill"
        assert status["last_error"] == "worker exited: killed by the kernel OOM killer (SIGKILL)"
        assert status["hint"] == LOAD_OOM_KILL_HINT
        assert 'openarc_worker_crashes_total{model="big",reason="oom_kill",signal="SIGKILL"} 1.0' in app.metrics()
        assert (f"model big: worker exited: killed by the kernel OOM killer (SIGKILL) (hint: {LOAD_OOM_KILL_HINT})"
                in app.logs())
        app.stop()


@pytest.mark.skipif(not os.access("/dev/kmsg", os.R_OK), reason="the kill order is read from the kernel log")
def test_under_memory_pressure_the_kernel_takes_a_serving_worker_not_the_process_that_asked(appliance_factory,
                                                                                           demo_model):
    # A ready front and worker in a 512 MiB memory cgroup; then another process of that cgroup, with the default
    # oom_score_adj of 0, allocates until the cgroup is full. The kernel must kill someone: its first choice is the
    # worker (oom_score_adj 800) although the other process holds more memory, and never the front.
    # The allocating process may be killed second: its page fault is retried at once, and while the killed worker's
    # pages are still being freed (exit_mmap hides a dying victim from the OOM killer before its gathered pages are
    # uncharged) the kernel can pick again. Seen on a loaded machine and in a full test run: the worker first, the
    # allocator 3 ms later. So the order of the kernel's kills is what this test reads.
    model = model_entry("demo", demo_model, restart={"backoff_initial_s": 60, "backoff_max_s": 60,
                                                     "max_failures": 5, "window_s": 600})
    with KmsgWatcher() as kernel_log, MemoryCgroup(512 * MiB) as cgroup:
        app = appliance_factory({"models": [model]}, prefix=cgroup.shell_prefix())
        worker = app.worker_pid("demo")
        kills = cgroup.oom_kills
        before = kills.read()
        hog, _ = start_in(cgroup, ALLOCATE_UNTIL_A_KILL.format(pid=worker, counter=kills.path, kills=before))
        out, _ = hog.communicate("go\n", timeout=60)
        status = wait_until(lambda: crashed(app, "demo"), 60, "crashed")
        assert not pid_alive(worker) and app.proc.poll() is None
        killed = [pid for record in kernel_log.poll_records() if (pid := oom_killed_pid(record)) in
                  (worker, hog.pid, app.proc.pid)]
        if hog.returncode == 0:
            assert out.startswith("survived with ") and killed == [worker] and kills.read() == before + 1, out
        else:
            assert hog.returncode == -signal.SIGKILL and killed == [worker, hog.pid], (hog.returncode, killed)
        assert status["last_exit"] == "oom_kill"
        assert status["last_error"] == "worker exited: killed by the kernel OOM killer (SIGKILL)"
        assert status["hint"] == OOM_KILL_HINT  # it was serving, not loading
        assert 'openarc_worker_crashes_total{model="demo",reason="oom_kill",signal="SIGKILL"} 1.0' in app.metrics()
        app.stop()


# 4 MiB at a time, until the cgroup's oom_kill counter moves from {kills}, process {pid} is gone (reaped, or a
# zombie), or 1 GiB is held: it stops at the first kill, whoever it took, and allocates no more than it must.
ALLOCATE_UNTIL_A_KILL = """
import re, sys
sys.stdin.readline()
def alive(pid):
    try:
        return open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
def kills():
    return int(re.search(r"^oom_kill (\\d+)$", open("{counter}").read(), re.M)[1])
held = []
while kills() == {kills} and alive({pid}) and len(held) < 256:
    held.append(b"x" * (4 << 20))
print("survived with", len(held) * 4, "MiB", flush=True)
"""


def crashed(app, model: str) -> dict | None:
    assert app.proc.poll() is None, app.logs()
    status = app.model_status(model)
    return status if status["crashes"] else None
