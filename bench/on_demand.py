"""`python -m bench.on_demand [--quick]`: what a request pays when its model is not loaded (models on demand).

Its own appliance serves two copies of the demo model, both `load: on_demand`, with `max_loaded: 1` and a cache_dir
for OpenVINO's compiled models (warmed by a first load of each, so every measured load reads the cache, as loads on a
box that has run before do). Every round asks the model that is not loaded (the request waits while the other is
evicted and this one loads: its time to first token includes the switch), then the same model again (resident).

In the same run, the limits a switch is measured against: what a fresh Python process pays to import OpenVINO
GenAI and build the same pipeline from the same cache (the worker's own code, timed from the process's start), and
the pipeline's construction alone in a warm process. The switch is printed beside both, as ratios, with the
targets of issue 44: at most 1.5 times the fresh process plus 0.3 s, and (with a parked worker, the default) at
most 1.2 times the warm construction plus 0.1 s. Results in bench/results/on_demand.{md,json}.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from bench import client, report
from bench.launcher import OwnAppliance, child_env

MODELS = ("chat", "coder")
ROUNDS = {True: 3, False: 20}  # --quick: a few rounds, checks the bench, measures nothing
# A fresh process as a worker is one: import OpenVINO GenAI, then the worker's engine for the spec (the pipeline).
FRESH = ("import sys, json; import openvino_genai; from appliance.worker.engines import load_engine; "
         "load_engine(json.loads(sys.argv[1]), None); print('loaded', flush=True)")
# The construction alone, in one warm process: the spec's engine built once per line read, each timed.
WARM = ("import sys, json, time; import openvino_genai; from appliance.worker.engines import load_engine\n"
        "spec = json.loads(sys.argv[1]); print('ready', flush=True)\n"
        "for _ in sys.stdin:\n"
        "    started = time.monotonic(); engine = load_engine(spec, None); print(time.monotonic() - started, flush=True)\n"
        "    del engine")


async def first_token_s(session: aiohttp.ClientSession, base: str, model: str) -> float:
    """Seconds from sending a streamed chat request to its first content chunk."""
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True}
    got = await client.stream(session, base, body)
    if got.status != 200 or got.error or not got.token_times:
        raise RuntimeError(f"{model}: {got.status}: {got.error or got.broken or 'the stream had no content'}")
    return got.token_times[0] - got.started


async def measure(quick: bool) -> tuple[dict, list[report.Figure]]:
    rounds = ROUNDS[quick]
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        from appliance.demo.catalog import build_demo_model
        model = build_demo_model(Path(tmp) / "llm", "llm")
        app = OwnAppliance(model, Path(tmp), models=[{"name": name, "path": str(model), "load": "on_demand"}
                                                     for name in MODELS])
        # OwnAppliance's config, plus the residency settings
        app.config["server"].update(max_loaded=1, cache_dir=str(Path(tmp) / "ov-cache"))
        app.config_path.write_text(yaml.safe_dump(app.config))
        switching, resident, stages, fresh, warm = [], [], [], [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await app.start(session)
            try:
                for name in MODELS:  # warm: compile each once into the cache
                    await first_token_s(session, app.base, name)
                spec = worker_spec_of(app.config)
                with WarmProcess(spec) as warm_process:
                    # Round by round, so that a shared machine's load hits the switch and its limits alike.
                    for i in range(rounds):
                        name = MODELS[i % 2]  # the model the previous round (or the warm-up) did not leave loaded
                        await spare_warm(session, app.base)
                        switching.append(await first_token_s(session, app.base, name))
                        stages.append(await last_switch(session, app.base, name))
                        resident.append(await first_token_s(session, app.base, name))
                        fresh.append(fresh_load_s(spec))
                        warm.append(warm_process.construct())
            finally:
                app.stop()
    meta = {"when": report.now(), "rounds": rounds, "quick": quick, "load_average": report.load_average(),
            **report.machine(), "samples": {"switching_s": switching, "resident_s": resident, "fresh_load_s": fresh,
                                            "warm_construction_s": warm, "switch_stages_s": stages}}
    return meta, figures(switching, resident, fresh, warm) + stage_figures(stages)


async def spare_warm(session: aiohttp.ClientSession, base: str, bound_s: float = 120) -> None:
    """Until the appliance's parked spare has imported OpenVINO (its name says so: openarc-parked), as it has
    between a person's requests; a back-to-back storm of switches would pay the rest of its import."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        async with session.get(base + "/openarc/status") as answer:
            workers = (await answer.json())["residency"]["workers"]
        for pid in (w["pid"] for w in workers if w["role"] == "parked"):
            try:
                if open(f"/proc/{pid}/comm").read().strip() == "openarc-parked":
                    return
            except OSError:
                pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"no parked worker was ready within {bound_s:g}s")


async def last_switch(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, float]:
    """The stages of the model's last switch, as /openarc/status shows them."""
    async with session.get(base + "/openarc/status") as answer:
        models = (await answer.json())["models"]
    switch = next(m for m in models if m["name"] == model)["last_switch"] or {}
    return switch.get("stages", {})


def stage_figures(stages: list[dict[str, float]]) -> list[report.Figure]:
    """The median of each stage of the switches, as the server timed them (status's last_switch, in its order)."""
    order = list(dict.fromkeys(stage for switch in stages for stage in switch))
    medians = {stage: statistics.median(s[stage] for s in stages if stage in s) for stage in order}
    return [report.Figure(f"Switch stage: {stage} (median, server's own timing)", f"{median * 1000:,.0f} ms",
                          median * 1000, "ms") for stage, median in medians.items()]


def worker_spec_of(config: dict) -> dict:
    """The spec the appliance's workers of the first model get (the same model, device and cache)."""
    from appliance.config import parse_config, worker_spec
    parsed = parse_config(config, "bench")
    return worker_spec(parsed.models[0], parsed)


def fresh_load_s(spec: dict) -> float:
    """Seconds from starting a new Python process to its pipeline built from the cache, as a worker's is."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", FRESH, json.dumps(spec)], env=child_env(), capture_output=True,
                          text=True, timeout=300)
    if "loaded" not in done.stdout:
        raise RuntimeError(f"a fresh process could not load the model: {done.stderr[-2000:]}")
    return time.monotonic() - started


class WarmProcess:
    """A process that imported OpenVINO GenAI and the worker's engines once: construct() times one build of the
    pipeline in it."""

    def __init__(self, spec: dict):
        self.proc = subprocess.Popen([sys.executable, "-c", WARM, json.dumps(spec)], env=child_env(), text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def __enter__(self) -> WarmProcess:
        if self.proc.stdout.readline().strip() != "ready":
            raise RuntimeError("the warm process did not start")
        return self

    def construct(self) -> float:
        self.proc.stdin.write("build\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def figures(switching: list[float], resident: list[float], fresh: list[float], warm: list[float]) -> list[report.Figure]:
    def ms(name: str, seconds: float) -> report.Figure:
        return report.Figure(name, f"{seconds * 1000:,.0f} ms", seconds * 1000, "ms")

    cost = statistics.median(s - r for s, r in zip(switching, resident))
    switch, fresh_load, construction = (statistics.median(x) for x in (switching, fresh, warm))
    return [ms("TTFT, model resident (median)", statistics.median(resident)),
            ms("TTFT, model resident (worst)", max(resident)),
            ms("TTFT, request triggers an evict and a load from the compiled-model cache (median)", switch),
            ms("TTFT, request triggers an evict and a load (worst)", max(switching)),
            ms("Cost of the switch (median of load-triggering minus resident, same round)", cost),
            ms("A fresh process: Python start, import OpenVINO GenAI, build the pipeline from the cache (median)",
               fresh_load),
            ms("The pipeline's construction alone in a warm process (median)", construction),
            ratio("Switch against a fresh process's import and load (x; target <= 1.5x + 0.3 s)", switch,
                  fresh_load, 1.5, 0.3),
            ratio("Switch against the warm construction (x; target <= 1.2x + 0.1 s, with a parked worker)", switch,
                  construction, 1.2, 0.1)]


def ratio(name: str, switch: float, limit: float, factor: float, margin: float) -> report.Figure:
    """The switch as a multiple of a limit, judged against factor x limit + margin (in seconds)."""
    return report.judged(name, switch / limit, "x", f"{switch / limit:.2f}x ({switch * 1000:,.0f} ms against "
                         f"{limit * 1000:,.0f} ms)", at_most=factor + margin / limit)


def main(argv: list[str] | None = None) -> None:
    report.side_bench_main(argv, "on_demand", __doc__, measure, "a few rounds: checks the bench, measures nothing")


if __name__ == "__main__":
    main()
