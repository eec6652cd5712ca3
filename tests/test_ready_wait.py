"""ready_wait_s: a request for a model that is loading or restarting waits for it, bounded, instead of a 503."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

from conftest import http, model_entry, wait_until

HANG_BOUND_S = 30  # catches hangs only
SLOW_RESTART = {"backoff_initial_s": 4, "backoff_max_s": 4, "max_failures": 5, "window_s": 60}


def waiting_gauge(app, model: str) -> float:
    match = re.search(rf'^openarc_requests_waiting{{model="{model}"}} (\S+)$', app.metrics(), re.M)
    return float(match.group(1))


def complete(app, model: str = "demo", timeout: float = 60) -> tuple[int, dict, dict, float]:
    started = time.monotonic()
    status, headers, body = http("POST", app.base + "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2},
                                 timeout=timeout)
    return status, headers, body, time.monotonic() - started


def test_a_request_during_a_restart_waits_and_is_answered_by_the_new_worker(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model, restart={**SLOW_RESTART, "backoff_initial_s": 1})]})
    pid = app.worker_pid("demo")
    os.kill(pid, signal.SIGKILL)
    app.wait_model("demo", "restarting")
    status, _, body, waited = complete(app)
    assert status == 200, body
    assert 0.5 < waited < HANG_BOUND_S  # it waited out the 1 s backoff and the load
    assert app.worker_pid("demo") != pid


def test_the_wait_is_bounded_by_ready_wait_s_then_503_with_retry_after(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model, ready_wait_s=1, restart=SLOW_RESTART)]})
    os.kill(app.worker_pid("demo"), signal.SIGKILL)
    app.wait_model("demo", "restarting")
    status, headers, body, waited = complete(app)
    assert status == 503 and body["error"]["code"] == "model_unavailable" and int(headers["Retry-After"]) >= 4
    assert 1 <= waited < HANG_BOUND_S  # it waited ready_wait_s; the 503, not a 200, shows it gave up before the restart


def test_waiting_requests_are_counted_and_a_client_that_gives_up_leaves_the_count(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model, ready_wait_s=30, restart=SLOW_RESTART)]})
    os.kill(app.worker_pid("demo"), signal.SIGKILL)
    app.wait_model("demo", "restarting")
    gave_up: list[BaseException] = []

    def impatient_client() -> None:
        try:
            complete(app, timeout=1)
        except OSError as exc:  # the client's own timeout: it hangs up
            gave_up.append(exc)

    clients = [threading.Thread(target=impatient_client) for _ in range(2)]
    for client in clients:
        client.start()
    wait_until(lambda: waiting_gauge(app, "demo") == 2, HANG_BOUND_S, "2 requests waiting")
    assert app.model_status("demo")["requests_waiting"] == 2
    for client in clients:
        client.join(HANG_BOUND_S)
    assert len(gave_up) == 2
    # Dropped from the wait at once, not when the model comes back.
    wait_until(lambda: waiting_gauge(app, "demo") == 0, HANG_BOUND_S, "no request waiting")
    assert app.model_status("demo")["state"] == "restarting"


def test_a_failed_model_answers_at_once(appliance_factory, demo_model, tmp_path):
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 2, "window_s": 60}
    app = appliance_factory({"models": [model_entry("broken", tmp_path / "no-such-model", ready_wait_s=600,
                                                    restart=budget),
                                        model_entry("demo", demo_model)]}, wait_ready=False)
    app.wait_model("broken", "failed")
    status, _, body, waited = complete(app, "broken")
    assert status == 503 and body["error"]["code"] == "model_failed"
    assert waited < HANG_BOUND_S  # at once: not after ready_wait_s=600


def test_a_request_while_the_model_first_loads_waits_for_it(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]}, wait_ready=False)
    # The first moment the front listens, the model is still loading.
    status, _, body, _ = wait_until(lambda: complete(app), HANG_BOUND_S, "the front listening", interval=0.01)
    assert status == 200, body
