"""`python -m bench [--quick] [--url URL] [--model NAME] [--model-path DIR] [--out DIR]`."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from appliance.telemetry import process_rss_bytes
from bench import client, figures, report, workload
from bench.launcher import FAULT_MODEL, PERF_MODEL, RESTART, STALL_TIMEOUT_S, OwnAppliance, child_env

RESULTS = Path(__file__).resolve().parent / "results"
NOTES = [
    "Every ratio compares the server with the same model, prompts and token counts driven in process through "
    "openvino_genai.ContinuousBatchingPipeline (the worker's engine), warm, in a bare process, run just before.",
    "Latency: one request at a time over a kept-alive connection, timed at the client from send to parsed body; "
    "the baseline is templating + generate() + decoding. 'Added p99' is p99(server) - p99(baseline).",
    "Streaming: tokens after the first / time from the first to the last token, for the SSE client and for an "
    "in-process streamer callback.",
    "Concurrency: N clients each send requests back to back; the baseline runs N requests as one generate() batch.",
    f"Faults hit a second copy of the model (`{FAULT_MODEL}`, stall_timeout_s={STALL_TIMEOUT_S:g}, restart backoff "
    f"{RESTART['backoff_initial_s']:g} s, included in recovery). Recovery ends at the first 200 of a 1-token request "
    "polled every 5 ms; the load time subtracted is that restart's openarc_model_load_seconds (spawn to ready).",
    "Client cost: the load generator's CPU time (asyncio + aiohttp, one process) per request and as a share of one "
    "core; it runs on the same 2 cores as the server, so it is part of what the server figures pay.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a few repetitions of each figure (a smoke run, not a measurement)")
    p.add_argument("--url", help="measure the HTTP figures of this OpenAI-compatible server instead of starting one")
    p.add_argument("--model", help="with --url: the model to ask for (default: the first of /v1/models)")
    p.add_argument("--model-path", help="with --url: the same model on disk, for the in-process baseline and ratios")
    p.add_argument("--out", default=str(RESULTS), help="where results.json, results.md and the appliance's log go "
                                                       "(default: bench/results)")
    return p.parse_args(argv)


def run_baseline(model_path: Path, plan_name: str) -> dict:
    """The in-process baseline, in a bare process of its own (see bench/baseline.py)."""
    done = subprocess.run([sys.executable, "-m", "bench.baseline", str(model_path), "--plan", plan_name],
                          env=child_env(), stdout=subprocess.PIPE, check=True, timeout=600)
    return json.loads(done.stdout)


async def http_figures(session, base: str, model: str, plan, baseline: dict | None) -> list:
    found = await figures.overhead(session, base, model, plan, baseline)
    found.append(await figures.streaming(session, base, model, plan, baseline))
    found += await figures.concurrency(session, base, model, plan, baseline)
    return found


async def against_own_appliance(model_path: Path, out: Path, plan, baseline: dict) -> list:
    app = OwnAppliance(model_path, out)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        try:
            await app.start(session)
            for i in range(plan.warmup):
                await client.completion_tokens(session, app.base, workload.chat_body(PERF_MODEL, i, 8))
            front_idle = process_rss_bytes(app.pid)
            peak = figures.PeakRss(app.pid)
            sampler = asyncio.create_task(peak.run())
            found = await http_figures(session, app.base, PERF_MODEL, plan, baseline)
            sampler.cancel()
            worker = process_rss_bytes(await app.worker_pid(session, PERF_MODEL))
            aborts = await figures.trials(session, app, signal.SIGABRT, plan.fault_trials)
            stalls = await figures.trials(session, app, signal.SIGSTOP, plan.stall_trials)
        finally:
            app.stop()
    return found + figures.fault_figures(aborts, stalls, baseline) + figures.memory(front_idle, peak.peak, worker, baseline)


async def against_url(url: str, model: str | None, plan, baseline: dict | None) -> list:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        if model is None:
            async with session.get(url + "/v1/models") as response:
                model = (await response.json())["data"][0]["id"]
        found = await http_figures(session, url, model, plan, baseline)
    return found + figures.http_only("needs the bench's own appliance (not with --url)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan, plan_name = (workload.QUICK, "quick") if args.quick else (workload.FULL, "full")
    started = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        model_path = Path(args.model_path) if args.model_path else None
        if model_path is None and not args.url:
            from appliance.demo_model import build_demo_model
            model_path = build_demo_model(Path(tmp) / "demo", eos_after=0, max_new_tokens=4096)  # never stops early
        baseline = run_baseline(model_path, plan_name) if model_path else None
        if args.url:
            target = args.url.rstrip("/")
            found = asyncio.run(against_url(target, args.model, plan, baseline))
        else:
            target = "its own appliance (python -m appliance serve, demo model, CPU)"
            found = asyncio.run(against_own_appliance(model_path, out, plan, baseline))
    meta = {"date": report.now(), "mode": plan_name, "duration_s": time.monotonic() - started, "target": target,
            "machine": report.machine(), "baseline_load_seconds": baseline and baseline["load_seconds"]}
    print(report.write(out, meta, found, NOTES))
    return 0
