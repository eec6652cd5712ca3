"""/metrics as an operator sees it: counters that match what happened, valid for promtool, scraped by a real Prometheus."""

from __future__ import annotations

import json
import os
import shutil
import socket
import signal
import subprocess
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import free_port, http, model_entry, wait_until

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
PROMTOOL = shutil.which("promtool") or "/usr/bin/promtool"


def samples(text: str) -> dict[tuple, float]:
    """{(name, sorted label items): value} for every sample of a scrape."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(scrape: dict, name: str, **labels) -> float:
    """The sample with these labels, summed over any label not given (as PromQL's sum without)."""
    wanted = labels.items()
    return sum(v for (n, items), v in scrape.items() if n == name and wanted <= dict(items).items())


@pytest.fixture
def busy_app(appliance_factory, demo_model):
    """An appliance that has served 3 chats, 2 streams, refused 4 bad requests, and lost a worker to SIGABRT."""
    app = appliance_factory({"models": [model_entry("demo", demo_model, scheduler_config={"num_kv_blocks": 4},
                                                    max_context=2048)]})
    client = app.client()
    for _ in range(3):
        client.chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=10)
    for _ in range(2):
        list(client.completions.create(model="demo", prompt="Once", max_tokens=10, stream=True))
    for bad in ({"model": "demo"}, {"model": "demo", "prompt": 3}, {"model": "nope", "prompt": "x"}):
        http("POST", app.base + "/v1/completions", bad)
    http("POST", app.base + "/v1/completions", raw=b"{")
    http("POST", app.base + "/v1/completions", {"model": "demo", "prompt": "hello world " * 150, "max_tokens": 4})
    pid = app.worker_pid("demo")
    os.kill(pid, signal.SIGABRT)
    app.wait_model("demo", "ready", new_pid_not=pid)
    return app


def test_counters_match_what_the_test_did(busy_app):
    scrape = samples(busy_app.metrics())
    chat, comp = "chat/completions", "completions"
    assert value(scrape, "openarc_requests_total", model="demo", endpoint=chat, status="200") == 3
    assert value(scrape, "openarc_requests_total", model="demo", endpoint=comp, status="200") == 2
    assert value(scrape, "openarc_requests_total", model="demo", endpoint=comp, status="500") == 1
    assert value(scrape, "openarc_requests_total", model="demo", endpoint=comp, status="400") == 2
    # a request naming no configured model is labelled with the empty model: client input never mints label values
    assert value(scrape, "openarc_requests_total", model="", endpoint=comp, status="400") == 1
    assert value(scrape, "openarc_requests_total", model="", endpoint=comp, status="404") == 1
    assert value(scrape, "openarc_request_errors_total", model="demo", kind="invalid_request") == 2
    assert value(scrape, "openarc_request_errors_total", model="", kind="invalid_request") == 2
    assert value(scrape, "openarc_request_errors_total", model="demo", kind="scheduler_oom") == 1
    assert value(scrape, "openarc_worker_crashes_total", model="demo", signal="SIGABRT", reason="crash") == 1
    assert value(scrape, "openarc_worker_exits_total", model="demo", reason="crash") == 1
    assert value(scrape, "openarc_worker_restarts_total", model="demo") == 1
    assert value(scrape, "openarc_worker_up", model="demo") == 1
    assert value(scrape, "openarc_model_state", model="demo", state="ready") == 1
    assert value(scrape, "openarc_model_state", model="demo", state="failed") == 0
    assert value(scrape, "openarc_generation_tokens_total", model="demo") >= 50
    assert value(scrape, "openarc_prompt_tokens_total", model="demo") > 0
    assert value(scrape, "openarc_time_to_first_token_seconds_count", model="demo") == 5
    assert value(scrape, "openarc_request_duration_seconds_count", model="demo", endpoint=chat) == 3
    assert value(scrape, "openarc_model_load_seconds_count", model="demo") == 2
    assert value(scrape, "openarc_requests_running", model="demo") == 0


def test_worker_memory_and_loop_lag_are_reported(busy_app):
    # telemetry arrives every 2 s
    scrape = wait_until(lambda: (s := samples(busy_app.metrics())) and
                        value(s, "openarc_worker_resident_memory_bytes", model="demo") > 0 and s, 10, "worker RSS")
    rss = value(scrape, "openarc_worker_resident_memory_bytes", model="demo")
    assert 20e6 < rss < 2e9
    assert ("openarc_event_loop_lag_seconds", ()) in scrape


def test_kv_cache_usage_rises_under_load_and_falls_back_when_idle(appliance_factory, long_demo_model):
    """openarc_kv_cache_usage_ratio, what a cluster's endpoint picker routes on, follows genai's pipeline metrics on
    a live scrape: 0 while idle, a growing share of the blocks while requests generate, 0 again when they end."""
    app = appliance_factory({"models": [model_entry("demo", long_demo_model, max_context=4096,
                                                    scheduler_config={"num_kv_blocks": 256})]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.01"})  # ~100 steps/s: 8 s of generation

    def usage() -> float:
        return value(samples(app.metrics()), "openarc_kv_cache_usage_ratio", model="demo")

    assert usage() == 0
    client = app.client()
    with ThreadPoolExecutor(4) as pool:
        replies = [pool.submit(client.completions.create, model="demo", prompt=f"Once {i}", max_tokens=800)
                   for i in range(4)]
        seen = []
        while not all(reply.done() for reply in replies):
            seen.append(usage())
            time.sleep(0.5)
        assert all(reply.result().usage.completion_tokens == 800 for reply in replies)
    under_load = sorted({ratio for ratio in seen if ratio > 0})
    print(f"KV-cache usage under load: {under_load}")
    # Telemetry comes every 2 s: several readings, rising as the sequences grow, all within the cache.
    assert len(under_load) >= 2 and under_load[-1] <= 1, seen
    assert seen.index(under_load[0]) < seen.index(under_load[-1]), seen
    deadline = time.monotonic() + 10
    while usage() != 0:
        assert time.monotonic() < deadline, "the KV-cache usage stayed up after every request ended"
        time.sleep(0.2)


def test_promtool_accepts_a_live_scrape(busy_app):
    done = subprocess.run([PROMTOOL, "check", "metrics"], input=busy_app.metrics(), capture_output=True, text=True,
                          timeout=30)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "" and done.stderr == ""


def test_metrics_can_require_the_api_key(appliance_factory, demo_model):
    app = appliance_factory({"server": {"api_key_env": "K", "metrics_require_key": True},
                             "models": [model_entry("demo", demo_model)]}, env={"K": "k1"})
    assert http("GET", app.base + "/metrics")[0] == 401
    assert http("GET", app.base + "/metrics", headers={"Authorization": "Bearer k1"})[0] == 200


def prometheus_query(base: str, query: str) -> list:
    status, _, body = http("GET", f"{base}/api/v1/query?query={urllib.parse.quote(query)}", timeout=5)
    assert status == 200, body
    return body["data"]["result"]


def test_a_real_prometheus_counts_a_worker_crash(appliance_factory, demo_model, tmp_path):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})
    port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "openarc", "static_configs": [{"targets": [f"127.0.0.1:{app.port}"]}]}]}))
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address=127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                            stderr=open(tmp_path / "prometheus.log", "w"))
    base = f"http://127.0.0.1:{port}"
    try:
        pid = app.worker_pid("demo")
        os.kill(pid, signal.SIGABRT)
        app.wait_model("demo", "ready", new_pid_not=pid)
        try:
            result = wait_until(lambda: prometheus_query(base, 'openarc_worker_crashes_total{job="openarc"}'), 60,
                                "scraped by prometheus", interval=0.5)
        except AssertionError as exc:
            raise AssertionError((tmp_path / "prometheus.log").read_text()[-2000:]) from exc
        assert [(r["metric"]["model"], r["metric"]["signal"], r["value"][1]) for r in result] == [("demo", "SIGABRT", "1")]
        up = prometheus_query(base, 'openarc_worker_up{model="demo"}')
        assert up[0]["value"][1] == "1"
    finally:
        prom.terminate()
        prom.wait(20)


def test_a_client_that_hangs_up_is_counted_as_499(appliance_factory, long_demo_model):
    """A request whose client leaves before its answer is complete is counted, with its duration, under status
    "499" (nginx's client-closed convention): whole or streamed, waiting for the worker or mid-stream."""
    app = appliance_factory({"models": [model_entry("demo", long_demo_model, max_context=4096)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.01"})  # ~100 tokens/s: 4000 take 40 s
    before = samples(app.metrics())
    for stream in (False, True):
        body = json.dumps({"model": "demo", "prompt": "Once", "max_tokens": 4000, "stream": stream}).encode()
        with socket.create_connection(("127.0.0.1", app.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body)
            if stream:  # hang up once tokens flow
                received = b""
                while b"data: {" not in received:
                    received += sock.recv(65536)
            else:  # hang up while the worker generates
                wait_until(lambda: value(samples(app.metrics()), "openarc_requests_running", model="demo") == 1,
                           30, "the request running")

    def counted(name: str, **labels) -> float:
        return value(samples(app.metrics()), name, **labels) - value(before, name, **labels)

    wait_until(lambda: counted("openarc_requests_total", model="demo", endpoint="completions", status="499") == 2,
               30, "both hang-ups counted")
    assert counted("openarc_request_duration_seconds_count", model="demo", endpoint="completions") == 2
    assert counted("openarc_requests_total", model="demo", endpoint="completions") == 2  # and nothing else
    # the worker stopped generating for them
    wait_until(lambda: value(samples(app.metrics()), "openarc_requests_running", model="demo") == 0, 30, "idle")
