"""POST /v1/images/generations (JSON) and /v1/images/edits (multipart/form-data), as the OpenAI SDK's
`client.images.generate()` and `client.images.edit()` send them, on models of kind image (appliance.worker.engines.image).

Fields (OpenAI's): `model`, `prompt`, `n`, `size` ("auto" or WIDTHxHEIGHT, sides multiples of 8), `response_format`
(b64_json only: a `url` answer would need the server to keep pictures and serve them to whoever holds the link;
it is refused with a 400 saying so), `output_format` (png, jpeg, webp), `output_compression` (0-100, jpeg and
webp), `stream` with `partial_images` (0-3), and `quality`, `style`, `background` (transparent is refused),
`moderation`, `user`, accepted and unused. Extensions: `seed`, `negative_prompt`, `num_inference_steps`,
`guidance_scale`, `lora` ([{name, weight}]: adapters of the model's config; a model named BASE:ADAPTER, as
/v1/models lists them, applies that adapter too), and for edits `strength` (0-1: how much
of the image is repainted). Edits take `image` (or `image[]`, one picture) and an optional `mask` (transparent, or
white where to paint), decoded and checked in the image decoder process (appliance.front.image_decoder) into spool
files whose bytes are claimed on the server's one spool budget until the request ends (appliance.front.spool_budget:
no room now is a 503 spool_full with Retry-After).

The model's limits (max_resolution, max_images_per_request, max_inference_steps) are 400s, and so are more than
MAX_IMAGE_REQUEST_PIXELS (appliance.config.rules) in one request's pictures together. A streamed request gets
SSE events: `progress` (an extension: step, steps, image_index) after each denoising step, OpenAI's
`image_generation.partial_image` (`image_edit.partial_image`) at the partial pictures, and `image_generation.completed`
(`image_edit.completed`) per picture; a client that hangs up cancels the request, which the worker stops at its next
step.
"""

from __future__ import annotations

import itertools
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from appliance.config.rules import IMAGE_SIZE_STEP, MIN_IMAGE_SIDE, image_pixels_problem
from appliance.front.api import fields, lookup, sse
from appliance.front.api.audio import TRANSCRIPT_ERRORS, Upload, UploadRoutes, read_form
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.images import spool_size
from appliance.front.api.route import Call, route
from appliance.front.api.server_view import ServerView
from appliance.front.helper_process import HelperFault
from appliance.front.image_decoder import OVER_BUDGET, ImageDecoder, ImageError, rgb_bytes
from appliance.front.request import Event, RequestFailed
from appliance.front.spool_budget import spool_full

KIND = "image"
MAX_PROMPT_CHARS = 32000  # OpenAI's, for its newest image models
MAX_N = 10  # OpenAI's bound on n; a model's max_images_per_request is at most this (appliance.config.rules)
MAX_PARTIAL_IMAGES = 3  # OpenAI's
MAX_LORAS = 8
MAX_SEED = (1 << 31) - 1
SIZE = re.compile(r"(\d{1,5})x(\d{1,5})", re.ASCII)
SIZE_STEP, MIN_SIDE = IMAGE_SIZE_STEP, MIN_IMAGE_SIDE
OUTPUT_FORMATS = ("png", "jpeg", "webp")
EDIT_FORMATS = ["png", "jpeg", "webp"]
MAX_EDIT_UPLOAD_BYTES = 50 << 20  # OpenAI's bound on an edit's image
IGNORED_TEXT = ("quality", "style", "moderation", "user", "input_fidelity")
# Multipart fields are text: the types the JSON body would have.
FORM_INTEGERS = ("n", "output_compression", "partial_images", "seed", "num_inference_steps")
FORM_NUMBERS = ("guidance_scale", "strength")
FORM_BOOLEANS = {"true": True, "1": True, "false": False, "0": False}
USAGE = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
         "input_tokens_details": {"image_tokens": 0, "text_tokens": 0}}


def add_routes(app: web.Application, appliance: ServerView) -> None:
    images = ImageRoutes(appliance)
    # TRANSCRIPT_ERRORS: OpenAI's bodies, and in a stream an event of type "error" like the image events' types.
    app.router.add_post("/v1/images/generations",
                        route(appliance, "images/generations", images.generations, TRANSCRIPT_ERRORS))
    app.router.add_post("/v1/images/edits", route(appliance, "images/edits", images.edits, TRANSCRIPT_ERRORS))
    images.mount(app)


@dataclass
class ImageRequest:
    model: str
    prompt: str
    n: int = 1
    size: tuple[int, int] | None = None  # (width, height); None: the model's own
    output_format: str = "png"
    output_compression: int | None = None
    stream: bool = False
    partial_images: int = 0
    seed: int | None = None
    negative_prompt: str | None = None
    steps: int | None = None
    guidance_scale: float | None = None
    strength: float | None = None
    lora: list[tuple[str, float | None]] = field(default_factory=list)
    edit: bool = False

    def body(self, image: dict | None = None, mask: dict | None = None, model=None) -> dict[str, Any]:
        """The body of the worker's `request` frame (appliance.worker.engines.image); the `model`'s
        max_inference_steps and max_resolution bound the model's own steps and size for a request naming none."""
        width, height = self.size or (None, None)
        return {"prompt": self.prompt, "negative_prompt": self.negative_prompt, "n": self.n, "width": width,
                "height": height, "steps": self.steps, "max_steps": model and model.max_inference_steps,
                "max_resolution": model and model.max_resolution, "guidance_scale": self.guidance_scale,
                "seed": self.seed,
                "strength": self.strength, "lora": [list(pair) for pair in self.lora],
                "output_format": self.output_format, "output_compression": self.output_compression,
                "partial_images": self.partial_images if self.stream else 0, "image": image, "mask": mask}

    @property
    def event_prefix(self) -> str:
        return "image_edit" if self.edit else "image_generation"


def parse(body: Any, edit: bool = False) -> ImageRequest:
    """A generation's JSON body (or an edit's form fields, typed by form_values) as an ImageRequest; every error a
    400 naming its field."""
    model = fields.model_name(body)
    prompt = fields.required_text(body, "prompt", MAX_PROMPT_CHARS, "what the picture shows")
    _response_format(body.get("response_format"))
    output_format = body.get("output_format") or "png"
    if output_format not in OUTPUT_FORMATS:
        raise InvalidRequest(f"'output_format' must be one of {', '.join(OUTPUT_FORMATS)}", "output_format")
    if body.get("background") not in (None, "auto", "opaque"):
        raise InvalidRequest("'background' may be auto or opaque: this server's models paint no transparency",
                             "background")
    for key in IGNORED_TEXT:  # accepted, unused: the open models have no such settings
        if body.get(key) is not None:
            fields.text(body[key], key, empty=True)
    stream = fields.flag(body, "stream")
    partial_images = fields.number(body, "partial_images", 0, MAX_PARTIAL_IMAGES, integer=True) or 0
    negative = body.get("negative_prompt")
    if negative is not None:
        negative = fields.utf8(fields.text(negative, "negative_prompt", empty=True), "negative_prompt")
    strength = fields.number(body, "strength", 0.0, 1.0) if edit else None
    if not edit and body.get("strength") is not None:
        raise InvalidRequest("'strength' applies to /v1/images/edits only", "strength")
    return ImageRequest(
        model=model, prompt=prompt, n=fields.number(body, "n", 1, MAX_N, integer=True) or 1,
        size=parse_size(body.get("size")), output_format=output_format,
        output_compression=fields.number(body, "output_compression", 0, 100, integer=True), stream=stream,
        partial_images=partial_images, seed=fields.number(body, "seed", 0, MAX_SEED, integer=True),
        negative_prompt=negative or None,
        steps=fields.number(body, "num_inference_steps", 1, 10_000, integer=True),
        guidance_scale=fields.number(body, "guidance_scale", 0.0, 100.0), strength=strength,
        lora=parse_lora(body.get("lora")), edit=edit)


def _response_format(value: Any) -> None:
    if value in (None, "b64_json"):
        return
    if value == "url":
        raise InvalidRequest("'response_format' url is not served: this server keeps no pictures to link to (a "
                             "link anyone holding it could fetch); ask for b64_json, the picture in the answer",
                             "response_format", "unsupported_response_format")
    raise InvalidRequest("'response_format' must be b64_json", "response_format")


def parse_size(value: Any) -> tuple[int, int] | None:
    """`size` as (width, height); None for auto (the model's own size)."""
    if value is None or value == "auto":
        return None
    match = SIZE.fullmatch(value) if isinstance(value, str) else None
    if match is None:
        raise InvalidRequest(f"'size' must be auto or WIDTHxHEIGHT such as 512x512 (got {value!r})", "size",
                             "invalid_size")
    width, height = int(match[1]), int(match[2])
    if width % SIZE_STEP or height % SIZE_STEP or min(width, height) < MIN_SIDE:
        raise InvalidRequest(f"'size' {value}: width and height must be multiples of {SIZE_STEP}, at least "
                             f"{MIN_SIDE}", "size", "invalid_size")
    return width, height


def parse_lora(value: Any) -> list[tuple[str, float | None]]:
    """The `lora` extension: [{"name": adapter, "weight": number (absent: the adapter's configured alpha)}]."""
    if value is None:
        return []
    if not isinstance(value, list) or len(value) > MAX_LORAS:
        raise InvalidRequest(f"'lora' must be a list of at most {MAX_LORAS} {{\"name\", \"weight\"}} objects", "lora")
    found: list[tuple[str, float | None]] = []
    for i, item in enumerate(value):
        where = f"lora[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or set(item) - {"name", "weight"}:
            raise InvalidRequest(f"'{where}' must be an object with a 'name' (an adapter of the model) and an "
                                 "optional 'weight'", where)
        weight = fields.number(item, "weight", -10.0, 10.0)
        if any(name == item["name"] for name, _ in found):
            raise InvalidRequest(f"'{where}': the adapter '{item['name']}' is named twice", where)
        found.append((item["name"], None if weight is None else float(weight)))
    return found


def with_named_adapter(adapter: str, lora: list[tuple[str, float | None]]) -> list[tuple[str, float | None]]:
    """`lora` with the adapter a served name BASE:ADAPTER picks (/v1/models lists each adapter so, as for chat
    models; lookup.named_adapter reads it once the model is found) first, at its configured alpha, unless `lora`
    names it with a weight of its own."""
    if not adapter or any(name == adapter for name, _ in lora):
        return lora
    return [(adapter, None), *lora]


def check_limits(req: ImageRequest, model) -> None:
    """The model's limits (its config: max_images_per_request, max_resolution, max_inference_steps) and adapters."""
    if req.n > model.max_images_per_request:
        raise InvalidRequest(f"'n' is {req.n}; the model '{model.name}' makes at most max_images_per_request="
                             f"{model.max_images_per_request} pictures a request", "n", "too_many_images")
    if req.size and max(req.size) > model.max_resolution:
        raise InvalidRequest(f"'size' {req.size[0]}x{req.size[1]} exceeds the model '{model.name}''s max_resolution="
                             f"{model.max_resolution} (per side)", "size", "invalid_size")
    if req.size:
        check_pixels(req.n, *req.size)
    if req.steps is not None and req.steps > model.max_inference_steps:
        raise InvalidRequest(f"'num_inference_steps' is {req.steps}; the model '{model.name}' runs at most "
                             f"max_inference_steps={model.max_inference_steps}", "num_inference_steps",
                             "too_many_steps")
    adapters = model.adapters
    for i, (name, _) in enumerate(req.lora):
        if name not in adapters:
            have = ", ".join(sorted(adapters)) or "none"
            raise InvalidRequest(f"'lora[{i}]': the model '{model.name}' has no adapter '{name}' (its adapters: "
                                 f"{have})", f"lora[{i}]", "unknown_adapter")


def check_pixels(n: int, width: int, height: int) -> None:
    """A request's pictures together within MAX_IMAGE_REQUEST_PIXELS (one frame each, one answer the front holds); a
    size left to the model (auto) is checked by the worker once it knows it (appliance.worker.engines.image)."""
    problem = image_pixels_problem(n, width, height)
    if problem:
        raise InvalidRequest(f"'n' x 'size': {problem}", "size", "too_many_pixels")


def form_values(form_fields: dict[str, str]) -> dict[str, Any]:
    """An edit's form fields with the types a JSON body would have (`lora` is JSON text)."""
    values: dict[str, Any] = {k: v for k, v in form_fields.items() if v != ""}
    for key in FORM_INTEGERS + FORM_NUMBERS:
        if key in values:
            values[key] = fields.form_number(values[key], key, integer=key in FORM_INTEGERS)
    if "stream" in values:
        flag = FORM_BOOLEANS.get(values["stream"].strip().lower())
        if flag is None:
            raise InvalidRequest("'stream' must be true or false", "stream")
        values["stream"] = flag
    if "lora" in values:
        try:
            values["lora"] = json.loads(values["lora"])
        except ValueError:
            raise InvalidRequest("'lora' must be JSON: [{\"name\": ..., \"weight\": ...}]", "lora") from None
    return values


def picture_size(req: ImageRequest) -> str:
    """The size a stream's events name before the result tells the pictures' own."""
    return f"{req.size[0]}x{req.size[1]}" if req.size else "auto"


def images_response(req: ImageRequest, pictures: list[str], size: str, created: int) -> dict[str, Any]:
    """OpenAI's ImagesResponse."""
    return {"created": created, "data": [{"b64_json": data} for data in pictures], "background": "opaque",
            "output_format": req.output_format, "quality": "auto", "size": size, "usage": USAGE}


def stream_event(req: ImageRequest, event: Event, size: str, partial_index: int) -> list[dict[str, Any]]:
    """The SSE events of one worker event: progress and partial pictures after a step, completed per picture."""
    frame = event.result
    shared = {"created_at": int(time.time()), "size": size, "quality": "auto", "background": "opaque",
              "output_format": req.output_format}
    if event.op == "picture":
        return [{"type": f"{req.event_prefix}.completed", "b64_json": frame["data"], **shared, "usage": USAGE,
                 "image_index": frame["index"]}]
    events = [{"type": "progress", "step": frame["step"], "steps": frame["steps"], "image_index": frame["index"]}]
    if "image" in frame:
        events.append({"type": f"{req.event_prefix}.partial_image", "b64_json": frame["image"], **shared,
                       "partial_image_index": partial_index})
    return events


class ImageRoutes(UploadRoutes):
    def __init__(self, appliance: ServerView):
        self.decoder = ImageDecoder()
        super().__init__(appliance, KIND, self.decoder, "openarc-image-edits-")
        self.serial = itertools.count(1)

    @staticmethod
    def upload_limit(model) -> int:
        return MAX_EDIT_UPLOAD_BYTES

    async def generations(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await fields.json_body(request)
        call.label(body)
        req = parse(body)
        sup = await lookup.model_for(self.appliance, req.model, call, (KIND,))
        req.lora = with_named_adapter(lookup.named_adapter(sup, req.model), req.lora)
        check_limits(req, sup.model)
        frame = {"kind": KIND, "body": req.body(model=sup.model)}
        return await self._run(request, call, sup, req, frame, False)

    async def edits(self, request: web.Request, call: Call) -> web.StreamResponse:
        upload = Upload(self, call)
        paths: list[str] = []
        try:
            form = await read_form(request, upload.before_file, ("image", "image[]", "mask"), max_files=2)
            call.label(form.fields)
            req = parse(form_values(form.fields), edit=True)
            sup = await upload.admit(req.model)
            req.lora = with_named_adapter(lookup.named_adapter(sup, req.model), req.lora)
            check_limits(req, sup.model)
            images = form.files.get("image", []) + form.files.get("image[]", [])
            if len(images) != 1:
                raise InvalidRequest("'image' must be one picture to edit" if images else
                                     "'image' is required: the picture to edit", "image")
            masks = form.files.get("mask", [])
            if len(masks) > 1:
                raise InvalidRequest("'mask' must be one picture", "mask")
            image = await self._decode(images[0], sup.model, "image", paths)
            mask = await self._decode(masks[0], sup.model, "mask", paths) if masks else None
            form.files.clear()  # decoded into spool files: the upload's memory is free for the next
            upload.release_slot()
            check_edit_sizes(req, image, mask, sup.model.max_resolution)
            sup = await upload.follow(req.model)
            frame = {"kind": KIND, "body": req.body(image, mask, sup.model)}
            return await self._run(request, call, sup, req, frame, upload.hand_over())
        finally:
            upload.close()
            for path in paths:
                self.budget.remove(path)

    async def _decode(self, data: bytes, model, name: str, paths: list[str]) -> dict[str, Any]:
        """One uploaded picture into an RGB spool file on the spool budget: {"path", "width", "height"}; a
        400 naming the field for a picture that cannot be used, a 503 for a fault of the decoder's or a spool with
        no room for its pixels now (the decoder reserves the room left as it takes the picture: it stops at the
        header past it)."""
        path = self.spool_file(f"{next(self.serial)}.rgb")
        paths.append(path)
        max_pixels = model.max_resolution ** 2
        try:
            info = await self.decoder.decode(bytes(data), max_pixels, EDIT_FORMATS, path,
                                             lambda: self.budget.reserve(path, rgb_bytes(max_pixels)), mask=name == "mask")
        except ImageError as exc:
            if exc.reason == OVER_BUDGET:
                raise spool_full(f"'{name}': {exc}", self.budget.capacity) from None
            raise InvalidRequest(f"'{name}': {exc}", name, "invalid_image" if name == "image" else "invalid_mask") \
                from None
        except HelperFault as exc:
            raise exc.failure() from None
        file = {"path": path, "width": info["width"], "height": info["height"]}
        self.budget.settle(path, spool_size(file))
        return file

    async def _run(self, request: web.Request, call: Call, sup, req: ImageRequest, frame: dict[str, Any],
                   reserved: bool) -> web.StreamResponse:
        handle = sup.open(frame, op="request", reserved=reserved)
        try:
            if req.stream:
                return await self._stream(request, call, sup, handle, req)
            pictures: list[str] = []
            async for event in sup.events(handle):
                if event.op == "picture":
                    pictures.append(event.result["data"])
                elif event.op == "result":
                    size = f"{event.result['width']}x{event.result['height']}"
                    return web.json_response(images_response(req, pictures, size, int(time.time())))
        finally:
            sup.close(handle)  # a caller gone mid-generation: the worker is told to stop at its next step
        raise AssertionError("event stream ended without a result")

    async def _stream(self, request: web.Request, call: Call, sup, handle, req: ImageRequest) -> web.StreamResponse:
        events = sup.events(handle)
        event = await sse.next_event(events)
        sse.refused_before_start(event)
        stream = await sse.EventStream(request).open()
        size, partials = picture_size(req), 0
        while isinstance(event, Event) and event.op in ("step", "picture"):
            for payload in stream_event(req, event, size, partials):
                partials += payload["type"].endswith("partial_image")
                await stream.send(payload, event=payload["type"])
            event = await sse.next_event(events)
        if isinstance(event, RequestFailed):
            return await call.end_stream(stream, event)
        return await stream.close()


def check_edit_sizes(req: ImageRequest, image: dict[str, Any], mask: dict[str, Any] | None,
                     max_resolution: int) -> None:
    """An edit's picture keeps its size: its sides must suit the VAE and the model's max_resolution, a size asked for
    must be the picture's, and a mask must cover the picture exactly."""
    width, height = image["width"], image["height"]
    if width % SIZE_STEP or height % SIZE_STEP or min(width, height) < MIN_SIDE or max(width, height) > max_resolution:
        raise InvalidRequest(f"'image' is {width}x{height}; its sides must be multiples of {SIZE_STEP} from "
                             f"{MIN_SIDE} to the model's max_resolution={max_resolution}", "image", "invalid_image")
    if req.size and req.size != (width, height):
        raise InvalidRequest(f"'size' {req.size[0]}x{req.size[1]} differs from the image's {width}x{height}; an "
                             "edit keeps the picture's size (send size auto)", "size", "invalid_size")
    check_pixels(req.n, width, height)
    if mask and (mask["width"], mask["height"]) != (width, height):
        raise InvalidRequest(f"'mask' is {mask['width']}x{mask['height']}; it must be the image's size "
                             f"{width}x{height}", "mask", "invalid_mask")
