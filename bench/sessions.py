"""`python -m bench.sessions [--quick] [--peer URL --peer-model NAME]`: warm sessions, the time to first token of
every turn of multi-turn conversations.

Its own appliance serves the 12-layer demo model (`openarc demo-model --layers 12 --eos-after 0`: prefill then costs
about as much as a 7B model's on an Arc card, relative to a decoded token) twice: `warm` as configured by default
(prefix caching on) and `cold` with `scheduler_config: {enable_prefix_caching: false}`. Several sessions (a system
prompt and tools of about 1,100 tokens, the demo's 2,048 positions allowing no more, and a history growing by a
question and its answer a turn) are interleaved turn by turn, and each turn goes to every side in turn: warm, cold,
genai's ContinuousBatchingPipeline in this process with the worker's scheduler settings (prefix caching on), and
the peer if given (the same model directory served by another server). Figures: the median time to first token of
turn 1 and of later turns per side, their spread (lowest-highest), and the share of prompt tokens the warm model's
cache served (openarc_prompt_tokens_total by source). Results in bench/results/sessions.{md,json}.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import client, report
from bench.launcher import OwnAppliance

LAYERS = {True: 2, False: 12}
SESSIONS = {True: 2, False: 3}
TURNS = {True: 3, False: 6}
ANSWER_TOKENS = 16
TOOLS = [{"type": "function", "function": {
    "name": f"tool_{i}", "description": f"Tool {i} of the agent: reads, edits or runs part {i} of the project.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "line": {"type": "integer"}},
                   "required": ["path"]}}} for i in range(4)]
SYSTEM = "You are a coding agent working in a repository. " + " ".join(
    f"Rule {i}: keep changes small and explain each." for i in range(8))


def conversation_turn(history: list[dict], session: int, turn: int) -> list[dict]:
    history.append({"role": "user", "content": f"Session {session}, step {turn}: what is the next change to make?"})
    return list(history)


async def first_token(session: aiohttp.ClientSession, base: str, model: str, messages: list, tools: list) -> float:
    """Seconds to the first text chunk of one streamed chat."""
    body = {"model": model, "messages": messages, "tools": tools, "max_tokens": ANSWER_TOKENS, "stream": True,
            "temperature": 0}
    got = await client.stream(session, base, body)
    if got.status != 200 or got.error or not got.token_times:
        raise RuntimeError(f"{model} at {base}: {got.status}: {got.error or got.broken or 'no content'}")
    return got.token_times[0] - got.started


class InProcessGenai:
    """genai's ContinuousBatchingPipeline in this process, with the worker's scheduler settings."""

    def __init__(self, path: Path, settings: dict):
        import openvino_genai
        from appliance.worker.engines.batching import scheduler_config
        self.genai = openvino_genai
        self.pipe = openvino_genai.ContinuousBatchingPipeline(str(path), scheduler_config(settings), "CPU", {})
        self.tokenizer = self.pipe.get_tokenizer()
        self.next_id = 0

    def first_token(self, messages: list, tools: list) -> float:
        start = time.perf_counter()
        text = self.tokenizer.apply_chat_template(self.genai.ChatHistory(messages), add_generation_prompt=True,
                                                  tools=[t["function"] for t in tools])
        ids = self.tokenizer.encode(text, add_special_tokens=False).input_ids
        config = self.genai.GenerationConfig()
        config.max_new_tokens = ANSWER_TOKENS
        self.next_id += 1
        handle = self.pipe.add_request(self.next_id, ids, config)
        first = None
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
            if first is None and handle.can_read():
                first = time.perf_counter() - start
        return first


async def prompt_tokens(session: aiohttp.ClientSession, base: str, model: str) -> dict[str, float]:
    async with session.get(base + "/metrics") as response:
        text = await response.text()
    out = {"cache": 0.0, "computed": 0.0}
    for line in text.splitlines():
        if line.startswith("openarc_prompt_tokens_total{") and f'model="{model}"' in line:
            source = line.split('source="')[1].split('"')[0]
            out[source] = float(line.rsplit(" ", 1)[1])
    return out


async def measure(quick: bool, peer: str | None = None, peer_model: str | None = None) -> tuple[dict, list]:
    from appliance.config import ModelConfig
    from appliance.demo.catalog import build_demo_model
    sides = ["warm", "cold", "in-process genai"] + (["peer"] if peer else [])
    times: dict[str, dict[int, list[float]]] = {side: {} for side in sides}
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        model = build_demo_model(Path(tmp) / "llm", "llm", eos_after=0, max_new_tokens=4096, layers=LAYERS[quick])
        entry = {"path": str(model), "max_context": 2048, "max_running": 8}
        app = OwnAppliance(model, Path(tmp), models=[
            {"name": "warm", **entry}, {"name": "cold", **entry, "scheduler_config": {"enable_prefix_caching": False}}])
        inproc = InProcessGenai(model, ModelConfig(name="x", path=str(model)).scheduler_settings())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            await app.start(session)
            try:
                before = await prompt_tokens(session, app.base, "warm")
                histories = [[{"role": "system", "content": f"Project {s}. {SYSTEM}"}] for s in range(SESSIONS[quick])]
                for turn in range(1, TURNS[quick] + 1):
                    for s, history in enumerate(histories):
                        messages = conversation_turn(history, s, turn)
                        for side in sides:
                            if side == "in-process genai":
                                took = inproc.first_token(messages, TOOLS)
                            else:
                                base, name = (peer, peer_model) if side == "peer" else (app.base, side)
                                took = await first_token(session, base, name, messages, TOOLS)
                            times[side].setdefault(turn, []).append(took)
                        history.append({"role": "assistant", "content": f"Change {turn} of session {s} is done."})
                after = await prompt_tokens(session, app.base, "warm")
            finally:
                app.stop()
    cached = after["cache"] - before["cache"]
    total = cached + after["computed"] - before["computed"]
    meta = {"when": report.now(), "quick": quick, "layers": LAYERS[quick], "sessions": SESSIONS[quick],
            "turns": TURNS[quick], "peer": peer, "load_average": report.load_average(), **report.machine(),
            "samples_ms": {side: {str(t): [round(x * 1000, 2) for x in v] for t, v in per.items()}
                           for side, per in times.items()}}
    hit_ratio = cached / total if total else 0.0
    return meta, figures(times, hit_ratio) + [headline(times, hit_ratio, quick)]


def later_turns(per_turn: dict[int, list[float]]) -> list[float]:
    """One side's times to first token of every turn after the first."""
    return [x for turn, xs in per_turn.items() if turn > 1 for x in xs]


def figures(times: dict[str, dict[int, list[float]]], hit_ratio: float) -> list[report.Figure]:
    out = []
    for side, per_turn in times.items():
        first, later = per_turn[1], later_turns(per_turn)
        for what, samples in (("turn 1", first), ("later turns", later)):
            median = statistics.median(samples) * 1000
            out.append(report.Figure(f"TTFT {what}, {side} (median; lowest-highest)",
                                     f"{median:,.1f} ms ({min(samples) * 1000:,.1f}-{max(samples) * 1000:,.1f})",
                                     median, "ms"))
    out.append(report.Figure("Prompt tokens the warm model's cache served (all turns)", report.percent(hit_ratio * 100),
                             hit_ratio * 100, "%"))
    return out


HEADLINE = "Warm sessions, later turns: time to first token, prefix cache on (default) / off"


def headline(times: dict[str, dict[int, list[float]]], hit_ratio: float, quick: bool) -> report.Figure:
    """The main bench's row: the median time to first token of later turns with the default config against the same
    turns with prefix caching off, and the share of prompt tokens the cache served."""
    warm, cold = (statistics.median(later_turns(times[side])) * 1000 for side in ("warm", "cold"))
    return report.Figure(HEADLINE, f"{warm:,.1f} ms / {cold:,.1f} ms (off / on: {cold / warm:.2f}x); "
                                   f"{hit_ratio:.0%} of prompt tokens served from the cache",
                         cold / warm, "x", f"{SESSIONS[quick]} sessions of {TURNS[quick]} turns interleaved, "
                                             f"{LAYERS[quick]}-layer demo model (python -m bench.sessions)")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sessions", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a 2-layer model, 2 sessions of 3 turns: checks the "
                                                             "bench, measures nothing")
    parser.add_argument("--out", type=Path, default=report.RESULTS, help="where sessions.{json,md} go")
    parser.add_argument("--peer", help="base URL of another server serving the same model directory")
    parser.add_argument("--peer-model", help="the model name on the peer (default: its first)")
    args = parser.parse_args(argv)

    async def run():
        name = args.peer_model
        if args.peer and not name:
            async with aiohttp.ClientSession() as session:
                name = await client.first_model(session, args.peer)
        return await measure(args.quick, args.peer, name)

    meta, figures_ = asyncio.run(run())
    print(report.write_side_bench(args.out, "sessions", meta, figures_, ("name", "measured")), end="", flush=True)


if __name__ == "__main__":
    main()
