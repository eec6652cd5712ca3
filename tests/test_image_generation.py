"""Image generation on the demo image model, through the server with the openai SDK unmodified: pictures whose colour
follows the prompt, an adapter that changes it and its absence that brings it back, edits, streamed progress and
partial pictures, a hang-up that stops the worker's steps, a SIGABRT mid-picture answered at once, and a card that
holds one model swapping chat and pictures with no request failing."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import threading
import time
from http.client import HTTPConnection

import openai
import pytest
import httpx
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

from conftest import http, model_entry, pid_alive, wait_until

HANG_BOUND_S = 60  # catches a hang, never a timing
ADAPTER = "recolour"
MAX_STEPS = 24  # the test model's max_inference_steps; the demo model's own default is 50


@pytest.fixture(scope="module")
def image_model(demo_image):
    return demo_image


def image_entry(model_dir, **overrides) -> dict:
    """The demo image model with its adapter (it swaps red and blue) named ADAPTER."""
    from appliance.demo.catalog import image_adapter_path
    return model_entry("pictures", model_dir, kind="image", adapters={ADAPTER: str(image_adapter_path(model_dir))},
                       **overrides)


@pytest.fixture(scope="module")
def app(image_model, tmp_path_factory):
    from conftest import Appliance
    # max_inference_steps below the demo model's own 50 steps: a request naming no steps is bound by it too.
    server = Appliance({"models": [image_entry(image_model, max_inference_steps=MAX_STEPS)]},
                       tmp_path_factory.mktemp("images")).start()
    yield server
    server.stop()


def colour_of(b64: str) -> str:
    """The dominant colour of a picture: the channel whose mean is highest."""
    import numpy as np
    from PIL import Image
    means = np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB")).mean(axis=(0, 1))
    return ("red", "green", "blue")[int(means.argmax())]


def picture(app, prompt: str, **extra) -> str:
    reply = app.client().images.generate(model="pictures", prompt=prompt, extra_body={"seed": 3, **extra})
    assert len(reply.data) == 1 and reply.data[0].b64_json
    return reply.data[0].b64_json


def test_the_sdk_generates_a_picture_whose_colour_follows_the_prompt(app):
    for colour in ("red", "green", "blue"):
        assert colour_of(picture(app, f"a {colour} square")) == colour


def test_an_adapter_changes_the_picture_and_without_it_it_is_back(app):
    plain = colour_of(picture(app, "a red square"))
    adapted = colour_of(picture(app, "a red square", lora=[{"name": ADAPTER, "weight": 1.0}]))
    assert adapted != plain
    assert colour_of(picture(app, "a red square")) == plain


def test_an_adapters_listed_name_paints_with_the_adapter(app):
    """/v1/models lists each adapter as BASE:NAME (as for chat models); asking for that name painted with the base
    model, the adapter silently left out."""
    served = f"pictures:{ADAPTER}"
    assert served in {m.id for m in app.client().models.list()}
    plain = colour_of(picture(app, "a red square", num_inference_steps=2))
    adapted = app.client().images.generate(model=served, prompt="a red square",
                                           extra_body={"seed": 3, "num_inference_steps": 2})
    assert colour_of(adapted.data[0].b64_json) != plain
    assert colour_of(adapted.data[0].b64_json) == colour_of(
        picture(app, "a red square", num_inference_steps=2, lora=[{"name": ADAPTER}]))
    edited = app.client().images.edit(model=served, image=("in.png", png_bytes((0, 0, 255))), prompt="a red square",
                                      extra_body={"strength": 1.0, "seed": 1, "num_inference_steps": 2})
    assert colour_of(edited.data[0].b64_json) != "red"


def test_n_formats_and_seeds(app):
    from PIL import Image
    client = app.client()
    reply = client.images.generate(model="pictures", prompt="a blue square", n=2, output_format="jpeg",
                                   extra_body={"seed": 5})
    assert len(reply.data) == 2 and reply.output_format == "jpeg"
    assert Image.open(io.BytesIO(base64.b64decode(reply.data[0].b64_json))).format == "JPEG"
    again = client.images.generate(model="pictures", prompt="a blue square", n=2, output_format="jpeg",
                                   extra_body={"seed": 5})
    assert [d.b64_json for d in again.data] == [d.b64_json for d in reply.data]  # the same seed, the same pictures


def png_bytes(colour, size=(64, 64), mode="RGB") -> bytes:
    from PIL import Image
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, "PNG")
    return out.getvalue()


def test_the_sdk_edits_a_picture_with_and_without_a_mask(app):
    client = app.client()
    edited = client.images.edit(model="pictures", image=("in.png", png_bytes((0, 0, 255))), prompt="a red square",
                                extra_body={"strength": 1.0, "seed": 1})
    assert colour_of(edited.data[0].b64_json) == "red"
    mask = png_bytes((0, 0, 0, 0), mode="RGBA")  # transparent: paint everywhere
    inpainted = client.images.edit(model="pictures", image=("in.png", png_bytes((0, 0, 255))),
                                   mask=("mask.png", mask), prompt="a green square", extra_body={"seed": 1})
    assert colour_of(inpainted.data[0].b64_json) == "green"


@pytest.mark.parametrize("call, code", [
    (lambda c: c.images.generate(model="pictures", prompt="x", size="100x100"), "invalid_size"),
    (lambda c: c.images.generate(model="pictures", prompt="x", size="６４x６４"), "invalid_size"),  # full-width digits
    (lambda c: c.images.generate(model="pictures", prompt="x", n=9), "too_many_images"),
    (lambda c: c.images.generate(model="pictures", prompt="x", response_format="url"), "unsupported_response_format"),
    (lambda c: c.images.generate(model="pictures", prompt="x", extra_body={"num_inference_steps": 51}),
     "too_many_steps"),
    (lambda c: c.images.generate(model="pictures", prompt="x", extra_body={"lora": [{"name": "nope"}]}),
     "unknown_adapter"),
    (lambda c: c.images.edit(model="pictures", prompt="x", image=("in.png", b"not a picture")), "invalid_image"),
    (lambda c: c.images.edit(model="pictures", prompt="x", image=("in.png", png_bytes((1, 2, 3))),
                             mask=("m.png", png_bytes((0, 0, 0), size=(72, 64)))), "invalid_mask"),
])
def test_bad_requests_are_openai_shaped_400s_and_the_worker_lives_on(app, call, code):
    pid = app.worker_pid("pictures")
    with pytest.raises(openai.BadRequestError) as err:
        call(app.client())
    assert err.value.status_code == 400 and err.value.body["code"] == code, err.value.body
    assert app.worker_pid("pictures") == pid
    assert colour_of(picture(app, "a green square")) == "green"


# Form numbers int() and float() read but no JSON body could hold: they were taken (n "１" made a picture, steps
# "1_0" ran ten), where `size` with the same digits is a 400.
@pytest.mark.parametrize("field, value", [("n", "\uff11"), ("n", "\u0661"), ("n", " 1 "), ("num_inference_steps", "1_0"),
                                          ("num_inference_steps", "\uff12"), ("strength", "\u0660.\u0665"),
                                          ("guidance_scale", "nan")])
def test_an_edit_form_number_in_other_than_ascii_digits_is_a_400_naming_it(app, field, value):
    form = {"model": "pictures", "prompt": "a red square", "num_inference_steps": "2", field: value}
    reply = httpx.post(app.base + "/v1/images/edits", data=form, timeout=HANG_BOUND_S,
                       files={"image": ("in.png", png_bytes((0, 0, 255)), "image/png")})
    body = reply.json()
    assert reply.status_code == 400 and body["error"]["param"] == field, body
    assert f"'{field}' must be a" in body["error"]["message"], body


def test_an_edit_form_of_more_files_than_it_uses_is_a_400_before_the_next_is_read(app):
    """Each file part of an edit may hold 50 MiB; a form of many (up to its 32 parts) was read whole, held in the
    front's memory, before the route refused it for its second picture. The third file part is refused as it begins:
    here most of its body never comes, and the answer must not wait for it (it did, reading on to the part's end)."""
    import socket
    boundary = "openarc-test-boundary"

    def part(name: str, headers: str = "", data: bytes = b"") -> bytes:
        return (f"--{boundary}\r\nContent-Disposition: form-data; name=\"{name}\"{headers}\r\n\r\n").encode() + data

    picture_part = '; filename="in.png"\r\nContent-Type: image/png'
    head = b"".join([part("model", data=b"pictures\r\n"), part("prompt", data=b"a red square\r\n"),
                     part("image", picture_part, png_bytes((0, 0, 255)) + b"\r\n"),
                     part("image[]", picture_part, png_bytes((0, 0, 255)) + b"\r\n"),
                     # the third file: 256 KiB of it (the multipart reader reads ahead to find a part's end), and
                     # the rest never comes
                     part("mask", picture_part, b"\x89PNG" + bytes(256 << 10))])
    with socket.create_connection(("127.0.0.1", app.port), timeout=HANG_BOUND_S) as sock:
        sock.sendall(f"POST /v1/images/edits HTTP/1.1\r\nHost: x\r\nContent-Length: {40 << 20}\r\n"
                     f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n".encode() + head)
        answer = sock.recv(65536).decode(errors="replace")
    assert answer.startswith("HTTP/1.1 400"), answer[:300]
    assert "more than 2 files" in answer and '"param": "mask"' in answer, answer
    assert colour_of(picture(app, "a green square", num_inference_steps=2)) == "green"


def progress_steps(app, path: str, **request) -> set[int]:
    """The `steps` a streamed request's progress events announce."""
    if path.endswith("edits"):
        reply = httpx.post(app.base + path, files={"image": ("in.png", png_bytes((0, 0, 255)), "image/png")},
                           data={"model": "pictures", "prompt": "a red square", "stream": "true", **request},
                           timeout=HANG_BOUND_S)
        assert reply.status_code == 200, reply.text
        lines = reply.text.splitlines()
    else:
        response = post(app, path, {"model": "pictures", "prompt": "a red square", "stream": True, **request})
        response = response.getresponse()
        assert response.status == 200
        lines = response.read().decode().splitlines()
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    return {e["steps"] for e in events if e["type"] == "progress"}


def test_a_request_naming_no_steps_is_bound_by_max_inference_steps_too(app):
    # The demo model's own default is 50 steps: without the bound, leaving the field out ran past the operator's cap.
    assert progress_steps(app, "/v1/images/generations") == {MAX_STEPS}
    assert progress_steps(app, "/v1/images/edits", strength="1") == {MAX_STEPS}
    assert progress_steps(app, "/v1/images/generations", num_inference_steps=3) == {3}


@pytest.mark.parametrize("path, request_fields, param", [
    ("/v1/images/generations", {"negative_prompt": "blue", "guidance_scale": 1.0}, "negative_prompt"),
    ("/v1/images/generations", {"negative_prompt": "blue", "guidance_scale": 0}, "negative_prompt"),
    ("/v1/images/edits", {"negative_prompt": "blue", "guidance_scale": "0.5"}, "negative_prompt"),
    ("/v1/images/edits", {"strength": "0"}, "strength"),
    ("/v1/images/edits", {"strength": "0.01"}, "strength"),
    ("/v1/images/edits", {"strength": "0.1", "num_inference_steps": "5"}, "strength"),
])
def test_settings_genai_cannot_run_are_400s_naming_the_field(app, path, request_fields, param):
    """genai refuses these with a C++ check (its build paths in the text), which came back as a 500."""
    pid = app.worker_pid("pictures")
    if path.endswith("edits"):
        mask = {"mask": ("m.png", png_bytes((0, 0, 0, 0), mode="RGBA"), "image/png")} if param == "strength" else {}
        for files in ({"image": ("in.png", png_bytes((0, 0, 255)), "image/png")},
                      {"image": ("in.png", png_bytes((0, 0, 255)), "image/png"), **mask}):
            reply = httpx.post(app.base + path, files=files, timeout=HANG_BOUND_S,
                                  data={"model": "pictures", "prompt": "a red square", **request_fields})
            status, body = reply.status_code, reply.json()
            assert status == 400 and f"'{param}'" in body["error"]["message"], body
            assert ".cpp" not in body["error"]["message"], body
    else:
        status, _, body = http("POST", app.base + path, {"model": "pictures", "prompt": "a red square",
                                                         **request_fields}, timeout=HANG_BOUND_S)
        assert status == 400 and f"'{param}'" in body["error"]["message"], body
        assert ".cpp" not in body["error"]["message"], body
    assert app.worker_pid("pictures") == pid
    assert colour_of(picture(app, "a green square", num_inference_steps=2)) == "green"


# Generated bodies: every field the route reads, with values of the right type, the wrong type, and past its bounds.
IMAGE_FIELDS = {
    "model": st.sampled_from(["pictures", "nobody", ""]) | st.integers(),
    "prompt": st.sampled_from(["a red square", "", " "]) | st.text(max_size=12) | st.integers() | st.none(),
    "n": st.integers(-1, 12) | st.floats(allow_nan=True) | st.text(max_size=2) | st.booleans(),
    "size": st.sampled_from(["auto", "64x64", "128x64", "63x64", "2048x2048", "0x0", "64x64x1", ""]) | st.integers(),
    "response_format": st.sampled_from(["b64_json", "url", "png"]) | st.integers(),
    "output_format": st.sampled_from(["png", "jpeg", "webp", "gif"]) | st.integers(),
    "output_compression": st.integers(-5, 120) | st.floats(allow_nan=True),
    "seed": st.integers(-5, 1 << 40) | st.text(max_size=3),
    "num_inference_steps": st.integers(-1, 60) | st.floats(allow_nan=True),
    "guidance_scale": st.floats(allow_nan=True, allow_infinity=True) | st.integers(-5, 200),
    "negative_prompt": st.text(max_size=8) | st.integers(),
    "lora": st.sampled_from([[], [{"name": ADAPTER}], [{"name": ADAPTER, "weight": "x"}], [{"nom": 1}], "x",
                             [{"name": ADAPTER, "weight": 11}]]),
    "stream": st.booleans() | st.integers(),
    "partial_images": st.integers(-1, 5),
    "background": st.sampled_from(["auto", "opaque", "transparent", 3]),
    "strength": st.floats(0, 1),
}


@settings(max_examples=40, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=IMAGE_FIELDS))
def test_generated_bodies_never_get_a_5xx_or_hurt_the_worker(app, body):
    pid = app.worker_pid("pictures")
    body = {**body, "num_inference_steps": 2} if body.get("num_inference_steps") is None else body
    status, _, reply = http("POST", app.base + "/v1/images/generations", body, timeout=HANG_BOUND_S)
    assert status < 500, (body, reply)
    if status >= 400:
        assert set(reply) == {"error"} and reply["error"]["message"], reply
    assert app.worker_pid("pictures") == pid


# An edit's settings as genai reads them together: steps x strength, a negative prompt against the guidance, a mask,
# the model's own steps (no num_inference_steps) under max_inference_steps, an adapter by its listed name.
EDIT_FIELDS = {
    "model": st.sampled_from(["pictures", f"pictures:{ADAPTER}"]),
    "num_inference_steps": st.sampled_from(["1", "2", "3", "5", "0", "x"]),
    "strength": st.floats(0, 1).map(str) | st.sampled_from(["0.2", "0.34", "1", "nan"]),
    "guidance_scale": st.sampled_from(["0", "1", "1.5", "7.5", "inf"]),
    "negative_prompt": st.sampled_from(["", "blue", " "]),
    "n": st.sampled_from(["1", "2", "2.0"]),
    "stream": st.sampled_from(["true", "false"]),
    "partial_images": st.sampled_from(["0", "1", "3"]),
}


@settings(max_examples=30, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(form=st.fixed_dictionaries({}, optional=EDIT_FIELDS), mask=st.booleans())
def test_generated_edits_never_get_a_5xx_or_hurt_the_worker(app, form, mask):
    pid = app.worker_pid("pictures")
    files = {"image": ("in.png", png_bytes((0, 0, 255)), "image/png")}
    if mask:
        files["mask"] = ("m.png", png_bytes((0, 0, 0, 0), mode="RGBA"), "image/png")
    reply = httpx.post(app.base + "/v1/images/edits", files=files, timeout=HANG_BOUND_S,
                       data={"model": "pictures", "prompt": "a red square", **form})
    assert reply.status_code < 500 and '"type": "error"' not in reply.text, (form, reply.text[:400])
    if reply.status_code >= 400:
        assert set(reply.json()) == {"error"} and reply.json()["error"]["message"], reply.text
    assert app.worker_pid("pictures") == pid


def sse_events(response) -> list[dict]:
    return [json.loads(line[6:]) for line in response.read().decode().splitlines() if line.startswith("data: ")]


def post(app, path: str, body: dict) -> HTTPConnection:
    connection = HTTPConnection("127.0.0.1", app.port, timeout=HANG_BOUND_S)
    connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    return connection


# genai calls a step back on a thread of its own without waiting for it, and skips a step whose callback finds the
# previous one running (appliance.worker.engines.image): on the demo model, whose steps take a millisecond, some steps
# go unreported, so the stream tests ask for steps of a 512 x 512 picture and check order, not every step.
STREAM = {"size": "512x512", "num_inference_steps": 20}


def test_a_stream_sends_progress_partials_and_the_picture(app):
    response = post(app, "/v1/images/generations", {"model": "pictures", "prompt": "a red square", "stream": True,
                                                    "partial_images": 2, **STREAM}).getresponse()
    assert response.status == 200
    events = sse_events(response)
    types = [e["type"] for e in events]
    steps = [e["step"] for e in events if e["type"] == "progress"]
    assert steps and steps == sorted(set(steps)) and steps[-1] <= 20 and steps[0] == 1
    assert all(e["steps"] == 20 for e in events if e["type"] == "progress")
    partials = [e for e in events if e["type"] == "image_generation.partial_image"]
    assert 1 <= len(partials) <= 2 and [p["partial_image_index"] for p in partials] == list(range(len(partials)))
    assert all(colour_of(p["b64_json"]) == "red" for p in partials)  # the demo's latent is the colour from step 1
    assert types[-1] == "image_generation.completed" and colour_of(events[-1]["b64_json"]) == "red"


def test_the_sdk_reads_a_stream(app):
    stream = app.client().images.generate(model="pictures", prompt="a blue square", stream=True, partial_images=1,
                                          size="512x512", extra_body={"num_inference_steps": 20})
    events = list(stream)
    assert events[-1].type == "image_generation.completed" and colour_of(events[-1].b64_json) == "blue"
    assert any(e.type == "image_generation.partial_image" for e in events)


def test_metrics_count_pictures_and_steps(app):
    before = app.metrics()
    picture(app, "a red square", num_inference_steps=4)
    after = app.metrics()

    def value(text: str, series: str) -> float:
        line = next((l for l in text.splitlines() if l.startswith(series + " ")), f"{series} 0")
        return float(line.split()[-1])

    generated = 'openarc_images_generated_total{model="pictures"}'
    steps = 'openarc_image_step_seconds_count{model="pictures"}'
    assert value(after, generated) - value(before, generated) == 1
    assert 1 <= value(after, steps) - value(before, steps) <= 4  # a step genai did not call back is not seen


def test_more_pixels_than_a_request_may_make_are_a_400_before_any_is_painted(appliance_factory, image_model,
                                                                            tmp_path):
    """A model whose own size is 4096 x 4096 under max_resolution 4096: `size: auto` asks for one picture of
    16,777,216 pixels, past what one request may make (docs/images.md): the worker refuses it before painting (it
    painted for 40 s here, and a picture of that many pixels may not fit the frame that carries it back), as the
    front refuses a size asked for; both OpenAI-shaped 400s naming the limit, and the model paints on."""
    import shutil
    big = shutil.copytree(image_model, tmp_path / "big")
    unet = json.loads((big / "unet" / "config.json").read_text())
    (big / "unet" / "config.json").write_text(json.dumps({**unet, "sample_size": 512}))  # x 8: 4096 pixels a side
    app = appliance_factory({"models": [image_entry(big, max_resolution=4096)]})
    for size in ("auto", "4096x4096"):
        status, _, body = http("POST", app.base + "/v1/images/generations",
                               {"model": "pictures", "prompt": "a red square", "size": size, "num_inference_steps": 2},
                               timeout=HANG_BOUND_S)
        assert (status, body["error"]["code"]) == (400, "too_many_pixels"), body
        assert "at most 16,000,000 (n x width x height)" in body["error"]["message"], body
    assert colour_of(picture(app, "a blue square", size="256x256", num_inference_steps=2)) == "blue"


# --- with the worker slowed: mid-generation faults and hang-ups ------------------------------------------------

# A slow picture: genai does not wait for its step callback, so a debug delay there would not slow the steps; a demo
# built with more work per step does (step_work 64: about 20 ms a step here, 200 steps are seconds).
SLOW_STEPS = 200
SLOW = {"model": "pictures", "prompt": "a red square", "num_inference_steps": SLOW_STEPS}


@pytest.fixture(scope="module")
def slow_image_model(tmp_path_factory):
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "slow-image", "image", step_work=64)


def test_a_hang_up_stops_the_workers_steps(appliance_factory, slow_image_model):
    """A client that hangs up mid-stream: the worker stops at its next step. Its steps are counted whether a
    caller waits for them or not (openarc_image_step_seconds_count), so the counter stops."""
    app = appliance_factory({"models": [image_entry(slow_image_model, max_inference_steps=SLOW_STEPS)]})
    connection = post(app, "/v1/images/generations", {**SLOW, "stream": True})
    response = connection.getresponse()
    assert response.status == 200
    assert any(line.startswith(b"data: ") and b'"progress"' in line for line in iter(response.readline, b""))
    connection.sock.shutdown(2)
    connection.close()
    wait_until(lambda: not app.model_status("pictures")["requests_running"], HANG_BOUND_S, "the request closed")
    count = step_count(app)
    time.sleep(1.0)  # a worker that went on would count about fifty more steps a second
    assert step_count(app) <= count + 2 and count < SLOW_STEPS, count  # the callbacks that were in flight at most
    assert colour_of(picture(app, "a green square", num_inference_steps=2)) == "green"


def step_count(app) -> float:
    series = 'openarc_image_step_seconds_count{model="pictures"} '
    return float(next(l for l in app.metrics().splitlines() if l.startswith(series)).split()[-1])


def test_sigabrt_mid_picture_is_an_error_within_a_second_and_the_next_picture_succeeds(appliance_factory,
                                                                                       slow_image_model):
    app = appliance_factory({"models": [image_entry(slow_image_model, max_inference_steps=SLOW_STEPS)]})
    pid = app.worker_pid("pictures")
    result: dict = {}

    def generate() -> None:
        result["reply"] = http("POST", app.base + "/v1/images/generations", SLOW, timeout=HANG_BOUND_S)

    thread = threading.Thread(target=generate)
    thread.start()
    wait_until(lambda: step_count(app) >= 2, HANG_BOUND_S, "steps running")
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    thread.join(HANG_BOUND_S)
    assert time.monotonic() - aborted < 1.0
    status, _, body = result["reply"]
    assert status == 503 and body["error"]["code"] == "worker_crash", body
    new = app.wait_model("pictures", "ready", new_pid_not=pid)
    assert new["crashes"] == 1 and "SIGABRT" in new["last_error"] and not pid_alive(pid)
    assert colour_of(picture(app, "a blue square", num_inference_steps=2)) == "blue"


def test_one_model_at_a_time_chat_then_a_picture_then_chat_all_succeed(appliance_factory, image_model, demo_model):
    app = appliance_factory({"server": {"max_loaded": 1}, "models": [
        model_entry("chat", demo_model, load="on_demand"), image_entry(image_model, load="on_demand")]})
    client = app.client(timeout=HANG_BOUND_S)

    def chat() -> str:
        reply = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4)
        return reply.choices[0].finish_reason

    assert chat() == "length"
    chat_pid = app.worker_pid("chat")
    assert colour_of(picture(app, "a red square")) == "red"
    assert app.model_status("chat")["state"] == "unloaded" and not pid_alive(chat_pid)
    assert app.model_status("pictures")["memory"]["source"] == "measured"  # its footprint, measured at its load
    assert chat() == "length"
    assert app.model_status("pictures")["state"] == "unloaded"
    loads = {m["name"]: m for m in app.status()["models"]}
    assert loads["chat"]["state"] == "ready"


# A step's seconds are a difference (a picture of 32 steps less one of 8: bench.images); on the demo model, whose 24
# steps take milliseconds, --quick's 2 rounds under load may make it 0 or less. A timing, not the report's shape.
STEP_FIGURES = {"In process, seconds per step", "Server, seconds per step", "Server / in process, seconds per step"}


def test_quick_images_bench_reports_every_figure(tmp_path):
    """`python -m bench.images --quick`: server against in-process, and the swap; every figure there (no timing)."""
    import math
    from conftest import quick_side_bench
    figures = quick_side_bench("images", tmp_path)
    assert {"Server / in process, pictures per second", "Server / in process, seconds per step",
            "Swap: chat model loaded, time to the picture",
            "Swap: after the picture, the chat model's first token"} <= set(figures)
    assert STEP_FIGURES <= set(figures) and all(math.isfinite(f["value"]) for f in figures.values())
    assert all(f["value"] > 0 for name, f in figures.items() if name not in STEP_FIGURES), figures


def test_step_frames_keep_a_long_picture_alive_and_a_stalled_worker_is_a_504(appliance_factory, slow_image_model):
    """stall_timeout_s bounds one denoising step, not a picture: a picture of many steps, longer than the stall
    timeout, completes; a worker frozen mid-picture is a 504 within the bound, and is replaced."""
    stall = 1.0
    app = appliance_factory({"models": [image_entry(slow_image_model, max_inference_steps=2 * SLOW_STEPS,
                                                    stall_timeout_s=stall)]})
    started = time.monotonic()
    status, _, body = http("POST", app.base + "/v1/images/generations",
                           {**SLOW, "num_inference_steps": 2 * SLOW_STEPS}, timeout=HANG_BOUND_S)
    assert status == 200 and colour_of(body["data"][0]["b64_json"]) == "red"
    assert time.monotonic() - started > stall  # longer than the stall timeout, kept alive by its steps
    pid = app.worker_pid("pictures")
    result: list = []
    thread = threading.Thread(target=lambda: result.append(
        http("POST", app.base + "/v1/images/generations", SLOW, timeout=HANG_BOUND_S)))
    thread.start()
    wait_until(lambda: app.model_status("pictures")["requests_running"], HANG_BOUND_S, "drawing")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    thread.join(HANG_BOUND_S)
    assert time.monotonic() - stopped < stall + 1.5
    status, _, body = result[0]
    assert status == 504 and body["error"]["code"] == "stall", body
    app.wait_model("pictures", "ready", new_pid_not=pid)
    assert not pid_alive(pid)
