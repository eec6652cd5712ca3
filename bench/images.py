"""`python -m bench.images [--quick]`: image generation through the server against the in-process
Text2ImagePipeline, same demo model, same prompt, steps and size, same run; then the swap an image request makes
on a card that holds one model.

The baseline (bench.inprocess) is the demo image model's Text2ImagePipeline, warm, in a bare process of its own; the
server gets the same request on /v1/images/generations (PNG, the default format, so its encoding counts), so its
figures include what a client's request costs on top: the hops between client, front and worker, a step frame per
denoising step, the picture's PNG encoding and base64. Baseline and server take turns block by block; each figure
is the median over its blocks. Figures:

- pictures per second, and seconds per denoising step: a picture of LONG_STEPS steps less one of STEPS, over the
  steps between (the fixed costs, prompt encoding, VAE decoding and the path, cancel out), on either side; and the
  ratios server / in process. (Streamed `progress` events are no step clock on the demo: genai runs its step
  callback on a thread of its own, and on steps of a few milliseconds the callbacks lag and come in bursts.)
- the swap: a second appliance with `max_loaded: 1` serves the chat demo and the image demo, both `load:
  on_demand`; with the chat model loaded (it holds the budget), a picture is asked for: the time until the picture
  (the chat model evicted, the image model loaded, the picture made), then a chat request: the time until its
  first token (the image model evicted, the chat model back).

The demo model's steps take a fraction of a millisecond, far less than a real Stable Diffusion step on a GPU: the
ratios here are the path's cost at its most visible.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import aiohttp

from bench import client, inprocess, report
from bench.launcher import OwnAppliance

MODEL = "pictures"
PROMPT = "a red square"
STEPS = 8
LONG_STEPS = 32  # a step's cost: (a picture of LONG_STEPS - one of STEPS) / the steps between, on either side
SIZE = 64
REQUEST = {"model": MODEL, "prompt": PROMPT, "num_inference_steps": STEPS, "size": f"{SIZE}x{SIZE}", "seed": 1}
SWAP_ROUNDS = {True: 2, False: 5}


# --- the baseline, in its own process ----------------------------------------------------------------------

def baseline(model_path: str) -> None:
    """The in-process side: a warm Text2ImagePipeline making the pictures the server is asked for."""
    import openvino_genai

    pipe = openvino_genai.Text2ImagePipeline(model_path, "CPU")
    # A step callback, as the worker always passes one: genai 2026.4 runs a generation with one several times faster
    # on the demo model than one without (measured: 100 steps in 0.11 s against 0.56 s, the same picture), so a
    # baseline without it would not be the worker's pipeline.
    settings = {"width": SIZE, "height": SIZE, "rng_seed": 1, "callback": lambda step, steps, latent: False}
    pipe.generate(PROMPT, num_inference_steps=STEPS, **settings)

    def picture_s(steps: int, rounds: int) -> float:
        started = time.perf_counter()
        for _ in range(rounds):
            pipe.generate(PROMPT, num_inference_steps=steps, **settings)
        return (time.perf_counter() - started) / rounds

    def run_phase(phase: str, rounds: int) -> float:
        if phase == "images":
            return 1 / picture_s(STEPS, rounds)
        return (picture_s(LONG_STEPS, rounds) - picture_s(STEPS, rounds)) / (LONG_STEPS - STEPS)

    inprocess.serve(run_phase)


# --- the server ----------------------------------------------------------------------------------------------

async def picture_s(session: aiohttp.ClientSession, base: str, steps: int, rounds: int) -> float:
    """Seconds from a request to its picture (PNG, base64, whole), averaged over `rounds`."""
    started = time.perf_counter()
    for _ in range(rounds):
        async with session.post(base + "/v1/images/generations",
                                json={**REQUEST, "num_inference_steps": steps}) as response:
            body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {body[:300]!r}")
    return (time.perf_counter() - started) / rounds


async def server_rates(session: aiohttp.ClientSession, base: str, rounds: int) -> dict[str, float]:
    images = 1 / await picture_s(session, base, STEPS, rounds)
    longer = await picture_s(session, base, LONG_STEPS, rounds)
    return {"images": images, "step": (longer - await picture_s(session, base, STEPS, rounds)) / (LONG_STEPS - STEPS)}


def figures(m: dict[str, float]) -> list[report.Figure]:
    def ms(name: str, seconds: float) -> report.Figure:
        return report.Figure(name, f"{seconds * 1000:,.2f} ms", seconds * 1000, "ms")

    share = m["server_images"] / m["inprocess_images"] * 100
    step_ratio = m["server_step"] / m["inprocess_step"]
    return [
        report.Figure("In process, pictures per second", f"{m['inprocess_images']:,.1f} /s", m["inprocess_images"],
                      "/s"),
        report.Figure("Server, pictures per second", f"{m['server_images']:,.1f} /s", m["server_images"], "/s"),
        report.Figure("Server / in process, pictures per second", f"{share:.0f} %", share, "%"),
        ms("In process, seconds per step", m["inprocess_step"]),
        ms("Server, seconds per step", m["server_step"]),
        report.Figure("Server / in process, seconds per step", f"{step_ratio:.2f} x", step_ratio, "x"),
    ]


# --- the swap: one model at a time ---------------------------------------------------------------------------

async def swap(quick: bool) -> list[report.Figure]:
    """Chat model loaded, a picture asked for, then chat again: the time to the picture and to the chat's first
    token, medians over the rounds."""
    from appliance.demo.catalog import build_demo_model
    picture_s, chat_s = [], []
    with tempfile.TemporaryDirectory(prefix="openarc-bench-") as tmp:
        chat_model = build_demo_model(Path(tmp) / "llm", "llm")
        image_model = build_demo_model(Path(tmp) / "image", "image")
        app = OwnAppliance(chat_model, Path(tmp), server={"max_loaded": 1},
                           models=[{"name": "chat", "path": str(chat_model), "load": "on_demand"},
                                   {"name": MODEL, "kind": "image", "path": str(image_model), "load": "on_demand"}])
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await app.start(session)
            try:
                await first_token_s(session, app.base)  # the chat model holds the budget
                for _ in range(SWAP_ROUNDS[quick]):
                    started = time.perf_counter()
                    async with session.post(app.base + "/v1/images/generations", json=REQUEST) as response:
                        body = await response.read()
                    if response.status != 200:
                        raise RuntimeError(f"{response.status}: {body[:300]!r}")
                    picture_s.append(time.perf_counter() - started)
                    chat_s.append(await first_token_s(session, app.base))
            finally:
                app.stop()
    return [report.Figure("Swap: chat model loaded, time to the picture",
                          f"{statistics.median(picture_s) * 1000:,.0f} ms", statistics.median(picture_s) * 1000, "ms"),
            report.Figure("Swap: after the picture, the chat model's first token",
                          f"{statistics.median(chat_s) * 1000:,.0f} ms", statistics.median(chat_s) * 1000, "ms")]


async def first_token_s(session: aiohttp.ClientSession, base: str) -> float:
    body = {"model": "chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4, "stream": True}
    got = await client.stream(session, base, body)
    if got.status != 200 or got.error or not got.token_times:
        raise RuntimeError(f"chat: {got.status}: {got.error or got.broken or 'the stream had no content'}")
    return got.token_times[0] - got.started


BENCH = inprocess.SideBench("images", "image", {"name": MODEL}, ("images", "step"), ((2, 2), (10, 9)),
                            server_rates, figures, more=swap)


def main(argv: list[str] | None = None) -> None:
    BENCH.main(argv, __doc__, baseline)


if __name__ == "__main__":
    main()
