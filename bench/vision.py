"""`python -m bench.vision [--quick]`: what a chat request with one image costs through the server over the same
request in process, same model, same image, same run.

The baseline (bench.inprocess) is the demo VLM on the pipeline the server's worker runs (ContinuousBatchingPipeline
on the VLM directory), warm, in a bare process of its own: per request it decodes the image file with Pillow (an
application embedding genai has to decode it too), templates the same conversation and generates the same answer.
The server gets the image as a base64 PNG data URL in /v1/chat/completions through one client, so its figure adds
what the appliance's path costs: the HTTP request and JSON, base64, the image decoder process and its checks, the
spool file, the worker's hop and the answer's way back. Baseline and server take turns block by block; each figure is
the median over its blocks. The image is 640 x 480 (a screenshot's order of size), the answer 16 tokens.

The demo model encodes an image in well under a millisecond, where a real VLM takes tens to hundreds: the added
latency is the figure to read, not the share.
"""

from __future__ import annotations

import base64
import io
import time

import aiohttp
import numpy as np

from bench import inprocess, report

MODEL = "vlm"
TOKENS = 16
SIZE = (640, 480)
QUESTION = "Describe the image."


def image_png() -> bytes:
    """The bench's image: a fixed pattern of colours, as PNG."""
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = np.repeat(np.repeat(rng.integers(0, 255, (SIZE[1] // 16, SIZE[0] // 16, 3), np.uint8), 16, 0), 16, 1)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "PNG")
    return out.getvalue()


# --- the baseline, in its own process ----------------------------------------------------------------------

def baseline(model_path: str) -> None:
    """The in-process side: a warm ContinuousBatchingPipeline on the VLM directory, as the worker builds it; a phase
    is measured in requests per second, one request at a time."""
    import openvino as ov
    import openvino_genai
    from PIL import Image

    pipe = openvino_genai.ContinuousBatchingPipeline(model_path, openvino_genai.SchedulerConfig(), "CPU", {})
    tokenizer = pipe.get_tokenizer()
    prompt = tokenizer.apply_chat_template(openvino_genai.ChatHistory(
        [{"role": "user", "content": QUESTION + "<ov_genai_image_0>"}]), add_generation_prompt=True)
    config = openvino_genai.GenerationConfig(max_new_tokens=TOKENS)
    config.apply_chat_template = False
    png = image_png()

    def one() -> None:
        pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
        pipe.generate([prompt], images=[[ov.Tensor(pixels)]], generation_config=[config])

    one()  # warm

    def run_phase(phase: str, rounds: int) -> float:
        started = time.perf_counter()
        for _ in range(rounds):
            one()
        return rounds / (time.perf_counter() - started)

    inprocess.serve(run_phase)


# --- the server ----------------------------------------------------------------------------------------------

async def server_rates(session: aiohttp.ClientSession, base: str, rounds: int) -> dict[str, float]:
    url = "data:image/png;base64," + base64.b64encode(image_png()).decode()
    body = {"model": MODEL, "max_tokens": TOKENS, "messages": [{"role": "user", "content": [
        {"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": url}}]}]}
    started = time.perf_counter()
    for _ in range(rounds):
        async with session.post(base + "/v1/chat/completions", json=body) as response:
            reply = await response.json()
        if response.status != 200 or reply["usage"]["completion_tokens"] != TOKENS:
            raise RuntimeError(f"{response.status}: {str(reply)[:300]}")
    return {"one_image": rounds / (time.perf_counter() - started)}


def figures(m: dict[str, float]) -> list[report.Figure]:
    inproc, server = 1000 / m["inprocess_one_image"], 1000 / m["server_one_image"]
    return [
        report.Figure("In process, one image, 16 tokens", f"{inproc:.1f} ms", inproc, "ms"),
        report.Figure("Server, one image as a PNG data URL, 16 tokens", f"{server:.1f} ms", server, "ms"),
        report.Figure("Added by the server per request with one image", f"{server - inproc:.1f} ms", server - inproc,
                      "ms"),
    ]


BENCH = inprocess.SideBench("vision", "vlm", {"name": MODEL}, ("one_image",), ((2, 2), (20, 5)), server_rates,
                            figures)


def main(argv: list[str] | None = None) -> None:
    BENCH.main(argv, __doc__, baseline)


if __name__ == "__main__":
    main()
