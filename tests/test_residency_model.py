"""A model-based test of models on demand: hypothesis drives a real front (real supervision, real workers of the demo
models; with OPENARC_MODEL_TEST_REPLICAS=1 model a is replicated, `device: [CPU, CPU]`, so an eviction may take one
replica of it and a reload or a signal meet two workers under one name) through random interleavings of chat
requests (whole, streamed, hung up mid-way), speech requests (whole, streamed, hung up, and streamed speeches whose
model is unloaded once their first audio is out, so that later sentences are opened and their places reserved during
the drain), load and unload calls, config reloads of both kinds, idle unloads, pressure on the two slots
(`max_loaded: 2`) and on the memory budget (model p declares the whole 2 GiB: its load evicts every other model),
workers killed (SIGKILL, SIGABRT), stopped during their load or while serving (a stall) and resumed later, and
SIGTERM.

After each run everything is let settle, then what a user and an operator see must hold: every request got an
answer within its bound; the worker processes alive are exactly the ones /openarc/status shows; no more than
max_loaded of them and their declared footprints within the budget; the loaded gauges say what status says; no
request is left counted as running or waiting, in status or in the queue gauges; no spool file is left; and the
front stops with no worker left behind and no invariant of residency broken (every front here runs with
OPENARC_DEBUG_INVARIANTS=1, checked after every step of the residency owner, the request ledger's included: every
request handle closed once, no spool file outliving its request).

The CI run (240 steps, the same walk every time) took 45 s to 3 minutes on two cores shared with other work. On the code
before issue 35 (2ba2a00, the parent of the owner change; this file with live_worker_children copied in) it
fails at its step 159 (run 10): model p's openarc_requests_waiting stays at 3 after every request was answered
(a replaced supervisor's queue figures left on the name's gauges). The two known defects, each measured with the
other kinds of step left out of the swarm (its first failure ends a walk): the reload-races-unload orphan at step
182 (run 11) without speech steps (two model workers alive, one not in /openarc/status); the speech during a drain
at step 20 (run 1) with speech, load and unload steps only (and at step 121, run 7, of a full walk): a sentence
opened during the drain whose next place could not be reserved, so its handle was never closed, its spool file
stayed, and its place was given back twice (`reserved` -1 on the retired supervisor, which status no longer shows:
the queue gauges kept 8 running and 13 waiting). On today's code the same walk found the gauges' share of that
last class (a name's queue gauges kept a drained speech's figures after its unload): fixed in
Placement._act_retire, regression test tests/test_speech.py::test_a_speech_playing_while_its_model_unloads_....

With OPENARC_MODEL_TEST_REPLICAS=1 and OPENARC_MODEL_TEST_STEPS=400 (2 cores, shared) the walk found, besides the
defects fixed with their regression tests (tests/test_on_demand.py: test_a_request_for_an_unloaded_model_during_
the_stop_...), two that did not reproduce on every run. "BUG: residency invariant: model b: a request handle was never
closed (its request ended)" came from hung-up requests whose model came up as they were cancelled (not from
replicas: asyncio.wait_for dropped the cancellation, appliance.front.lifecycle.Changes.wait; regression test
tests/test_lifecycle.py::test_a_waiter_cancelled_as_the_change_comes_ends_cancelled): a replicated walk
before the fix failed at its 6th run (after 100 steps); three replicated walks after the fix (292, 404 and 409
steps, 2 shared cores) passed.
Still open, not met again since: /openarc/status showing a worker pid of a that was no longer alive after the walk
settled (SIGKILL and SIGABRT of a's workers during speeches unloaded mid-way). Off in CI until that one is found
or ruled out.

OPENARC_MODEL_TEST_STEPS=N runs about N steps instead (e.g. 2000 for a long run), new random walks each time. A
failure found here becomes a named regression test (tests/test_on_demand.py: test_an_unload_overtaking_a_side_by_
side_reload_..., test_an_unload_the_server_stop_...), written from the failing run's steps (hypothesis prints them)
and the front's log in the failure.

A walk over real processes does not replay the same under other load: the failure a run found may not come back
when hypothesis runs the same steps again, or come back at another step. So nothing is shrunk (each shrink is a
replay, minutes of them, that may pass), and when the replay that reports the failure goes otherwise (hypothesis's
FlakyFailure: "Inconsistent results from replaying a test case"), the test fails with the failure the walk found,
not with the replay's inconsistency (a CI run once reported a real BUG line as only "Flaky").
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import random
import re
import signal
import socket
import tempfile
import threading
import time
from http.client import HTTPConnection
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, Phase, settings, strategies as st
from hypothesis.errors import FlakyFailure, HypothesisException
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from appliance.front.invariants import live_worker_children
from conftest import Appliance, http, model_entry, wait_until
from test_on_demand import worker_pids

STEPS_PER_RUN = 20
STEPS = int(os.environ.get("OPENARC_MODEL_TEST_STEPS", "240"))
# The CI run walks the same interleavings every time; a longer run walks new ones.
DERANDOMIZE = "OPENARC_MODEL_TEST_STEPS" not in os.environ
# OPENARC_MODEL_TEST_REPLICAS=1: model a is replicated (two workers under one name). Off in CI until the two
# timing-dependent defects it found are fixed (see the module's docstring).
REPLICAS = os.environ.get("OPENARC_MODEL_TEST_REPLICAS") == "1"
REQUEST_BOUND_S = 90  # every request is answered within this (catches a hang, not a timing)
SETTLE_BOUND_S = 60
MODELS = ("a", "b")  # the chat models that reloads change
SPEECH, PRESSURE = "s", "p"  # a tts model, and a model whose declared footprint is the whole memory_budget
EVERY_MODEL = (*MODELS, SPEECH, PRESSURE)
CHAT = [{"role": "user", "content": "Say something."}]
SENTENCES = ("Hi.", "Ok.", "Go on.", "Yes.", "Done.")  # short: each a few decoder steps of the demo tts
ANSWERS = {200, 429, 503, 504}  # served, queue full, unavailable (loading, no room, shutting down), stalled
SWARM = ("load", "unload", "reload", "signal", "resume", "sigterm", "speech", "pressure")
WALK = {"steps": 0, "runs": 0, "first_failure": None}  # how far the walk went, and where it first failed
CALLS: collections.Counter = collections.Counter()  # (what, outcome) of every call made: what the walk exercised


def base_config(model: Path, tts: Path) -> dict:
    """Two slots and 2 GiB declared: a is replicated (`device: [CPU, CPU]`: units a@CPU#0 and a@CPU#1, 512 MiB and a
    slot each), so a's two replicas fill the slots and b's load (1 GiB) evicts one of them, not the model; a third
    model takes a slot from what is loaded (max_loaded), and p (2 GiB) fits only alone: its load evicts by the
    budget, not by the slots."""
    def entry(name: str, path: Path = model, **overrides) -> dict:
        return model_entry(name, path, load="on_demand", ready_wait_s=15, load_timeout_s=30, stall_timeout_s=3,
                           max_queue=16, **overrides)
    return {"server": {"max_loaded": 2, "memory_budget": {"CPU": "2GiB"}, "drain_timeout_s": 2},
            "models": [entry("a", reload="side_by_side", **(dict(memory="512MiB", device=["CPU", "CPU"]) if REPLICAS
                                                             else dict(memory="1GiB"))),
                       entry("b", reload="restart", idle_unload_s=1, memory="1GiB"),
                       entry(SPEECH, tts, kind="tts", memory="512MiB"),
                       entry(PRESSURE, memory="2GiB")]}


def pids_of(model: dict) -> set[int]:
    """The worker pids /openarc/status shows for a model: its own, or each of its replicas'."""
    return {unit["pid"] for unit in model.get("replicas", [model]) if unit["pid"]}


class Residency(RuleBasedStateMachine):
    model_path: Path
    tts_path: Path

    def __init__(self):
        super().__init__()
        self.tmp = Path(tempfile.mkdtemp(prefix="openarc-model-test-"))
        self.config = base_config(self.model_path, self.tts_path)
        self.spool = self.tmp / "spool"  # the front's TMPDIR: its spool directories
        self.spool.mkdir()
        self.app = Appliance(self.config, self.tmp, env={"OPENARC_DEBUG_STEP_DELAY_S": "0.02",
                                                         "TMPDIR": str(self.spool)})
        self.calls: list[threading.Thread] = []
        self.outcomes: list[tuple[str, object, float]] = []  # (what, status or "hung up" or an exception, seconds)
        self.stopped: set[int] = set()  # workers this run SIGSTOPped
        self.terminated = False
        self.swarm: set[str] = set()

    @initialize(swarm=st.sets(st.sampled_from(SWARM), min_size=2))
    def start(self, swarm):
        """Swarm testing: each run enables some kinds of step only, so that a run dense in a few of them (reloads
        and unloads, say) is as likely as any; requests and pauses are always on."""
        self.swarm = swarm
        self.app.start()

    def enabled(self, kind: str) -> bool:
        return not self.terminated and kind in self.swarm

    # --- what clients do -----------------------------------------------------------------------------------

    def _call(self, what: str, work) -> None:
        def run():
            started = time.monotonic()
            try:
                outcome = work()
            except Exception as exc:  # noqa: BLE001 (an outcome to judge, whatever it is)
                outcome = exc
            self.outcomes.append((what, outcome, time.monotonic() - started))
            CALLS[what.replace("a ", "").replace("b ", ""), outcome if isinstance(outcome, (int, str)) else "error"] += 1
        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        self.calls.append(thread)

    @precondition(lambda self: not self.terminated)
    @rule(model=st.sampled_from(MODELS), how=st.sampled_from(["whole", "streamed", "hung up"]))
    def request(self, model, how):
        body = {"model": model, "messages": CHAT, "max_tokens": 8, "stream": how != "whole"}
        if how == "hung up":
            self._call(f"{model} hung up", lambda: self._hang_up(body))
        else:
            self._call(f"{model} {how}", lambda: http("POST", self.app.base + "/v1/chat/completions", body,
                                                      timeout=REQUEST_BOUND_S)[0])

    def _hang_up(self, body: dict, path: str = "/v1/chat/completions") -> str:
        payload = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", self.app.port), timeout=REQUEST_BOUND_S) as conn:
            conn.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path.encode()
                         + b"Content-Length: %d\r\n\r\n" % len(payload) + payload)
            conn.settimeout(random.choice([0.05, 0.5, 2.0]))  # gone before, during or after its first tokens
            with contextlib.suppress(OSError):
                conn.recv(200)
        return "hung up"

    @precondition(lambda self: self.enabled("speech"))
    @rule(sentences=st.integers(1, len(SENTENCES)), how=st.sampled_from(["whole", "streamed", "hung up"]))
    def speech(self, sentences, how):
        body = {"model": SPEECH, "input": " ".join(SENTENCES[:sentences]), "voice": "alloy", "response_format": "pcm"}
        if how == "hung up":
            self._call("speech hung up", lambda: self._hang_up(body, "/v1/audio/speech"))
            return
        if how == "streamed":
            body["stream_format"] = "sse"
        self._call(f"speech {how}", lambda: self._speak(body, unload=False))

    @precondition(lambda self: self.enabled("speech"))
    @rule()
    def speech_unloaded_midway(self):
        """A streamed speech whose model is unloaded once its first audio is out: its later sentences are opened,
        and their places reserved, while the model drains (a rule of its own, so that a run has a few)."""
        body = {"model": SPEECH, "input": " ".join(SENTENCES), "voice": "alloy", "response_format": "pcm",
                "stream_format": "sse"}
        self._call("speech unloaded mid-way", lambda: self._speak(body, unload=True))

    def _speak(self, body: dict, unload: bool) -> int:
        """A speech read to its end (audio bytes, or SSE audio then done or an error event, its status sent before
        the error); `unload`: the model's unload is called once the first audio event is out."""
        connection = HTTPConnection("127.0.0.1", self.app.port, timeout=REQUEST_BOUND_S)
        try:
            connection.request("POST", "/v1/audio/speech", json.dumps(body), {"Content-Type": "application/json"})
            response = connection.getresponse()
            if response.status == 200 and unload:
                response.readline()  # the first audio delta
                self.unload(SPEECH)
            response.read()
            return response.status
        finally:
            connection.close()

    @precondition(lambda self: self.enabled("pressure"))
    @rule(streamed=st.booleans())
    def pressure(self, streamed):
        """A request for the model that fills the whole budget: its load evicts every other model."""
        body = {"model": PRESSURE, "messages": CHAT, "max_tokens": 8, "stream": streamed}
        self._call("pressure", lambda: http("POST", self.app.base + "/v1/chat/completions", body,
                                            timeout=REQUEST_BOUND_S)[0])

    @precondition(lambda self: self.enabled("load"))
    @rule(model=st.sampled_from(MODELS), stop_its_load=st.booleans())
    def load(self, model, stop_its_load):
        before = set(worker_pids(self.app))
        self._call(f"load {model}", lambda: http("POST", f"{self.app.base}/openarc/models/{model}/load",
                                                 timeout=REQUEST_BOUND_S)[0])
        if stop_its_load:
            self._stop_new_worker(before)

    def _loaded_first(self, model: str) -> str:
        """A model with a worker (or one coming), if there is one, else `model`: an unload or a reload of an
        unloaded model changes nothing worth a step."""
        states = {m["name"]: m["state"] for m in self.app.status()["models"]}
        loaded = [name for name in EVERY_MODEL if states.get(name) not in ("unloaded", "stopped")]
        return model if model in loaded or not loaded else loaded[0]

    @precondition(lambda self: self.enabled("unload"))
    @rule(model=st.sampled_from(EVERY_MODEL))
    def unload_one(self, model):
        self.unload(self._loaded_first(model))

    def unload(self, model):
        self._call(f"unload {model}", lambda: http("POST", f"{self.app.base}/openarc/models/{model}/unload",
                                                   timeout=REQUEST_BOUND_S)[0])

    # --- what operators and the machine do -------------------------------------------------------------------

    @precondition(lambda self: self.enabled("reload"))
    @rule(model=st.sampled_from(MODELS), kind=st.sampled_from(["side_by_side", "restart"]), stop_its_load=st.booleans())
    def reload(self, model, kind, stop_its_load):
        model = self._loaded_first(model)
        entry = next(m for m in self.config["models"] if m["name"] == model)
        entry["reload"], entry["max_queue"] = kind, 33 - entry["max_queue"]  # 16 <-> 17: new settings
        before = set(worker_pids(self.app))
        self.app.config_path.write_text(yaml.safe_dump(self.config))
        self.app.proc.send_signal(signal.SIGHUP)
        if stop_its_load:
            self._stop_new_worker(before)

    def _stop_new_worker(self, before: set[int]) -> None:
        """SIGSTOP the next worker that appears (a load that never ends, holding the load gate), if one does soon."""
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            new = set(worker_pids(self.app)) - before
            if new:
                self._signal(min(new), signal.SIGSTOP)
                return
            time.sleep(0.002)

    def _signal(self, pid: int, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            self.app.worker_pids.add(pid)
            if sig == signal.SIGSTOP:
                self.stopped.add(pid)

    @precondition(lambda self: self.enabled("signal"))
    @rule(sig=st.sampled_from([signal.SIGKILL, signal.SIGABRT, signal.SIGSTOP]), pick=st.integers(0, 3))
    def signal_a_worker(self, sig, pick):
        live = sorted(live_worker_children(self.app.proc.pid))  # a parked spare too
        if live:
            self._signal(live[pick % len(live)], sig)

    @precondition(lambda self: "resume" in self.swarm)
    @rule()
    def resume(self):
        for pid in self.stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self.stopped.clear()

    @rule(seconds=st.sampled_from([0.05, 0.3, 1.2]))
    def pause(self, seconds):
        time.sleep(seconds)  # lets loads, drains, idle timers and stall timers move on

    @precondition(lambda self: self.enabled("sigterm"))
    @rule()
    def sigterm(self):
        self.resume()
        self.app.proc.send_signal(signal.SIGTERM)
        self.terminated = True

    @invariant()
    def the_front_runs_and_says_no_bug(self):
        if self.app.proc is None:
            return
        WALK["steps"] += 1
        bugs = re.findall(r"^.*BUG: .*$", self.app.logs(), re.M)
        if bugs or not (self.terminated or self.app.proc.poll() is None):
            WALK["first_failure"] = WALK["first_failure"] or (WALK["steps"], WALK["runs"] + 1)
        assert self.terminated or self.app.proc.poll() is None, self.app.logs()[-3000:]
        assert not bugs, bugs

    # --- settle, then what must hold -------------------------------------------------------------------------

    def teardown(self):
        WALK["runs"] += 1
        try:
            if self.app.proc is not None:
                self.settle_and_check()
        except AssertionError as exc:
            WALK["first_failure"] = WALK["first_failure"] or (WALK["steps"], WALK["runs"], str(exc)[:600])
            raise
        finally:
            self.resume()
            self.app.stop()  # no worker outlives the front, no illegal transition, no broken invariant
            for path in sorted(self.tmp.rglob("*"), reverse=True):
                path.unlink() if not path.is_dir() else path.rmdir()
            self.tmp.rmdir()

    def settle_and_check(self):
        self.resume()
        for thread in self.calls:
            thread.join(REQUEST_BOUND_S)
        late = [thread for thread in self.calls if thread.is_alive()]
        assert not late, f"{len(late)} requests got no answer within {REQUEST_BOUND_S}s"
        odd = [(what, outcome) for what, outcome, _ in self.outcomes if outcome not in ANSWERS and outcome != "hung up"]
        if self.terminated:  # requests sent as the front stopped may find it gone
            odd = [(w, o) for w, o in odd if not isinstance(o, OSError)]
        assert not odd, odd
        if self.terminated:
            self.app.proc.wait(60)
            return
        with contextlib.suppress(AssertionError):  # not settled within the bound: what is left is judged below
            wait_until(self._settled, SETTLE_BOUND_S, "the front settled", interval=0.2)
        status, live = self.app.status(), live_worker_children(self.app.proc.pid)  # parked spares too
        shown = {pid for m in status["models"] for pid in pids_of(m)}
        shown |= {w["pid"] for w in status["residency"].get("workers", [])}
        problems = []  # every one found, so that a failure names all it broke
        if live != shown:
            problems.append(f"worker processes {sorted(live)}, /openarc/status shows {sorted(shown)}")
        if len(worker_pids(self.app)) > self.config["server"]["max_loaded"]:
            problems.append(f"model workers {worker_pids(self.app)} beyond max_loaded")
        declared = {m["name"]: m["memory"]["bytes"] * len(pids_of(m)) for m in status["models"] if pids_of(m)}
        if sum(declared.values()) > 2 << 30:
            problems.append(f"declared footprints {declared} exceed the 2 GiB budget")
        metrics = self.app.metrics()
        for m in status["models"]:
            loaded = re.search(rf'^openarc_model_loaded{{model="{m["name"]}"}} (\S+)$', metrics, re.M)
            if float(loaded.group(1)) != (m["state"] == "ready"):
                problems.append(f"model {m['name']} is {m['state']}, its gauge says {loaded.group(0)}")
            if (m["requests_running"], m["requests_waiting"]) != (0, 0):
                problems.append(f"model {m['name']}: {m['requests_running']} requests running, "
                                f"{m['requests_waiting']} waiting, after every request was answered")
            for gauge in ("openarc_requests_running", "openarc_requests_waiting"):  # what Prometheus sees
                found = re.search(rf'^{gauge}{{model="{m["name"]}"}} (\S+)$', metrics, re.M)
                if found and float(found.group(1)) != 0:
                    problems.append(f"{found.group(0)} after every request was answered")
        left = sorted(str(path.relative_to(self.spool)) for path in self.spool.glob("openarc-*/*"))
        if left:
            problems.append(f"spool files outlived their requests: {left}")
        assert not problems, problems

    def _settled(self) -> bool:
        """Nothing on its way (no load, drain or restart), the same twice, and the live workers the ones serving."""
        def snapshot():
            status = self.app.status()
            return ([(m["name"], r["state"], r["pid"]) for m in status["models"] for r in m.get("replicas", [m])],
                    sorted(worker_pids(self.app)))
        first = snapshot()
        if any(state in ("loading", "draining", "restarting") for _, state, _ in first[0]):
            return False
        if len(live_worker_children(self.app.proc.pid)) > len(first[1]) + 1:  # more than the models' and a spare
            return False
        time.sleep(0.3)
        return first == snapshot() and first[1] == sorted(pid for _, _, pid in first[0] if pid)


@pytest.mark.slow
def test_random_interleavings_keep_every_worker_owned_and_every_request_answered(demo_model, demo_tts):
    Residency.model_path, Residency.tts_path = demo_model, demo_tts
    try:
        run_state_machine_as_test(Residency, settings=settings(
            max_examples=max(1, STEPS // STEPS_PER_RUN), stateful_step_count=STEPS_PER_RUN, deadline=None,
            suppress_health_check=list(HealthCheck), derandomize=DERANDOMIZE, database=None,
            phases=[Phase.explicit, Phase.generate]))  # no shrinking: see the module's docstring
    except FlakyFailure as flaky:
        raise the_finding(flaky) from flaky
    finally:
        print(f"model test: {WALK['steps']} steps in {WALK['runs']} runs; first failure after (steps, runs): "
              f"{WALK['first_failure']}; calls (what, outcome): {sorted(CALLS.items(), key=str)}")


def the_finding(flaky: FlakyFailure) -> BaseException:
    """The failure a walk found, out of hypothesis's report that its replay went otherwise: the first exception in
    it that is not hypothesis's own (the replay's inconsistency); the report itself if it holds none."""
    pending = list(flaky.exceptions)
    while pending:
        exc = pending.pop(0)
        if isinstance(exc, BaseExceptionGroup):
            pending[:0] = exc.exceptions
        elif not isinstance(exc, HypothesisException):
            return exc
    return flaky


def test_a_failure_its_replay_does_not_repeat_is_reported_as_the_walk_found_it():
    """What the walk above meets under load, on a machine of one rule: a failure at one step of one run that the
    replay does not meet. Hypothesis reports it as FlakyFailure; the test fails with the finding itself."""
    calls = iter(range(1000))

    class FailsOnce(RuleBasedStateMachine):
        @rule()
        def step(self):
            assert next(calls) != 3, "found at the walk's fourth step"

    with pytest.raises(FlakyFailure) as info:
        run_state_machine_as_test(FailsOnce, settings=settings(
            max_examples=5, stateful_step_count=5, deadline=None, database=None, derandomize=True,
            phases=[Phase.explicit, Phase.generate]))
    finding = the_finding(info.value)
    assert isinstance(finding, AssertionError) and str(finding).startswith("found at the walk's fourth step")
