"""`python -m bench.lora [--quick]`: what mixing LoRA adapters costs on one card, on the demo model and its demo
adapters (appliance.demo.llm.write_adapter), 12 layers deep: 16 clients on the base model alone, then 16 clients spread over 1, 2
and 4 adapters of the same model, aggregate tokens per second.

OpenVINO GenAI's continuous batching runs one adapter set at a time and changes it only when its batch has
drained (docs/lora.md), so openarc's worker runs the requests of one adapter together and rotates between
adapters: with more adapters in the mix, batches are smaller and each switch waits out a drain. One appliance serves
two models from the same files: `plain` (no adapters: prefix caching on, as any model) and `lora` (four adapters:
upper, title, and a copy of each under another name, so four groups). Client i of 16 asks for adapter i mod k (k =
1, 2, 4) of `lora`, or for the base; each client sends its requests back to back. Each row is run `repeats` times;
the figure is the median, the spread the range of the repeats. `python -m bench` runs this too, after its figures.
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import report
from bench.launcher import OwnAppliance
from bench.report import Figure

CLIENTS = 16
LAYERS = 12
ADAPTERS = {"upper": "upper", "title": "title", "upper2": "upper", "title2": "title"}  # served name -> demo family
SIZES = {True: (48, 2, 1), False: (48, 8, 3)}  # quick, full: (tokens a reply, requests a client, repeats)
ROWS = {  # row -> (model, adapters the clients spread over)
    "base model alone (no adapters configured)": ("plain", [""]),
    "base of the model with adapters": ("lora", [""]),
    "1 adapter": ("lora", ["upper"]),
    "2 adapters": ("lora", ["upper", "title"]),
    "4 adapters": ("lora", list(ADAPTERS)),
}
HEADLINE = f"LoRA, {CLIENTS} clients"


def served_models(model: Path, adapters: dict[str, Path], properties: dict) -> list[dict]:
    entry = {"path": str(model), "device": "CPU", "runtime_config": dict(properties), "max_running": CLIENTS,
             "max_queue": 4 * CLIENTS}
    return [{"name": "plain", **entry},
            {"name": "lora", **entry, "adapters": {name: str(path) for name, path in adapters.items()},
             "max_adapters": len(adapters)}]


def build_adapters(model: Path, where: Path) -> dict[str, Path]:
    """The demo's two adapter families, each also copied under a second name (a fourth and a third group)."""
    from appliance.demo.catalog import build_demo_adapter
    built: dict[str, Path] = {}
    for name, family in ADAPTERS.items():
        if family not in built:
            built[family] = build_demo_adapter(where / family, family, model)
        if name != family:
            shutil.copytree(built[family], where / name)
    return {name: where / name for name in ADAPTERS}


async def client(session: aiohttp.ClientSession, base: str, model: str, requests: int, tokens: int, n: int) -> int:
    """One client's requests, back to back; the completion tokens it got."""
    got = 0
    for i in range(requests):
        body = {"model": model, "max_tokens": tokens, "temperature": 0,
                "messages": [{"role": "user", "content": f"client {n} request {i}"}]}
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{model}: {response.status} {await response.text()}")
            got += (await response.json())["usage"]["completion_tokens"]
    return got


async def one_run(session: aiohttp.ClientSession, base: str, model: str, adapters: list[str], requests: int,
                  tokens: int) -> float:
    """Aggregate tokens/s of CLIENTS clients, client i naming adapters[i % len(adapters)] ("" : the base)."""
    names = [f"{model}:{a}" if a else model for a in adapters]
    started = time.perf_counter()
    got = await asyncio.gather(*(client(session, base, names[n % len(names)], requests, tokens, n)
                                 for n in range(CLIENTS)))
    return sum(got) / (time.perf_counter() - started)


async def measure(quick: bool, properties: dict | None = None) -> tuple[dict, list[Figure]]:
    from appliance.demo.catalog import build_demo_model
    tokens, requests, repeats = SIZES[quick]
    with tempfile.TemporaryDirectory(prefix="openarc-bench-lora-") as tmp:
        workdir = Path(tmp)
        # 12 layers, as the speculative demo's main model: a step costs enough that batch size shows, as on a card
        model = build_demo_model(workdir / "models" / "demo", eos_after=0, max_new_tokens=4096, layers=LAYERS)
        adapters = build_adapters(model, workdir / "models")
        app = OwnAppliance(model, workdir, models=served_models(model, adapters, properties or {}))
        rates: dict[str, list[float]] = {row: [] for row in ROWS}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await app.start(session)
            try:
                for model_name, spread in ROWS.values():  # warm each worker and adapter
                    await one_run(session, app.base, model_name, spread, 1, 4)
                for _ in range(repeats):
                    for row, (model_name, spread) in ROWS.items():  # rows take turns, repeat by repeat
                        rates[row].append(await one_run(session, app.base, model_name, spread, requests, tokens))
            finally:
                app.stop()
    meta = {"when": report.now(), "clients": CLIENTS, "tokens": tokens, "requests_per_client": requests,
            "repeats": repeats, "quick": quick, **report.machine(), "properties": properties or {}, "rates": rates}
    return meta, figures(rates, tokens)


def figures(rates: dict[str, list[float]], tokens: int) -> list[Figure]:
    reference = statistics.median(rates["base of the model with adapters"])
    out = []
    for row, found in rates.items():
        median = statistics.median(found)
        spread = f"{min(found):,.0f}-{max(found):,.0f} over {len(found)} runs"
        out.append(Figure(f"{HEADLINE} ({tokens} tokens each): {row}", f"{median:,.0f} tokens/s ({spread}; "
                          f"{median / reference:.2f}x the base of the model with adapters)", median, "tokens/s",
                          "the base of the model with adapters, same run"))
    return out


def main(argv: list[str] | None = None) -> None:
    args = report.side_bench_parser("python -m bench.lora", __doc__, "lora").parse_args(argv)
    meta, found = asyncio.run(measure(args.quick, report.engine_properties(args)))
    print(report.write_side_bench(args.out, "lora", meta, found, ("name", "measured", "baseline", "verdict")),
          end="", flush=True)


if __name__ == "__main__":
    main()
