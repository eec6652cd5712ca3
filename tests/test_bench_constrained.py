"""`python -m bench.constrained --quick`: the constrained-decoding figures come out complete and well formed.

Shapes are asserted, and no MISS of a figure the docs quote as met (conftest.quoted_as_met)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO, quoted_as_met

BENCH_TIMEOUT_S = 300  # only catches a hang: the quick run takes ~10 s


def test_quick_run_reports_every_figure(tmp_path):
    done = subprocess.run([sys.executable, "-m", "bench.constrained", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (tmp_path / "constrained.md").read_text()
    results = json.loads((tmp_path / "constrained.json").read_text())
    assert not quoted_as_met(results["figures"]), quoted_as_met(results["figures"])  # the docs say these are met
    names = [f["name"] for f in results["figures"]]
    assert any("unconstrained" in n for n in names) and any("JSON schema" in n for n in names)
    rates = results["meta"]["rates"]
    for kind in ("unconstrained", "json_schema"):  # each stream's rate, first token and per-token time, all measured
        assert [len(rates[f"{kind} {what}"]) for what in ("rate", "first_s", "per_token_s")] == [2, 2, 2]
        assert all(value > 0 for what in ("rate", "first_s") for value in rates[f"{kind} {what}"])
        # 0 when a loaded machine delivered the whole stream in one frame (the chunks carry the text, not the time)
        assert all(value >= 0 for value in rates[f"{kind} per_token_s"])
    assert all(f["value"] is not None for f in results["figures"])
    # the two costs apart: differences, so either sign is a measurement; they are there, and said apart
    assert any(n.startswith("Per-token mask cost") for n in names) and any(n.startswith("First-token cost") for n in names)
    assert all(f["value"] > 0 for f in results["figures"] if f["unit"] == "tokens/s" or f["name"].startswith("1-token"))
