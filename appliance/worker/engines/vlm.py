"""The VLM worker kind: chat with images, on genai's ContinuousBatchingPipeline (a VLM export directory, images per
request, batched like text) or, with `pipeline: stateful`, on VLMPipeline (one request at a time).

Everything but the images is the LLM engine's (templates, tools, structured outputs, reasoning, stop sequences,
sampling).  The front decoded and checked each image in its decoder process (appliance.front.image_decoder) and
wrote its RGB pixels to a spool file; the messages carry genai's universal image tags (`<ov_genai_image_N>`) where
the images were, which genai turns into the model's own tags (LLaVA's `<image>`, Qwen2-VL's vision pads, ...).
This worker never parses an image file: it reads width x height x 3 bytes, and refuses a file of any other size.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from appliance.host import faults
from appliance.worker.engines.batching import BatchingEngine
from appliance.worker.engines.llm import Request
from appliance.worker.engines.stateful import SequentialEngine
from appliance.worker.prompt import INVALID_REQUEST, Refused

INVALID_IMAGE = faults.Fault("invalid_request", "invalid_image", None, False)
# genai's refusals of a prompt's image tags (a native tag such as "<image>" typed beside the images, a tag with no
# image): the caller's to fix.
TAG_ERRORS = ("vision tags", "universal tags", "Missing image")


def load_images(message: dict[str, Any]) -> list:
    """The request's images as HWC uint8 ov.Tensors, from the spool files the front wrote."""
    import openvino as ov

    tensors = []
    for i, image in enumerate(message.get("images") or ()):
        width, height = int(image["width"]), int(image["height"])
        try:
            pixels = np.fromfile(image["path"], dtype=np.uint8)
        except OSError as exc:  # the front removed it: the request was cancelled before it got here
            raise Refused(INVALID_IMAGE, f"image {i} is gone: {exc.strerror}") from None
        if pixels.size != width * height * 3:
            raise Refused(INVALID_IMAGE, f"image {i}: {pixels.size} bytes of pixels for {width}x{height} RGB")
        tensors.append(ov.Tensor(pixels.reshape(height, width, 3)))
    return tensors


class VisionRequests:
    """What both VLM engines add to the LLM engine's requests: the images, read when the request is admitted
    (on the channel reader thread, as tokenizing is), and prompt_tokens as genai counted them (image tokens
    included) once the request has run."""

    def _request(self, message: dict[str, Any]) -> Request:
        req = super()._request(message)
        req.images = load_images(message)
        return req

    def generation_config(self, req: Request):
        config = super().generation_config(req)
        # The prompt is text here (a VLM pipeline takes no token ids), already templated by the engine: genai
        # would wrap it in the chat template a second time.
        config.apply_chat_template = False
        return config

    @staticmethod
    def refused_tags(exc: Exception) -> Refused | None:
        message = str(exc)
        if any(marker in message for marker in TAG_ERRORS):
            return Refused(INVALID_REQUEST,
                           "the prompt's image tags do not match its images: " + message.strip().splitlines()[-1])
        return None


class BatchingVLMEngine(VisionRequests, BatchingEngine):
    """ContinuousBatchingPipeline on a VLM export: genai batches requests with their images (each request's images
    are encoded when it is added, then its tokens join the batch as text requests' do)."""

    def add_request(self, req: Request):
        try:
            handle = self.pipe.add_request(req.id, req.text, req.images, req.config)
        except Exception as exc:
            raise self.refused_tags(exc) or exc
        req.handle = handle
        return handle

    @staticmethod
    def models_prefix(req: Request) -> bool:
        # genai counts a request's image tokens apart from its text's ids: the cache model follows text-only prompts
        return not req.images

    def finish(self, req: Request, finish_reason: str) -> None:
        try:  # available once genai has finished the request (not for one cut here by a stop sequence)
            req.prompt_tokens = req.handle.get_vlm_perf_metrics().get_num_input_tokens()
        except Exception:
            pass
        super().finish(req, finish_reason)


class SequentialVLMEngine(VisionRequests, SequentialEngine):
    """VLMPipeline (pipeline: stateful): one request at a time."""

    def __init__(self, spec, channel):
        import openvino_genai
        self.pipe = openvino_genai.VLMPipeline(spec["path"], spec["device"], **spec["properties"])
        self._init_sequential(spec, channel)

    def run_pipeline(self, req: Request, streamer) -> None:
        try:
            result = self.pipe.generate(req.text, images=req.images, generation_config=req.config, streamer=streamer)
        except Exception as exc:
            raise self.refused_tags(exc) or exc
        req.prompt_tokens = result.perf_metrics.get_num_input_tokens()
