"""Images in chat completions, through the official openai SDK against a real `openarc serve` with the tiny
LLaVA-shaped demo VLM (appliance.demo.vlm: its answer starts by naming the images' dominant colour): one image,
two, an image in an earlier turn, streaming, every format, image-dependent answers, image tokens in usage; bad
images (each a 400 naming its part, never a 5xx or a worker restart); remote URLs off by default and fetched from
allowed hosts only; a worker SIGABRTed mid-generation; metrics; check-config's kind hints.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import re
import signal
import struct
import subprocess
import sys
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest
import yaml
from PIL import Image

from conftest import REPO, Appliance, http, model_entry, pid_alive, quick_side_bench

HANG_BOUND_S = 3.0  # a client waiting longer than this after a fault is a hang, not a slow error
RED, GREEN, BLUE, GRAY = (220, 30, 30), (30, 200, 40), (20, 40, 230), (128, 128, 128)
IMAGE_TOKENS = 17  # the demo's 16 patches, and the newline genai's LLaVA support puts after them
LIMITED = {"max_image_bytes": 4096, "max_image_pixels": 10_000, "image_formats": ["png"]}


@pytest.fixture(scope="module")
def app(demo_vlm, demo_model, tmp_path_factory):
    config = {"models": [model_entry("vlm", demo_vlm, kind="vlm"),
                         model_entry("vlm-limited", demo_vlm, kind="vlm", **LIMITED),
                         model_entry("vlm-stateful", demo_vlm, kind="vlm", pipeline="stateful"),
                         model_entry("vlm-think", demo_vlm, kind="vlm", reasoning_parser="qwen3"),
                         model_entry("chat", demo_model)],
              "server": {"model_aliases": {"gpt-4o*": "vlm"}}}
    appliance = Appliance(config, tmp_path_factory.mktemp("vision")).start()
    yield appliance
    appliance.stop()


def encoded(rgb=RED, fmt: str = "png", size=(40, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, fmt.upper())
    return out.getvalue()


def data_url(data: bytes, fmt: str = "png") -> str:
    return f"data:image/{fmt};base64,{base64.b64encode(data).decode()}"


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def ask(app, *images: str, text: str = "What is in the picture?", model: str = "vlm", **kwargs):
    content = [{"type": "text", "text": text}, *(image_part(url) for url in images)]
    return app.client().chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                                **kwargs)


def answer(app, *images: str, **kwargs) -> str:
    return ask(app, *images, **kwargs).choices[0].message.content


# --- what the model sees -----------------------------------------------------------------------------------------

def test_the_answer_depends_on_the_image(app):
    answers = {colour: answer(app, data_url(encoded(rgb)), seed=7)
               for colour, rgb in (("Red", RED), ("Green", GREEN), ("Blue", BLUE), ("Gray", GRAY))}
    for colour, text in answers.items():
        assert text.startswith(f"{colour} "), answers
    assert len(set(answers.values())) == 4
    without = app.client().chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": "What is in the picture?"}], seed=7)
    assert without.choices[0].message.content.split()[0] not in answers  # no image, no colour


@pytest.mark.parametrize("fmt", ["png", "jpeg", "webp", "gif"])
def test_every_allowed_format_reaches_the_model(app, fmt):
    assert answer(app, data_url(encoded(BLUE, fmt), fmt)).startswith("Blue ")


def test_usage_counts_the_image_tokens(app, demo_vlm):
    from tokenizers import Tokenizer
    text_only = app.client().chat.completions.create(
        model="vlm", messages=[{"role": "user", "content": "What is in the picture?"}])
    # the prompt is the conversation in the (ChatML) template once: genai must not template it again
    templated = "<|im_start|>user\nWhat is in the picture?<|im_end|>\n<|im_start|>assistant\n"
    assert text_only.usage.prompt_tokens == len(Tokenizer.from_file(str(demo_vlm / "tokenizer.json")).encode(templated).ids)
    one = ask(app, data_url(encoded(RED)))
    two = ask(app, data_url(encoded(RED)), data_url(encoded(GREEN)))
    # the image tags genai replaces are text too: compare images with images
    assert two.usage.prompt_tokens - one.usage.prompt_tokens == IMAGE_TOKENS
    assert one.usage.prompt_tokens == text_only.usage.prompt_tokens + IMAGE_TOKENS
    assert one.usage.completion_tokens == 13 and one.choices[0].finish_reason == "stop"  # 12 phrases and EOS


def test_two_images_in_one_message(app):
    # two red images and a blue one: red dominates the patches the model reads
    text = answer(app, data_url(encoded(RED)), data_url(encoded(BLUE)), data_url(encoded(RED)))
    assert text.startswith("Red ")


def test_an_image_in_an_earlier_turn(app):
    messages = [
        {"role": "user", "content": [image_part(data_url(encoded(GREEN))), {"type": "text", "text": "Look."}]},
        {"role": "assistant", "content": "I see it."},
        {"role": "user", "content": "And what colour was it?"},
    ]
    reply = app.client().chat.completions.create(model="vlm", messages=messages)
    assert reply.choices[0].message.content.startswith("Green ")
    without = app.client().chat.completions.create(model="vlm", messages=messages[1:])
    assert reply.usage.prompt_tokens >= without.usage.prompt_tokens + IMAGE_TOKENS


def test_the_stateful_pipeline_sees_the_images_too(app):
    """pipeline: stateful runs VLMPipeline: the same answers and usage as the batching pipeline."""
    urls = data_url(encoded(GREEN)), data_url(encoded(BLUE, "jpeg"), "jpeg")
    batched, stateful = (ask(app, *urls, seed=5, model=model) for model in ("vlm", "vlm-stateful"))
    assert stateful.choices[0].message.content == batched.choices[0].message.content
    assert stateful.choices[0].message.content.startswith("Green ")  # a tie goes to the first colour
    assert stateful.usage == batched.usage
    chunks = list(ask(app, data_url(encoded(RED)), model="vlm-stateful", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).startswith("Red ")


def test_concurrent_requests_each_see_their_own_images(app):
    """The batching pipeline steps requests together: each answer follows its own image, none another's."""
    from concurrent.futures import ThreadPoolExecutor
    colours = [("Red", RED), ("Green", GREEN), ("Blue", BLUE), ("Gray", GRAY)] * 2
    with ThreadPoolExecutor(len(colours)) as pool:
        answers = list(pool.map(lambda c: answer(app, data_url(encoded(c[1])), seed=1), colours))
    assert [a.split(" ")[0] for a in answers] == [name for name, _ in colours]


def test_streaming_with_an_image(app):
    url = data_url(encoded(GRAY, "webp"), "webp")
    whole = ask(app, url, seed=3)
    chunks = list(ask(app, url, seed=3, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text.startswith("Gray ")
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_structured_output_with_an_image(app):
    # unconstrained, the demo says "Red ...: ..."; a choice constraint reaching genai makes it pick one
    choices = ["a red square", "a blue circle"]
    reply = ask(app, data_url(encoded(RED)), max_tokens=40, extra_body={"structured_outputs": {"choice": choices}})
    assert reply.choices[0].message.content in choices
    reply = ask(app, data_url(encoded(RED)), max_tokens=40, stream=True,
                extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{4}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{4}", "".join(c.choices[0].delta.content or "" for c in reply if c.choices))


def test_a_tool_call_about_an_image(app):
    tools = [{"type": "function", "function": {"name": "report_colour", "parameters": {
        "type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"], "additionalProperties": False}}}]
    reply = ask(app, data_url(encoded(BLUE)), tools=tools, tool_choice="required", max_tokens=100)
    assert reply.choices[0].finish_reason == "tool_calls"
    (call,) = reply.choices[0].message.tool_calls
    assert call.function.name == "report_colour" and set(json.loads(call.function.arguments)) == {"colour"}


def test_reasoning_is_split_as_for_text(app):
    reply = ask(app, data_url(encoded(RED)), model="vlm-think", max_tokens=100,
                extra_body={"structured_outputs": {"regex": r"<think>[a-z ]{5,40}</think>\nHello [a-z]{3,10}"}})
    message = reply.choices[0].message
    assert re.fullmatch("[a-z ]{5,40}", message.reasoning_content) and re.fullmatch("Hello [a-z]{3,10}", message.content)
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens


# --- bad input: a 400 naming the part, the worker untouched ---------------------------------------------------------

def bomb_png(side: int = 20000) -> bytes:
    """A real, valid 1-bit PNG of side x side black pixels: a few tens of kB that decode to side^2 pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    row = b"\x00" * (1 + side // 8)
    packer = zlib.compressobj(9)
    idat = b"".join(packer.compress(row) for _ in range(side)) + packer.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", idat) + chunk(b"IEND", b""))


BAD_IMAGES = {
    # name: (model, url, reason as counted, what the message says)
    "bad_base64": ("vlm", "data:image/png;base64,iVBORw0K!!!notbase64", "bad_base64", "not valid base64"),
    "truncated_png": ("vlm", data_url(encoded(RED, size=(64, 64))[:60]), "undecodable", "could not be decoded"),
    "not_an_image": ("vlm", data_url(b"hello, I am text, not a picture"), "unsupported_format", "unsupported image"),
    "oversized": ("vlm-limited", data_url(os.urandom(5000)), "too_large", "max_image_bytes=4096"),
    "too_many_pixels": ("vlm-limited", data_url(encoded(RED, size=(200, 100))), "too_many_pixels", "20000 pixels"),
    "format_not_allowed": ("vlm-limited", data_url(encoded(RED, "gif"), "gif"), "unsupported_format", "image/gif"),
    "remote_url_by_default": ("vlm", "http://127.0.0.1:9/cat.png", "fetch_disabled", "server.image_fetch"),
    "other_scheme": ("vlm", "file:///etc/passwd", "bad_url", "data: URL"),
}


def post_chat(app, body: dict) -> tuple[int, dict]:
    status, _, reply = http("POST", app.base + "/v1/chat/completions", body, timeout=60)
    return status, reply


@pytest.mark.parametrize("name", BAD_IMAGES)
def test_a_bad_image_is_a_400_naming_its_part(app, name):
    model, url, reason, says = BAD_IMAGES[name]
    pid = app.worker_pid(model)
    with pytest.raises(openai.BadRequestError) as caught:
        ask(app, data_url(encoded(GREEN)), url, model=model)
    error = caught.value.body
    assert error["param"] == "messages[0].content[2]" and says in error["message"], error
    assert error["message"].startswith("messages[0].content[2]: ")
    status = app.model_status(model)
    assert status["pid"] == pid and status["crashes"] == 0 and status["state"] == "ready"
    assert f'openarc_image_rejections_total{{model="{model}",reason="{reason}"}}' in app.metrics()
    assert answer(app, data_url(encoded(RED)), model=model).startswith("Red ")  # and it goes on serving


def test_a_dead_image_decoder_is_replaced(app):
    """The decoder process is the front's child; killed between requests, the next image gets a new one."""
    def decoder_pid() -> int:
        return app.helper_pid("appliance.front.image_decoder")
    decoder = decoder_pid()
    os.kill(decoder, signal.SIGKILL)
    assert answer(app, data_url(encoded(BLUE))).startswith("Blue ")
    assert decoder_pid() != decoder and app.model_status("vlm")["crashes"] == 0


def test_a_decompression_bomb_is_refused_from_its_header(app):
    bomb = bomb_png()
    assert len(bomb) < 200_000
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as caught:
        ask(app, data_url(bomb))
    assert "400000000 pixels" in caught.value.body["message"] and "max_image_pixels=25000000" in caught.value.body["message"]
    assert time.monotonic() - started < 10  # refused from the header, not after decoding 400 MP


def test_malformed_parts_are_400s(app):
    for content, param in (
            ([{"type": "image_url"}], "messages[0].content[0].image_url.url"),
            ([{"type": "image_url", "image_url": {"url": data_url(encoded()), "detail": "max"}}],
             "messages[0].content[0].image_url.detail"),
            ([{"type": "audio", "audio": {}}], "messages[0].content[0]"),
            ([{"type": "text", "text": "<ov_genai_image_0> hi"}, image_part(data_url(encoded()))],
             "messages[0].content[0]"),
            ([image_part(data_url(encoded()))] * 9, "messages[0].content")):
        status, body = post_chat(app, {"model": "vlm", "messages": [{"role": "user", "content": content}]})
        assert status == 400 and body["error"]["param"] == param, body


def test_a_text_model_refuses_images(app):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(app, data_url(encoded()), model="chat")
    assert caught.value.body["param"] == "messages[0].content[1]" and "kind vlm" in caught.value.body["message"]
    assert ask(app, model="chat").choices[0].message.content  # text alone still works


def test_a_large_image_body_is_read(app):
    """A chat body with a few MB of base64 image passes where a text body that size would not (max_body_bytes 1 MB)."""
    noise = Image.frombytes("RGB", (1200, 900), os.urandom(1200 * 900 * 3))
    out = io.BytesIO()
    noise.save(out, "PNG")
    assert len(out.getvalue()) > 2 << 20
    assert answer(app, data_url(out.getvalue()))


def test_metrics_count_images(app):
    def images() -> float:
        line = next((ln for ln in app.metrics().splitlines() if ln.startswith('openarc_images_total{model="vlm"}')), None)
        return float(line.split()[-1]) if line else 0.0
    before = images()
    ask(app, data_url(encoded(RED)), data_url(encoded(BLUE)))
    assert images() == before + 2


# --- remote URLs ---------------------------------------------------------------------------------------------------

class ImageServer:
    """A local HTTP server with a red PNG at /red.png, a large bluish one (noise, about 2 MB, sent in many pieces) at
    /big.png, and a redirect to the red one at /moved; it records the paths asked for."""

    def __init__(self):
        import numpy as np
        noise = np.random.default_rng(0).integers(0, 60, (800, 1000, 3), dtype=np.uint8)
        noise[..., 2] += 190
        big = io.BytesIO()
        Image.fromarray(noise).save(big, "PNG")
        files, hits = {"/red.png": encoded(RED), "/big.png": big.getvalue()}, []
        self.big_bytes = len(big.getvalue())

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                hits.append(self.path)
                if self.path == "/moved":
                    self.send_response(302)
                    self.send_header("Location", "/red.png")
                    self.end_headers()
                    return
                body = files.get(self.path, b"")
                self.send_response(200 if body else 404)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                for i in range(0, len(body), 8192):
                    self.wfile.write(body[i:i + 8192])
                    self.wfile.flush()

            def log_message(self, *args):
                pass

        self.hits = hits
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_remote_urls_from_allowed_hosts_only(appliance_factory, demo_vlm):
    images = ImageServer()
    try:
        # host names compare without case, as DNS does: an operator's LocalHost:PORT allows localhost on that port
        app = appliance_factory({"server": {"image_fetch": {"enabled": True,
                                                            "allow_hosts": ["127.0.0.1", f"LocalHost:{images.port}"]}},
                                 "models": [model_entry("vlm", demo_vlm, kind="vlm")]})
        assert answer(app, f"http://127.0.0.1:{images.port}/red.png").startswith("Red ")
        assert images.big_bytes > 1 << 20
        assert answer(app, f"http://127.0.0.1:{images.port}/big.png").startswith("Blue ")  # read whole
        assert answer(app, f"http://localhost:{images.port}/red.png").startswith("Red ")
        assert images.hits == ["/red.png", "/big.png", "/red.png"]
        for url, says in ((f"http://localhost:{images.port + 1}/red.png", "not in server.image_fetch.allow_hosts"),
                          (f"http://127.0.0.1:{images.port}/missing.png", "HTTP 404"),
                          (f"http://127.0.0.1:{images.port}/moved", "HTTP 302")):
            with pytest.raises(openai.BadRequestError) as caught:
                answer(app, url)
            assert says in caught.value.body["message"] and caught.value.body["param"] == "messages[0].content[1]"
        # not localhost on another port, not the redirect
        assert images.hits == ["/red.png", "/big.png", "/red.png", "/missing.png", "/moved"]
    finally:
        images.close()


# --- failures ------------------------------------------------------------------------------------------------------

def test_worker_abort_mid_generation_is_fast_then_restarts(appliance_factory, tmp_path_factory):
    from appliance.demo.catalog import build_demo_model
    long_vlm = build_demo_model(tmp_path_factory.mktemp("models") / "vlm-long", "vlm", eos_after=0,
                                max_new_tokens=4096)
    app = appliance_factory({"models": [model_entry("vlm", long_vlm, kind="vlm")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.05"})
    pid = app.worker_pid("vlm")
    stream = ask(app, data_url(encoded(RED)), stream=True, max_tokens=2000)
    first = next(c for c in stream if c.choices and c.choices[0].delta.content)
    assert first.choices[0].delta.content.startswith("Red ")
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - aborted < HANG_BOUND_S
    new = app.wait_model("vlm", "ready", new_pid_not=pid)
    assert new["crashes"] == 1 and "SIGABRT" in new["last_error"] and not pid_alive(pid)
    assert answer(app, data_url(encoded(BLUE)), max_tokens=4).startswith("Blue ")


# --- the image decoder's own faults, through the resolver and the real decoder process -------------------------------

def resolve_with_spool_file(make_file, timeout_s: float = 30.0, cancel_after_s: float | None = None):
    """Resolve one red PNG through a real ImageResolver (its decoder process included) after `make_file(path)` made
    the spool file the decoder will write; returns (what resolve raised or returned, the files left in the spool,
    the metrics' exposition)."""
    import asyncio

    from appliance.config import ImageFetch, ModelConfig
    from appliance.front.api.images import Content, ImagePart, ImageResolver
    from appliance.front.metrics import Metrics
    from appliance.front.spool_budget import SpoolBudget

    async def run():
        metrics = Metrics()
        resolver = ImageResolver(ImageFetch(), metrics, SpoolBudget())
        resolver.decoder.timeout_s = timeout_s
        spool = resolver._spool()
        make_file(os.path.join(spool, "0.rgb"))  # the first image's spool file
        found = Content([ImagePart("messages[0].content[1]", data_url(encoded(RED)))])
        task = asyncio.create_task(resolver.resolve(found, ModelConfig(name="vlm", path="/m", kind="vlm")))
        try:
            if cancel_after_s is not None:  # the client hangs up mid-decode
                await asyncio.sleep(cancel_after_s)
                task.cancel()
            try:
                outcome = await task
            except BaseException as exc:  # noqa: BLE001 - the outcome under test
                outcome = exc
            return outcome, os.listdir(spool), metrics.exposition()[0].decode()
        finally:
            await resolver.close()
    return asyncio.run(run())


def test_a_full_spool_disk_is_a_503_not_the_clients_bad_image():
    """The spool file is /dev/full: every write fails with ENOSPC, as on a full disk (it was a 400 invalid_image,
    counted as the client's bad image)."""
    from appliance.front.request import RequestFailed
    failure, left, metrics = resolve_with_spool_file(lambda path: os.symlink("/dev/full", path))
    assert isinstance(failure, RequestFailed), failure
    assert (failure.status, failure.code) == (503, "image_decoder_unavailable") and failure.retry_after
    assert "server fault" in failure.message and "No space left" in failure.message
    assert left == [] and 'openarc_image_rejections_total{model="vlm"' not in metrics


def test_a_decoder_slower_than_its_timeout_is_a_503_and_a_hang_up_mid_decode_leaves_no_file():
    """The spool file is a FIFO no one reads: the decoder blocks writing the pixels as one stuck in a C library
    does. Past its timeout it is killed and the client gets a 503 (it was a 400); a client that hangs up while it
    is stuck leaves no spool file behind (it leaked)."""
    from appliance.front.request import RequestFailed
    failure, left, metrics = resolve_with_spool_file(os.mkfifo, timeout_s=2.0)
    assert isinstance(failure, RequestFailed), failure
    assert (failure.status, failure.code) == (503, "image_decoder_unavailable") and failure.retry_after
    assert "did not answer within 2 s" in failure.message
    assert left == [] and 'openarc_image_rejections_total{model="vlm"' not in metrics
    cancelled, left, _ = resolve_with_spool_file(os.mkfifo, cancel_after_s=1.0)
    assert isinstance(cancelled, asyncio.CancelledError) and left == [], (cancelled, left)


# --- bounds before the queue: admitted before fetch and decode, spool bytes, body size -------------------------------

def resolver_run(scenario, spool_base=None):
    """Run `scenario(resolver, model)` (async) against a real ImageResolver and its decoder process."""
    from appliance.config import ImageFetch, ModelConfig
    from appliance.front.api.images import ImageResolver
    from appliance.front.metrics import Metrics
    from appliance.front.spool_budget import SpoolBudget

    async def run():
        resolver = ImageResolver(ImageFetch(), Metrics(), SpoolBudget(), spool_base)
        try:
            return await scenario(resolver, ModelConfig(name="vlm", path="/m", kind="vlm"))
        finally:
            await resolver.close()
    return asyncio.run(run())


def content_of(*images: bytes):
    from appliance.front.api.images import Content, ImagePart
    return Content([ImagePart(f"messages[0].content[{i}]", data_url(data)) for i, data in enumerate(images)])


def test_spool_bytes_are_bounded_per_request_and_per_server():
    """A request whose images' pixels pass its bound is a 400 naming the image that passed it, checked from the
    header before decoding (8 small single-colour PNGs were 600 MB of spool); a server whose spool is held by
    requests in flight answers 503 with Retry-After until they end."""
    from appliance.front.api.images import ImageRejected
    from appliance.front.request import RequestFailed
    one = 40 * 30 * 3  # the spool bytes of one encoded() image

    async def scenario(resolver, model):
        resolver.max_request_bytes, resolver.budget.capacity = 2 * one, 3 * one
        with pytest.raises(ImageRejected) as too_many:
            await resolver.resolve(content_of(encoded(RED), encoded(GREEN), encoded(BLUE)), model)
        assert (resolver.budget.held, os.listdir(resolver.spool)) == (0, [])  # the first two went with it
        held = await resolver.resolve(content_of(encoded(RED), encoded(GREEN)), model)
        with pytest.raises(RequestFailed) as full:
            await resolver.resolve(content_of(encoded(RED), encoded(BLUE)), model)  # one more fits, two do not
        assert resolver.budget.held == 2 * one and len(os.listdir(resolver.spool)) == 2
        resolver.release(held)  # the request in flight ended
        again = await resolver.resolve(content_of(encoded(RED), encoded(BLUE)), model)
        resolver.release(again)
        resolver.release(again)  # (twice: its bytes come back once)
        return too_many.value, full.value, resolver.budget.held

    too_many, full, left = resolver_run(scenario)
    assert too_many.param == "messages[0].content[2]" and too_many.reason == "too_large"
    assert "3600 bytes of pixels" in str(too_many) and f"may take {2 * one} bytes" in str(too_many)
    assert (full.status, full.code, full.retry_after) == (503, "image_spool_full", 1)
    assert left == 0


def test_the_spool_is_in_the_units_cache_directory(tmp_path, monkeypatch):
    """On disk under systemd's CacheDirectory=, not in the private /tmp (often RAM); the spool a killed front left
    there is removed by the next one."""
    from appliance.front.api.images import spool_base
    monkeypatch.setenv("CACHE_DIRECTORY", f"{tmp_path}:/elsewhere")

    async def scenario(resolver, model):
        files = await resolver.resolve(content_of(encoded(RED)), model)
        resolver.release(files)
        return files[0]["path"]
    stale = tmp_path / f"openarc-images-{2 ** 22 + 1}-x"  # a pid above pid_max: a front that is gone
    (stale / "0.rgb").parent.mkdir()
    (stale / "0.rgb").write_bytes(b"pixels")
    live = tmp_path / f"openarc-images-{os.getppid()}-y"  # a live front's (another instance sharing the directory)
    live.mkdir()
    assert os.path.dirname(os.path.dirname(resolver_run(scenario, spool_base()))) == str(tmp_path)
    assert not stale.exists() and live.exists()  # a killed front's spool does not outlive it on disk


def test_a_spool_directory_that_cannot_be_made_is_a_503_not_a_500(tmp_path):
    """CACHE_DIRECTORY missing or read only (a container run without its volume): the server's fault, a 503 saying
    where (it raised FileNotFoundError in the route: a 500); the image is not counted as the client's bad one."""
    from appliance.front.request import RequestFailed

    async def scenario(resolver, model):
        with pytest.raises(RequestFailed) as failed:
            await resolver.resolve(content_of(encoded(RED)), model)
        return failed.value, resolver.metrics.exposition()[0].decode()
    failure, metrics = resolver_run(scenario, str(tmp_path / "missing"))
    assert (failure.status, failure.code, failure.retry_after) == (503, "image_decoder_unavailable", 1)
    assert str(tmp_path / "missing") in failure.message and "server fault" in failure.message
    assert 'openarc_image_rejections_total{model="vlm"' not in metrics


def test_a_body_past_max_body_bytes_is_read_only_for_a_vision_model(app):
    """The larger chat body a vision model needs is not every model's: the same 2 MB body to the text model is a
    413 (it was read, parsed and answered with a 400 about images)."""
    noise = Image.frombytes("RGB", (1200, 900), os.urandom(1200 * 900 * 3))
    out = io.BytesIO()
    noise.save(out, "PNG")
    body = {"model": "chat", "messages": [{"role": "user", "content": [image_part(data_url(out.getvalue()))]}]}
    status, reply = post_chat(app, body)
    assert status == 413 and reply["error"]["code"] == "request_entity_too_large", reply
    assert "only a request to a vision model" in reply["error"]["message"]
    status, reply = post_chat(app, {**body, "model": "vlm", "max_tokens": 2})
    assert status == 200, reply
    status, reply = post_chat(app, {**body, "model": "gpt-4o-mini", "max_tokens": 2})  # an alias of the VLM
    assert status == 200 and reply["model"] == "gpt-4o-mini", reply


def test_a_request_with_images_to_a_busy_model_is_refused_before_they_are_fetched(appliance_factory,
                                                                                 tmp_path_factory):
    """The queue place is reserved before the images are fetched and decoded, as audio uploads are admitted
    before they are read: with the model's one place taken, a request naming a remote image gets its 429 at once
    and the image is never fetched (it was fetched and decoded first)."""
    from appliance.demo.catalog import build_demo_model
    long_vlm = build_demo_model(tmp_path_factory.mktemp("models") / "vlm-busy", "vlm", eos_after=0,
                                max_new_tokens=4096)
    images = ImageServer()
    try:
        app = appliance_factory({"server": {"image_fetch": {"enabled": True, "allow_hosts": ["127.0.0.1"]}},
                                 "models": [model_entry("vlm", long_vlm, kind="vlm", max_running=1, max_queue=0)]},
                                env={"OPENARC_DEBUG_STEP_DELAY_S": "0.05"})
        busy = threading.Thread(target=lambda: post_chat(app, {
            "model": "vlm", "max_tokens": 200, "messages": [{"role": "user", "content": "Go on."}]}))
        busy.start()
        deadline = time.monotonic() + 60
        while app.model_status("vlm")["requests_running"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        started = time.monotonic()
        status, reply = post_chat(app, {"model": "vlm", "messages": [{"role": "user", "content": [
            image_part(f"http://127.0.0.1:{images.port}/big.png")]}]})
        assert status == 429 and time.monotonic() - started < HANG_BOUND_S, reply
        assert images.hits == []
        busy.join(60)
    finally:
        images.close()


# --- parsing, without a server ---------------------------------------------------------------------------------------

def test_image_parts_become_tags_in_order_across_messages():
    from appliance.front.api.completions import parse_chat
    req = parse_chat({"model": "m", "messages": [
        {"role": "user", "content": [image_part("data:a"), {"type": "text", "text": "compare "}, image_part("data:b")]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "and"}, image_part("data:c")]}]})
    assert [m["content"] for m in req.messages] == ["<ov_genai_image_0>compare <ov_genai_image_1>", "ok",
                                                     "and<ov_genai_image_2>"]
    assert [(p.where, p.url) for p in req.content.images] == [
        ("messages[0].content[0]", "data:a"), ("messages[0].content[2]", "data:b"), ("messages[2].content[1]", "data:c")]


def test_the_body_limit_grows_only_with_a_vision_model():
    from appliance.config import parse_config
    from appliance.front.api.images import MAX_IMAGES, body_limit
    text = parse_config({"models": [{"name": "t", "path": "/t"}]}, "x")
    vision = parse_config({"models": [{"name": "t", "path": "/t"}, {"name": "v", "path": "/v", "kind": "vlm",
                                                                    "max_image_bytes": 3000}]}, "x")
    assert body_limit(text) == text.server.max_body_bytes
    assert body_limit(vision) >= vision.server.max_body_bytes + MAX_IMAGES * 4000


# --- bench ---------------------------------------------------------------------------------------------------------

def test_quick_vision_bench_reports_every_figure(tmp_path):
    """`python -m bench.vision --quick`: server against in-process, every figure there (never a timing)."""
    figures = quick_side_bench("vision", tmp_path)
    assert len(figures) == 3 and all(f["unit"] == "ms" for f in figures.values())
    assert all(figures[name]["value"] > 0 for name in list(figures)[:2])


def test_a_worker_stuck_before_its_first_token_is_caught_by_the_stall_monitor(appliance_factory, demo_vlm):
    """A worker frozen when an image request reaches it (as a hung vision encoder would leave it: the request added,
    nothing sent back) gets the caller a 504 within stall_timeout_s, and the model restarts."""
    app = appliance_factory({"models": [model_entry("vlm", demo_vlm, kind="vlm", stall_timeout_s=1)]})
    pid = app.worker_pid("vlm")
    os.kill(pid, signal.SIGSTOP)
    started = time.monotonic()
    status, reply = post_chat(app, {"model": "vlm", "messages": [
        {"role": "user", "content": [image_part(data_url(encoded(RED)))]}]})
    assert status == 504 and reply["error"]["code"] == "stall", reply
    assert time.monotonic() - started < 1 + HANG_BOUND_S
    new = app.wait_model("vlm", "ready", new_pid_not=pid)
    assert "no progress" in new["last_error"] and not pid_alive(pid)
    assert answer(app, data_url(encoded(GREEN)), max_tokens=2).startswith("Green ")


# --- config --------------------------------------------------------------------------------------------------------

def check_config(tmp_path, model: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "openarc.yaml"
    path.write_text(yaml.safe_dump({"models": [model]}))
    return subprocess.run([sys.executable, "-m", "appliance", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_demo_model_command_builds_the_same_vlm_twice(tmp_path):
    """`openarc demo-model --kind vlm DIR`: the files genai's LLaVA support reads, byte-identical weights per build."""
    builds = []
    for name in ("a", "b"):
        done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--kind", "vlm", "--eos-after", "4",
                               str(tmp_path / name)], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout.strip() == str(tmp_path / name), done.stderr[-2000:]
        builds.append(tmp_path / name)
    for model in ("language", "text_embeddings", "vision_embeddings"):
        a, b = ((build / f"openvino_{model}_model.bin").read_bytes() for build in builds)
        assert a == b and len(a) > 0
    config = yaml.safe_load((builds[0] / "config.json").read_text())
    assert config["model_type"] == "llava" and config["vision_config"]["patch_size"] == 8
    assert (builds[0] / "preprocessor_config.json").is_file() and (builds[0] / "openvino_tokenizer.xml").is_file()


def test_check_config_names_the_kind_of_an_export(tmp_path, demo_vlm, demo_model):
    as_llm = check_config(tmp_path, {"name": "v", "path": str(demo_vlm)})
    assert as_llm.returncode == 2
    assert "models[0].path:" in as_llm.stderr and "kind 'vlm'; use kind: vlm" in as_llm.stderr, as_llm.stderr
    as_vlm = check_config(tmp_path, {"name": "t", "path": str(demo_model), "kind": "vlm"})
    assert as_vlm.returncode == 2 and "lacks openvino_language_model.xml/.bin" in as_vlm.stderr
    assert "kind 'llm'; use kind: llm" in as_vlm.stderr
    assert check_config(tmp_path, {"name": "v", "path": str(demo_vlm), "kind": "vlm",
                                   "max_image_pixels": 1 << 20}).returncode == 0
    wrong_key = check_config(tmp_path, {"name": "t", "path": str(demo_model), "max_image_bytes": 1 << 20})
    assert "applies to kind 'vlm' models only" in wrong_key.stderr
