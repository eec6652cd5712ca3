"""Decoding the images of chat requests (png, jpeg, webp, gif) to RGB pixels, in a process of its own.

Images are untrusted files and their decoders (Pillow's, over libpng, libjpeg, libwebp) are C code: a malformed
file must never crash the front (every model) or a VLM worker (every request it is serving).  So, as uploaded audio
(appliance.front.audio_decoder), they are decoded in a long-lived helper process (`python -m
appliance.front.image_decoder`) the front talks to over pipes (appliance.front.helper_process): a crash costs the
request whose image it was a 400, and the process is started again.

What is checked, in this order: the format, from the file's first bytes (not the client's MIME type), against the
model's allow-list; the pixel count from the header, before anything is decoded (a decompression bomb is a small
file that declares a huge image); then the whole image is decoded (a truncated or corrupt file fails here), the
first frame of an animation taken, and composited onto white if it has transparency.  The pixels go to the `out`
file as height x width x 3 bytes, which the worker reads without parsing anything. A fault of ours (the pixels
cannot be written, the decoder hangs past DECODE_TIMEOUT_S) is a HelperFault: a 503 the client may retry.

Protocol: request {"max_pixels": n, "formats": [...], "out": path, "max_bytes": b or null, "mask": bool (an inpainting
mask of /v1/images/edits: white where to paint)} and the file's bytes;
reply {"width", "height", "format"} or {"error": reason, "message": ...}, reason being one of REASONS, OVER_BUDGET
or "write_failed".
"""

from __future__ import annotations

import io
import os
import sys
import warnings
from typing import Callable

from appliance.front.helper_process import HelperFailed, HelperProcess, write_failed
from appliance.ipc import serve_requests

DECODE_TIMEOUT_S = 30.0
# (magic bytes at offset, offset, format as config and Pillow name it)
FORMATS = (
    (b"\x89PNG\r\n\x1a\n", 0, "png", "PNG"),
    (b"\xff\xd8\xff", 0, "jpeg", "JPEG"),
    (b"GIF87a", 0, "gif", "GIF"),
    (b"GIF89a", 0, "gif", "GIF"),
    (b"WEBP", 8, "webp", "WEBP"),
)
REASONS = ("unsupported_format", "too_many_pixels", "undecodable")
OVER_BUDGET = "over_budget"  # the pixels would exceed the spool bytes the front allowed (its reply, not a REASON)


class ImageError(Exception):
    """An image that cannot go to the model: `reason` is one of REASONS (the rejection metric's label)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def sniff_format(data: bytes) -> tuple[str, str] | None:
    """(config name, Pillow name) of the format the bytes start with, or None."""
    for magic, offset, name, pil_name in FORMATS:
        if data[offset:offset + len(magic)] == magic and (name != "webp" or data[:4] == b"RIFF"):
            return name, pil_name
    return None


def decode(data: bytes, max_pixels: int, formats: list[str], max_bytes: int | None = None, mask: bool = False):
    """The image as an RGB PIL image, checked as the module doc says; ImageError otherwise (OVER_BUDGET when its
    pixels would take more than `max_bytes` of spool, read from the header as the pixel count is). `mask`: an
    inpainting mask, read as _mask says."""
    from PIL import Image

    sniffed = sniff_format(data)
    if sniffed is None or sniffed[0] not in formats:
        found = f"a {sniffed[0]} file" if sniffed else "not a png, jpeg, webp or gif file"
        raise ImageError("unsupported_format", f"unsupported image format ({found}); this model takes "
                                               f"{', '.join(formats)}")
    name, pil_name = sniffed
    guard = Image.MAX_IMAGE_PIXELS  # Pillow's process-wide guard, set per image below and given back after
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            Image.MAX_IMAGE_PIXELS = None  # open() reads the header only: the check just below names the limit
            image = Image.open(io.BytesIO(data), formats=[pil_name])
            width, height = image.size
            if width * height > max_pixels:
                raise ImageError("too_many_pixels", f"the image is {width}x{height} = {width * height} pixels; this "
                                                    f"model takes at most max_image_pixels={max_pixels}")
            if max_bytes is not None and rgb_bytes(width * height) > max_bytes:
                raise ImageError(OVER_BUDGET, f"the image is {width}x{height}: {rgb_bytes(width * height)} bytes of "
                                              "pixels")
            # Pillow's own guard from here on (an error, not a warning, past the limit): a later frame's size
            Image.MAX_IMAGE_PIXELS = max_pixels
            image.seek(0)  # an animation's first frame
            image.load()
            return _mask(image) if mask else _rgb(image)
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError("too_many_pixels", f"the image decodes to too many pixels: {exc}") from None
    except Exception as exc:  # OSError (truncated, corrupt), SyntaxError (bad header), ValueError, EOFError, ...
        raise ImageError("undecodable", f"the {name} image could not be decoded: {exc}") from None
    finally:
        Image.MAX_IMAGE_PIXELS = guard


def _rgb(image):
    """RGB pixels; transparency composited onto white (a transparent PNG's hidden colour is noise)."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def _mask(image):
    """An inpainting mask as genai reads one (white: paint here, black: keep): OpenAI's masks mark the area to
    edit as fully transparent, so a mask with transparency is white where alpha is 0; one without is read by its
    brightness (the diffusers convention, white is painted)."""
    from PIL import Image

    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        alpha = image.convert("RGBA").getchannel("A")
        return alpha.point(lambda a: 255 if a == 0 else 0).convert("RGB")
    return image.convert("L").convert("RGB")


def _handle(request: dict, data: bytes) -> dict:
    try:
        image = decode(data, request["max_pixels"], request["formats"], request.get("max_bytes"),
                       request.get("mask", False))
        with open(request["out"], "wb") as out:
            out.write(image.tobytes())
        return {"width": image.width, "height": image.height, "format": sniff_format(data)[0]}
    except ImageError as exc:
        return {"error": exc.reason, "message": str(exc)}
    except OSError as exc:  # ENOSPC, EDQUOT, EIO writing the pixels: the server's trouble, not the image's
        return write_failed(request["out"], "image", exc)


def rgb_bytes(pixels: int) -> int:
    """The bytes of that many pixels in a spool file: RGB, a byte each (a mask's too)."""
    return pixels * 3


class ImageDecoder(HelperProcess):
    """The front's handle on the image decoder process."""

    def __init__(self):
        super().__init__("appliance.front.image_decoder", DECODE_TIMEOUT_S, "image decoder")

    async def decode(self, data: bytes, max_pixels: int, formats: list[str], out_path: str,
                     max_bytes: Callable[[], int] | None = None, mask: bool = False) -> dict:
        """Decode `data` into `out_path`: {"width", "height", "format"}; ImageError for an image that cannot be
        used (one that crashed a fresh decoder included), HelperFault for a fault of ours (a hung decoder, a full
        spool disk). `max_bytes`: called when the decoder takes the image (the caller reserves them then), the
        spool bytes its pixels may take (OVER_BUDGET past them). `mask`: an inpainting mask (_mask)."""
        try:
            reply = await self.answer({"max_pixels": max_pixels, "formats": formats, "out": out_path, "mask": mask},
                                      data, max_bytes and (lambda: {"max_bytes": max_bytes()}))
        except HelperFailed as exc:
            raise ImageError("undecodable", f"the image could not be decoded (the decoder {exc.how} on it)") from None
        if "error" in reply:
            raise ImageError(reply["error"], reply["message"])
        return reply


def main() -> None:
    os.nice(5)  # decoding yields to the model workers on a busy box
    serve_requests(sys.stdin.buffer, sys.stdout.buffer, _handle)


if __name__ == "__main__":
    main()
