"""Replicas of one model behind one name (`device: [CPU, CPU]`), for real on the CPU with the demo model: each
conversation keeps to the replica that holds its prefix (cached tokens as the API reports them), a replica killed
under load fails only its own requests, and status and metrics show each replica.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import threading
import time
import uuid

import openai
import pytest
import yaml
from hypothesis import given, settings, strategies as st

from appliance.config import load_config
from appliance.front.api.adapters import on_every_unit
from appliance.front.invariants import live_worker_children
from appliance.front.lifecycle import ModelState
from appliance.front.metrics import Metrics
from appliance.front.request import RequestFailed
from appliance.front.supervisor import Supervisor
from appliance.golden.compare import Difference
from appliance.golden.record import Answer, ModelRecord, save
from conftest import Appliance, http, model_entry, pid_alive, wait_until
from test_lora import lora_dir  # noqa: F401 (a fixture: the demo adapters)
from test_metrics import samples, value

# A short system prompt and long questions: a turn served by a replica that holds only its conversation's turn
# before last (what a router blind to prefixes gives) has well under 80 % of the previous prompt cached.
QUESTION = " ".join(f"Detail {i} of the story matters." for i in range(30))


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    # parked_workers 0: each replica's worker is started for it (no spare to tell apart from the replicas)
    appliance = Appliance({"server": {"parked_workers": 0},
                           "models": [model_entry("twin", demo_model, device=["CPU", "CPU"])]},
                          tmp_path_factory.mktemp("replicas")).start()
    yield appliance
    appliance.stop()


def replicas(app) -> list[dict]:
    return app.model_status("twin")["replicas"]


def both_ready(app) -> list[dict]:
    """/ready answers once one replica serves; the other may still load (one load at a time)."""
    return wait_until(lambda: all(r["state"] == "ready" and r["pid"] for r in replicas(app)) and replicas(app), 120,
                      "both replicas ready")


def test_status_and_metrics_show_each_replica(app):
    both_ready(app)
    model = app.model_status("twin")
    assert model["device"] == ["CPU", "CPU"] and model["state"] == "ready"
    shown = replicas(app)
    assert [r["device"] for r in shown] == ["CPU#0", "CPU#1"]
    assert all(r["state"] == "ready" and r["pid"] for r in shown)
    assert len({r["pid"] for r in shown}) == 2
    workers = [w for w in app.status()["residency"]["workers"] if w["model"]]
    # each replica a worker in the ledger, under its model's name
    assert sorted((w["pid"], w["model"], w["device"]) for w in workers) == sorted((r["pid"], "twin", "CPU") for r in shown)
    scrape = samples(app.metrics())
    for device in ("CPU#0", "CPU#1"):
        assert value(scrape, "openarc_replica_up", model="twin", device=device) == 1
        assert value(scrape, "openarc_replica_state", model="twin", device=device, state="ready") == 1
    assert value(scrape, "openarc_worker_up", model="twin") == 1  # the model's own series, as before
    assert value(scrape, "openarc_model_state", model="twin", state="ready") == 1


def conversation(app, nonce: str, turns: int, usages: list, barrier: threading.Barrier) -> None:
    client = app.client()
    messages = [{"role": "system", "content": f"{nonce}: be brief."}]
    for turn in range(turns):
        barrier.wait(60)  # the conversations' turns interleave
        messages.append({"role": "user", "content": f"Question {turn}: what comes next? {QUESTION}"})
        reply = client.chat.completions.create(model="twin", messages=messages, max_tokens=8)
        usages.append(reply.usage)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})


def test_interleaved_conversations_keep_their_cached_tokens(app):
    """4 conversations x 6 turns at once: from turn 2 each prompt is served >= 80 % from the prefix cache of the
    replica that holds its conversation, and both replicas took conversations."""
    conversations = 4
    routed = [r["requests_routed"] for r in both_ready(app)]
    usages: list[list] = [[] for _ in range(conversations)]
    barrier = threading.Barrier(conversations)
    with concurrent.futures.ThreadPoolExecutor(conversations) as pool:
        futures = [pool.submit(conversation, app, uuid.uuid4().hex, 6, usages[i], barrier)
                   for i in range(conversations)]
        for future in futures:
            future.result(timeout=300)
    for turns in usages:
        assert turns[0].prompt_tokens > 200
        for previous, usage in zip(turns, turns[1:]):
            assert usage.prompt_tokens_details.cached_tokens >= 0.8 * previous.prompt_tokens, \
                [(u.prompt_tokens, u.prompt_tokens_details.cached_tokens) for u in turns]
    # both replicas took conversations (whole ones: 6 turns each)
    took = [r["requests_routed"] - before for r, before in zip(replicas(app), routed)]
    assert sorted(took) in ([6, 18], [12, 12]), took


def test_a_killed_replica_fails_only_its_own_requests(app):
    """SIGKILL of one replica under 8 clients: its requests in flight end with an error (none hangs), the other
    replica's finish, and new requests keep being answered (by the other replica while it restarts)."""
    victim = both_ready(app)[0]["pid"]
    stop = threading.Event()
    outcomes: list[str] = []

    def client_loop(i: int) -> None:
        client = app.client(timeout=60)
        while not stop.is_set():
            try:
                stream = client.chat.completions.create(
                    model="twin", stream=True, max_tokens=60,
                    messages=[{"role": "user", "content": f"client {i} {uuid.uuid4().hex}: tell a long story"}])
                for _ in stream:
                    pass
                outcomes.append("ok")
            except (openai.APIError, openai.APIStatusError) as exc:
                outcomes.append(f"error: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    wait_until(lambda: len(outcomes) >= 8, 120, "requests answered before the kill")
    before = len(outcomes)
    # Frozen first, until a request runs on it: the demo model's 60 tokens take milliseconds, and one CI run killed
    # the replica between its requests (nothing in flight, nothing to fail); SIGKILL ends a stopped process too.
    os.kill(victim, signal.SIGSTOP)
    wait_until(lambda: replicas(app)[0]["requests_running"] > 0, 60, "a request running on the frozen replica")
    os.kill(victim, signal.SIGKILL)
    killed_at = time.monotonic()
    wait_until(lambda: outcomes[before:].count("ok") >= 16, 120, "requests answered after the kill")
    stop.set()
    for thread in threads:
        thread.join(90)
        assert not thread.is_alive(), "a client hangs"
    failed = [o for o in outcomes[before:] if o != "ok"]
    assert 0 < len(failed) <= 8, outcomes[before:]  # at most what ran or waited on the killed replica
    # each error names the model as clients know it, and which replica, never a replica's key NAME@DEVICE
    assert all("twin (replica CPU#" in o and "@" not in o for o in failed), failed
    assert time.monotonic() - killed_at < 120
    both_ready(app)
    assert victim not in [r["pid"] for r in replicas(app)]
    scrape = samples(app.metrics())
    assert value(scrape, "openarc_worker_crashes_total", model="twin", signal="SIGKILL", reason="crash") >= 1


def test_a_replicas_key_is_no_model_name(app):
    """NAME@DEVICE is how residency keys a replica, never a name a client may use: the admin routes and the API
    answer it with the model's 404 (naming only the model), and no replica is loaded or unloaded by it."""
    before = [(r["pid"], r["state"]) for r in both_ready(app)]
    for key in ("twin@CPU%230", "twin@CPU%231"):
        for verb in ("load", "unload"):
            status, _, body = http("POST", f"{app.base}/openarc/models/{key}/{verb}")
            assert status == 404 and body["error"]["code"] == "model_not_found", (verb, status, body)
            assert body["error"]["message"].endswith("(have: twin)"), body
    status, _, body = http("POST", app.base + "/v1/chat/completions",
                           {"model": "twin@CPU#0", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 404 and body["error"]["code"] == "model_not_found", body
    assert [(r["pid"], r["state"]) for r in replicas(app)] == before
    assert "@" not in app.metrics()


def test_replicas_load_on_demand_unload_together_and_reload_to_one_device(appliance_factory, demo_model):
    """A replicated model on demand: its first request loads its replicas (answered by the first ready), an unload
    takes every replica's worker, and a reload to one device leaves one worker under the name, no replica."""
    config = {"server": {"parked_workers": 0},
              "models": [model_entry("lazy", demo_model, device=["CPU", "CPU"], load="on_demand")]}
    app = appliance_factory(config)
    assert [r["state"] for r in app.model_status("lazy")["replicas"]] == ["unloaded", "unloaded"]
    reply = app.client().chat.completions.create(model="lazy", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert reply.choices[0].message.content
    wait_until(lambda: [r["state"] for r in app.model_status("lazy")["replicas"]] == ["ready", "ready"], 120,
               "both replicas loaded")
    pids = {r["pid"] for r in app.model_status("lazy")["replicas"]}
    app.worker_pids |= pids
    status, _, body = http("POST", app.base + "/openarc/models/lazy/unload")
    assert status == 200 and body["state"] == "unloaded", body
    assert [r["state"] for r in app.model_status("lazy")["replicas"]] == ["unloaded", "unloaded"]
    wait_until(lambda: not any(pid_alive(pid) for pid in pids), 30, "the replicas' workers gone")
    assert live_worker_children(app.proc.pid) == set()
    config["models"][0].update(device="CPU", load="at_start")
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    model = app.wait_model("lazy", "ready", timeout=120)
    assert model["device"] == "CPU" and "replicas" not in model
    assert live_worker_children(app.proc.pid) == {model["pid"]}
    assert [w["model"] for w in app.status()["residency"]["workers"]] == ["lazy"]


def test_a_reload_between_one_device_and_replicas_fails_no_request(appliance_factory, demo_model):
    """`device: CPU` -> `[CPU, CPU]` -> `CPU` by SIGHUP while clients stream: the model's units change keys (its
    name, then a key per replica), and no request fails on the way (docs/configuration.md `reload:`): a request
    waits for the new units while the old ones drain, as a `reload: restart` does."""
    config = {"server": {"parked_workers": 0}, "models": [model_entry("shift", demo_model)]}
    app = appliance_factory(config)
    for device in (["CPU", "CPU"], "CPU"):
        stop, outcomes = threading.Event(), []

        def client_loop(i: int) -> None:
            while not stop.is_set():
                status, _, body = http("POST", app.base + "/v1/chat/completions",
                                       {"model": "shift", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": f"{i} {uuid.uuid4().hex}"}]})
                outcomes.append("ok" if status == 200 else f"{status} {body}")

        threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(outcomes) >= 8, 60, "requests answered before the reload")
        config["models"][0]["device"] = device
        app.config_path.write_text(yaml.safe_dump(config))
        app.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: app.model_status("shift")["device"] == device
                   and all(r["state"] == "ready" for r in app.model_status("shift").get("replicas", [])), 120,
                   f"the reload to {device}")
        count = len(outcomes)
        wait_until(lambda: len(outcomes) >= count + 8, 60, "requests answered after the reload")
        stop.set()
        for thread in threads:
            thread.join(90)
            assert not thread.is_alive(), "a client hangs"
        assert [o for o in outcomes if o != "ok"] == [], device
        app.worker_pids |= {w["pid"] for w in app.status()["residency"]["workers"]}
    wait_until(lambda: len(live_worker_children(app.proc.pid)) == 1, 30, "the replicas' workers gone")


def test_a_replica_that_cannot_load_leaves_requests_to_the_one_that_can(appliance_factory, demo_model):
    """A replicated model on demand whose first replica cannot load (its card, GPU.7, is on no box here): the
    requests that wait for the model are served by the replica that loads, never answered with the other's
    refusal while it is still coming up; the broken one's failure shows in its own status."""
    config = {"server": {"parked_workers": 0},
              "models": [model_entry("half", demo_model, device=["GPU.7", "CPU"], load="on_demand",
                                     restart={"backoff_initial_s": 5, "backoff_max_s": 5, "max_failures": 50,
                                              "window_s": 60})]}
    app = appliance_factory(config)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda _: http("POST", app.base + "/v1/chat/completions", {
            "model": "half", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}, timeout=120), range(3)))
    assert [status for status, _, _ in replies] == [200] * 3, [body for _, _, body in replies]
    broken, working = app.model_status("half")["replicas"]
    assert working["state"] == "ready" and broken["device"] == "GPU.7" and broken["state"] != "ready" \
        and "load_error" in (broken["last_error"] or ""), (broken, working)


def test_an_adapter_loaded_while_a_replica_still_loads_waits_for_it_and_reaches_both(appliance_factory, demo_model,
                                                                                      lora_dir, tmp_path):
    """At the start of a replicated model /ready answers once one replica serves, while the other still loads (one
    load at a time): an adapter loaded then waits for that load to end (as a request waits for a load, up to
    ready_wait_s) and reaches both replicas' workers, instead of a 503 to retry (before). The second replica stays
    `loading` for seconds by construction: each replica is checked against a golden record (server.canary: warn)
    with slowed steps before it serves."""
    save(tmp_path / "golden.yaml", {"twin": ModelRecord("llm", [Answer("Name three colours.", tokens=["x"])])}, "test")
    app = appliance_factory({"server": {"parked_workers": 0, "load_concurrency": 1, "canary": "warn"},
                             "models": [model_entry("twin", demo_model, adapters={"upper": str(lora_dir / "upper")},
                                                    device=["CPU", "CPU"])]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.1"})
    assert sorted(r["state"] for r in replicas_of(app, "twin")) == ["loading", "ready"]
    status, _, body = http("POST", app.base + "/openarc/models/twin/adapters",
                           {"name": "shout", "path": str(lora_dir / "title")}, timeout=120)
    assert status == 201 and body["model"] == "twin:shout", body
    assert [r["state"] for r in replicas_of(app, "twin")] == ["ready", "ready"]
    routed = [r["requests_routed"] for r in replicas_of(app, "twin")]
    answers = [http("POST", app.base + "/v1/chat/completions",
                    {"model": "twin:shout", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
               for i in range(4)]  # (distinct prompts, one at a time: idle replicas take them in turn)
    assert [status for status, _, _ in answers] == [200] * 4, answers
    took = [r["requests_routed"] - before for r, before in zip(replicas_of(app, "twin"), routed)]
    assert took == [2, 2], took  # both replicas answered the adapter


def replicas_of(app, name: str) -> list[dict]:
    return app.model_status(name)["replicas"]


def test_an_adapter_change_while_a_replica_loads_is_a_503_naming_the_replica_as_clients_know_it(tmp_path, demo_model):
    """A runtime adapter load while one replica's worker is loading (past the wait for it): that worker started with
    the model's adapters of before the change and would come up without it, so the call is refused with a 503 to
    retry, naming the replica as `twin (replica CPU#1)`, never by its residency key twin@CPU#1 (a name no route
    takes). Real supervisors, not started: the replica is put in `loading` as its worker's start puts it. (An unload
    then goes on: a worker started with an adapter since unloaded holds it unserved.)"""
    units = unstarted(tmp_path, demo_model).units_of("twin")
    units[1].life.lifecycle.enter(ModelState.LOADING)
    with pytest.raises(RequestFailed) as refused:
        asyncio.run(on_every_unit(units, "shout", {"path": "/x", "alpha": 1.0}))
    assert (refused.value.status, refused.value.kind, refused.value.retry_after) == (503, "model_unavailable", 5)
    assert "(twin (replica CPU#1))" in refused.value.message and "@" not in refused.value.message, \
        refused.value.message


def unstarted(tmp_path, demo_model, metrics: Metrics | None = None, **entry) -> Supervisor:
    """Real supervisors of a model `twin` on [CPU, CPU], not started: a test moves their states as workers would."""
    config_path = tmp_path / "openarc.yaml"
    config_path.write_text(yaml.safe_dump({"models": [model_entry("twin", demo_model, device=["CPU", "CPU"], **entry)]}))
    return Supervisor(load_config(config_path), metrics or Metrics())


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["unloaded", "ready", "loading", "restarting", "draining", "failed"]), min_size=2,
                max_size=2))
def test_a_replicated_models_state_is_its_best_replicas_in_status_and_metrics_alike(tmp_path_factory, demo_model,
                                                                                    states):
    """/openarc/status's `state` of a replicated model and its openarc_model_state say the same, whatever its
    replicas' states, and something true of the model: ready if any replica serves, else coming up if any is. Before,
    status took the first replica among those neither ready nor failed: `unloaded` while the other one loaded, where
    the metric said `loading`."""
    metrics = Metrics()
    supervisor = unstarted(tmp_path_factory.mktemp("state"), demo_model, metrics, load="on_demand")
    paths = {"unloaded": [], "ready": ["loading", "ready"], "loading": ["loading"],
             "restarting": ["loading", "restarting"], "draining": ["draining"], "failed": ["loading", "failed"]}
    for unit, state in zip(supervisor.units_of("twin"), states):
        for step in paths[state]:
            unit.life.lifecycle.enter(ModelState(step))
    model = supervisor.status("twin")
    assert [r["state"] for r in model["replicas"]] == states
    scrape = samples(metrics.exposition()[0].decode())
    assert value(scrape, "openarc_model_state", model="twin", state=model["state"]) == 1, model["state"]
    assert model["state"] in states
    if "ready" in states:
        assert model["state"] == "ready"
    elif {"loading", "restarting"} & set(states):
        assert model["state"] in ("loading", "restarting", "draining"), states


def test_a_replicated_models_device_memory_is_its_replicas_sum():
    """openarc_model_device_memory_bytes of a model on [GPU.0, GPU.1] adds its replicas' GPU buffers up, as its
    resident memory does (before, it showed whichever replica's telemetry came last)."""
    metrics = Metrics()
    for key, device in (("twin@GPU.0", "GPU.0"), ("twin@GPU.1", "GPU.1")):
        metrics.add_replica(key, "twin", device)
    for _ in range(2):  # telemetry repeats: each replica's latest counts once
        metrics.set_device_memory("twin@GPU.0", {"vram": 3 << 30, "system": 1 << 20})
        metrics.set_device_memory("twin@GPU.1", {"vram": 2 << 30, "system": 1 << 20})
    scrape = samples(metrics.exposition()[0].decode())
    assert value(scrape, "openarc_model_device_memory_bytes", model="twin", region="vram") == 5 << 30
    assert value(scrape, "openarc_model_device_memory_bytes", model="twin", region="system") == 2 << 20


def test_a_replica_that_failed_its_golden_check_shows_it_in_status(tmp_path, demo_model):
    """server.canary: warn serves a replica whose answers differ from the record; /openarc/status shows the failure
    on that replica and on the model, though the other replica (ready) speaks for the model's state (before, the
    model showed its head replica's `canary_failure` only: none)."""
    supervisor = unstarted(tmp_path, demo_model)
    first, second = supervisor.units_of("twin")
    for unit in (first, second):
        unit.life.lifecycle.enter(ModelState.LOADING)
    first.life.lifecycle.enter(ModelState.READY)
    difference = Difference("answer", "model twin: probe 1 ('Name three colours.'): differs at token 3")
    supervisor.placement.canary.judge(second.name, difference)  # what the check of its worker concluded
    model = supervisor.status("twin")
    assert model["state"] == "ready" and model["canary_failure"] == difference.detail
    assert [r["canary_failure"] for r in model["replicas"]] == [None, difference.detail]


def test_an_adapter_loaded_while_a_reload_replaces_the_replicas_one_by_one_reaches_both_new_workers(
        appliance_factory, demo_model, lora_dir, tmp_path):
    """A reload that changes a replicated model replaces its replicas one at a time: for seconds the first one's new
    worker serves while the second one's new worker still loads, started with the model's adapters of then. An
    adapter loaded in that window must reach both new workers, or be refused to retry: it answered 201 though the
    second new worker never held it, and each request for it routed there was a 400 "not loaded on this model"."""
    save(tmp_path / "golden.yaml", {"twin": ModelRecord("llm", [Answer("Name three colours.", tokens=["x"])])}, "test")
    config = {"server": {"parked_workers": 0, "load_concurrency": 1, "canary": "warn"},
              "models": [model_entry("twin", demo_model, adapters={"upper": str(lora_dir / "upper")},
                                     device=["CPU", "CPU"], max_adapters=3)]}
    app = appliance_factory(config, env={"OPENARC_DEBUG_STEP_DELAY_S": "0.1"})
    wait_until(lambda: all(r["state"] == "ready" for r in replicas_of(app, "twin")), 120, "both replicas ready")
    old = {r["pid"] for r in replicas_of(app, "twin")}
    config["models"][0]["max_adapters"] = 4
    config["server"]["port"] = app.port
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    # one replica serves from its new worker while the other's new worker still loads (its slowed golden check)
    wait_until(lambda: sum(r["pid"] not in old and r["state"] == "ready" for r in replicas_of(app, "twin")) == 1,
               120, "the first replica replaced", interval=0.02)
    status, _, body = http("POST", app.base + "/openarc/models/twin/adapters",
                           {"name": "shout", "path": str(lora_dir / "title")}, timeout=120)
    assert status == 201, body
    assert all(r["pid"] not in old and r["state"] == "ready" for r in replicas_of(app, "twin")), replicas_of(app, "twin")
    answers = [http("POST", app.base + "/v1/chat/completions",
                    {"model": "twin:shout", "messages": [{"role": "user", "content": f"hi {i}"}], "max_tokens": 2})
               for i in range(4)]  # (distinct prompts, one at a time: idle replicas take them in turn)
    assert [status for status, _, _ in answers] == [200] * 4, answers
    assert all(r["requests_routed"] for r in replicas_of(app, "twin")), replicas_of(app, "twin")
