"""The image worker kind: genai's diffusion pipelines (Stable Diffusion 1.5/XL/3, FLUX, LCM, ...) make pictures.

One InpaintingPipeline is loaded where the model has a VAE encoder, and the text-to-image and image-to-image
pipelines are built from it (they share its compiled models: one copy in memory); a model without one serves
generations only. Every LoRA adapter the model config names is declared at load (genai fixes the set then); a
request applies the ones it names at its weights, and a request that names none runs with all at weight 0: the
base model.

Request body (ipc op `request`): {"prompt", "negative_prompt" (or None), "n", "width"/"height" (None: the model's
own size, fitted into "max_resolution"), "steps" (None: the model's own, at most "max_steps", the model's
max_inference_steps), "guidance_scale"
(None: the model's own), "seed" (None: random), "lora": [[name, weight],...],
"output_format": png | jpeg | webp, "output_compression": 0-100 (jpeg, webp), "partial_images": 0-3, and for an
edit "image" (and "mask"): {"path", "width", "height"} of RGB pixels the front's image decoder wrote, "strength"}.

Pictures are made one at a time (seed, seed+1, ...): a card's memory holds one picture's activations, a hang-up is
seen between pictures too, and each goes to the front as it is done (a `picture` frame). genai calls back after
every denoising step: a `step` frame (the stall timer's progress, the step histogram, a streamed `progress`
event), with the picture so far at the steps a streamed request asked partial images for; a cancelled request
stops at the next step. Result: {"pictures": n made, "width", "height"}.

genai runs the step callback on a thread of its own and does not wait for it: the denoising goes on while it runs,
and a step whose callback finds the previous one still running is not called back (on a real model a step takes far
longer than a callback; on the demo model some steps go unreported). So the callback stays short, and partial
pictures are decoded by a VAE decoder of their own (PartialDecoder), never by the pipeline, whose own decoder the
generation is using at its end.
"""

from __future__ import annotations

import base64
import io
import logging
import os
import random
import time
from typing import Any

from appliance.config.rules import IMAGE_SIZE_STEP, MIN_IMAGE_SIDE, image_pixels_problem
from appliance.ipc import frame
from appliance.worker.engines.base import InvalidInput, ResultEngine

log = logging.getLogger("openarc.worker")

PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}
ENCODER = "vae_encoder/openvino_model.xml"  # appliance.model_files.IMAGE_ENCODER
SIZE_STEP, MIN_SIDE = IMAGE_SIZE_STEP, MIN_IMAGE_SIDE


def partial_steps(steps: int, partial_images: int) -> list[int]:
    """The steps (1-based, in order) after which a request asking for `partial_images` partial pictures gets one:
    spread evenly over the generation, never the last step (the finished picture follows it)."""
    if partial_images <= 0 or steps <= 1:
        return []
    return sorted({max(1, round(steps * (k + 1) / (partial_images + 1))) for k in range(partial_images)} - {steps})


def settle(body: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
    """genai's num_inference_steps, guidance_scale (and strength for an edit) for a request: the body's, else the
    model's own (`own`: its pipeline's generation config), its own steps bounded by the body's max_steps (the
    operator's max_inference_steps binds a request naming no steps too). Settings genai refuses with a C++ check
    (a 500 quoting its sources) are InvalidInput naming the field: a negative prompt needs classifier-free guidance
    (guidance_scale above 1), and an edit's steps x strength must leave a step to run."""
    steps = body.get("steps")
    if steps is None:
        steps = own["steps"] if body.get("max_steps") is None else min(own["steps"], body["max_steps"])
    guidance = own["guidance_scale"] if body.get("guidance_scale") is None else body["guidance_scale"]
    if body.get("negative_prompt") is not None and guidance <= 1:
        raise InvalidInput(f"'negative_prompt' needs guidance_scale above 1 (classifier-free guidance is what applies "
                           f"it); this request's guidance_scale is {guidance:g}", "invalid_guidance")
    settings = {"num_inference_steps": steps, "guidance_scale": guidance}
    if body.get("image") is not None:
        strength = own["strength"] if body.get("strength") is None else body["strength"]
        if steps_run(steps, strength) < 1:
            raise InvalidInput(f"'strength' {strength:g} of num_inference_steps={steps} leaves no denoising step "
                               "(the steps run are steps x strength, rounded down): raise either", "invalid_strength")
        settings["strength"] = strength
    size = picture_size(body, own)
    if size is not None:
        settings["width"], settings["height"] = size
    image = body.get("image")
    made = size or (image and (image["width"], image["height"]))
    problem = made and image_pixels_problem(body["n"], *made)
    if problem:  # (a size asked for, and an edit's, the front refused already: here the model's own, now known)
        raise InvalidInput(f"'n' x 'size': {problem}", "too_many_pixels")
    return settings


def picture_size(body: dict[str, Any], own: dict[str, Any]) -> tuple[int, int] | None:
    """The (width, height) to ask genai for: the body's (the front checked it), for an edit its picture's (None),
    else the model's own scaled down into the body's max_resolution (SDXL's own 1024 under a cap of 512: 512),
    sides multiples of 8 and at least 64. None where the model's config names no size (genai picks)."""
    if body.get("width") is not None:
        return body["width"], body["height"]
    width, height = own.get("width") or 0, own.get("height") or 0
    if body.get("image") is not None or width <= 0 or height <= 0:
        return None
    cap = body.get("max_resolution")
    if cap is None or max(width, height) <= cap:
        return width, height
    scale = cap / max(width, height)
    return tuple(max(MIN_SIDE, int(side * scale) // SIZE_STEP * SIZE_STEP) for side in (width, height))


def steps_run(steps: int, strength: float) -> int:
    """The denoising steps an edit runs, as genai's schedulers count them: size_t(steps * strength) in C++ floats."""
    import numpy as np
    return int(np.float32(steps) * np.float32(strength))


def encode_picture(pixels, output_format: str, compression: int | None) -> str:
    """height x width x 3 uint8 pixels as a base64 file of `output_format` (jpeg and webp at the quality
    `compression` says, OpenAI's output_compression: 100 keeps the most)."""
    from PIL import Image
    out = io.BytesIO()
    options = {} if output_format == "png" or compression is None else {"quality": max(1, int(compression))}
    Image.fromarray(pixels).save(out, PIL_FORMATS[output_format], **options)
    return base64.b64encode(out.getvalue()).decode("ascii")


class ImageEngine(ResultEngine):
    def __init__(self, spec: dict[str, Any], channel):
        import openvino_genai
        super().__init__(spec, channel)
        self.adapters = {name: openvino_genai.Adapter(entry["path"]) for name, entry in spec["adapters"].items()}
        self.alphas = {name: float(entry["alpha"]) for name, entry in spec["adapters"].items()}
        properties = dict(spec["properties"])
        if self.adapters:
            properties["adapters"] = openvino_genai.AdapterConfig(list(self.adapters.values()))
        self.edits = os.path.exists(os.path.join(spec["path"], ENCODER))
        if self.edits:
            self.inpaint = openvino_genai.InpaintingPipeline(spec["path"], spec["device"], **properties)
            self.text2image = openvino_genai.Text2ImagePipeline(self.inpaint)
            self.image2image = openvino_genai.Image2ImagePipeline(self.inpaint)
        else:
            self.text2image = openvino_genai.Text2ImagePipeline(spec["path"], spec["device"], **properties)
        self.cancelled = False
        self.partials = PartialDecoder(spec)
        self._warm_up()

    def _warm_up(self) -> None:
        """One step of a small picture: the first call's one-off costs, paid before `ready`."""
        try:
            self.text2image.generate("warm up", width=64, height=64, num_inference_steps=1,
                                     **self._adapter_kwargs([]))
        except RuntimeError as exc:  # a family that refuses that size pays its first call on its first request
            log.info("warm-up skipped: %s", str(exc).strip().splitlines()[-1] if str(exc).strip() else exc)

    def on_cancel(self, request_id: int) -> None:
        super().on_cancel(request_id)
        self.cancelled = self.cancelled or (self.current is not None and request_id == self.current["id"])

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        self.cancelled = False
        pipe, inputs = self._pipeline(body)
        kwargs = self._generate_kwargs(pipe, body)
        seed = body["seed"] if body["seed"] is not None else random.randrange(1 << 31)
        if body["partial_images"]:
            self.partials.compile()  # here, not in genai's callback: a step must stay short (see the module doc)
        made, shape = 0, (0, 0)
        for index in range(body["n"]):
            if self.cancelled:
                break
            steps = StepReporter(self, index, body)
            started = time.monotonic()
            tensor = pipe.generate(body["prompt"], *inputs, rng_seed=seed + index, callback=steps, **kwargs)
            if steps.error is not None:  # our own code failed inside genai's callback: raised now that it returned
                raise steps.error
            if self.cancelled:
                break
            pixels = tensor.data[0]
            shape = pixels.shape[:2]
            data = encode_picture(pixels, body["output_format"], body["output_compression"])
            self.post(frame("picture", id=self.current["id"], index=index, data=data,
                            seconds=time.monotonic() - started))
            self.flush()
            made += 1
        return {"pictures": made, "height": int(shape[0]), "width": int(shape[1])}, {}

    def _pipeline(self, body: dict[str, Any]):
        """The pipeline of the request and its image inputs: text to image, image to image, or inpainting."""
        if body.get("image") is None:
            return self.text2image, ()
        if not self.edits:
            raise InvalidInput(f"the model '{self.spec['name']}' has no VAE encoder (vae_encoder/) and cannot edit "
                               "pictures; it serves /v1/images/generations only", "edits_unsupported")
        image = read_pixels(body["image"])
        if body.get("mask") is None:
            return self.image2image, (image,)
        return self.inpaint, (image, read_pixels(body["mask"]))

    def _generate_kwargs(self, pipe, body: dict[str, Any]) -> dict[str, Any]:
        config = pipe.get_generation_config()
        own = {"steps": config.num_inference_steps, "guidance_scale": config.guidance_scale,
               "strength": config.strength, "width": config.width, "height": config.height}
        kwargs: dict[str, Any] = self._adapter_kwargs(body["lora"])
        kwargs.update(settle(body, own))
        if body.get("negative_prompt") is not None:
            kwargs["negative_prompt"] = body["negative_prompt"]
        return kwargs

    def _adapter_kwargs(self, lora: list) -> dict[str, Any]:
        """The request's adapters at their weights, every other declared adapter at 0 (genai would otherwise apply
        all of them at their load-time weights): the base model for a request that names none."""
        import openvino_genai
        if not self.adapters:
            return {}
        weights = {name: 0.0 for name in self.adapters}
        for name, weight in lora:
            weights[name] = self.alphas[name] if weight is None else float(weight)
        return {"adapters": openvino_genai.AdapterConfig([(self.adapters[n], w) for n, w in weights.items()])}


def read_pixels(image: dict[str, Any]):
    """An RGB spool file the front's image decoder wrote, as the [1, height, width, 3] uint8 tensor genai takes."""
    import numpy as np
    import openvino as ov
    pixels = np.fromfile(image["path"], dtype=np.uint8).reshape(1, image["height"], image["width"], 3)
    return ov.Tensor(pixels)


class PartialDecoder:
    """The VAE decoder partial pictures are decoded with: compiled on the first request that asks for them (most
    never do), apart from the pipeline's (see the module doc). A family whose step latents it cannot decode (FLUX
    packs them) gets no partial pictures, said once in the log."""

    def __init__(self, spec: dict[str, Any]):
        self.spec = spec
        self.vae = None
        self.broken = False

    def compile(self) -> None:
        """The decoder, compiled once (a model whose decoder cannot be built gets no partial pictures)."""
        if self.vae is None and not self.broken:
            self._guarded(self._build)

    def _build(self) -> None:
        import openvino_genai
        vae = openvino_genai.AutoencoderKL(os.path.join(self.spec["path"], "vae_decoder"))
        vae.compile(self.spec["device"], **self.spec["properties"])
        self.vae = vae

    def decode(self, latent):
        """The picture so far as height x width x 3 uint8 pixels, or None."""
        if self.vae is None or self.broken:
            return None
        return self._guarded(lambda: self.vae.decode(latent).data[0])

    def _guarded(self, call):
        try:
            return call()
        except RuntimeError as exc:
            self.broken = True
            log.warning("no partial pictures for this model: its step latents cannot be decoded (%s)",
                        str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
            return None


class StepReporter:
    """genai's step callback: a `step` frame for each step (with the picture so far where a partial one is due),
    the engine's inbox read (a cancel), and the request stopped once cancelled. genai would print and swallow an
    exception raised here: it is kept, generation stops, and answer() raises it."""

    def __init__(self, engine: ImageEngine, index: int, body: dict[str, Any]):
        self.engine, self.index, self.body = engine, index, body
        self.partial: list[int] | None = None  # the steps partial pictures are due after, once genai says how many
        self.last = time.monotonic()
        self.error: BaseException | None = None

    def __call__(self, step: int, num_steps: int, latent) -> bool:
        engine = self.engine
        try:
            if self.partial is None:
                self.partial = partial_steps(num_steps, self.body["partial_images"])
            now = time.monotonic()
            extra = {}
            if self.partial and step + 1 >= self.partial[0]:  # due (at this step, or at one not called back)
                while self.partial and step + 1 >= self.partial[0]:
                    self.partial.pop(0)
                pixels = engine.partials.decode(latent)
                if pixels is not None:
                    extra["image"] = encode_picture(pixels, self.body["output_format"],
                                                    self.body["output_compression"])
            engine.post(frame("step", id=engine.current["id"], index=self.index, step=step + 1, steps=num_steps,
                              seconds=now - self.last, **extra))
            self.last = now
            engine.flush()
            engine.drain_inbox(block=False)
            engine.after_step()
        except BaseException as exc:
            self.error = exc
            return True
        return engine.cancelled
