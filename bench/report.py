"""Figures, their targets, and the two outputs: results.json and a markdown table (PASS/MISS, never a failure)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import importlib.metadata
import json
import os
import platform
from dataclasses import asdict, dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # where a side bench writes by default

MB = 1 << 20
NOT_COMPARABLE = "not comparable"  # the server did other work than its baseline (stopped early, failed, uncounted)
WITHIN_NOISE = "within noise"      # missed its target by less than the spread of the baseline's own repeats


@dataclass
class Figure:
    name: str
    measured: str             # as the table shows it
    value: float | None       # the number the verdict is about, in `unit`
    unit: str
    baseline: str = ""
    target: str = ""          # empty: reported for information
    verdict: str = "info"     # PASS | MISS | info | not measured | not comparable
    client: str = ""          # what the load generator cost while measuring this figure


def percent(share: float) -> str:
    """A share judged against a target, to one decimal: "95 %" must not hide a 94.8 % that missed 95."""
    return f"{share:.1f} %"


def judged(name: str, value: float, unit: str, measured: str, *, at_most: float | None = None,
           at_least: float | None = None, below: float | None = None, baseline: str = "", client: str = "",
           noise: float = 0.0) -> Figure:
    """A figure with a target: exactly one of at_most (<=), below (<) or at_least (>=). `noise`: how far the
    baseline's own repeats spread, in `unit`; a miss by less than that is reported as within noise, not as a MISS
    (between two runs the reference moved by half, and verdicts flipped)."""
    if at_most is not None:
        target, ok, near = f"<= {at_most:g}{_spaced(unit)}", value <= at_most, value - noise <= at_most
    elif below is not None:
        target, ok, near = f"< {below:g}{_spaced(unit)}", value < below, value - noise < below
    else:
        target, ok, near = f">= {at_least:g}{_spaced(unit)}", value >= at_least, value + noise >= at_least
    verdict = "PASS" if ok else WITHIN_NOISE if near else "MISS"
    return Figure(name, measured, value, unit, baseline, target, verdict, client)


def not_measured(name: str, why: str) -> Figure:
    return Figure(name, why, None, "", verdict="not measured")


def machine() -> dict[str, str]:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor() or "unknown CPU")
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal:"))
    return {"cpu": cpu, "cores": str(os.cpu_count()), "memory": f"{mem_kb / (1 << 20):.0f} GiB",
            "kernel": platform.release(), "python": platform.python_version(),
            "openvino_genai": _version("openvino-genai"), "aiohttp": _version("aiohttp")}


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def markdown(meta: dict, figures: list[Figure], notes: list[str], side_by_side: list[str] | None = None) -> str:
    m = meta["machine"]
    lines = [f"Measured {meta['date']} ({meta['mode']} run, {meta['duration_s']:.0f} s) against {meta['target']}.",
             f"Model: {meta['model']}.",
             f"Machine: {m['cpu']}, {m['cores']} cores, {m['memory']} RAM, Linux {m['kernel']}, Python {m['python']}, "
             f"OpenVINO GenAI {m['openvino_genai']}, client aiohttp {m['aiohttp']}; load average {meta['load']}.",
             ""]
    if side_by_side:
        lines += side_by_side + ["", f"{meta['primary']} against its in-process baseline:", ""]
    lines += ["| Figure | Measured | In-process baseline | Target | Verdict | Client cost |",
              "|---|---|---|---|---|---|"]
    lines += [f"| {f.name} | {f.measured} | {f.baseline} | {f.target} | {f.verdict} | {f.client} |" for f in figures]
    lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def write(out: Path, meta: dict, figures: list[Figure], notes: list[str], side_by_side: dict | None = None) -> str:
    out.mkdir(parents=True, exist_ok=True)
    table = markdown(meta, figures, notes, side_by_side and side_by_side["markdown"])
    result = {"meta": meta, "figures": [asdict(f) for f in figures], "notes": notes}
    if side_by_side:
        result["side_by_side"] = {"servers": side_by_side["servers"], "rows": side_by_side["rows"]}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "results.md").write_text(table)
    return table


def side_bench_parser(prog: str, doc: str, name: str) -> argparse.ArgumentParser:
    """The flags every side bench takes (`python -m bench.NAME`): --quick, --engine-threads, --out."""
    parser = argparse.ArgumentParser(prog=prog, description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few requests: checks the bench, measures little")
    parser.add_argument("--engine-threads", type=int, metavar="N", help="INFERENCE_NUM_THREADS of every model")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where {name}.{{json,md}} go")
    return parser


def engine_properties(args: argparse.Namespace) -> dict:
    """The OpenVINO properties a side bench's --engine-threads asks for."""
    return {"INFERENCE_NUM_THREADS": args.engine_threads} if args.engine_threads else {}


def write_side_bench(out: Path, stem: str, meta: dict, figures: list[Figure], columns: tuple[str, ...]) -> str:
    """A side bench's (bench.constrained, bench.embeddings) figures: a table of the Figure fields `columns` as
    <stem>.md, everything as <stem>.json; returns the table."""
    rows = [" | ".join(str(getattr(f, column)) for column in columns) for f in figures]
    headers = ("Figure" if column == "name" else column.capitalize() for column in columns)
    table = "\n".join([f"| {' | '.join(headers)} |",
                       "|" + "---|" * len(columns)] + [f"| {row} |" for row in rows]) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "figures": [asdict(f) for f in figures]}, indent=2) + "\n")
    (out / f"{stem}.md").write_text(table)
    return table


def load_average() -> str:
    """The 1, 5 and 15 minute load averages while the run ended: other work on the cores moves every figure."""
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _spaced(unit: str) -> str:
    return unit if unit == "x" else f" {unit}"


def side_bench_main(argv: list[str] | None, stem: str, doc: str, measure, quick_help: str) -> None:
    """The command line of a side bench that takes only --quick and --out (`python -m bench.<stem>`): run
    `measure(quick)` (a coroutine returning meta and figures) and print and write its table."""
    parser = argparse.ArgumentParser(prog=f"python -m bench.{stem}", description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"where {stem}.{{json,md}} go")
    args = parser.parse_args(argv)
    meta, figures = asyncio.run(measure(args.quick))
    print(write_side_bench(args.out, stem, meta, figures, ("name", "measured")), end="", flush=True)

