"""The worker's grammar-probe thread, where each new constraint compiles before its request joins the batch: a
fault there fails loudly through the worker's one exit path, and a compile that takes longer than stall_timeout_s
is progress (up to grammar_compile_timeout_s), not a hung GPU.

The slow compile is slow by construction: the worker's test knob OPENARC_DEBUG_PROBE_HOLD_S holds the probe thread
inside the compile's heartbeat for a set time after the real compile, so the test means the same on a machine that
compiles any real regex in a blink."""

from __future__ import annotations

import json
import threading
import time

from hypothesis import given
from hypothesis import strategies as st

from appliance.worker.engines.constraints import cost_verdict, probed_parts

from bench.hostile import ambiguous_alternatives, custom_tool
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


# --- what a grammar costs the engine thread: bounded by the probe's budgets ----------------------------------

CHUNK_GAP_BOUND_S = 8.0  # only a hang: before the budgets the 27 KB grammar held the other client 20 s


@given(st.lists(st.floats(0, 60), max_size=12), st.floats(0.01, 30), st.floats(0.01, 30))
def test_the_cost_verdict_refuses_exactly_the_probes_past_a_budget(seconds, compile_budget, step_budget):
    verdict = cost_verdict(seconds, compile_budget, step_budget)
    over_compile = bool(seconds) and seconds[0] > compile_budget
    over_step = any(s > step_budget for s in seconds[1:])
    assert (verdict is not None) == (over_compile or over_step)
    if verdict is not None:  # it names the key an operator would change
        assert ("grammar_compile_budget_s" if over_compile else "grammar_step_budget_s") in verdict
        for more in (0.0, 1e9):  # a probe that went on never turns a refusal into an acceptance
            assert cost_verdict(seconds + [more], compile_budget, step_budget) is not None


TOOLS = st.lists(st.one_of(
    st.builds(lambda n: {"name": n, "parameters": '{"type": "object"}'}, st.text("abc", min_size=1, max_size=3)),
    st.builds(lambda n, kind: {"name": n, "custom": {"type": kind, kind: "x", "grammar": 'root ::= "x"'}
                               if kind == "regex" else {"type": kind, kind: 'root ::= "x"'} if kind == "grammar"
                               else {"type": kind}},
              st.text("abc", min_size=1, max_size=3), st.sampled_from(["grammar", "regex", "text"]))), max_size=6)


@given(TOOLS, TOOLS)
def test_each_tools_input_is_probed_on_its_own_whatever_tools_come_with_it(tools, others):
    constraint = {"type": "tool_calls", "tools": tools, "required": False, "single": False}
    parts = probed_parts(constraint, "hermes")
    assert parts[0] == ("", constraint, "hermes")  # the whole (its compile and that it compiles at all)
    expected = [t for t in tools if t.get("custom", {}).get("type") != "text"]
    assert [label for label, _, _ in parts[1:]] == [f"tool {t['name']!r}: " for t in expected]
    assert all(parser is None and part["type"] in ("grammar", "regex", "json_schema") for _, part, parser in parts[1:])
    # a tool's own part is the same in any tool set: a set that changes by one tool probes that tool alone
    alone = {json.dumps(p, sort_keys=True) for t in expected for _, p, _ in probed_parts(
        {**constraint, "tools": [t]}, "hermes")[1:]}
    mixed = {json.dumps(p, sort_keys=True) for _, p, _ in probed_parts(
        {**constraint, "tools": others + tools}, "hermes")[1:]}
    assert alone <= mixed
    assert probed_parts({"type": "grammar", "grammar": 'root ::= "x"'}, None) == [
        ("", {"type": "grammar", "grammar": 'root ::= "x"'}, None)]


def stream_while(app, model: str, busy: threading.Event) -> list[float]:
    """Chat streams back to back on the model while busy is set; the arrival time of every chunk."""
    arrivals = [time.monotonic()]
    while busy.is_set():
        stream = app.client().chat.completions.create(model=model, messages=CHAT, max_tokens=200, stream=True)
        for _ in stream:
            arrivals.append(time.monotonic())
    return arrivals


def test_a_grammar_that_costs_the_engine_seconds_is_refused_while_another_client_streams(appliance_factory,
                                                                                        demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})
    pid = app.worker_pid("demo")
    busy = threading.Event()
    busy.set()
    arrivals: list[float] = []
    streamer = threading.Thread(target=lambda: arrivals.extend(stream_while(app, "demo", busy)))
    streamer.start()
    try:
        wait_until(lambda: app.model_status("demo")["requests_running"] > 0, 30, "the other client streaming")
        body = {"model": "demo", "input": "Patch it", "max_output_tokens": 8, "tool_choice": "required",
                "tools": [custom_tool(ambiguous_alternatives(), True)]}
        started = time.monotonic()
        status, _, reply = http("POST", app.base + "/v1/responses", body, timeout=180)
        waited = time.monotonic() - started
    finally:
        busy.clear()
        streamer.join(120)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    print(f"the 27 KB grammar was answered (status {status}) after {waited:.1f} s; the other client got "
          f"{len(arrivals) - 1} chunks, the longest gap {max(gaps):.2f} s")
    assert max(gaps) < CHUNK_GAP_BOUND_S
    assert status == 400, reply
    error = reply["error"]
    assert error["code"] == "invalid_grammar" and error["param"] == "tools", error
    # refused by either budget (the compile and first mask, or a later mask: which one runs over depends on the
    # machine's speed); the message names the tool and the key that bounds it
    assert "tool 'patch'" in error["message"] and ("grammar_compile_budget_s" in error["message"]
                                                   or "grammar_step_budget_s" in error["message"]), error
    # the verdict is remembered: the same grammar again is refused without a second compile
    started = time.monotonic()
    status, _, reply = http("POST", app.base + "/v1/responses", body, timeout=60)
    assert status == 400 and reply["error"]["code"] == "invalid_grammar", reply
    assert time.monotonic() - started < waited / 2
    assert app.worker_pid("demo") == pid and app.model_status("demo")["crashes"] == 0
