"""The worker's grammar-probe thread, where each new constraint compiles before its request joins the batch: a
fault there fails loudly through the worker's one exit path, and a compile that takes longer than stall_timeout_s
is progress (up to grammar_compile_timeout_s), not a hung GPU.

The slow compile is slow by construction: the worker's test knob OPENARC_DEBUG_PROBE_HOLD_S holds the probe thread
inside the compile's heartbeat for a set time after the real compile, so the test means the same on a machine that
compiles any real regex in a blink."""

from __future__ import annotations

import time

from conftest import http, model_entry, pid_alive, wait_until
from test_tools import CHAT

PROBE_FAULT_ENV = "OPENARC_DEBUG_PROBE_FAULT"  # appliance.worker.engines.llm
PROBE_HOLD_ENV = "OPENARC_DEBUG_PROBE_HOLD_S"  # appliance.worker.engines.llm
STALL_S = 1.0  # above the worker's 0.25 s progress beat with room for a loaded machine
COMPILE_S = 4 * STALL_S  # how long every compile on the probe thread takes in the slow-compile test
SLOW_REGEX = "(amber|river)[a-z]{3}"


def constrained(app, regex: str, timeout: float = 120) -> tuple[int, dict, float]:
    started = time.monotonic()
    status, _, body = http("POST", app.base + "/v1/chat/completions",
                           {"model": "demo", "messages": CHAT, "max_tokens": 8,
                            "structured_outputs": {"regex": regex}}, timeout=timeout)
    return status, body, time.monotonic() - started


def test_a_fault_on_the_probe_thread_fails_its_request_fast_and_the_next_is_served(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]}, env={PROBE_FAULT_ENV: "poison"})
    pid = app.worker_pid("demo")
    status, body, waited = constrained(app, "poison[a-z]{3}", timeout=60)
    assert status == 503 and body["error"]["code"] == "worker_crash", body  # the client is told, and soon
    assert waited < 30
    assert "internal error in the worker's grammar-probe thread: InjectedFault" in app.logs()
    wait_until(lambda: not pid_alive(pid), 10, "the faulted worker gone")
    status, body, _ = constrained(app, "[a-z]{4}")  # waits for the restarted worker (ready_wait_s)
    assert status == 200, body
    assert app.model_status("demo")["pid"] != pid


def test_a_compile_longer_than_stall_timeout_is_progress_up_to_its_own_bound(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model, stall_timeout_s=STALL_S),
                                        model_entry("bounded", demo_model, stall_timeout_s=STALL_S,
                                                    grammar_compile_timeout_s=0.3)]},
                            env={PROBE_HOLD_ENV: str(COMPILE_S)})
    pids = {name: app.worker_pid(name) for name in ("demo", "bounded")}
    status, body, waited = constrained(app, SLOW_REGEX)
    assert status == 200, body
    print(f"the slow constraint was answered after {waited:.1f} s (stall_timeout_s={STALL_S})")
    assert waited >= COMPILE_S > 2 * STALL_S  # it did outlast the stall timer
    assert app.worker_pid("demo") == pids["demo"] and app.model_status("demo")["crashes"] == 0
    # With a compile bound shorter than the compile, the same compile is taken for hung: the stall timer ends it.
    status, _, body = http("POST", app.base + "/v1/chat/completions",
                           {"model": "bounded", "messages": CHAT, "max_tokens": 8,
                            "structured_outputs": {"regex": SLOW_REGEX}}, timeout=120)
    assert status == 504 and body["error"]["code"] == "stall", body
