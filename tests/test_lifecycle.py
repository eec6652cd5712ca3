"""No silent ends: every way a worker's life can end is a fast error to its callers, a logged reason, and a restart.

Faults are real: the worker's interpreter removed before a respawn (a spawn that raises), bytes that are not a
frame written into the real channel (duplicated out of the worker with pidfd_getfd), an exception raised inside
the real engine thread and inside the stateful pipeline's streamer (the OPENARC_DEBUG_RAISE_AFTER_STEPS knob),
and a worker made to exit 75 (a lost device) by gdb calling _exit(75) inside it. Wall times bound only hangs.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from conftest import REPO as REPO_ROOT, http, model_entry, pid_alive, wait_until
from appliance.host.faults import INTERNAL_MESSAGE

HANG_BOUND_S = 5.0  # well under the default stall_timeout_s (60 s) that a silent end used to cost
CHAT = [{"role": "user", "content": "Say something long."}]
SLOW_STEPS = {"OPENARC_DEBUG_STEP_DELAY_S": "0.005"}


def stream_error(app, model: str, **kwargs) -> tuple[openai.APIError, float, str | None]:
    """Stream a chat answer until the SDK raises; (the error, seconds from the request, last finish_reason)."""
    started = time.monotonic()
    finish = None
    with pytest.raises(openai.APIError) as info:
        for chunk in app.client().chat.completions.create(model=model, messages=CHAT, stream=True, **kwargs):
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
    return info.value, time.monotonic() - started, finish


def log_lines(app, needle: str) -> list[str]:
    return [line for line in app.logs().splitlines() if needle in line]


# --- a spawn that raises --------------------------------------------------------------------------------

def interpreter_we_can_remove(tmp_path: Path) -> Path:
    """A venv of our own that shares this one's packages: its `python` can be deleted while the front runs,
    as an upgrade that removes the interpreter would."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(Path(sys.prefix) / "pyvenv.cfg", venv / "pyvenv.cfg")
    (venv / "lib").symlink_to(Path(sys.prefix) / "lib")
    python = venv / "bin" / "python"
    python.symlink_to(os.path.realpath(sys.executable))
    return python


def test_a_spawn_that_raises_is_logged_retried_and_recovers(appliance_factory, demo_model, tmp_path):
    python = interpreter_we_can_remove(tmp_path)
    # ready_wait_s: 1, so the request below waits out one second of failed restarts, not the default minute
    # no parked spare: it would take the restart, and this is about a fresh spawn that fails
    app = appliance_factory({"server": {"parked_workers": 0}, "models": [model_entry("demo", demo_model, ready_wait_s=1)]},
                            python=str(python))
    pid = app.worker_pid("demo")
    target = os.readlink(python)
    python.unlink()
    os.kill(pid, signal.SIGKILL)
    failing = wait_until(lambda: (m := app.model_status("demo"))["last_exit"] == "spawn_error" and m, 30,
                         "a spawn error reported")
    # Not a model sitting in `loading` with nothing running: no pid, the reason in status and in the log.
    assert failing["pid"] is None and failing["state"] in ("restarting", "loading")
    assert "cannot start the worker: FileNotFoundError" in failing["last_error"]
    assert log_lines(app, "cannot start the worker: FileNotFoundError")
    started = time.monotonic()
    status, headers, body = http("POST", app.base + "/v1/chat/completions", {"model": "demo", "messages": CHAT})
    assert status == 503 and body["error"]["code"] == "model_unavailable" and "Retry-After" in headers
    assert time.monotonic() - started < 1 + HANG_BOUND_S
    python.symlink_to(target)  # the interpreter is back: the next attempt serves again
    app.wait_model("demo", "ready")
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"


def test_spawn_errors_use_up_the_restart_budget_and_the_model_fails(appliance_factory, demo_model, tmp_path):
    python = interpreter_we_can_remove(tmp_path)
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 3, "window_s": 60}
    app = appliance_factory({"server": {"parked_workers": 0},  # a fresh spawn each restart (no spare to take)
                             "models": [model_entry("demo", demo_model, restart=budget),
                                        model_entry("other", demo_model)]}, python=str(python))
    pid = app.worker_pid("demo")
    python.unlink()
    os.kill(pid, signal.SIGKILL)
    failed = app.wait_model("demo", "failed", timeout=30)
    assert "restart budget used up" in failed["last_error"] and "FileNotFoundError" in failed["last_error"]
    status, _, body = http("POST", app.base + "/v1/chat/completions", {"model": "demo", "messages": CHAT})
    assert status == 503 and body["error"]["code"] == "model_failed"
    assert app.model_status("other")["state"] == "ready"  # its worker was spawned before; it never noticed


# --- a worker that writes something that is not a frame ------------------------------------------------

def steal_fd(pid: int, fd: int) -> int:
    """A duplicate of another process's file descriptor (pidfd_open + pidfd_getfd, Linux 5.6)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = libc.syscall(434, pid, 0)  # SYS_pidfd_open
    assert pidfd >= 0, os.strerror(ctypes.get_errno())
    try:
        stolen = libc.syscall(438, pidfd, fd, 0)  # SYS_pidfd_getfd
        assert stolen >= 0, os.strerror(ctypes.get_errno())
        return stolen
    finally:
        os.close(pidfd)


def worker_channel_fd(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return int(argv[argv.index(b"--fd") + 1])


@pytest.mark.parametrize("garbage", [b"\x00\x00\x00\x05hello", b'\x00\x00\x00\x0e{"op":"bogus"}',
                                     b'\x00\x00\x00\x0f{"op":"tokens"}'], ids=["not-json", "unknown-op", "no-fields"])
def test_a_malformed_frame_from_the_worker_fails_its_requests_and_restarts_it(appliance_factory, long_demo_model,
                                                                               garbage):
    app = appliance_factory({"models": [model_entry("victim", long_demo_model)]}, env=SLOW_STEPS)
    pid = app.worker_pid("victim")
    stream = app.client().chat.completions.create(model="victim", messages=CHAT, max_tokens=3000, stream=True)
    next(iter(stream))
    channel = steal_fd(pid, worker_channel_fd(pid))
    os.write(channel, garbage)  # as if the worker wrote it: the front reads it from the same socket
    os.close(channel)
    injected = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - injected < HANG_BOUND_S
    restarted = app.wait_model("victim", "ready", new_pid_not=pid)
    assert restarted["last_exit"] == "protocol_error" and "malformed frame" in restarted["last_error"]
    wait_until(lambda: not pid_alive(pid), 10, "the misbehaving worker killed")


# --- exceptions inside the worker ----------------------------------------------------------------------

@pytest.mark.parametrize("pipeline", ["continuous_batching", "stateful"])
def test_an_exception_in_the_engine_is_a_fast_error_and_a_restart(appliance_factory, long_demo_model, pipeline):
    """The batching engine's loop and the stateful pipeline's streamer both raise after 20 steps; the caller
    gets an error (not a truncated answer with finish_reason stop), at once, and the worker is restarted."""
    app = appliance_factory({"models": [model_entry("demo", long_demo_model, pipeline=pipeline)]},
                            env={"OPENARC_DEBUG_RAISE_AFTER_STEPS": "20"})
    pid = app.worker_pid("demo")
    error, waited, finish = stream_error(app, "demo", max_tokens=200)
    assert waited < HANG_BOUND_S and finish is None
    # the client gets the classified line; the exception's text is the operator's (status, the journal)
    assert error.body["code"] == "internal_error" and error.body["message"] == INTERNAL_MESSAGE
    restarted = app.wait_model("demo", "ready", new_pid_not=pid)
    assert restarted["last_exit"] == "worker_error" and restarted["crashes"] == 1
    assert "InjectedFault" in restarted["last_error"]
    # a whole (non-streaming) request on the new worker fails the same way: a 500 with the reason
    started = time.monotonic()
    status, _, body = http("POST", app.base + "/v1/chat/completions",
                           {"model": "demo", "messages": CHAT, "max_tokens": 200})
    assert status == 500 and body["error"]["code"] == "internal_error"
    assert time.monotonic() - started < HANG_BOUND_S
    assert body["error"]["message"] == INTERNAL_MESSAGE
    assert log_lines(app, "internal error in the worker's engine thread: InjectedFault")


def test_a_short_request_finishes_before_the_fault_and_is_not_harmed(appliance_factory, long_demo_model):
    app = appliance_factory({"models": [model_entry("demo", long_demo_model)]},
                            env={"OPENARC_DEBUG_RAISE_AFTER_STEPS": "20"})
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=5)
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5


# --- a lost device --------------------------------------------------------------------------------------

def test_a_worker_exiting_75_is_a_lost_device_in_status_log_and_metrics(appliance_factory, demo_model):
    if shutil.which("gdb") is None:
        pytest.fail("gdb is needed (make apt-test-deps installs it)")
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})
    pid = app.worker_pid("demo")
    # What the worker does after the plugin reports a lost device, made to happen for real: _exit(75) inside it.
    subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "call (void)_exit(75)"], capture_output=True, timeout=60)
    restarted = app.wait_model("demo", "ready", new_pid_not=pid)
    assert restarted["last_exit"] == "device_lost" and restarted["crashes"] == 1
    assert restarted["last_error"].startswith("worker exited: device lost (exit_75)")
    assert log_lines(app, "device lost (exit_75)")
    metrics = app.metrics()
    assert 'openarc_worker_crashes_total{model="demo",reason="device_lost",signal="exit_75"} 1.0' in metrics
    assert 'openarc_worker_exits_total{model="demo",reason="device_lost"} 1.0' in metrics


# --- the state machine itself ---------------------------------------------------------------------------

def test_every_transition_outside_the_table_is_reported_as_a_bug(caplog):
    from appliance.front.lifecycle import ILLEGAL, TRANSITIONS, Lifecycle, ModelState

    async def attempt(old: ModelState, new: ModelState) -> bool:
        life = Lifecycle("m", lambda *_: None)
        life.state = old
        caplog.clear()
        with caplog.at_level(logging.ERROR, logger="openarc.supervisor"):
            life.enter(new)
        return ILLEGAL in caplog.text

    for old in ModelState:
        for new in ModelState:
            if new is not old:
                assert asyncio.run(attempt(old, new)) == (new not in TRANSITIONS[old]), (old, new)


def test_waiters_wake_on_the_change_itself():
    from appliance.front.lifecycle import Lifecycle, ModelState

    async def scenario() -> tuple[bool, float, bool]:
        life = Lifecycle("m", lambda *_: None)
        waiter = asyncio.create_task(life.wait_for({ModelState.READY}, timeout=30))
        await asyncio.sleep(0)
        life.enter(ModelState.LOADING)
        await asyncio.sleep(0)
        assert not waiter.done()  # a change to another state is not what it waits for
        changed = time.monotonic()
        life.enter(ModelState.READY)
        woke = await waiter
        return woke, time.monotonic() - changed, await life.wait_for({ModelState.FAILED}, timeout=0.01)

    woke, after, timed_out = asyncio.run(scenario())
    assert woke and after < 1.0 and timed_out is False


def test_a_waiter_cancelled_as_the_change_comes_ends_cancelled():
    """What a request waiting for its model's load does when its client leaves just as the model comes up: its wait
    is cancelled in the loop iteration the change wakes it. It must end cancelled, not go on (it would open a request
    handle after its route ended, which nobody closes: tests/test_residency_model.py found it). On Python 3.11
    asyncio.wait_for returned the change and dropped the cancellation."""
    from appliance.front.lifecycle import Changes

    async def scenario() -> str:
        changes = Changes()

        async def waiter() -> str:
            await changes.wait(10)
            return "went on"

        task = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)  # waiting
        changes.notify()
        task.cancel()
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(scenario()) == "cancelled"


def test_no_bounded_wait_of_the_appliance_uses_asyncio_wait_for():
    """The class of the defect above, not its one instance: every bounded wait uses asyncio.timeout."""
    found = [f"{path.relative_to(REPO_ROOT)}:{number}" for path in sorted((REPO_ROOT / "appliance").rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "asyncio.wait_for(" in line and not line.lstrip().startswith("#")]
    assert not found, found
