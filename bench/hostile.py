"""`python -m bench.hostile [--quick] [--clients N]`: what a storm of hostile clients costs an honest one.

Its own appliance serves the demo model. One honest client sends chat requests one after another (16 tokens each)
and times them at the client, first alone, then beside N hostile clients that replay the fixed corpus of known
bombs (BOMBS: the issue-36 grammars, a 100 MB-expanding schema, nested-repeat regexes and EBNF, deep nesting,
NaN, invalid UTF-8, giant strings) back to back, each waiting for its answer. Figures: the honest client's median
and p90 latency with and without the storm and their ratio, the hostile requests answered and the slowest of
their answers, and whether any got a 5xx or changed the worker's pid. Results in bench/results/hostile.{md,json}.
The corpus is the hostile suite's too (tests/test_hostile.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import report
from bench.launcher import OwnAppliance

CLIENTS = {True: 4, False: 16}
HONEST_SECONDS = {True: 3.0, False: 20.0}  # the honest client's time on each side: requests back to back
WARM_STORM_S = 1.0  # the storm under way (the grammar helper started, the refusals remembered) before timing
CHAT = [{"role": "user", "content": "Hi"}]
HONEST = {"model": "demo", "messages": CHAT, "max_tokens": 16, "temperature": 0}

# The known bombs, as sent before issue 36 took each apart (tests/test_hostile.py sends them to every route).
NESTED_REPEATS = "start: A\nA: /((((a){64}){64}){64}){64}/"  # 224 bytes as a request: 67 MB of EBNF
OPTIONALS_16 = "start: " + " ".join(f"x{i}?" for i in range(16)) + "\n" + "".join(f'x{i}: "x"\n' for i in range(16))
TERMINAL_DAG = "start: A\n" + "".join(f"{a}: {b} {b}\n" for a, b in zip("ABCDEFGHIJKLMNOPQRST", "BCDEFGHIJKLMNOPQRSTU")) \
    + 'U: "abc"\n'  # 20 terminals each using the next twice: lark's own resolution of them took minutes
REGEX_BOMB = "((a{100}){100}){100}"  # 30 s of genai's compile
NAMED_GROUP_REGEX_BOMB = "(?<n>" + REGEX_BOMB + ")"  # genai's dialect, not Python's: 12 s of genai's compile
# 785 bytes: templates each using the next 20 times, seven deep; counting their uses took 20^6 steps (the helper
# held every client's conversion for its 30 s time bound)
TEMPLATE_FANOUT = 'start: t1{"a"}\n' + "".join(f"t{i}{{x}}: " + " ".join([f"t{i + 1}{{x}}"] * 20) + "\n"
                                               for i in range(1, 7)) + "t7{x}: x\n"
EBNF_BOMB = 'root ::= ((("a"{100}){100}){100})'  # 25 s of genai's compile


def ambiguous_alternatives(n: int = 1800) -> str:
    """A Lark grammar inside every size limit that costs genai seconds on the engine thread: n alternatives of a
    short character class under `+`, so every text has many parses (27 KB at 1,800: 16.5 s to compile on the
    demo vocabulary, 127.5 s on a 150,000-token one; 300 of them cost 0.6 s a token). Not in BOMBS: the worker's
    probe answers it after its compile, not in milliseconds (tests/test_grammar_probe.py sends it)."""
    pick = random.Random(2)  # the same grammar every time
    classes = ("".join(pick.choice("abcdefghij") for _ in range(3)) for _ in range(n))
    return "start: (" + " | ".join(f"/[{c}]{{2,5}}/" for c in classes) + ")+\n"


def schema_bomb(levels: int = 21) -> dict:
    """Over 100 MB written out (2**21 copies of a 64-character enum), 3 KB as sent."""
    defs = {"d0": {"type": "string", "enum": ["x" * 64]}}
    for i in range(1, levels + 1):
        ref = {"$ref": f"#/$defs/d{i - 1}"}
        defs[f"d{i}"] = {"type": "object", "properties": {"a": ref, "b": ref}, "required": ["a", "b"]}
    return {"$defs": defs, "$ref": f"#/$defs/d{levels}"}


def custom_tool(definition: str, responses: bool = False) -> dict:
    """A custom tool with a Lark grammar, in the Responses API's shape or chat completions'."""
    fmt = {"type": "grammar", "syntax": "lark", "definition": definition}
    if responses:
        return {"type": "custom", "name": "patch", "format": fmt}
    return {"type": "custom", "custom": {"name": "patch", "format": {"type": "grammar", "grammar": {
        "syntax": "lark", "definition": definition}}}}


def deep(n: int) -> bytes:
    return b"[" * n + b"]" * n


def bombs() -> list[tuple[str, bytes]]:
    """(path, raw body) of each bomb, on the demo model."""
    chat = {"model": "demo", "messages": CHAT, "max_tokens": 4}
    responses = {"model": "demo", "input": "Hi", "max_output_tokens": 4}
    out = [("/v1/chat/completions", {**chat, "tools": [custom_tool(NESTED_REPEATS)]}),
           ("/v1/responses", {**responses, "tools": [custom_tool(NESTED_REPEATS, True)]}),
           ("/v1/responses", {**responses, "tools": [custom_tool(OPTIONALS_16, True)]}),
           ("/v1/chat/completions", {**chat, "tools": [custom_tool(TERMINAL_DAG)]}),
           ("/v1/responses", {**responses, "tools": [custom_tool(TEMPLATE_FANOUT, True)]}),
           ("/v1/chat/completions", {**chat, "response_format": {"type": "json_schema", "json_schema": {
               "name": "bomb", "schema": schema_bomb()}}}),
           ("/v1/chat/completions", {**chat, "structured_outputs": {"regex": REGEX_BOMB}}),
           ("/v1/chat/completions", {**chat, "structured_outputs": {"regex": NAMED_GROUP_REGEX_BOMB}}),
           ("/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 4,
                                "structured_outputs": {"grammar": EBNF_BOMB}}),
           ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": "a" * 900_000}]}),
           ("/v1/messages/count_tokens", {"model": "demo", "messages": [{"role": "user", "content": "a" * 900_000}]}),
           ("/v1/responses", {**responses, "input": "a" * 900_000}),
           ("/v1/chat/completions", deep(100_000)),
           ("/v1/chat/completions", json.dumps(chat).encode().replace(b'"max_tokens": 4', b'"temperature": NaN')),
           ("/v1/chat/completions", json.dumps(chat).encode().replace(b'"demo"', b'"\xff\xfe"'))]
    return [(path, body if isinstance(body, bytes) else json.dumps(body).encode()) for path, body in out]


async def honest_latencies(session: aiohttp.ClientSession, base: str, seconds: float) -> list[float]:
    times: list[float] = []
    until = time.monotonic() + seconds
    while time.monotonic() < until or len(times) < 5:
        started = time.monotonic()
        async with session.post(base + "/v1/chat/completions", json=HONEST) as response:
            await response.read()
            assert response.status == 200, response.status
        times.append(time.monotonic() - started)
    return times


async def hostile_client(session: aiohttp.ClientSession, base: str, corpus: list, answers: list,
                         stop: asyncio.Event, start: int) -> None:
    i = start  # each client its own place in the corpus: every bomb is in flight at once
    while not stop.is_set():
        path, body = corpus[i % len(corpus)]
        i += 1
        started = time.monotonic()
        async with session.post(base + path, data=body, headers={"Content-Type": "application/json"}) as response:
            await response.read()
            answers.append((response.status, time.monotonic() - started, (i - 1) % len(corpus)))


async def measure(quick: bool, clients: int | None = None) -> tuple[dict, list]:
    from appliance.demo.catalog import build_demo_model
    clients = clients or CLIENTS[quick]
    with tempfile.TemporaryDirectory(prefix="openarc-bench-hostile-") as tmp:
        model = build_demo_model(Path(tmp) / "llm", "llm", eos_after=0, max_new_tokens=4096)
        app = OwnAppliance(model, Path(tmp), models=[{"name": "demo", "path": str(model), "max_context": 2048}])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                         connector=aiohttp.TCPConnector(limit=clients + 4)) as session:
            await app.start(session)
            try:
                pid = await app.worker_pid(session, "demo")
                await honest_latencies(session, app.base, 0.5)  # warm
                alone = await honest_latencies(session, app.base, HONEST_SECONDS[quick])
                answers: list[tuple[int, float, int]] = []
                stop = asyncio.Event()
                storm = [asyncio.create_task(hostile_client(session, app.base, bombs(), answers, stop, i))
                         for i in range(clients)]
                await asyncio.sleep(WARM_STORM_S)
                beside = await honest_latencies(session, app.base, HONEST_SECONDS[quick])
                stop.set()
                await asyncio.gather(*storm)
                same_worker = await app.worker_pid(session, "demo") == pid
            finally:
                app.stop()
    meta = {"when": report.now(), "quick": quick, "hostile_clients": clients, "bombs": len(bombs()),
            "load_average": report.load_average(), **report.machine(),
            "honest_ms": {"alone": [round(x * 1000, 2) for x in alone], "storm": [round(x * 1000, 2) for x in beside]},
            "hostile_statuses": sorted({status for status, _, _ in answers}),
            "hostile_median_ms_by_bomb": {str(b): round(statistics.median(t for _, t, k in answers if k == b) * 1000, 1)
                                          for b in sorted({k for _, _, k in answers})}}
    return meta, figures(alone, beside, answers, same_worker, clients)


def p90(samples: list[float]) -> float:
    return sorted(samples)[int(0.9 * (len(samples) - 1))]


HEADLINE = "Hostile storm: an honest client's chat latency beside / without hostile clients"


def figures(alone: list[float], beside: list[float], answers: list[tuple[int, float, int]], same_worker: bool,
            clients: int) -> list[report.Figure]:
    a, b = statistics.median(alone) * 1000, statistics.median(beside) * 1000
    server_errors = sum(status >= 500 for status, _, _ in answers)
    slowest = max((took for _, took, _ in answers), default=0.0) * 1000
    return [
        report.Figure("Honest chat latency alone (median / p90)", f"{a:,.1f} ms / {p90(alone) * 1000:,.1f} ms", a, "ms"),
        report.Figure(f"Honest chat latency beside {clients} hostile clients (median / p90)",
                      f"{b:,.1f} ms / {p90(beside) * 1000:,.1f} ms", b, "ms"),
        report.Figure("Hostile requests answered; 5xx among them; slowest answer",
                      f"{len(answers):,}; {server_errors}; {slowest:,.1f} ms", server_errors, "5xx",
                      verdict="PASS" if server_errors == 0 and same_worker else "MISS", target="no 5xx, same worker"),
        report.Figure(HEADLINE, f"{b:,.1f} ms / {a:,.1f} ms ({b / a:.2f}x), {clients} hostile clients, "
                                f"{'the worker kept its pid' if same_worker else 'THE WORKER WAS REPLACED'}",
                      b / a, "x", f"the fixed corpus of {len(bombs())} bombs replayed back to back "
                                  "(python -m bench.hostile)"),
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.hostile", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"{CLIENTS[True]} hostile clients, "
                                                             f"{HONEST_SECONDS[True]:g} s of honest requests a side")
    parser.add_argument("--clients", type=int, help="hostile clients (default 16, 4 with --quick)")
    parser.add_argument("--out", type=Path, default=report.RESULTS, help="where hostile.{json,md} go")
    args = parser.parse_args(argv)
    meta, figures_ = asyncio.run(measure(args.quick, args.clients))
    print(report.write_side_bench(args.out, "hostile", meta, figures_, ("name", "measured", "target", "verdict")),
          end="", flush=True)


if __name__ == "__main__":
    main()
