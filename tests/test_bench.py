"""`python -m bench --quick`: a complete, well-formed report, against its own appliance and against a URL.

Only the shape of the output is asserted, never a timing: the quick mode measures too little to mean anything,
and CI machines differ (the real figures are in the README, Benchmarks).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, model_entry

BENCH_TIMEOUT_S = 300  # only catches a hang: the quick run takes ~15 s
VERDICTS = {"PASS", "MISS", "info", "not measured"}
TARGETED = ("median ratio", "added median", "Streaming", "Concurrency", "SIGABRT", "Recovery", "SIGSTOP", "Front RSS",
            "Worker RSS")


def run_bench(out: Path, *args: str) -> dict:
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out), *args], cwd=REPO,
                          # TMPDIR: the bench's model directory lands in `out`, so every process it starts names
                          # the test's directory on its command line (the leftover check below relies on it)
                          env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(out)},
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (out / "results.md").read_text() + "\n"  # what it prints is what it wrote
    return json.loads((out / "results.json").read_text())


def table_rows(markdown: str) -> list[list[str]]:
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    assert lines[0] == "| Figure | Measured | In-process baseline | Target | Verdict | Client cost |"
    assert set(lines[1]) <= {"|", "-"}
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def assert_report_matches(result: dict, out: Path) -> None:
    rows = table_rows((out / "results.md").read_text())
    assert [(r[0], r[4]) for r in rows] == [(f["name"], f["verdict"]) for f in result["figures"]]
    assert all(len(r) == 6 for r in rows)
    for figure in result["figures"]:
        assert figure["verdict"] in VERDICTS, figure
        assert figure["measured"] and "|" not in figure["measured"] + figure["baseline"], figure
        if figure["verdict"] in ("PASS", "MISS"):
            assert figure["target"] and isinstance(figure["value"], float), figure
    machine = result["meta"]["machine"]
    assert machine["cores"] == str(os.cpu_count()) and machine["cpu"] and machine["openvino_genai"]
    assert result["meta"]["mode"] == "quick" and result["notes"]


def test_quick_bench_reports_every_figure_against_its_baseline(tmp_path):
    result = run_bench(tmp_path)
    assert_report_matches(result, tmp_path)
    verdicts = {f["name"]: f["verdict"] for f in result["figures"]}
    for word in TARGETED:  # every figure with a target got a verdict, none was skipped
        matching = [v for name, v in verdicts.items() if word in name]
        assert matching and set(matching) <= {"PASS", "MISS"}, (word, verdicts)
    assert sum("Concurrency" in name for name in verdicts) == 4
    assert all(f["baseline"] for f in result["figures"] if "ratio" in f["name"] or "Concurrency" in f["name"])
    # its appliance stopped cleanly, and took its workers with it
    assert "stopped" in (tmp_path / "appliance.log").read_text()
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline_mentions(p, str(tmp_path))]


def test_quick_bench_against_a_url_measures_the_http_figures_only(appliance_factory, long_demo_model, tmp_path):
    app = appliance_factory({"models": [model_entry("served", long_demo_model, max_running=16)]})
    result = run_bench(tmp_path, "--url", app.base)
    assert_report_matches(result, tmp_path)
    assert result["meta"]["target"] == app.base
    by_verdict: dict[str, list[str]] = {}
    for figure in result["figures"]:
        by_verdict.setdefault(figure["verdict"], []).append(figure["name"])
    # no in-process baseline without --model-path: absolute figures, no verdicts; no signals to someone else's workers
    assert set(by_verdict) == {"info", "not measured"}
    assert any("Concurrency, 16 clients" in name for name in by_verdict["info"])
    assert any("SIGABRT" in name for name in by_verdict["not measured"])
    assert app.model_status("served")["restarts"] == 0


def _cmdline_mentions(proc: Path, text: str) -> bool:
    try:
        return text.encode() in (proc / "cmdline").read_bytes()
    except OSError:
        return False
