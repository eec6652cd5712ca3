"""`python -m bench.responses_ws [--quick]`: the per-turn overhead of the Responses API's WebSocket mode against
SSE, in one run on one appliance.

An agent loop of short turns (a few tokens each, so a turn's time is mostly the transport's and the front's, not the
model's): every turn continues the one before with `previous_response_id` and a short new input. Two loops take
turns, turn by turn, so both see the same load: one over HTTP (a streamed POST /v1/responses on a kept-alive
connection, `store: true`, the server's store), one over a WebSocket (`response.create` messages on one socket,
`store: false`, the connection's own cache). A turn's time is from sending its request to its response.completed.
Figures: the median turn over each transport, their difference, and the median time to the first event.
Results in bench/results/responses_ws.{md,json}.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import report
from bench.launcher import PERF_MODEL, OwnAppliance

TURN_TOKENS = 4


def turn_body(turn: int, previous: str | None) -> dict:
    return {"model": PERF_MODEL, "input": f"Step {turn}: the tool said ok. Next?", "max_output_tokens": TURN_TOKENS,
            "previous_response_id": previous}


async def sse_turn(session: aiohttp.ClientSession, base: str, body: dict) -> tuple[float, float, str]:
    """(seconds to the first event, to response.completed, the response's id) of one streamed POST."""
    started = time.perf_counter()
    first = None
    async with session.post(base + "/v1/responses", json={**body, "stream": True, "store": True}) as response:
        if response.status != 200:
            raise RuntimeError(f"SSE turn: {response.status}: {await response.text()}")
        async for line in response.content:
            if not line.startswith(b"data: "):
                continue
            first = first or time.perf_counter() - started
            event = json.loads(line[6:])
            if event["type"] in ("response.completed", "response.incomplete"):
                return first, time.perf_counter() - started, event["response"]["id"]
    raise RuntimeError("SSE turn: the stream ended without its response")


async def socket_turn(ws, body: dict) -> tuple[float, float, str]:
    started = time.perf_counter()
    first = None
    await ws.send_json({"type": "response.create", **body, "store": False})
    while True:
        event = await ws.receive_json()
        first = first or time.perf_counter() - started
        if event["type"] in ("response.completed", "response.incomplete"):
            return first, time.perf_counter() - started, event["response"]["id"]
        if event["type"] in ("error", "response.failed"):
            raise RuntimeError(f"WebSocket turn: {event}")


async def measure(quick: bool) -> tuple[dict, list[report.Figure]]:
    turns = 4 if quick else 40
    times: dict[str, dict[str, list[float]]] = {side: {"first": [], "turn": []} for side in ("sse", "websocket")}
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        from appliance.demo.catalog import build_demo_model
        model = build_demo_model(Path(tmp) / "demo", eos_after=0, max_new_tokens=4096)
        app = OwnAppliance(model, Path(tmp))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await app.start(session)
            try:
                async with session.ws_connect(app.base.replace("http://", "ws://") + "/v1/responses") as ws:
                    previous = {"sse": None, "websocket": None}
                    for turn in range(turns + 1):  # turn 0 warms both paths, and is not counted
                        for side in (("sse", "websocket") if turn % 2 else ("websocket", "sse")):
                            body = turn_body(turn, previous[side])
                            first, took, previous[side] = await (sse_turn(session, app.base, body) if side == "sse"
                                                                 else socket_turn(ws, body))
                            if turn:
                                times[side]["first"].append(first)
                                times[side]["turn"].append(took)
            finally:
                app.stop()
    median = {side: {what: statistics.median(values) * 1e3 for what, values in kinds.items()}
              for side, kinds in times.items()}
    saved = median["sse"]["turn"] - median["websocket"]["turn"]
    figures = [
        report.Figure(f"Turn of {TURN_TOKENS} tokens over SSE (POST, previous_response_id)",
                      f"{median['sse']['turn']:.1f} ms", median["sse"]["turn"], "ms"),
        report.Figure(f"Turn of {TURN_TOKENS} tokens over WebSocket (response.create, previous_response_id)",
                      f"{median['websocket']['turn']:.1f} ms", median["websocket"]["turn"], "ms"),
        report.Figure("Per-turn overhead saved by WebSocket (SSE turn - WebSocket turn, medians)",
                      f"{saved:.1f} ms", saved, "ms"),
        report.Figure("First event over SSE", f"{median['sse']['first']:.1f} ms", median["sse"]["first"], "ms"),
        report.Figure("First event over WebSocket", f"{median['websocket']['first']:.1f} ms",
                      median["websocket"]["first"], "ms"),
    ]
    meta = {"when": report.now(), "turns": turns, "turn_tokens": TURN_TOKENS, "quick": quick, **report.machine(),
            "times_s": times}
    return meta, figures


def main(argv: list[str] | None = None) -> None:
    report.side_bench_main(argv, "responses_ws", __doc__, measure, "four turns each: checks the bench, measures nothing")


if __name__ == "__main__":
    main()
