"""Models on demand on real workers: loaded by their first request, evicted when idle to make room, unloaded after
idle_unload_s, loaded and unloaded through the API and the CLI; never more workers than max_loaded allows."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
import yaml

from audio_samples import multipart, tone, wav_bytes
from conftest import REPO, http, model_entry, parked_spare, pid_alive, quick_side_bench, wait_until

HANG_BOUND_S = 60  # catches hangs only
CHAT = [{"role": "user", "content": "Say something."}]
KEY_ENV = "TEST_OPENARC_ON_DEMAND_KEY"


def on_demand(name: str, path: Path, **overrides) -> dict:
    return model_entry(name, path, load="on_demand", **overrides)


def worker_pids(app) -> list[int]:
    """The front's live model workers, read from /proc (not from what the front says); a parked spare, which holds
    no model (appliance.front.parked), is not one."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        parked = parked_spare(stat, cmdline)
        # a model's worker is `python -m appliance.worker --fd N --spec ...` (the token counter, a module under it)
        if int(fields[1]) == app.proc.pid and fields[0] != "Z" and b"\0appliance.worker\0" in cmdline and not parked:
            pids.append(int(entry.name))
    return pids


class Sampler:
    """The front's live worker processes, sampled from /proc every 10 ms while the block runs: `peak`."""

    def __init__(self, app):
        self.app, self.peak, self.stop = app, 0, threading.Event()
        self.thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, len(worker_pids(self.app)))
            time.sleep(0.01)

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def peak_from_log(app) -> int:
    """The most worker processes the front had at once, counted after the fact from its log: each worker from its
    spawn to its reaping (which covers the process's whole life), so an excursion too short for a sampler counts."""
    live = peak = 0
    for event in re.findall(r"^.*model \S+: worker \d+ (started|reaped)", app.logs(), re.M):
        live += 1 if event == "started" else -1
        peak = max(peak, live)
    return peak


def assert_never_more_than(app, sampler: Sampler, bound: int) -> None:
    assert sampler.peak <= bound, f"sampled {sampler.peak} live workers"
    assert peak_from_log(app) <= bound, f"{peak_from_log(app)} workers at once by the log"


def samples(app, name: str, label: str = "reason") -> dict[str, float]:
    """{label value: count} of one counter, per model: {"a": {"demand": 2.0, ...}}."""
    out: dict[str, dict[str, float]] = {}
    for model, value, count in re.findall(rf'^{name}{{model="([^"]+)",{label}="([^"]+)"}} (\S+)$', app.metrics(), re.M):
        out.setdefault(model, {})[value] = float(count)
    return out


def gauge(app, name: str, model: str) -> float:
    return float(re.search(rf'^{name}{{model="{model}"}} (\S+)$', app.metrics(), re.M).group(1))


def chat(app, model: str, stream: bool, **kwargs) -> str:
    client = app.client(timeout=HANG_BOUND_S, **kwargs)
    if not stream:
        answer = client.chat.completions.create(model=model, messages=CHAT, max_tokens=4)
        return answer.choices[0].finish_reason
    finish = None
    for chunk in client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, stream=True):
        finish = chunk.choices[0].finish_reason if chunk.choices else finish
    return finish


def test_clients_cycling_through_three_models_never_exceed_max_loaded(appliance_factory, demo_model):
    app = appliance_factory({"server": {"max_loaded": 2},
                             "models": [on_demand(name, demo_model) for name in ("a", "b", "c")]})
    assert worker_pids(app) == [] and app.model_status("a")["state"] == "unloaded"
    assert [m.id for m in app.client().models.list()] == ["a", "b", "c"]  # every configured model, loaded or not
    outcomes = []

    def client(offset: int) -> None:
        for i in range(6):
            model = "abc"[(offset + i) % 3]
            try:
                outcomes.append((model, chat(app, model, stream=(i + offset) % 2 == 0)))
            except openai.APIError as exc:
                outcomes.append((model, repr(exc)))

    with Sampler(app) as sampler:
        clients = [threading.Thread(target=client, args=(offset,)) for offset in range(3)]
        for thread in clients:
            thread.start()
        for thread in clients:
            thread.join(HANG_BOUND_S * 3)
    assert len(outcomes) == 18 and all(finish in ("length", "stop") for _, finish in outcomes), outcomes
    assert sampler.peak >= 1
    assert_never_more_than(app, sampler, 2)
    assert len(worker_pids(app)) == app.status()["residency"]["loaded"] <= 2  # and none left over

    log = app.logs()
    evictions = re.findall(r"model (\w+): unloading \(evicted to make room for another model; .*, (\d+) requests "
                           r"to finish\)", log)
    assert evictions and all(running == "0" for _, running in evictions), evictions  # only idle models were evicted
    loads, unloads = samples(app, "openarc_model_loads_total"), samples(app, "openarc_model_unloads_total")
    for model in "abc":
        state = app.model_status(model)["state"]
        assert loads[model]["demand"] == log.count(f"model {model}: unloaded -> loading")
        assert unloads[model]["evicted"] == sum(1 for name, _ in evictions if name == model)
        assert loads[model]["start"] == loads[model]["api"] == unloads[model]["idle"] == unloads[model]["api"] == 0
        # every load is either still resident or was unloaded once
        assert loads[model]["demand"] - unloads[model]["evicted"] == (state == "ready") == gauge(
            app, "openarc_model_loaded", model)
    assert sum(loads[m]["demand"] for m in "abc") >= 4  # three models through two slots: some model came back
    # an unload is a stop, not a crash: every worker that ended was stopped
    assert "openarc_worker_crashes_total{" not in app.metrics()
    exits = samples(app, "openarc_worker_exits_total")
    assert all(set(exits.get(m, {})) <= {"stopped"} for m in "abc"), exits
    assert all(exits.get(m, {}).get("stopped", 0) == unloads[m]["evicted"] for m in "abc"), (exits, unloads)
    waits = re.search(r'^openarc_model_load_wait_seconds_count{model="a"} (\S+)$', app.metrics(), re.M)
    assert float(waits.group(1)) >= 1


def test_a_switch_costs_the_load_not_a_grace_after_the_last_request(appliance_factory, demo_model):
    """A request that ran leaves nothing behind it: with max_loaded 1, a request for b right after one on a evicts a
    at once (no hand-out grace: a's request opened, ran and ended), so b waits for its load only."""
    app = appliance_factory({"server": {"max_loaded": 1},
                             "models": [on_demand("a", demo_model), on_demand("b", demo_model)]})
    started = time.monotonic()
    assert chat(app, "b", stream=False) == "length"  # the same load without a switch: nothing is resident
    load_only = time.monotonic() - started
    assert http("POST", app.base + "/openarc/models/b/unload", timeout=HANG_BOUND_S)[0] == 200
    assert chat(app, "a", stream=False) == "length"  # a short request on a: a is resident and idle
    started = time.monotonic()
    assert chat(app, "b", stream=True) == "length"
    switch = time.monotonic() - started
    # The old 5 s grace would show here; the margin covers a's drain and exit on a loaded machine.
    assert switch < load_only + 2.5, (switch, load_only)
    last_used = re.findall(r"model a: unloading \(evicted to make room for another model; last used ([\d.]+)s ago",
                           app.logs())
    assert last_used and float(last_used[-1]) < 2.5, last_used
    # The switch, visible: its stages in the log, in status and in openarc_model_switch_seconds
    switch = app.model_status("b")["last_switch"]
    assert {"eviction_wait", "old_exit", "handover", "construction", "first_token", "total"} <= set(switch["stages"])
    assert switch["parked"] and switch["stages"]["total"] <= switch_bound(switch)
    assert re.search(r"model b: loaded on demand in [\d.]+s: eviction wait [\d.]+s, old worker exit [\d.]+s, "
                     r"parked hand-over", app.logs())
    counts = re.findall(r'^openarc_model_switch_seconds_count{model="b",stage="(\w+)"} (\S+)$', app.metrics(), re.M)
    assert dict(counts)["total"] == "2.0" and dict(counts)["old_exit"] == "1.0", counts  # two loads, one evicted a


def switch_bound(switch: dict) -> float:
    """A switch's total is its stages' sum (they are consecutive), give or take rounding."""
    return sum(v for k, v in switch["stages"].items() if k != "total") + 0.01


def test_idle_unload_s_unloads_an_idle_model_and_the_next_request_reloads_it(appliance_factory, demo_model):
    app = appliance_factory({"models": [on_demand("idle", demo_model, idle_unload_s=1),
                                        model_entry("pinned", demo_model)]})
    assert chat(app, "idle", stream=False) == "length"
    pid = app.worker_pid("idle")
    assert app.model_status("idle")["memory"]["source"] == "measured"
    app.wait_model("idle", "unloaded", timeout=HANG_BOUND_S)
    wait_until(lambda: not pid_alive(pid), HANG_BOUND_S, "its worker gone")
    assert pid not in worker_pids(app) and len(worker_pids(app)) == 1  # the at_start model stays
    assert gauge(app, "openarc_model_loaded", "idle") == 0
    wait_until(lambda: gauge(app, "openarc_worker_resident_memory_bytes", "idle") == 0, HANG_BOUND_S,
               "its resident memory gauge at 0")  # set once the drain has ended, a moment after the process
    assert http("GET", app.base + "/health")[0] == 200  # an unloaded model is healthy
    assert chat(app, "idle", stream=True) == "length"
    assert app.worker_pid("idle") != pid
    loads, unloads = samples(app, "openarc_model_loads_total"), samples(app, "openarc_model_unloads_total")
    assert (loads["idle"]["demand"], unloads["idle"]["idle"], loads["pinned"]["start"]) == (2, 1, 1)
    status = app.model_status("idle")
    assert (status["load"], status["idle_unload_s"]) == ("on_demand", 1) and status["last_used"] > time.time() - 60
    assert http("GET", app.base + "/ready")[0] == 200


def cli(app, *args: str, key: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    if key:
        env[KEY_ENV] = key
    return subprocess.run([sys.executable, "-m", "appliance", *args, "--url", app.base, "--config", str(app.config_path)],
                          cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=HANG_BOUND_S)


def test_load_and_unload_through_the_api_and_the_cli_with_and_without_the_key(appliance_factory, demo_model, tmp_path):
    app = appliance_factory({"server": {"api_key_env": KEY_ENV},
                             "models": [on_demand("a", demo_model),
                                        on_demand("broken", tmp_path / "no-such-model",
                                                  restart={"backoff_initial_s": 30, "backoff_max_s": 30,
                                                           "max_failures": 5, "window_s": 60})]},
                            env={KEY_ENV: "s3cret"})
    for action in ("load", "unload"):
        status, _, body = http("POST", f"{app.base}/openarc/models/a/{action}")
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        status, _, body = http("POST", f"{app.base}/openarc/models/nope/{action}", headers=app.auth)
        assert status == 404 and body["error"]["code"] == "model_not_found"
    assert app.model_status("a")["state"] == "unloaded"

    status, _, body = http("POST", f"{app.base}/openarc/models/a/load", headers=app.auth, timeout=HANG_BOUND_S)
    assert status == 200 and body["state"] == "ready" and pid_alive(body["pid"])
    pid = body["pid"]
    app.worker_pids.add(pid)
    status, _, body = http("POST", f"{app.base}/openarc/models/a/unload", headers=app.auth, timeout=HANG_BOUND_S)
    assert status == 200 and body["state"] == "unloaded"
    wait_until(lambda: not pid_alive(pid), HANG_BOUND_S, "the unloaded worker gone")

    # A broken path: 503 with the reason; tried again only after the restart policy's backoff, answered at once.
    # The body says how the load ended; the runtime's text (its build's source files, the server's paths) is the
    # operator's: /openarc/status and the log.
    status, headers, body = http("POST", f"{app.base}/openarc/models/broken/load", headers=app.auth,
                                 timeout=HANG_BOUND_S)
    assert status == 503 and "failed to load: worker ended: load_error" in body["error"]["message"], body
    assert "no-such-model" not in body["error"]["message"] and ".cpp" not in body["error"]["message"], body
    assert "no-such-model" in app.model_status("broken")["last_error"] and int(headers["Retry-After"]) >= 1
    started = time.monotonic()
    status, _, again = http("POST", f"{app.base}/v1/chat/completions", {"model": "broken", "messages": CHAT},
                            headers=app.auth, timeout=HANG_BOUND_S)
    assert status == 503 and again["error"]["message"] == body["error"]["message"]
    assert time.monotonic() - started < 5  # no new load attempt inside the backoff
    assert samples(app, "openarc_model_loads_total")["broken"]["api"] == 1
    assert http("GET", app.base + "/ready")[0] == 200  # an on-demand model's failure is its own requests' business

    # The CLI: the key from the environment variable the config names; without it, a clear refusal.
    refused = cli(app, "models")
    assert refused.returncode == 1 and "401" in refused.stderr and "API key" in refused.stderr
    loaded = cli(app, "load", "a", key="s3cret")
    assert loaded.returncode == 0 and loaded.stdout.startswith("a: ready"), loaded.stderr
    listed = cli(app, "models", key="s3cret")
    assert listed.returncode == 0, listed.stderr
    rows = {line.split()[0]: line.split() for line in listed.stdout.splitlines()[1:] if line.strip()}
    assert rows["a"][2:4] == ["ready", "on_demand"] and rows["broken"][2] == "unloaded"
    app.remember_workers()
    unloaded = cli(app, "unload", "a", key="s3cret")
    assert unloaded.returncode == 0 and unloaded.stdout.startswith("a: unloaded"), unloaded.stderr
    missing = cli(app, "load", "nope", key="s3cret")
    assert missing.returncode == 1 and "does not exist" in missing.stderr
    unloads = samples(app, "openarc_model_unloads_total")["a"]
    assert (samples(app, "openarc_model_loads_total")["a"]["api"], unloads["api"]) == (2, 2)


def test_an_unload_lets_a_running_stream_finish_first(appliance_factory, demo_model):
    app = appliance_factory({"models": [on_demand("a", demo_model)]}, env={"OPENARC_DEBUG_STEP_DELAY_S": "0.03"})
    stream = app.client(timeout=HANG_BOUND_S).chat.completions.create(model="a", messages=CHAT, max_tokens=40,
                                                                      stream=True)
    chunks = iter(stream)
    first = next(chunks)
    assert first.choices
    unloaded: list[tuple[int, float]] = []
    unloader = threading.Thread(target=lambda: unloaded.append((
        http("POST", app.base + "/openarc/models/a/unload", timeout=HANG_BOUND_S)[0], time.monotonic())))
    unloader.start()
    wait_until(lambda: app.model_status("a")["state"] == "unloaded", HANG_BOUND_S, "a new unloaded supervisor")
    finish = None
    text = ""
    for chunk in chunks:
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            text += chunk.choices[0].delta.content or ""
    stream_ended = time.monotonic()
    unloader.join(HANG_BOUND_S)
    assert finish == "length" and text  # the stream ran to its end, not cut by the unload
    assert unloaded[0][0] == 200 and unloaded[0][1] >= stream_ended - 0.5  # the unload answered after the drain
    assert worker_pids(app) == []


def test_sigabrt_of_a_worker_while_another_model_loads_on_demand(appliance_factory, demo_model, long_demo_model):
    app = appliance_factory({"server": {"max_loaded": 2},
                             "models": [model_entry("resident", long_demo_model), on_demand("late", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.02"})
    resident = app.worker_pid("resident")
    stream = iter(app.client(timeout=HANG_BOUND_S).chat.completions.create(
        model="resident", messages=CHAT, max_tokens=2000, stream=True))
    assert next(stream).choices  # generating (for 40 s unless cut)
    results: dict[str, object] = {}

    def call(name: str, model: str) -> None:
        try:
            results[name] = chat(app, model, stream=False)
        except openai.APIError as exc:
            results[name] = exc

    late = threading.Thread(target=call, args=("late", "late"))
    late.start()
    app.wait_model("late", "loading", timeout=HANG_BOUND_S)
    os.kill(resident, signal.SIGABRT)
    started = time.monotonic()
    with pytest.raises(openai.APIError):  # the crashed worker's stream ends at once with its error
        for _ in stream:
            pass
    assert time.monotonic() - started < HANG_BOUND_S / 2
    late.join(HANG_BOUND_S)
    assert results["late"] == "length"  # the load it waited for went on, and served it
    app.wait_model("resident", "ready", timeout=HANG_BOUND_S, new_pid_not=resident)
    assert app.client(timeout=HANG_BOUND_S).completions.create(model="resident", prompt="x", max_tokens=2).usage
    crashes = re.findall(r'^openarc_worker_crashes_total{model="resident",reason="crash",signal="SIGABRT"} (\S+)$',
                         app.metrics(), re.M)
    assert crashes == ["1.0"]
    loads = samples(app, "openarc_model_loads_total")
    assert (loads["late"]["demand"], loads["resident"]["start"]) == (1, 1)  # a restart is not a load
    assert len(worker_pids(app)) == 2


def test_the_bench_reports_the_time_to_first_token_of_a_load_against_a_resident_model(tmp_path):
    figures = quick_side_bench("on_demand", tmp_path)
    resident = figures["TTFT, model resident (median)"]
    switching = figures["TTFT, request triggers an evict and a load from the compiled-model cache (median)"]
    assert resident["unit"] == switching["unit"] == "ms" and resident["value"] > 0 and switching["value"] > 0
    fresh = figures["A fresh process: Python start, import OpenVINO GenAI, build the pipeline from the cache (median)"]
    warm = figures["The pipeline's construction alone in a warm process (median)"]
    assert 0 < warm["value"] < fresh["value"]  # an import costs something
    ratios = [f for name, f in figures.items() if name.startswith("Switch against")]
    assert len(ratios) == 2 and all(f["unit"] == "x" and f["target"] for f in ratios)
    stages = {name.split(": ")[1].split(" ")[0] for name in figures if name.startswith("Switch stage")}
    assert {"old_exit", "construction", "first_token", "total"} <= stages  # every round evicted the other model
    assert len(figures) == 9 + len(stages)


def test_memory_budget_evicts_by_declared_footprint_and_reports_measured_ones(appliance_factory, demo_model):
    app = appliance_factory({"server": {"memory_budget": {"CPU": "2GiB"}},
                             "models": [on_demand("a", demo_model, memory="1GiB"),
                                        on_demand("b", demo_model, memory="1GiB"),
                                        on_demand("free", demo_model, device="AUTO:CPU")]})
    assert app.model_status("a")["memory"] == {"bytes": 1 << 30, "source": "declared"}
    assert app.model_status("free")["memory"] == {"bytes": None, "source": "unknown"}
    for model in ("a", "free", "b"):
        assert chat(app, model, stream=False) == "length"
    # b (1 GiB) did not fit beside a (1 GiB) and free's measured footprint within CPU's 2 GiB: a, the least recently
    # used, was evicted (free's RSS, some hundred MiB, fits beside b)
    assert [app.model_status(m)["state"] for m in ("a", "b", "free")] == ["unloaded", "ready", "ready"]
    assert samples(app, "openarc_model_unloads_total")["a"]["evicted"] == 1
    measured = app.model_status("free")["memory"]
    assert measured["source"] == "measured" and measured["bytes"] > 10 << 20  # the worker's RSS at its load
    residency = app.status()["residency"]
    workers = residency.pop("workers")
    assert residency == {"max_loaded": 0, "memory_budget": {"CPU": "2GiB"}, "loaded": 2}
    models = [w for w in workers if w["role"] != "parked"]  # a parked spare holds no model
    assert sorted((w["model"], w["role"], w["pid"]) for w in models) == sorted(
        (m, "serving", app.worker_pid(m)) for m in ("b", "free")) and sorted(worker_pids(app)) == sorted(
        w["pid"] for w in models)  # every model's worker process of the front, and what it is


def test_no_idle_model_to_evict_means_a_bounded_wait_then_503_with_retry_after(appliance_factory, demo_model,
                                                                                 long_demo_model):
    # Two keys: `all` may use every model; `guest` only `other`, and never learns another model's name.
    app = appliance_factory({"server": {"max_loaded": 1, "api_keys": [
                                 {"name": "all", "key_env": "ALL_KEY"},
                                 {"name": "guest", "key_env": "GUEST_KEY", "models": ["other"]}]},
                             "models": [on_demand("busy", long_demo_model),
                                        on_demand("other", demo_model, ready_wait_s=1)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.02", "ALL_KEY": "all-secret",
                                 "GUEST_KEY": "guest-secret"})
    response = app.client(timeout=HANG_BOUND_S, api_key="all-secret").chat.completions.create(
        model="busy", messages=CHAT, max_tokens=2000, stream=True)
    assert next(iter(response)).choices  # `busy` holds the one slot, generating
    started = time.monotonic()
    status, headers, body = http("POST", app.base + "/v1/chat/completions", {"model": "other", "messages": CHAT},
                                 headers=app.auth, timeout=HANG_BOUND_S)
    waited = time.monotonic() - started
    assert status == 503 and body["error"]["code"] == "model_unavailable" and int(headers["Retry-After"]) >= 1
    assert "no room to load model other" in body["error"]["message"] and "busy (ready, busy)" in body["error"]["message"]
    status, _, body = http("POST", app.base + "/v1/chat/completions", {"model": "other", "messages": CHAT},
                           headers={"Authorization": "Bearer guest-secret"}, timeout=HANG_BOUND_S)
    assert status == 503 and "loaded 1 other model;" in body["error"]["message"], body
    assert "busy" not in body["error"]["message"], body
    assert 1 <= waited < HANG_BOUND_S / 2  # it waited ready_wait_s, not forever
    assert app.model_status("busy")["state"] == "ready"  # never evicted mid-request
    response.close()  # the client hangs up: its request ends, and busy is idle
    # Once busy is idle it is evicted for other: a client retrying after Retry-After is served (the load a waiter
    # started goes on after that waiter gave up).
    wait_until(lambda: http("POST", app.base + "/v1/chat/completions", {"model": "other", "messages": CHAT},
                            headers=app.auth, timeout=HANG_BOUND_S)[0] == 200, HANG_BOUND_S, "other served",
               interval=0.5)
    assert app.model_status("busy")["state"] == "unloaded"
    assert samples(app, "openarc_model_unloads_total")["busy"]["evicted"] == 1


def hang_up_on(app, path: str, after_s: float) -> None:
    """POST `path` and hang up after `after_s` without reading an answer (an operator's Ctrl-C, a proxy timeout)."""
    with socket.create_connection(("127.0.0.1", app.port)) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode())
        time.sleep(after_s)


def test_a_client_that_hangs_up_on_an_unload_leaks_no_worker_and_max_loaded_holds(appliance_factory, demo_model):
    app = appliance_factory({"server": {"max_loaded": 1}, "models": [on_demand("a", demo_model), on_demand("b", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.08"})
    with Sampler(app) as sampler:
        stream = iter(app.client(timeout=HANG_BOUND_S).chat.completions.create(model="a", messages=CHAT,
                                                                              max_tokens=40, stream=True))
        assert next(stream).choices  # a generates for about 3 s: its drain waits for it
        a = app.worker_pid("a")
        hang_up_on(app, "/openarc/models/a/unload", after_s=0.3)  # gone mid-drain
        answered: list = []
        other = threading.Thread(target=lambda: answered.append(chat(app, "b", stream=False)))
        other.start()  # b wants the slot a holds until its worker is gone
        finish = None
        for chunk in stream:
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        other.join(HANG_BOUND_S)
    assert finish in ("length", "stop") and answered == ["length"]  # the stream ran to its end, then b was served
    wait_until(lambda: not pid_alive(a), HANG_BOUND_S, "the unloaded worker gone")
    assert_never_more_than(app, sampler, 1)
    assert worker_pids(app) == [app.worker_pid("b")] and app.status()["residency"]["loaded"] == 1


def test_a_stopped_idle_worker_is_killed_to_make_room_within_a_bound(appliance_factory, demo_model):
    app = appliance_factory({"server": {"max_loaded": 1},
                             "models": [on_demand("a", demo_model), on_demand("b", demo_model, ready_wait_s=20)]})
    assert chat(app, "a", stream=False) == "length"
    a = app.worker_pid("a")
    os.kill(a, signal.SIGSTOP)  # wedged: it will never read "shutdown"
    started = time.monotonic()
    assert chat(app, "b", stream=False) == "length"  # a was asked to leave, then killed after the grace
    waited = time.monotonic() - started
    assert not pid_alive(a) and waited < 15, waited  # the grace (3 s) and a load, not ready_wait_s
    assert f"worker {a} did not leave within" in app.logs()
    assert worker_pids(app) == [app.worker_pid("b")]


def test_unloading_a_model_still_loading_kills_its_worker_at_once(appliance_factory, demo_model):
    app = appliance_factory({"models": [on_demand("a", demo_model, load_timeout_s=120)]})
    with socket.create_connection(("127.0.0.1", app.port)) as loader:  # a load, whose caller then gives up
        loader.sendall(b"POST /openarc/models/a/load HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n")
        status = wait_until(lambda: (m := app.model_status("a"))["state"] == "loading" and m["pid"] and m,
                            HANG_BOUND_S, "a worker loading", interval=0.005)
        pid = status["pid"]
        app.worker_pids.add(pid)
        os.kill(pid, signal.SIGSTOP)  # a load that takes forever (a driver stuck compiling)
    wait_until(lambda: app.model_status("a")["requests_waiting"] == 0, HANG_BOUND_S, "the load's caller gone")
    started = time.monotonic()
    code, _, body = http("POST", app.base + "/openarc/models/a/unload", timeout=HANG_BOUND_S)
    assert code == 200 and body["state"] == "unloaded", body
    assert time.monotonic() - started < 10 and not pid_alive(pid)  # not load_timeout_s
    assert "model a: loading -> draining" in app.logs()
    assert f"worker {pid} did not leave within" not in app.logs()  # no grace: it had no request to lose


def test_ready_wait_s_0_starts_the_load_and_says_so(appliance_factory, demo_model):
    app = appliance_factory({"models": [on_demand("a", demo_model, ready_wait_s=0)]})
    code, headers, body = http("POST", app.base + "/v1/chat/completions", {"model": "a", "messages": CHAT})
    assert code == 503 and int(headers["Retry-After"]) >= 1, body
    assert "is being loaded now" in body["error"]["message"] and "no room" not in body["error"]["message"]
    app.wait_model("a", "ready", timeout=HANG_BOUND_S)  # loaded though no request waited for it
    assert chat(app, "a", stream=False) == "length"
    assert samples(app, "openarc_model_loads_total")["a"]["demand"] == 1


def test_a_measured_footprint_over_budget_is_refused_until_a_reload_raises_the_budget(appliance_factory, demo_model):
    config = {"server": {"memory_budget": {"CPU": "20MiB"}}, "models": [on_demand("a", demo_model)]}
    app = appliance_factory(config)
    assert chat(app, "a", stream=False) == "length"  # unknown footprint: only max_loaded bounds its first load
    assert app.model_status("a")["memory"]["source"] == "measured"  # some hundred MiB of RSS
    assert http("POST", app.base + "/openarc/models/a/unload", timeout=HANG_BOUND_S)[0] == 200
    code, _, body = http("POST", app.base + "/v1/chat/completions", {"model": "a", "messages": CHAT},
                         timeout=HANG_BOUND_S)
    assert code == 503 and "exceeds server.memory_budget CPU: 20.0 MiB" in body["error"]["message"], body
    config["server"]["memory_budget"] = {"CPU": "8GiB"}
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    wait_until(lambda: "reloaded" in app.logs(), HANG_BOUND_S, "the reload")
    assert chat(app, "a", stream=False) == "length"  # the refusal was not kept
    assert "measured footprint" in body["error"]["message"]  # the 503 said where the figure came from


def test_reload_restart_of_a_loaded_on_demand_model_keeps_max_loaded_and_ready(appliance_factory, demo_model):
    config = {"server": {"max_loaded": 1},
              "models": [on_demand("a", demo_model, reload="restart", max_context=1024), on_demand("b", demo_model)]}
    app = appliance_factory(config, env={"OPENARC_DEBUG_STEP_DELAY_S": "0.08"})
    not_ready: list[int] = []
    stop = threading.Event()

    def readiness() -> None:
        while not stop.is_set():
            code = http("GET", app.base + "/ready", timeout=5)[0]
            if code != 200:
                not_ready.append(code)
            time.sleep(0.02)

    with Sampler(app) as sampler:
        watcher = threading.Thread(target=readiness)
        watcher.start()
        stream = iter(app.client(timeout=HANG_BOUND_S).chat.completions.create(model="a", messages=CHAT,
                                                                              max_tokens=40, stream=True))
        assert next(stream).choices  # the old worker drains for about 3 s
        old = app.worker_pid("a")
        config["models"][0]["max_context"] = 512
        app.config_path.write_text(yaml.safe_dump(config))
        app.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: "model a: switched" in app.logs(), HANG_BOUND_S, "the restart begun")
        answered: list = []
        other = threading.Thread(target=lambda: answered.append(chat(app, "b", stream=False)))
        other.start()
        finish = None
        for chunk in stream:
            finish = chunk.choices[0].finish_reason if chunk.choices else finish
        other.join(HANG_BOUND_S)
        assert finish in ("length", "stop") and answered == ["length"]
        code, _, body = http("POST", app.base + "/v1/completions", {"model": "a", "prompt": "word " * 350},
                             timeout=HANG_BOUND_S)
        stop.set()
        watcher.join()
    assert code == 400 and "512" in body["error"]["message"], body  # the new settings serve
    assert not pid_alive(old)
    assert_never_more_than(app, sampler, 1)
    assert len(worker_pids(app)) == 1
    assert not_ready == []  # an on-demand model's reload is not the whole server's readiness


@contextlib.contextmanager
def held_upload(app, model: str):
    """An audio upload to `model` whose file is read only in part: its place in the model's queue is reserved (the
    model is loaded for it first). Yields the connection and the bytes still to send (finish_upload)."""
    content_type, body = multipart({"model": model, "file": wav_bytes(tone(1.0))})
    split = body.index(b"RIFF") + 1000  # the model field and the first kilobyte of the file
    with socket.create_connection(("127.0.0.1", app.port), timeout=HANG_BOUND_S) as upload:
        upload.sendall(f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\nContent-Type: {content_type}\r\n"
                       f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body[:split])
        time.sleep(0.3)
        upload.sendall(body[split:split + 1000])  # aiohttp reads a chunk ahead before it ends a part
        wait_until(lambda: (m := app.model_status(model))["state"] == "ready" and m["requests_waiting"] == 1,
                   HANG_BOUND_S, f"{model} loaded, the upload's place reserved")
        yield upload, body[split + 1000:]


def finish_upload(upload: socket.socket, rest: bytes) -> bytes:
    """Send the rest of a held upload; the whole HTTP answer."""
    upload.sendall(rest)
    answer = b""
    while chunk := upload.recv(65536):
        answer += chunk
    return answer


def test_an_upload_holding_its_reserved_place_is_busy_past_the_grace_for_eviction_and_drain(appliance_factory, demo_model,
                                                                                           demo_whisper):
    """An audio upload still being read holds a reserved place in its model's queue: the model is busy for as long
    (the hand-out grace ended when it reserved), so it is not evicted for another model, and an unload's drain waits
    for it."""
    app = appliance_factory({"server": {"max_loaded": 1},
                             "models": [on_demand("w", demo_whisper, kind="transcription"),
                                        on_demand("b", demo_model, ready_wait_s=1)]})
    with held_upload(app, "w") as (upload, rest):  # its place reserved: only the reservation keeps w busy now
        code, _, refused = http("POST", app.base + "/v1/chat/completions", {"model": "b", "messages": CHAT},
                                timeout=HANG_BOUND_S)
        assert code == 503 and "w (ready, busy)" in refused["error"]["message"], refused  # w was not evicted
        unloaded: list = []
        unloader = threading.Thread(target=lambda: unloaded.append(
            http("POST", app.base + "/openarc/models/w/unload", timeout=HANG_BOUND_S)[0]))
        unloader.start()
        wait_until(lambda: app.model_status("w")["state"] == "unloaded", HANG_BOUND_S, "the unload under way")
        answer = finish_upload(upload, rest)  # opened on the draining model, which waited for it
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    assert b"hello world" in answer
    unloader.join(HANG_BOUND_S)
    assert unloaded == [200] and worker_pids(app) == []
    assert samples(app, "openarc_model_unloads_total")["w"]["evicted"] == 0


def test_an_upload_whose_model_was_unloaded_under_it_waits_for_the_next_load(appliance_factory, demo_whisper):
    """The unload's drain waits for a reserved place only up to drain_timeout_s; the upload, read after that, is not
    told 503 "shutting down" (the server is not): it waits for the model's next load and is answered."""
    app = appliance_factory({"server": {"drain_timeout_s": 0.5},
                             "models": [on_demand("w", demo_whisper, kind="transcription")]})
    with held_upload(app, "w") as (upload, rest):
        old = app.worker_pid("w")
        code, _, body = http("POST", app.base + "/openarc/models/w/unload", timeout=HANG_BOUND_S)
        assert code == 200 and body["state"] == "unloaded", body  # the drain gave up waiting after 0.5 s
        wait_until(lambda: not pid_alive(old), HANG_BOUND_S, "the unloaded worker gone")
        answer = finish_upload(upload, rest)
    assert answer.startswith(b"HTTP/1.1 200") and b"hello world" in answer, answer[:300]
    assert app.worker_pid("w") != old and samples(app, "openarc_model_loads_total")["w"]["demand"] == 2


def test_an_unload_overtaking_a_side_by_side_reload_leaves_one_worker_per_name(appliance_factory, demo_model):
    """Issue 35's reproduction: a side-by-side reload's replacement stopped while it loads (it holds the load gate),
    an unload, a request that loads the model again, then the replacement resumes. Every worker the front has is one
    status shows; exactly one serves the name; an unload after it leaves none."""
    config = {"models": [on_demand("small", demo_model, max_queue=16, load_timeout_s=120)]}
    app = appliance_factory(config)
    assert chat(app, "small", stream=False) == "length"
    serving = app.worker_pid("small")
    config["models"][0]["max_queue"] = 17
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    replacement = wait_until(lambda: next((p for p in worker_pids(app) if p != serving), None), HANG_BOUND_S,
                             "the replacement's worker", interval=0.002)
    os.kill(replacement, signal.SIGSTOP)  # a load that takes forever, holding the load gate
    app.worker_pids.add(replacement)
    assert "model small: switched" not in app.logs()  # stopped while it loaded, as the reproduction needs
    code, _, body = http("POST", app.base + "/openarc/models/small/unload", timeout=HANG_BOUND_S)
    assert code == 200 and body["state"] == "unloaded", body
    answered: list = []
    loader = threading.Thread(target=lambda: answered.append(chat(app, "small", stream=False)))
    loader.start()  # a fresh load, which waits for the load gate the replacement holds
    time.sleep(0.5)
    with contextlib.suppress(ProcessLookupError):
        os.kill(replacement, signal.SIGCONT)
    loader.join(HANG_BOUND_S)
    assert answered == ["length"]

    def settled() -> bool:
        status = app.status()
        shown = {m["pid"] for m in status["models"] if m["pid"]}
        shown |= {w["pid"] for w in status["residency"].get("workers", []) if w["role"] != "parked"}
        return sorted(worker_pids(app)) == sorted(shown) and len(worker_pids(app)) == 1
    wait_until(settled, HANG_BOUND_S, "one worker, and every worker shown in status")
    assert worker_pids(app) == [app.worker_pid("small")] and app.status()["residency"]["loaded"] == 1
    assert http("POST", app.base + "/openarc/models/small/unload", timeout=HANG_BOUND_S)[0] == 200
    wait_until(lambda: worker_pids(app) == [], HANG_BOUND_S, "no worker after the unload")
    assert app.model_status("small")["state"] == "unloaded"


def parked(app) -> list[int]:
    """The parked spares /openarc/status shows."""
    return [w["pid"] for w in app.status()["residency"]["workers"] if w["role"] == "parked"]


def a_spare(app, other_than: int | None = None) -> int:
    """The pid of a parked spare (not `other_than`), once there is one."""
    return wait_until(lambda: next((p for p in parked(app) if p != other_than), None), HANG_BOUND_S, "a parked worker")


def test_a_parked_worker_takes_the_next_load_and_a_crash_restart_and_is_replaced(appliance_factory, demo_model):
    app = appliance_factory({"models": [on_demand("a", demo_model)]})
    spare = a_spare(app)
    app.worker_pids.add(spare)
    wait_until(lambda: Path(f"/proc/{spare}/comm").read_text().strip() == "openarc-parked", HANG_BOUND_S,
               "the spare's imports done")
    assert worker_pids(app) == []
    assert chat(app, "a", stream=False) == "length"
    assert app.worker_pid("a") == spare  # the load took the spare: no new interpreter, no imports
    assert Path(f"/proc/{spare}/comm").read_text().strip() == "openarc-worker"
    second = a_spare(app, other_than=spare)  # a new spare after the load
    app.worker_pids.add(second)
    assert second != spare and worker_pids(app) == [spare]

    os.kill(second, signal.SIGKILL)  # a parked spare dies: replaced quietly, nothing a model counts
    third = a_spare(app, other_than=second)  # the dead spare replaced
    app.worker_pids.add(third)
    assert f"parked worker {second} exited" in app.logs() and "openarc_worker_crashes_total{" not in app.metrics()

    os.kill(spare, signal.SIGABRT)  # the model's worker crashes: its restart takes the spare too
    app.wait_model("a", "ready", timeout=HANG_BOUND_S, new_pid_not=spare)
    assert app.worker_pid("a") == third
    assert chat(app, "a", stream=True) == "length"
    last = a_spare(app, other_than=third)
    wait_until(lambda: Path(f"/proc/{last}/comm").read_text().strip() == "openarc-parked", HANG_BOUND_S, "imported")
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", Path(f"/proc/{last}/status").read_text(), re.M).group(1))
    print(f"a parked worker's RSS: {rss_kib / 1024:.0f} MiB")  # the figure docs/on-demand.md quotes


def test_parked_workers_0_starts_no_spare(appliance_factory, demo_model):
    app = appliance_factory({"server": {"parked_workers": 0}, "models": [on_demand("a", demo_model)]})
    assert chat(app, "a", stream=False) == "length"
    time.sleep(1)  # a spare would be started right after the load
    assert parked(app) == [] and worker_pids(app) == [app.worker_pid("a")]
    assert [w["role"] for w in app.status()["residency"]["workers"]] == ["serving"]


def test_an_unload_the_server_stop_overtakes_is_answered_503_not_500(appliance_factory, demo_model):
    """Found by the model-based test (tests/test_residency_model.py) on the code before issue 35: an unload still
    draining when SIGTERM came found its model gone and answered 500. It is a 503 "shutting down" now."""
    app = appliance_factory({"server": {"drain_timeout_s": 10}, "models": [on_demand("a", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.08"})
    stream = iter(app.client(timeout=HANG_BOUND_S).chat.completions.create(model="a", messages=CHAT, max_tokens=40,
                                                                          stream=True))
    assert next(stream).choices  # a generates for about 3 s: the unload's drain waits for it
    app.worker_pid("a")
    answered: list = []
    unloader = threading.Thread(target=lambda: answered.append(
        http("POST", app.base + "/openarc/models/a/unload", timeout=HANG_BOUND_S)))
    unloader.start()
    wait_until(lambda: "model a: unloading" in app.logs(), HANG_BOUND_S, "the unload under way")
    app.proc.send_signal(signal.SIGTERM)
    for _ in stream:  # the stream runs to its end: a drain, not a cut
        pass
    unloader.join(HANG_BOUND_S)
    code, _, body = answered[0]
    assert code in (200, 503) and (code == 200 or body["error"]["code"] == "shutting_down"), (code, body)
    assert app.proc.wait(HANG_BOUND_S) == 0


def test_a_request_for_an_unloaded_model_during_the_stop_is_answered_503_not_404(appliance_factory, demo_model):
    """Found by the model-based test's long walk (OPENARC_MODEL_TEST_STEPS=600, with model a replicated; shrunk to
    a request for an unloaded model sent as SIGTERM came): the stop forgets an unloaded model's name at once, and a
    request reaching the front while another model still drained was answered 404 "does not exist" for a
    configured model. During the stop every request is a 503 "shutting down", whatever it names."""
    app = appliance_factory({"server": {"drain_timeout_s": 10},
                             "models": [on_demand("a", demo_model), on_demand("p", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.08"})
    stream = iter(app.client(timeout=HANG_BOUND_S).chat.completions.create(model="a", messages=CHAT, max_tokens=40,
                                                                          stream=True))
    assert next(stream).choices  # a generates for about 3 s: the stop's drain waits for it
    app.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "draining" in app.logs(), HANG_BOUND_S, "the stop under way")
    time.sleep(0.3)  # p, never loaded, is forgotten by now
    for model in ("p", "a", "nonesuch"):
        code, _, body = http("POST", app.base + "/v1/chat/completions", {"model": model, "messages": CHAT,
                                                                         "max_tokens": 4}, timeout=HANG_BOUND_S)
        assert (code, body["error"]["code"]) == (503, "shutting_down"), (model, code, body)
    for _ in stream:
        pass
    assert app.proc.wait(HANG_BOUND_S) == 0
