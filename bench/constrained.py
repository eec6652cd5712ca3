"""`python -m bench.constrained [--quick]`: what constrained decoding costs per token, on the demo model.

One appliance, one model, the same prompts and token counts; streams alternate between an unconstrained request
and the same request under a JSON schema (an array of short strings, long enough that max_tokens ends it, so
both sides generate exactly the tokens asked for). Reported: each side's streamed tokens/s (from the request to
the last token, as the main bench counts it) and their ratio; then the two costs apart: the first token's extra
time under the schema (the per-request matcher set-up and, on a schema seen before, no compile) and the per-token
mask cost (from the first token to the last, so neither the first token nor the set-up is in it); and the
first-request latency of a schema the worker has not seen (its probe compile plus genai's own) against the same
schema again.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import client, report, workload
from bench.launcher import PERF_MODEL, OwnAppliance

TOKENS = 256
SCHEMA = {"type": "array", "minItems": 10000, "items": {"type": "string", "maxLength": 12}}


def bodies(i: int, tokens: int) -> dict[str, dict]:
    plain = workload.chat_body(PERF_MODEL, i, tokens, stream=True)
    schema = {"type": "json_schema", "json_schema": {"name": "words", "schema": SCHEMA}}
    return {"unconstrained": plain, "json_schema": {**plain, "response_format": schema}}


async def stream_rates(session: aiohttp.ClientSession, base: str, rounds: int, tokens: int) -> dict[str, list[float]]:
    """Per kind: `rate` (request to last token), `first_s` (request to first token) and `per_token_s` (first token
    to last, per token after the first)."""
    rates: dict[str, list[float]] = {f"{kind} {what}": [] for kind in ("unconstrained", "json_schema")
                                     for what in ("rate", "first_s", "per_token_s")}
    for i in range(rounds):
        order = list(bodies(i, tokens).items())
        for kind, body in order if i % 2 == 0 else order[::-1]:
            got = await client.stream(session, base, body)
            if got.status != 200 or got.error or got.tokens != tokens:
                raise RuntimeError(f"{kind}: {got.status} {got.error or ''} ({got.tokens} of {tokens} tokens)")
            rates[f"{kind} rate"].append(workload.stream_rate(got.started, got.token_times, got.tokens))
            rates[f"{kind} first_s"].append(got.token_times[0] - got.started)
            rates[f"{kind} per_token_s"].append((got.token_times[-1] - got.token_times[0]) / (got.tokens - 1))
    return rates


async def first_schema_latency(session: aiohttp.ClientSession, base: str) -> tuple[float, float]:
    """Seconds for a one-token request under a schema never seen, then under the same schema again."""
    schema = {"type": "object", "properties": {f"field_{time.time_ns()}": {"type": "integer"}}}
    body = {"model": PERF_MODEL, "messages": workload.messages(0), "max_tokens": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "fresh", "schema": schema}}}
    seconds = []
    for _ in range(2):
        started = time.perf_counter()
        reply = await client.complete(session, base, body)
        if reply.status != 200:
            raise RuntimeError(f"{reply.status}: {reply.error}")
        seconds.append(time.perf_counter() - started)
    return seconds[0], seconds[1]


async def measure(quick: bool) -> tuple[dict, list[report.Figure]]:
    rounds = 2 if quick else 12
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        from appliance.demo.catalog import build_demo_model
        model = build_demo_model(Path(tmp) / "demo", eos_after=0, max_new_tokens=4096)
        app = OwnAppliance(model, Path(tmp))
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await app.start(session)
            try:
                await stream_rates(session, app.base, 1, TOKENS)  # warm both paths (and compile the schema once)
                rates = await stream_rates(session, app.base, rounds, TOKENS)
                fresh, again = await first_schema_latency(session, app.base)
            finally:
                app.stop()
    plain, constrained = (statistics.median(rates[f"{k} rate"]) for k in ("unconstrained", "json_schema"))
    first = {k: statistics.median(rates[f"{k} first_s"]) for k in ("unconstrained", "json_schema")}
    per_token = {k: statistics.median(rates[f"{k} per_token_s"]) for k in ("unconstrained", "json_schema")}
    mask_us = (per_token["json_schema"] - per_token["unconstrained"]) * 1e6
    first_ms = (first["json_schema"] - first["unconstrained"]) * 1e3
    figures = [
        report.Figure(f"Stream, {TOKENS} tokens, unconstrained", f"{plain:,.0f} tokens/s", plain, "tokens/s"),
        report.Figure(f"Stream, {TOKENS} tokens, JSON schema", f"{constrained:,.0f} tokens/s", constrained, "tokens/s"),
        report.Figure("JSON schema / unconstrained", f"{constrained / plain:.0%}", constrained / plain * 100, "%"),
        report.Figure("Per-token mask cost of the schema (first token to last)", f"{mask_us:,.0f} µs a token "
                      f"({per_token['json_schema'] * 1e6:,.0f} against {per_token['unconstrained'] * 1e6:,.0f})",
                      mask_us, "µs"),
        report.Figure("First-token cost of the schema (a schema seen before: matcher set-up, no compile)",
                      f"{first_ms:,.1f} ms ({first['json_schema'] * 1e3:.1f} against {first['unconstrained'] * 1e3:.1f})",
                      first_ms, "ms"),
        report.Figure("1-token request, new schema", f"{fresh * 1e3:.1f} ms", fresh * 1e3, "ms"),
        report.Figure("1-token request, same schema again", f"{again * 1e3:.1f} ms", again * 1e3, "ms"),
    ]
    meta = {"when": report.now(), "rounds": rounds, "tokens": TOKENS, "quick": quick, **report.machine(),
            "rates": rates}
    return meta, figures


def main(argv: list[str] | None = None) -> None:
    report.side_bench_main(argv, "constrained", __doc__, measure, "two rounds: checks the bench, measures nothing")


if __name__ == "__main__":
    main()
