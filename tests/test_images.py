"""Image generation (kind image): the pure parts, without processes. What a directory is (model_index.json), the
config's image keys and adapters, the routes' parsing and limits (each a 400 naming its field), the events a stream
sends, when partial pictures are due, and the inpainting mask as the decoder reads it."""

from __future__ import annotations

import io
import json

import pytest
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from appliance import model_files
from appliance.config import ConfigError, parse_config
from appliance.front.api import image_generation as images
from appliance.front.api.errors import InvalidRequest
from appliance.front.image_decoder import decode
from appliance.front.request import Event
from appliance.worker.engines.base import InvalidInput
from appliance.config.rules import MAX_IMAGE_REQUEST_PIXELS, MAX_IMAGE_SIDE, MAX_IMAGES_PER_REQUEST
from appliance.ipc import MAX_FRAME, encode, frame
from appliance.worker.engines.image import encode_picture, partial_steps, settle

SD_FILES = ["model_index.json", "scheduler/scheduler_config.json"] + [
    f"{stem}.{ext}" for stem in ("unet/openvino_model", "vae_decoder/openvino_model", "text_encoder/openvino_model",
                                 "tokenizer/openvino_tokenizer", "tokenizer/openvino_detokenizer")
    for ext in ("xml", "bin")]


def test_a_diffusers_export_is_an_image_model_and_its_missing_parts_are_named():
    assert model_files.detect(SD_FILES, None) == model_files.Detected("openvino", "image")
    flux = [f.replace("unet/", "transformer/") for f in SD_FILES]
    assert model_files.detect(flux, None).kind == "image"
    broken = model_files.detect([f for f in SD_FILES if not f.startswith("vae_decoder/")], None)
    assert broken.kind is None and "vae_decoder/openvino_model.xml/.bin" in broken.reason
    pytorch = model_files.detect(["model_index.json", "unet/diffusion_pytorch_model.safetensors"], None)
    assert (pytorch.format, pytorch.kind) == ("pytorch", "image")
    assert "--task text-to-image" in model_files.export_command("org/sd", "image", "/out")


def image_model(tmp_path, files=SD_FILES):
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("{}")
    return tmp_path


def write_safetensors(path):
    """A safetensors file of one LoRA pair of rank 1 (the config's adapter check reads the pairs' shapes)."""
    header = (b'{"unet.lora_A.weight":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]},'
              b'"unet.lora_B.weight":{"dtype":"F32","shape":[2,1],"data_offsets":[8,16]}}')
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    return path


def config_text(path, **keys) -> dict:
    return {"models": [{"name": "pictures", "path": str(path), "kind": "image", **keys}]}


def test_an_image_model_config_takes_adapter_files_and_peft_directories(tmp_path):
    model_dir = image_model(tmp_path / "sd")
    write_safetensors(model_dir / "red.safetensors")
    red = str(model_dir / "red.safetensors")
    config = parse_config(config_text(model_dir, adapters={"red": red, "blue": {"path": red, "alpha": 0.5}}),
                          "test.yaml", checks=[model_files_check()])
    entries = config.models[0].adapter_entries()
    assert entries["red"].path == red and entries["red"].alpha == 1.0 and entries["blue"].alpha == 0.5
    peft = model_dir / "peft"
    peft.mkdir()
    write_safetensors(peft / "adapter_model.safetensors")
    parse_config(config_text(model_dir, adapters={"peft": str(peft)}), "test.yaml", checks=[model_files_check()])


def model_files_check():
    from appliance.config import path_check
    return path_check


@pytest.mark.parametrize("keys, named", [
    ({"adapters": {"red": "DIR/missing.safetensors"}}, "models[0].adapters.red: expected a LoRA adapter (a "),
    ({"adapters": {"red": "DIR/model_index.json"}}, "models[0].adapters.red: expected a safetensors file"),
    ({"adapters": {"red": {"path": "DIR/red.safetensors", "alpha": 0}}}, "models[0].adapters.red.alpha"),
    ({"max_resolution": 1001}, "models[0].max_resolution: expected a multiple of 8"),
    ({"max_images_per_request": 0}, "models[0].max_images_per_request"),
    ({"max_inference_steps": 0}, "models[0].max_inference_steps"),
])
def test_a_bad_image_key_is_one_line_naming_it(tmp_path, keys, named):
    model_dir = image_model(tmp_path / "sd")
    write_safetensors(model_dir / "red.safetensors")
    keys = json.loads(json.dumps(keys).replace("DIR/", f"{model_dir}/"))  # adapter paths are taken as given
    with pytest.raises(ConfigError) as err:
        parse_config(config_text(model_dir, **keys), "test.yaml", checks=[model_files_check()])
    assert any(line.startswith(named) or named in line for line in err.value.lines), err.value.lines


def test_image_keys_on_a_chat_model_are_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        parse_config({"models": [{"name": "chat", "path": str(tmp_path), "max_resolution": 512}]}, "test.yaml")
    assert "models[0].max_resolution: applies to kind 'image' models only" in str(err.value)


def body(**fields):
    return {"model": "pictures", "prompt": "a red square", **fields}


def test_a_generation_body_becomes_the_workers_request():
    req = images.parse(body(n=2, size="512x256", output_format="webp", output_compression=80, seed=7,
                            negative_prompt="blurry", num_inference_steps=4, guidance_scale=0,
                            lora=[{"name": "red", "weight": 0.5}, {"name": "blue"}], stream=True, partial_images=2,
                            quality="high", style="vivid", user="u1"))
    worker = req.body()
    assert (worker["width"], worker["height"], worker["n"], worker["steps"]) == (512, 256, 2, 4)
    assert worker["lora"] == [["red", 0.5], ["blue", None]] and worker["guidance_scale"] == 0
    assert worker["partial_images"] == 2 and worker["image"] is None
    assert images.parse(body(partial_images=2)).body()["partial_images"] == 0  # partials are for streams
    # a served name BASE:ADAPTER (as /v1/models lists adapters; lookup.named_adapter reads it once the model is
    # found) applies its adapter, at the weight lora gives it
    assert images.with_named_adapter("red", images.parse(body(model="pictures:red")).lora) == [("red", None)]
    assert images.with_named_adapter("red", images.parse(body(model="pictures:red", lora=[
        {"name": "blue"}, {"name": "red", "weight": 0.3}])).lora) == [("blue", None), ("red", 0.3)]


@pytest.mark.parametrize("fields, param", [
    ({"prompt": ""}, "prompt"), ({"n": 0}, "n"), ({"n": 11}, "n"), ({"size": "big"}, "size"),
    ({"size": "500x500"}, "size"), ({"size": "32x32"}, "size"), ({"response_format": "url"}, "response_format"),
    ({"output_format": "gif"}, "output_format"), ({"output_compression": 101}, "output_compression"),
    ({"background": "transparent"}, "background"), ({"partial_images": 4}, "partial_images"),
    ({"seed": -1}, "seed"), ({"num_inference_steps": 0}, "num_inference_steps"), ({"lora": {"x": 1}}, "lora"),
    ({"lora": [{"name": "a", "scale": 1}]}, "lora[0]"), ({"lora": [{"name": "a"}, {"name": "a"}]}, "lora[1]"),
    ({"strength": 0.5}, "strength"),
])
def test_a_bad_field_is_a_400_naming_it(fields, param):
    with pytest.raises(InvalidRequest) as err:
        images.parse(body(**fields))
    assert err.value.param == param


class Model:
    name, max_images_per_request, max_resolution, max_inference_steps = "pictures", 2, 512, 20
    adapters = {"red": "red.safetensors"}


@pytest.mark.parametrize("fields, param, code", [
    ({"n": 3}, "n", "too_many_images"), ({"size": "1024x512"}, "size", "invalid_size"),
    ({"num_inference_steps": 21}, "num_inference_steps", "too_many_steps"),
    ({"lora": [{"name": "blue"}]}, "lora[0]", "unknown_adapter"),
])
def test_the_models_limits_are_400s(fields, param, code):
    with pytest.raises(InvalidRequest) as err:
        images.check_limits(images.parse(body(**fields)), Model)
    assert (err.value.param, err.value.code) == (param, code)
    images.check_limits(images.parse(body(n=2, size="512x512", num_inference_steps=20, lora=[{"name": "red"}])),
                        Model)


class LargestModel(Model):
    max_images_per_request, max_resolution = MAX_IMAGES_PER_REQUEST, MAX_IMAGE_SIDE


def test_more_pixels_than_one_request_may_make_are_a_400_before_any_picture_is_painted():
    """The model's largest limits let 10 pictures of 4096 x 4096 through, each past the frame that carries it back
    from the worker: found only after it was painted. n x width x height is bounded at admission for a size asked
    for or an edit's, and by the worker before it paints for the model's own size (auto)."""
    def refused(check) -> str | None:
        try:
            check()
        except (InvalidRequest, InvalidInput) as err:
            return err.fault.code if isinstance(err, InvalidInput) else f"{err.param} {err.code}"
        return None

    for n, size, code in [(1, "4096x4096", "size too_many_pixels"), (1, "4000x4000", None),
                          (2, "4000x2000", None), (3, "4000x2000", "size too_many_pixels")]:
        assert refused(lambda: images.check_limits(images.parse(body(n=n, size=size)), LargestModel)) == code
    edit = images.parse(body(n=4), edit=True)
    assert refused(lambda: images.check_edit_sizes(edit, {"width": 2048, "height": 2048}, None, 4096)) \
        == "size too_many_pixels"
    own = {"steps": 50, "guidance_scale": 7.5, "strength": 1.0, "width": 2048, "height": 2048}
    auto = {"width": None, "height": None, "max_resolution": 4096, "image": None, "steps": 4, "guidance_scale": None,
            "negative_prompt": None}
    assert refused(lambda: settle({**auto, "n": 3}, own)) is None
    assert refused(lambda: settle({**auto, "n": 4}, own)) == "too_many_pixels"
    assert "4 pictures of 2048x2048 are 16,777,216 pixels" in str(pytest.raises(InvalidInput, settle,
                                                                                {**auto, "n": 4}, own).value)


def test_a_picture_of_the_most_pixels_a_request_may_make_fits_the_workers_frame():
    """The bound's reason: the worst picture (noise, which PNG cannot compress; jpeg and webp make it smaller) of
    MAX_IMAGE_REQUEST_PIXELS, as the worker's `picture` frame, stays under ipc.MAX_FRAME. Measured per pixel on a
    smaller noise picture (the PNG's overhead is per row and per block: no larger per pixel for a larger picture)."""
    import numpy as np
    side = 1024
    pixels = np.random.default_rng(0).integers(0, 256, (side, side, 3), dtype=np.uint8)
    per_pixel = max(len(encode_picture(pixels, fmt, 100)) for fmt in ("png", "jpeg", "webp")) / side ** 2
    picture = frame("picture", id=1 << 40, index=9, data="", seconds=1e9)
    assert per_pixel * MAX_IMAGE_REQUEST_PIXELS + len(encode(picture)) < MAX_FRAME, per_pixel


@given(st.integers(1, 4096), st.integers(1, 4096))
def test_a_size_is_taken_exactly_when_its_sides_suit_the_vae(width, height):
    ok = width % 8 == 0 and height % 8 == 0 and min(width, height) >= 64
    try:
        taken = images.parse_size(f"{width}x{height}")
    except InvalidRequest as err:
        assert not ok and err.param == "size"
    else:
        assert ok and taken == (width, height)


def test_an_edits_form_is_typed_as_a_json_body_would_be():
    values = images.form_values({"model": "pictures", "prompt": "p", "n": "2", "strength": "0.25", "stream": "true",
                                 "lora": '[{"name": "red", "weight": 1}]', "size": ""})
    req = images.parse(values, edit=True)
    assert (req.n, req.strength, req.stream, req.lora, req.size) == (2, 0.25, True, [("red", 1.0)], None)
    with pytest.raises(InvalidRequest):
        images.form_values({"n": "two"})


def test_an_edit_keeps_its_pictures_size_and_its_mask_must_match():
    req = images.parse(body(), edit=True)
    images.check_edit_sizes(req, {"width": 64, "height": 128}, {"width": 64, "height": 128}, 128)
    for image, mask, param in (({"width": 60, "height": 64}, None, "image"),
                               ({"width": 64, "height": 136}, None, "image"),
                               ({"width": 64, "height": 64}, {"width": 64, "height": 72}, "mask")):
        with pytest.raises(InvalidRequest) as err:
            images.check_edit_sizes(req, image, mask, 128)
        assert err.value.param == param
    with pytest.raises(InvalidRequest) as err:
        images.check_edit_sizes(images.parse(body(size="128x128"), edit=True), {"width": 64, "height": 64}, None, 128)
    assert err.value.param == "size"


@given(st.integers(1, 200), st.integers(0, 3))
def test_partial_pictures_come_spread_over_the_steps_and_never_at_the_last(steps, wanted):
    due = partial_steps(steps, wanted)
    assert due == sorted(set(due)) and set(due) <= set(range(1, steps)) and len(due) <= wanted
    if steps > wanted:
        assert len(due) == wanted


def test_a_stream_sends_progress_partials_and_completed_in_openais_names():
    req = images.parse(body(stream=True, partial_images=1))
    step = Event("step", result={"index": 0, "step": 2, "steps": 4, "seconds": 0.1, "image": "AAAA"})
    sent = images.stream_event(req, step, "auto", 0)
    assert [e["type"] for e in sent] == ["progress", "image_generation.partial_image"]
    assert sent[1]["partial_image_index"] == 0 and sent[1]["b64_json"] == "AAAA"
    done = images.stream_event(images.parse(body(), edit=True), Event("picture", result={"index": 0, "data": "BB",
                                                                                            "seconds": 1}), "auto", 1)
    assert done[0]["type"] == "image_edit.completed" and done[0]["b64_json"] == "BB"


def png(mode, size, colour):
    from PIL import Image
    out = io.BytesIO()
    Image.new(mode, size, colour).save(out, "PNG")
    return out.getvalue()


def test_an_openai_mask_paints_where_it_is_transparent():
    from PIL import Image
    image = Image.new("RGBA", (8, 8), (10, 200, 30, 255))
    image.putpixel((0, 0), (0, 0, 0, 0))
    out = io.BytesIO()
    image.save(out, "PNG")
    mask = decode(out.getvalue(), 64, ["png"], mask=True)
    assert mask.getpixel((0, 0)) == (255, 255, 255) and mask.getpixel((1, 1)) == (0, 0, 0)
    grey = decode(png("RGB", (8, 8), (255, 255, 255)), 64, ["png"], mask=True)
    assert grey.getpixel((3, 3)) == (255, 255, 255)


def test_decoding_leaves_pillows_pixel_guard_as_it_found_it():
    """decode() sets Pillow's process-wide MAX_IMAGE_PIXELS to each image's limit: left at a small one, every later
    Image.open of the process (a test's colour check beside it) failed as a decompression bomb."""
    from PIL import Image
    before = Image.MAX_IMAGE_PIXELS
    decode(png("RGB", (8, 8), (1, 2, 3)), 64, ["png"])
    with pytest.raises(Exception):
        decode(png("RGB", (16, 16), (1, 2, 3)), 64, ["png"])
    assert Image.MAX_IMAGE_PIXELS == before
    Image.open(io.BytesIO(png("RGB", (64, 64), (1, 2, 3)))).load()


@pytest.fixture(scope="module")
def edit_pipeline(demo_image):
    import openvino_genai
    return openvino_genai.Image2ImagePipeline(str(demo_image), "CPU")


def demo_pixels():
    import numpy as np
    import openvino as ov
    return ov.Tensor(np.zeros((1, 64, 64, 3), dtype=np.uint8))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.integers(1, 6), strength=st.floats(0, 1) | st.sampled_from([1 / 3, 0.2, 0.25, 0.5, 2 / 3]))
def test_settle_refuses_exactly_the_edits_genai_cannot_run(edit_pipeline, steps, strength):
    """settle's steps x strength rule against genai itself (whose refusal is a C++ check, a 500 otherwise)."""
    body = {"steps": steps, "strength": strength, "image": {}, "guidance_scale": None, "negative_prompt": None}
    try:
        settings_ = settle(body, {"steps": 50, "guidance_scale": 7.5, "strength": 0.8})
    except InvalidInput:
        settings_ = None
    try:
        edit_pipeline.generate("red", demo_pixels(), num_inference_steps=steps, strength=strength, rng_seed=1)
        ran = True
    except RuntimeError:
        ran = False
    assert (settings_ is not None) == ran, (steps, strength)


@given(steps=st.none() | st.integers(1, 500), max_steps=st.none() | st.integers(1, 500), own=st.integers(1, 1000),
       guidance=st.none() | st.floats(0, 100), own_guidance=st.floats(0, 20), negative=st.none() | st.just("blur"))
def test_settle_binds_the_models_own_steps_and_refuses_a_negative_prompt_without_guidance(steps, max_steps, own,
                                                                                           guidance, own_guidance,
                                                                                           negative):
    body = {"steps": steps, "max_steps": max_steps, "guidance_scale": guidance, "negative_prompt": negative,
            "image": None}
    effective = own_guidance if guidance is None else guidance
    try:
        settings_ = settle(body, {"steps": own, "guidance_scale": own_guidance, "strength": 1.0})
    except InvalidInput as exc:
        assert negative and effective <= 1 and "'negative_prompt'" in str(exc)
        return
    assert not (negative and effective <= 1)
    assert settings_["num_inference_steps"] == (steps if steps is not None else min(own, max_steps or own))
    assert settings_["guidance_scale"] == effective and "strength" not in settings_


SIDES = st.integers(8, 512).map(lambda k: k * 8)


@given(own=st.tuples(SIDES, SIDES), max_resolution=SIDES)
def test_the_models_own_size_is_fitted_into_max_resolution(own, max_resolution):
    """`size: auto` is the model's own size (1024 for SDXL): bound by max_resolution like a size asked for, it is
    scaled down to fit, its sides multiples of 8, its longer side kept longer. (Past 3992 a side it may be more pixels
    than a request may make: the test above.)"""
    assume(min(max_resolution, max(own)) <= 3992)
    body = {"width": None, "height": None, "max_resolution": max_resolution, "image": None, "steps": 4,
            "guidance_scale": None, "negative_prompt": None, "n": 1}
    got = settle(body, {"steps": 50, "guidance_scale": 7.5, "strength": 1.0, "width": own[0], "height": own[1]})
    width, height = got["width"], got["height"]
    assert width % 8 == 0 and height % 8 == 0 and min(width, height) >= min(64, max_resolution, *own)
    assert max(width, height) <= max(max_resolution, 64)
    if max(own) <= max_resolution:
        assert (width, height) == own
    else:
        assert (width >= height) == (own[0] >= own[1]) or width == height
    asked = settle({**body, "width": 128, "height": 64}, {"steps": 50, "guidance_scale": 7.5, "strength": 1.0,
                                                          "width": own[0], "height": own[1]})
    assert (asked["width"], asked["height"]) == (128, 64)  # a size asked for is the front's to check
