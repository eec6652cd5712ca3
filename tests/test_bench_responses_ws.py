"""`python -m bench.responses_ws --quick`: the WebSocket-against-SSE figures come out complete and well formed
(shapes only: a quick run's few turns measure nothing)."""

from __future__ import annotations

from conftest import quick_side_bench


def test_quick_run_reports_both_transports(tmp_path):
    figures = quick_side_bench("responses_ws", tmp_path)
    turns = [f for name, f in figures.items() if name.startswith("Turn of")]
    assert [("SSE" in f["name"], "WebSocket" in f["name"]) for f in turns] == [(True, False), (False, True)]
    assert all(f["value"] > 0 for f in turns)
    assert any(name.startswith("Per-turn overhead saved by WebSocket") for name in figures)  # a difference: any sign
    assert all(figures[f"First event over {side}"]["value"] > 0 for side in ("SSE", "WebSocket"))
