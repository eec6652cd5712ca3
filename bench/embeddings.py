"""`python -m bench.embeddings [--quick]`: embeddings per second through the server against the in-process
TextEmbeddingPipeline, same model, same texts, same run.

The baseline is `python -m bench.embeddings --baseline DIR` in a bare process of its own: the demo embedding model's
TextEmbeddingPipeline, warm, embedding the same batches. Baseline and server take turns, block by block (the one
not measured waits idle), and each figure is the median over its blocks. Figures:

- batches of 32 texts against embed_documents() of the same 32: one client (float and base64 answers), where every
  request also waits for its hops between client, front and worker; and two clients (base64, what the SDK asks
  for), where the worker embeds one batch while the front answers the other: the server's throughput, judged;
- 8 clients each sending one text at a time, against embed_documents() of one text at a time (what the server
  does with them) and of the 8 as one batch (what coalescing concurrent requests in the worker could reach).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp

from bench import inprocess, report

MODEL = "embed"
BATCH = 32
CLIENTS = 8
BATCH_CLIENTS = 2  # enough to keep the worker busy while the front answers the previous batch
TARGET = 90.0  # % of in-process for batched embeddings (issue 11)
WORDS = ("the cat sat on the mat while a dog ran in the park and the weather was sunny and warm in Paris where "
         "people bake bread boil pasta and talk about GPU drivers interest rates football and music").split()


def texts(count: int, offset: int = 0) -> list[str]:
    """Distinct sentences of 12 to 27 words."""
    return [" ".join(WORDS[(i * 7 + k) % len(WORDS)] for k in range(12 + i % 16))
            for i in range(offset, offset + count)]


# --- the baseline, in its own process ----------------------------------------------------------------------

def baseline(model_path: str) -> None:
    """The in-process side (bench.inprocess): a warm TextEmbeddingPipeline; a phase (batch, single or coalesced)
    is measured in embeddings per second."""
    import openvino_genai

    from appliance.config import Config, worker_spec
    from appliance.worker.engines.embedding import pipeline_config
    # The pipeline exactly as the server's worker configures it (pooling, normalisation, max_length).
    spec = worker_spec(model_config(model_path), Config())
    pipe = openvino_genai.TextEmbeddingPipeline(model_path, "CPU", pipeline_config(spec))
    pipe.embed_documents(texts(BATCH))  # warm

    def run_phase(phase: str, rounds: int) -> float:
        batches = phase_batches(phase, rounds)
        started = time.perf_counter()
        for batch in batches:
            pipe.embed_documents(batch)
        return sum(map(len, batches)) / (time.perf_counter() - started)

    inprocess.serve(run_phase)


def model_config(path: str):
    from appliance.config import ModelConfig
    return ModelConfig(name=MODEL, path=path, kind="embedding", max_running=CLIENTS)


def phase_batches(phase: str, rounds: int) -> list[list[str]]:
    if phase == "batch":
        return [texts(BATCH, r) for r in range(rounds)]
    if phase == "single":
        return [[text] for text in texts(rounds * CLIENTS)]
    return [texts(CLIENTS, r * CLIENTS) for r in range(rounds)]  # coalesced


# --- the server ----------------------------------------------------------------------------------------------

async def embed(session: aiohttp.ClientSession, base: str, inputs: list[str], encoding: str) -> None:
    body = {"model": MODEL, "input": inputs, "encoding_format": encoding}
    async with session.post(base + "/v1/embeddings", json=body) as response:
        reply = await response.json()
    if response.status != 200 or len(reply["data"]) != len(inputs):
        raise RuntimeError(f"{response.status}: {str(reply)[:300]}")


async def server_rates(session: aiohttp.ClientSession, base: str, rounds: int) -> dict[str, float]:
    async def clients(batches: list[list[str]], count: int, encoding: str) -> float:
        """Embeddings/s of `count` clients sending `batches` between them, each one request at a time."""
        async def one_client(c: int) -> None:
            for batch in batches[c::count]:
                await embed(session, base, batch, encoding)

        started = time.perf_counter()
        await asyncio.gather(*(one_client(c) for c in range(count)))
        return sum(map(len, batches)) / (time.perf_counter() - started)

    batches = phase_batches("batch", rounds)
    return {"batch_float": await clients(batches, 1, "float"), "batch_base64": await clients(batches, 1, "base64"),
            "batch_concurrent": await clients(batches, BATCH_CLIENTS, "base64"),
            "single": await clients(phase_batches("single", rounds), CLIENTS, "base64")}


def figures(m: dict[str, float]) -> list[report.Figure]:
    def rate(name: str, value: float, baseline: str = "") -> report.Figure:
        return report.Figure(name, f"{value:,.0f} embeddings/s", value, "embeddings/s", baseline=baseline)

    out = [rate(f"In process, batches of {BATCH}", m["inprocess_batch"])]
    for encoding in ("float", "base64"):
        share = m[f"server_batch_{encoding}"] / m["inprocess_batch"] * 100
        out.append(rate(f"Server, 1 client, batches of {BATCH}, {encoding}", m[f"server_batch_{encoding}"]))
        out.append(report.Figure(f"Server / in process, 1 client, {encoding}", f"{share:.0f} %", share, "%"))
    share = m["server_batch_concurrent"] / m["inprocess_batch"] * 100
    out.append(rate(f"Server, {BATCH_CLIENTS} clients, batches of {BATCH}, base64", m["server_batch_concurrent"]))
    out.append(report.judged(f"Server / in process, batches of {BATCH} ({BATCH_CLIENTS} clients)", share, "%",
                             report.percent(share), at_least=TARGET))
    single = m["server_single"] / m["inprocess_single"] * 100
    out += [rate("In process, 1 text per call", m["inprocess_single"]),
            rate(f"In process, {CLIENTS} texts per call (coalesced)", m["inprocess_coalesced"]),
            rate(f"Server, {CLIENTS} clients x 1 text", m["server_single"]),
            report.Figure(f"Server, {CLIENTS} clients x 1 text / in process, 1 text per call", f"{single:.0f} %",
                          single, "%")]
    return out


BENCH = inprocess.SideBench("embeddings", "embedding", {"name": MODEL, "max_running": CLIENTS},
                            ("batch", "single", "coalesced"), ((3, 2), (10, 15)), server_rates, figures)


def main(argv: list[str] | None = None) -> None:
    BENCH.main(argv, __doc__, baseline)


if __name__ == "__main__":
    main()
