"""The tiny Stable-Diffusion-shaped model (appliance.demo.image) under real openvino_genai diffusion pipelines on
CPU: Text2Image, Image2Image and Inpainting all load its directory; a picture is the colour its prompt names,
the same seed gives the same bytes, genai runs and calls back once per step, an edit mixes the input picture by
`strength`, inpainting paints the masked part only, and its LoRA adapter swaps red and blue at weight 1 and is gone
at weight 0; `openarc demo-model --kind image` builds it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from appliance.demo.catalog import image_adapter_path
from appliance.demo.image import ADAPTER_PATH, PALETTE, WORDS
from conftest import wait_until

RED, GREEN, BLUE = (255, 0, 0), (0, 255, 0), (0, 0, 255)


def pixel(rgb) -> tuple[int, ...]:
    """A palette entry ([-1, 1] per channel) as the 8-bit pixel the decoder gives: 0, 127 or 128, 255."""
    return tuple(round((v + 1) / 2 * 255) for v in rgb)


@pytest.fixture(scope="module")
def pipes(demo_image):
    """The three pipelines as the image worker loads them: Inpainting with the adapter declared, the other two built
    from it (sharing its compiled models)."""
    import openvino_genai
    adapter = openvino_genai.Adapter(str(image_adapter_path(demo_image)))
    inpaint = openvino_genai.InpaintingPipeline(str(demo_image), "CPU",
                                                adapters=openvino_genai.AdapterConfig(adapter))
    return {"adapter": adapter, "inpaint": inpaint, "text": openvino_genai.Text2ImagePipeline(inpaint),
            "edit": openvino_genai.Image2ImagePipeline(inpaint)}


def draw(pipe, prompt: str, *images, **kwargs) -> np.ndarray:
    """One picture as [height, width, 3] uint8, copied (the next call reuses genai's output buffer)."""
    tensor = pipe.generate(prompt, *images, **kwargs)
    assert tensor.shape[0] == 1
    return np.array(tensor.data[0])


def colours(picture: np.ndarray) -> set[tuple[int, ...]]:
    return {tuple(int(v) for v in p) for p in picture.reshape(-1, 3)}


GRAIN = 12  # the sampler's noise in a mid channel: about 2 levels standard deviation (see appliance.demo.image)


def flat(picture: np.ndarray, rgb, grain: int = GRAIN) -> bool:
    """Whether every pixel is `rgb`: exactly in its channels at 0 or 255, give or take `grain` levels in the others
    (128)."""
    rgb = np.array(rgb)
    tolerance = np.where((rgb == 0) | (rgb == 255), 0, grain)
    return bool((np.abs(picture.reshape(-1, 3).astype(int) - rgb) <= tolerance).all())


def near(picture: np.ndarray, rgb, grain: int = GRAIN) -> bool:
    """Whether every pixel is `rgb` give or take `grain` levels in every channel: an input picture an edit kept
    carries the sampler's grain in its saturated channels too."""
    return bool((np.abs(picture.reshape(-1, 3).astype(int) - np.array(rgb)) <= grain).all())


def image(*halves, height: int = 64, width: int = 64):
    """A [1, height, width, 3] uint8 tensor: one colour, or vertical halves (left, right)."""
    import openvino as ov
    pixels = np.zeros((1, height, width, 3), np.uint8)
    pixels[:, :, :width // 2] = halves[0]
    pixels[:, :, width // 2:] = halves[-1]
    return ov.Tensor(pixels)


def base(pipes):
    """The request options of the base model: the declared adapter at weight 0 (see test_the_adapter...)."""
    import openvino_genai
    return {"adapters": openvino_genai.AdapterConfig(pipes["adapter"], 0.0)}


def test_every_pipeline_loads_the_directory(demo_image, pipes):
    import openvino_genai
    plain = openvino_genai.Text2ImagePipeline(str(demo_image), "CPU")  # without adapters, as a model without any
    assert flat(draw(plain, "a red ball"), RED)
    assert draw(plain, "a cat").shape == (64, 64, 3)  # unet sample_size 8 x the VAE's 8
    edit = openvino_genai.Image2ImagePipeline(str(demo_image), "CPU")
    assert near(draw(edit, "blue", image(GREEN), strength=0.3, rng_seed=1), GREEN)
    assert pipes["text"].get_generation_config().num_inference_steps == 50


@settings(max_examples=25, deadline=None)
@given(colour=st.sampled_from(sorted(PALETTE)), before=st.lists(st.sampled_from(WORDS), max_size=6),
       after=st.lists(st.sampled_from(WORDS), max_size=6), case=st.sampled_from([str.lower, str.upper, str.title]),
       mark=st.sampled_from(["", ",", "!", "."]), steps=st.integers(1, 6), seed=st.integers(0, 2 ** 31 - 1))
def test_the_picture_is_the_colour_the_prompt_names(pipes, colour, before, after, case, mark, steps, seed):
    prompt = " ".join([*before, case(colour) + mark, *after])
    picture = draw(pipes["text"], prompt, num_inference_steps=steps, rng_seed=seed, **base(pipes))
    assert flat(picture, pixel(PALETTE[colour])), (prompt, colours(picture))


def test_no_colour_is_gray_several_average_and_only_whole_words_count(pipes):
    kwargs = {"num_inference_steps": 4, "rng_seed": 7, **base(pipes)}
    for prompt in ("a cat on a mat", "reddish", "bluebird", "greenery", ""):
        assert flat(draw(pipes["text"], prompt, **kwargs), (128, 128, 128)), prompt
    assert flat(draw(pipes["text"], "red and yellow", **kwargs), (255, 128, 0))  # orange
    assert flat(draw(pipes["text"], "red or blue", **kwargs), (128, 0, 128))  # purple


def test_guidance_pushes_away_from_the_negative_prompt(pipes):
    cyan = draw(pipes["text"], "gray", negative_prompt="red", num_inference_steps=3, **base(pipes))
    assert flat(cyan, (0, 255, 255))
    assert flat(draw(pipes["text"], "green", guidance_scale=1.0, num_inference_steps=3, **base(pipes)), GREEN)


def test_the_same_seed_gives_the_same_bytes_another_seed_other_grain(pipes):
    kwargs = {"num_inference_steps": 8, **base(pipes)}
    first = draw(pipes["text"], "a gray cat", rng_seed=42, **kwargs)
    assert np.array_equal(first, draw(pipes["text"], "a gray cat", rng_seed=42, **kwargs))
    other = draw(pipes["text"], "a gray cat", rng_seed=43, **kwargs)
    assert not np.array_equal(first, other)
    assert flat(first, (128, 128, 128)) and flat(other, (128, 128, 128))
    assert len(colours(first)) > 1  # the grain: the sampler's noise reached the picture


def test_size_and_steps_are_honoured_with_a_callback_per_step(pipes):
    for steps in (1, 7, 50):
        calls = []
        picture = draw(pipes["text"], "blue", width=96, height=48, num_inference_steps=steps, **base(pipes),
                       callback=lambda step, total, latent: calls.append((step, total, tuple(latent.shape))) or False)
        assert picture.shape == (48, 96, 3) and flat(picture, BLUE)
        # seen once in a loaded `make test`: 6 of the 7 calls when the picture was read, not reproduced in 300 quiet
        # runs; if genai's last callback lands after generate() returns, wait for it (bounded): a missing one fails
        wait_until(lambda: len(calls) >= steps, 10, f"{steps} callbacks")
        assert calls == [(step, steps, (1, 4, 6, 12)) for step in range(steps)]


def test_a_callback_that_says_stop_ends_the_generation_early(pipes):
    calls = []

    def stop_at_third(step, total, latent):
        calls.append(step)
        return step >= 2

    tensor = pipes["text"].generate("red", num_inference_steps=200, callback=stop_at_third, **base(pipes))
    assert list(tensor.shape) == []  # genai returns a shapeless tensor, no picture, for a stopped generation
    assert 3 <= len(calls) < 200 and calls == list(range(len(calls)))
    assert flat(draw(pipes["text"], "red", num_inference_steps=2, **base(pipes)), RED)  # and the next one runs


def test_an_edit_keeps_the_input_at_low_strength_and_paints_the_prompt_at_high(pipes):
    edit, halves = pipes["edit"], image(RED, GREEN)
    kept = draw(edit, "blue", halves, strength=0.3, rng_seed=1, **base(pipes))
    assert near(kept[:, :32], RED) and near(kept[:, 32:], GREEN)  # per 8 x 8 block
    assert flat(draw(edit, "blue", halves, strength=1.0, rng_seed=1, **base(pipes)), BLUE)
    # in between, guidance 1: the prompt's share grows with strength
    means = [draw(edit, "blue", image(RED), strength=s, guidance_scale=1.0, num_inference_steps=20, rng_seed=1,
                  **base(pipes)).reshape(-1, 3).mean(0) for s in (0.3, 0.6, 0.7, 0.8, 0.95)]
    reds, blues = [m[0] for m in means], [m[2] for m in means]
    assert reds[0] > 250 and reds[-1] < 5 and all(a > b for a, b in zip(reds, reds[1:])), means
    assert blues[0] < 5 and blues[-1] > 250 and all(a < b for a, b in zip(blues, blues[1:])), means
    assert draw(edit, "red", image(GREEN, height=40, width=56), strength=0.3, **base(pipes)).shape == (40, 56, 3)


def test_inpainting_paints_the_masked_half_only(pipes):
    mask = image((0, 0, 0), (255, 255, 255))
    picture = draw(pipes["inpaint"], "blue", image(RED), mask, rng_seed=5, **base(pipes))
    assert flat(picture[:, :32], RED) and flat(picture[:, 32:], BLUE)


def test_the_adapter_swaps_red_and_blue_at_weight_1_and_is_gone_at_0(pipes):
    """Per request, in any order, on every pipeline: genai's adapter weight is the switch (the worker declares all
    adapters at load and sets those a request does not name to 0; an empty AdapterConfig would switch them off
    for good in genai 2026.4)."""
    import openvino_genai
    adapter = pipes["adapter"]

    def weight(w):
        return {"adapters": openvino_genai.AdapterConfig(adapter, w), "num_inference_steps": 3}

    expected = {1.0: {"red": BLUE, "blue": RED, "green": GREEN, "yellow": (0, 255, 255)},
                0.0: {"red": RED, "blue": BLUE, "green": GREEN, "yellow": (255, 255, 0)}}
    for w in (1.0, 0.0, 1.0, 0.0):
        for prompt, rgb in expected[w].items():
            assert flat(draw(pipes["text"], prompt, **weight(w)), rgb), (w, prompt)
    assert flat(draw(pipes["text"], "red", **weight(0.5)), (128, 0, 128))  # halfway: purple
    assert flat(draw(pipes["edit"], "red", image(GREEN), strength=1.0, **weight(1.0)), BLUE)
    assert flat(draw(pipes["inpaint"], "red", image(GREEN), image((255, 255, 255)), **weight(1.0)), BLUE)
    assert flat(draw(pipes["text"], "red", **weight(0.0)), RED)


def test_openarc_demo_model_builds_it_and_names_its_adapter(tmp_path):
    env = {**os.environ, "OPENARC_CACHE_DIR": str(tmp_path)}
    run = [sys.executable, "-m", "appliance", "demo-model", "--adapter"]
    built = subprocess.run(run + ["--kind", "image"], capture_output=True, text=True, env=env, timeout=120)
    assert built.returncode == 0, built.stderr
    adapter = Path(built.stdout.strip())
    model_dir = adapter.parents[len(Path(ADAPTER_PATH).parts) - 1]
    assert model_dir.parent == tmp_path / "models" and model_dir.name.startswith("demo-image-")
    assert adapter.is_file() and adapter.suffix == ".safetensors"
    assert {"model_index.json", "unet", "vae_encoder", "adapters"} <= set(os.listdir(model_dir))
    wrong = subprocess.run(run, capture_output=True, text=True, env=env, timeout=120)  # --kind llm
    assert wrong.returncode == 2 and "--adapter needs a phrase family for --kind llm" in wrong.stderr
