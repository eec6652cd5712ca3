"""`python -m bench.summary DIR [DIR ...]`: the median of each figure over several runs of `python -m bench`.

One run on a shared machine moves by tens of percent; docs/performance.md reports medians. Each figure's verdict is its
target applied to the median; the range shows how far the runs spread. Prints a markdown table.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

TARGET = re.compile(r"^(<=|>=|<) (-?[\d.]+)")
CHECKS = {"<=": lambda v, t: v <= t, ">=": lambda v, t: v >= t, "<": lambda v, t: v < t}


def load(dirs: list[str]) -> list[dict]:
    return [json.loads((Path(d) / "results.json").read_text()) for d in dirs]


def verdict(target: str, value: float) -> str:
    match = TARGET.match(target)
    if not match:
        return "info"
    return "PASS" if CHECKS[match[1]](value, float(match[2])) else "MISS"


def fmt(value: float, unit: str) -> str:
    return f"{value:,.2f}{unit if unit == 'x' else ' ' + unit}" if abs(value) < 100 else f"{value:,.0f} {unit}"


def rows(runs: list[dict]) -> list[list[str]]:
    by_name: dict[str, list[dict]] = {}
    for run in runs:
        for figure in run["figures"]:
            by_name.setdefault(figure["name"], []).append(figure)
    table = []
    for name, figures in by_name.items():
        values = [f["value"] for f in figures if f["value"] is not None and f["verdict"] != "not comparable"]
        if not values:
            table.append([name, figures[-1]["measured"], "", figures[-1]["target"], figures[-1]["verdict"]])
            continue
        unit, target = figures[0]["unit"], figures[0]["target"]
        median = statistics.median(values)
        spread = f"{fmt(min(values), unit)} .. {fmt(max(values), unit)} (n={len(values)})"
        table.append([name, fmt(median, unit), spread, target, verdict(target, median) if target else "info"])
    return table


def markdown(runs: list[dict]) -> str:
    loads = "; ".join(run["meta"]["load"] for run in runs)
    lines = [f"Medians of {len(runs)} runs ({runs[0]['meta']['mode']}), {runs[0]['meta']['date']} to "
             f"{runs[-1]['meta']['date']}, against {runs[0]['meta']['target']}.",
             f"Load averages (1/5/15 min): {loads}.", "",
             "| Figure | Median | Range over the runs | Target | Verdict (median) |", "|---|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows(runs)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    dirs = sys.argv[1:] if argv is None else argv
    if not dirs:
        print(__doc__, file=sys.stderr)
        return 2
    print(markdown(load(dirs)), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
