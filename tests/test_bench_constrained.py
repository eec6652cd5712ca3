"""`python -m bench.constrained --quick`: the constrained-decoding figures come out complete and well formed.

Only shapes are asserted, never a timing (the README's Benchmarks section has the measured figures)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

BENCH_TIMEOUT_S = 300  # only catches a hang: the quick run takes ~10 s


def test_quick_run_reports_every_figure(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.constrained", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (tmp_path / "constrained.md").read_text()
    results = json.loads((tmp_path / "constrained.json").read_text())
    names = [f["name"] for f in results["figures"]]
    assert any("unconstrained" in n for n in names) and any("JSON schema" in n for n in names)
    rates = results["meta"]["rates"]
    assert len(rates["unconstrained"]) == len(rates["json_schema"]) == 2
    assert all(f["value"] is not None for f in results["figures"])
    assert all(f["value"] > 0 for f in results["figures"] if f["unit"] in ("tokens/s", "ms"))
