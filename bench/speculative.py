"""`python -m bench.speculative [--quick] [--engine-threads N]`: what a draft model and prompt lookup do to one
client's tokens per second, on the demo pair (appliance.demo.catalog.SPECULATIVE_DEMO), with output identity
checked in the same run.

One appliance serves the same main model four ways: plain, with a draft that predicts it exactly, with a draft
wrong every fourth token, and with prompt lookup. Every model gets the same prompts, which hold the main model's
own answers (so prompt lookup has something to copy), one request at a time, whole and streamed, the models taking
turns request by request; each figure is tokens / time summed over its requests, and the speed-up is against the
plain model in the same run. The acceptance ratio is the server's own (/openarc/status) over those requests.
`python -m bench` runs this too, after its own figures.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from bench import report
from bench.launcher import OwnAppliance
from bench.report import Figure, judged

ROLES = {  # served model name -> (what it is, its config beyond the main model)
    "plain": ("no draft", {}),
    "draft": ("draft model predicting the main model exactly", {"draft_model": "draft"}),
    "draft-miss": ("draft model wrong every 4th token", {"draft_model": "draft_miss"}),
    "lookup": ("prompt lookup", {"prompt_lookup": True}),
}
SIZES = {True: (64, 2), False: (256, 10)}  # quick, full: (tokens a reply, requests per model and mode)


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    texts: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def served_models(pair: dict[str, Path], properties: dict) -> list[dict]:
    models = []
    for name, (_, extra) in ROLES.items():
        entry = {"name": name, "path": str(pair["main"]), "device": "CPU", "runtime_config": dict(properties)}
        if "draft_model" in extra:
            entry["draft_model"] = {"path": str(pair[extra["draft_model"]]), "runtime_config": dict(properties)}
        else:
            entry.update(extra)
        models.append(entry)
    return models


async def ask(session: aiohttp.ClientSession, base: str, model: str, prompt: str, tokens: int,
              stream: bool) -> tuple[str, int, float]:
    """One greedy chat completion: (text, completion tokens, seconds from send to the last byte)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": tokens, "temperature": 0}
    if stream:
        body.update(stream=True, stream_options={"include_usage": True})
    started = time.perf_counter()
    async with session.post(base + "/v1/chat/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{model}: {response.status} {await response.text()}")
        if not stream:
            reply = await response.json()
            return reply["choices"][0]["message"]["content"], reply["usage"]["completion_tokens"], \
                time.perf_counter() - started
        text, usage = "", 0
        async for line in response.content:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = (chunk.get("usage") or {}).get("completion_tokens", usage)
            text += "".join(c["delta"].get("content") or "" for c in chunk.get("choices", []))
        return text, usage, time.perf_counter() - started


async def copy_prompts(session: aiohttp.ClientSession, base: str, tokens: int) -> list[str]:
    """Prompts that hold the main model's answers of all four variants (an answer's variant follows its prompt's
    length), in four orders: whatever the answer, the prompt holds it token for token."""
    answers: dict[str, str] = {}
    for n in range(32):
        text, _, _ = await ask(session, base, "plain", "Say something" + " more" * n, tokens, False)
        answers.setdefault(text.split()[0], text)
        if len(answers) == 4:
            break
    else:
        raise RuntimeError(f"the demo gave {len(answers)} variants of answer, not 4")
    texts = list(answers.values())
    return ["Repeat one of these:\n" + "\n".join(texts[i:] + texts[:i]) for i in range(4)]


async def draft_status(session: aiohttp.ClientSession, base: str) -> dict[str, tuple[int, int]]:
    async with session.get(base + "/openarc/status") as response:
        status = await response.json()
    return {m["name"]: (m.get("draft_tokens_accepted") or 0, m.get("draft_tokens_rejected") or 0)
            for m in status["models"]}


async def measure(workdir: Path, quick: bool, properties: dict | None = None,
                  demo_cache: Path | None = None) -> tuple[dict, list[Figure]]:
    """`demo_cache`: where the demo pair is built, or found already built (default: inside `workdir`)."""
    from appliance.demo.catalog import ensure_speculative_demo
    tokens, requests = SIZES[quick]
    pair = ensure_speculative_demo(demo_cache or workdir / "cache", eos_after=0, max_new_tokens=4096)
    app = OwnAppliance(pair["main"], workdir, models=served_models(pair, properties or {}))
    found = {(name, stream): Tally() for name in ROLES for stream in (False, True)}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await app.start(session)
        try:
            prompts = await copy_prompts(session, app.base, tokens)
            for name in ROLES:  # warm each worker
                await ask(session, app.base, name, prompts[0], tokens, False)
            before = await draft_status(session, app.base)
            for i in range(requests):
                for stream in (False, True):
                    for name in ROLES:  # turns, request by request
                        text, produced, seconds = await ask(session, app.base, name, prompts[i % 4], tokens, stream)
                        tally = found[name, stream]
                        tally.tokens, tally.seconds = tally.tokens + produced, tally.seconds + seconds
                        tally.texts.append(text)
            after = await draft_status(session, app.base)
        finally:
            app.stop()
    drafts = {name: (after[name][0] - before[name][0], after[name][1] - before[name][1]) for name in ROLES}
    meta = {"when": report.now(), "tokens": tokens, "requests": requests, "quick": quick, **report.machine(),
            "properties": properties or {}, "rates": {f"{n} {'streamed' if s else 'whole'}": t.rate
                                                      for (n, s), t in found.items()}, "draft_tokens": drafts}
    return meta, figures(found, drafts, tokens)


def figures(found: dict[tuple[str, bool], Tally], drafts: dict[str, tuple[int, int]], tokens: int) -> list[Figure]:
    out = []
    for stream in (False, True):
        how = "streamed" if stream else "whole"
        plain = found["plain", stream]
        out.append(Figure(f"Speculative decoding, 1 client, {tokens} tokens {how}: plain model",
                          f"{plain.rate:,.0f} tokens/s", plain.rate, "tokens/s", "the reference of the rows below"))
        for name, (what, _) in list(ROLES.items())[1:]:
            tally = found[name, stream]
            accepted, rejected = drafts[name]
            ratio = f"{accepted / (accepted + rejected):.0%}" if accepted + rejected else "none proposed"
            out.append(Figure(f"Speculative decoding, 1 client, {tokens} tokens {how}: {what}",
                              f"{tally.rate / plain.rate:.2f}x ({tally.rate:,.0f} tokens/s; acceptance {ratio})",
                              tally.rate / plain.rate, "x", f"plain {plain.rate:,.0f} tokens/s, same prompts, same run"))
    same = sum(found[name, stream].texts == found["plain", stream].texts for name in ROLES for stream in (False, True))
    total = len(ROLES) * 2
    replies = sum(len(t.texts) for t in found.values())
    out.append(judged("Speculative decoding: greedy replies identical to the plain model's", same / total * 100, "%",
                      f"{same} of {total} model x mode series identical ({replies} replies)", at_least=100))
    return out


def main(argv: list[str] | None = None) -> None:
    parser = report.side_bench_parser("python -m bench.speculative", __doc__, "speculative")
    parser.add_argument("--demo-cache", type=Path, help="where the demo pair is built or found (default: a temporary "
                                                        "directory; a host without transformers needs one built)")
    args = parser.parse_args(argv)
    properties = report.engine_properties(args)
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        meta, found = asyncio.run(measure(Path(tmp), args.quick, properties, args.demo_cache))
    print(report.write_side_bench(args.out, "speculative", meta, found, ("name", "measured", "baseline", "verdict")),
          end="", flush=True)


if __name__ == "__main__":
    main()
