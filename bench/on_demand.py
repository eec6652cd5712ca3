"""`python -m bench.on_demand [--quick]`: what a request pays when its model is not loaded (models on demand).

Its own appliance serves two copies of the demo model, both `load: on_demand`, with `max_loaded: 1` and a cache_dir
for OpenVINO's compiled models (warmed by a first load of each, so every measured load reads the cache, as loads on a
box that has run before do). Each round asks the model that is not loaded (the request waits while the other is
evicted and this one loads: its time to first token includes the switch), then the same model again (resident). The
figures are the medians and the worst of each, and the median cost of the switch. Results in
bench/results/on_demand.{md,json}.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import aiohttp
import yaml

from bench import client, report
from bench.launcher import OwnAppliance

MODELS = ("chat", "coder")
ROUNDS = {True: 3, False: 20}  # --quick: a few rounds, checks the bench, measures nothing


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
        switching, resident = [], []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await app.start(session)
            try:
                for name in MODELS:  # warm: compile each once into the cache
                    await first_token_s(session, app.base, name)
                for i in range(rounds):
                    name = MODELS[i % 2 == 0]  # the model the previous round did not leave loaded
                    switching.append(await first_token_s(session, app.base, name))
                    resident.append(await first_token_s(session, app.base, name))
            finally:
                app.stop()
    meta = {"when": report.now(), "rounds": rounds, "quick": quick, "load_average": report.load_average(),
            **report.machine(), "samples": {"switching_s": switching, "resident_s": resident}}
    return meta, figures(switching, resident)


def figures(switching: list[float], resident: list[float]) -> list[report.Figure]:
    def ms(name: str, seconds: float) -> report.Figure:
        return report.Figure(name, f"{seconds * 1000:,.0f} ms", seconds * 1000, "ms")

    cost = statistics.median(s - r for s, r in zip(switching, resident))
    return [ms("TTFT, model resident (median)", statistics.median(resident)),
            ms("TTFT, model resident (worst)", max(resident)),
            ms("TTFT, request triggers an evict and a load from the compiled-model cache (median)",
               statistics.median(switching)),
            ms("TTFT, request triggers an evict and a load (worst)", max(switching)),
            ms("Cost of the switch (median of load-triggering minus resident, same round)", cost)]


def main(argv: list[str] | None = None) -> None:
    report.side_bench_main(argv, "on_demand", __doc__, measure, "a few rounds: checks the bench, measures nothing")


if __name__ == "__main__":
    main()
