"""Images in chat completions: `image_url` content parts, from the request to pixel files a VLM worker reads.

Parsing (no I/O, while the body is validated): a message's content parts become its text, with genai's universal
image tag `<ov_genai_image_N>` where each image was (genai turns it into the model's own tag), and an ImagePart
per image naming where it was (`messages[i].content[j]`), so every error about it names that part.

Resolving (once the model is known, ImageResolver): a text model refuses images; a data URL is decoded from base64
(`data:image/png|jpeg|webp|gif;base64,...`); an http(s) URL is fetched only if server.image_fetch allows its host
(off by default: a server that fetches any URL for anyone is an SSRF hole); each image is held to the model's
max_image_bytes, then decoded and checked in the image decoder process (appliance.front.image_decoder:
format allow-list, max_image_pixels, a complete file), which writes its RGB pixels to a spool file for the worker.
Every failure of the image is a 400 naming the part, counted in openarc_image_rejections_total by reason; a fault
of the server's (its decoder hung or cannot write, its spool full) is a 503 with Retry-After. The route reserves the
request's queue place before resolving (appliance.front.api.results.QueuePlace), and at most
MAX_IMAGE_REQUESTS_IN_FLIGHT requests resolve at once; their pixels are bounded per request (MAX_REQUEST_SPOOL_BYTES)
and by the server's one spool budget, shared with image edits and audio (appliance.front.spool_budget), from each
image's header, before it is decoded.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import itertools
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import utf8
from appliance.front.helper_process import HelperFault
from appliance.front.image_decoder import OVER_BUDGET, ImageDecoder, ImageError, rgb_bytes
from appliance.front.request_ledger import LEDGER
from appliance.front.spool_budget import SpoolBudget, spool_full
from appliance.config.systemd_env import systemd_directory

IMAGE_TAG = "<ov_genai_image_{}>"
# Tags genai reads in a prompt: text that holds one would make genai place (or miss) images the caller did not send.
RESERVED_TAGS = ("<ov_genai_image_", "<ov_genai_video_")
MAX_IMAGES = 8  # per request: each is decoded, encoded by the vision model and held as pixels until it ends
MAX_IMAGE_REQUESTS_IN_FLIGHT = 4  # requests fetching and decoding images at once; the others wait, holding a place
# Spool bytes (RGB pixels, 3 bytes a pixel) the images of one request may hold: past it, a 400 naming the image. All
# requests in flight share the server's SpoolBudget: an image it has no room for now is a 503 with Retry-After.
MAX_REQUEST_SPOOL_BYTES = 256 << 20
IMAGE_SPOOL_FULL = "image_spool_full"  # this route's code for the budget's 503 (the edit and audio routes': spool_full)
SPOOL_PREFIX = "openarc-images-"  # + the front's pid: its spool directory
DATA_URL = re.compile(r"data:(?P<mime>[^;,]*)(?P<params>(;[^;,]*)*),(?P<data>.*)", re.DOTALL)
MIME_FORMATS = {"image/png": "png", "image/jpeg": "jpeg", "image/jpg": "jpeg", "image/webp": "webp",
                "image/gif": "gif"}


class ImageRejected(InvalidRequest):
    """A bad image: a 400 naming its part, and the reason it is counted under."""

    def __init__(self, message: str, where: str, reason: str):
        super().__init__(f"{where}: {message}", where, "image_fetch_disabled" if reason == "fetch_disabled"
                         else "invalid_image")
        self.reason = reason


@dataclass
class ImagePart:
    where: str  # messages[i].content[j]
    url: str


@dataclass
class Content:
    """What the parts of a request's messages add up to: its images, in order, and where text held a tag."""
    images: list[ImagePart] = field(default_factory=list)
    tag_in_text: str | None = None  # where a text part holds one of RESERVED_TAGS


def content_text(content: Any, where: str, found: Content) -> str:
    """A message's content as text, image parts replaced by their tags (appended to `found.images`)."""
    if isinstance(content, str):
        return _text(content, where, found)
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of content parts", where)
    parts = []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            parts.append(_text(part["text"], at, found))
        elif kind == "image_url":
            parts.append(IMAGE_TAG.format(len(found.images)))
            found.images.append(ImagePart(at, _image_url(part, at)))
        else:
            raise InvalidRequest(f"{at}: a content part must be {{\"type\": \"text\", \"text\": ...}} or "
                                 f"{{\"type\": \"image_url\", \"image_url\": {{\"url\": ...}}}}", at)
    if len(found.images) > MAX_IMAGES:
        raise InvalidRequest(f"{where}: at most {MAX_IMAGES} images per request", where, "too_many_images")
    return "".join(parts)


def _text(text: str, where: str, found: Content) -> str:
    text = utf8(text, where)
    if found.tag_in_text is None and any(tag in text for tag in RESERVED_TAGS):
        found.tag_in_text = where
    return text


def _image_url(part: dict, where: str) -> str:
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url  # some clients send the URL bare
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.image_url.url must be a data: or http(s) URL", f"{where}.image_url.url")
    detail = image_url.get("detail") if isinstance(image_url, dict) else None
    if detail not in (None, "auto", "low", "high"):  # accepted; the model's own preprocessing decides the size
        raise InvalidRequest(f"{where}.image_url.detail must be auto, low or high", f"{where}.image_url.detail")
    return url


class ImageResolver:
    """Turns a request's ImageParts into pixel files for its model's worker (see the module doc)."""

    def __init__(self, fetch, metrics, budget: SpoolBudget, spool_base: str | None = None):
        self.fetch = fetch  # config.ImageFetch
        self.metrics = metrics
        self.budget = budget  # the server's one spool budget (ServerView.spool_budget)
        self.decoder = ImageDecoder()
        self.spool_base = spool_base  # the directory the spool directory is made in (None: the system's tmp)
        self.spool: str | None = None
        self.serial = itertools.count()
        self.session = None  # aiohttp.ClientSession, made on the first fetch
        self.in_flight = asyncio.Semaphore(MAX_IMAGE_REQUESTS_IN_FLIGHT)
        self.max_request_bytes = MAX_REQUEST_SPOOL_BYTES

    async def resolve(self, found: Content, model) -> list[dict[str, Any]]:
        """The images of a request to `model` (a config.ModelConfig) as {"path", "width", "height"}, in order;
        ImageRejected (or InvalidRequest) for the first that cannot be used, RequestFailed 503 for a fault of the
        server's (its decoder, its full spool). At most MAX_IMAGE_REQUESTS_IN_FLIGHT requests fetch and decode at
        once; the others wait. The caller removes the files (release()) when the request is over."""
        if not found.images:
            return []
        if model.kind != "vlm":
            raise InvalidRequest(f"{found.images[0].where}: the model '{model.name}' is of kind {model.kind} and "
                                 f"does not take images (a vision model is kind vlm)", found.images[0].where,
                                 "model_not_vision")
        if found.tag_in_text:
            raise InvalidRequest(f"{found.tag_in_text}: text may not hold the image tags "
                                 f"{' or '.join(RESERVED_TAGS)}", found.tag_in_text)
        files: list[dict[str, Any]] = []
        try:
            async with self.in_flight:
                for part in found.images:
                    files.append(await self._resolve_one(part, model, sum(map(spool_size, files))))
        except BaseException:
            self.release(files)
            raise
        self.metrics.images.labels(model=model.name).inc(len(files))
        return files

    async def _resolve_one(self, part: ImagePart, model, held: int) -> dict[str, Any]:
        """One image into a spool file; `held`: the spool bytes of the request's images before it."""
        try:
            data = await self._bytes(part, model)
            request_left, server_left = self.max_request_bytes - held, 0
            path = os.path.join(self._spool(), f"{next(self.serial)}.rgb")
            LEDGER.spooled(path)
            kept = False

            def reserve() -> int:  # (as the decoder takes the image: the room then, reserved)
                nonlocal server_left
                server_left = self.budget.room()
                return self.budget.reserve(path, min(request_left, rgb_bytes(model.max_image_pixels)))
            try:
                info = await self.decoder.decode(data, model.max_image_pixels, model.image_formats, path, reserve)
                file = {"path": path, "width": info["width"], "height": info["height"]}
                self.budget.settle(path, spool_size(file))
                kept = True
            except ImageError as exc:
                if exc.reason == OVER_BUDGET and request_left > server_left:
                    raise spool_full(str(exc), self.budget.capacity, IMAGE_SPOOL_FULL) from None
                if exc.reason == OVER_BUDGET:
                    raise ImageRejected(f"{exc}; the images of one request may take {self.max_request_bytes} bytes "
                                        "of pixels together", part.where, "too_large") from None
                raise ImageRejected(str(exc), part.where, exc.reason) from None
            except HelperFault as exc:  # the server's fault, not the image's: a 503, not counted as a rejection
                raise exc.failure() from None
            finally:
                if not kept:  # refused, failed, or its client hung up mid-decode: no file stays behind
                    self.budget.remove(path)
        except ImageRejected as exc:
            self.metrics.image_rejections.labels(model=model.name, reason=exc.reason).inc()
            raise
        return file

    async def _bytes(self, part: ImagePart, model) -> bytes:
        scheme = part.url.split(":", 1)[0].lower()
        if scheme == "data":
            return _data_url(part, model)
        if scheme in ("http", "https"):
            return await self._fetch(part, model)
        raise ImageRejected("the image URL must be a data: URL (or http(s), where the server allows it)",
                            part.where, "bad_url")

    async def _fetch(self, part: ImagePart, model) -> bytes:
        if not self.fetch.enabled:
            raise ImageRejected("remote image URLs are off on this server (server.image_fetch.enabled); send the "
                                "image as a data: URL", part.where, "fetch_disabled")
        host = urlsplit(part.url)
        try:
            port = host.port
        except ValueError:
            raise ImageRejected("the image URL is malformed", part.where, "bad_url") from None
        allow_hosts = {name.lower() for name in self.fetch.allow_hosts}  # host names have no case (urlsplit lowers)
        allowed = host.hostname and (host.hostname in allow_hosts or f"{host.hostname}:{port}" in allow_hosts)
        if not allowed:
            raise ImageRejected(f"the host {host.hostname!r} is not in server.image_fetch.allow_hosts", part.where,
                                "host_not_allowed")
        limit = min(self.fetch.max_bytes, model.max_image_bytes)
        import aiohttp
        if self.session is None:
            self.session = aiohttp.ClientSession()
        try:
            # No redirects: one could lead to a host the allow-list does not name.
            async with self.session.get(part.url, allow_redirects=False,
                                        timeout=aiohttp.ClientTimeout(total=self.fetch.timeout_s)) as response:
                if response.status != 200:
                    raise ImageRejected(f"fetching the image answered HTTP {response.status}", part.where,
                                        "fetch_failed")
                data = bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):  # read(n) returns what has arrived
                    data += chunk
                    if len(data) > limit:
                        break
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
            raise ImageRejected(f"fetching the image failed: {type(exc).__name__} {exc}".strip(), part.where,
                                "fetch_failed") from None
        if len(data) > limit:
            raise ImageRejected(f"the image is larger than {limit} bytes", part.where, "too_large")
        return bytes(data)

    def _spool(self) -> str:
        """The spool directory, made on the first image; one that cannot be made (a base directory missing, read
        only or full) is the server's fault, a 503 as the decoder's own are (it was a 500)."""
        if self.spool is None:
            base = self.spool_base or tempfile.gettempdir()
            try:
                sweep_stale_spools(base)
                self.spool = tempfile.mkdtemp(prefix=f"{SPOOL_PREFIX}{os.getpid()}-", dir=base)
            except OSError as exc:
                raise HelperFault(self.decoder.what, f"cannot make the image spool in {base}: {exc}").failure() \
                    from None
        return self.spool

    def release(self, files: list[dict[str, Any]]) -> None:
        """Remove a request's spool files (its worker has read them) and give their bytes back (once: a file
        released twice gives nothing the second time)."""
        for file in files:
            self.budget.remove(file["path"])

    async def close(self) -> None:
        await self.decoder.close()
        if self.session is not None:
            await self.session.close()
        if self.spool:
            shutil.rmtree(self.spool, ignore_errors=True)


def _data_url(part: ImagePart, model) -> bytes:
    match = DATA_URL.fullmatch(part.url)
    if not match or ";base64" not in match["params"].lower():
        raise ImageRejected("the image must be a base64 data URL (data:image/png;base64,...)", part.where, "bad_url")
    mime = match["mime"].lower()
    if MIME_FORMATS.get(mime) not in model.image_formats:
        raise ImageRejected(f"unsupported image type {mime or '(none)'!r}; this model takes "
                            f"{', '.join('image/' + f for f in model.image_formats)}", part.where,
                            "unsupported_format")
    encoded = match["data"]
    if len(encoded) * 3 // 4 > model.max_image_bytes + 3:  # before decoding: the base64 text is 4/3 of the bytes
        raise ImageRejected(f"the image is larger than max_image_bytes={model.max_image_bytes}", part.where,
                            "too_large")
    try:
        data = base64.b64decode("".join(encoded.split()), validate=True)
    except (binascii.Error, ValueError):
        raise ImageRejected("the data URL is not valid base64", part.where, "bad_base64") from None
    if len(data) > model.max_image_bytes:
        raise ImageRejected(f"the image is larger than max_image_bytes={model.max_image_bytes}", part.where,
                            "too_large")
    if not data:
        raise ImageRejected("the image is empty", part.where, "undecodable")
    return data


def spool_size(file: dict[str, Any]) -> int:
    """The bytes of a decoded image's spool file: its RGB pixels."""
    return rgb_bytes(file["width"] * file["height"])


def sweep_stale_spools(base: str) -> None:
    """Remove the spool directories of fronts that are gone (killed before their cleanup): unlike the private /tmp,
    the cache directory outlives a process. Another instance's (openarc@NAME shares the directory) is left alone
    while its front lives."""
    for name in os.listdir(base):
        pid = name[len(SPOOL_PREFIX):].split("-", 1)[0]
        if name.startswith(SPOOL_PREFIX) and pid.isascii() and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def spool_base() -> str | None:
    """Where the image spool directory goes: the unit's cache directory (systemd's CacheDirectory=, on disk; the
    private /tmp is often RAM), else its state directory, else None (the system's temporary directory)."""
    return systemd_directory("CACHE_DIRECTORY", "STATE_DIRECTORY")


def body_limit(config) -> int:
    """The largest chat request body the server reads: its max_body_bytes, plus room for MAX_IMAGES base64 images
    of the largest max_image_bytes where a vision model is configured."""
    largest = max((m.max_image_bytes for m in config.models if m.kind == "vlm"), default=None)
    extra = 0 if largest is None else MAX_IMAGES * (largest * 4 // 3 + 64)  # + a data URL's head
    return config.server.max_body_bytes + extra
