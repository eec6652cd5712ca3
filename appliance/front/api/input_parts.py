"""The content parts of a Responses input item as chat completions' parts, so that images go through the one image
path chat completions has (appliance.front.api.images: the model-kind check, the fetch policy, the decoder process)
and files become text.

- `input_text`, `output_text`, `text`: a text part; `refusal` (an assistant's, replayed): its text.
- `input_image`: an `image_url` part (a data: URL, or an http(s) URL fetched only where server.image_fetch allows
  its host). A `file_id` is refused: this server has no Files API to look it up in.
- `input_file`: a text file as text, headed by its name. Taken: `file_data` (base64, bare or as a data: URL) or a
  data: URL in `file_url`, whose bytes are UTF-8 text. Refused with a 400 naming the part: a `file_id` (no Files
  API), an http(s) `file_url` (a file is not fetched: the image fetch policy is for images, and a remote document
  would need the same SSRF care), and anything that is not UTF-8 text (PDFs, office documents, archives: reading
  them needs a document parser this server does not run; chat models read text).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import text
from appliance.front.api.images import DATA_URL

TEXT_PARTS = ("input_text", "output_text", "text")
IMAGE_DETAILS = (None, "auto", "low", "high")
NO_FILES_API = "this server has no Files API"


def chat_parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """A message's (or tool output's) content as chat completions' content: the string itself, or its parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of content parts", where)
    return [_part(part, f"{where}[{j}]") for j, part in enumerate(content)]


def _part(part: Any, where: str) -> dict[str, Any]:
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in TEXT_PARTS:
        return {"type": "text", "text": text(part.get("text"), f"{where}.text", empty=True)}
    if kind == "refusal":
        return {"type": "text", "text": text(part.get("refusal"), f"{where}.refusal", empty=True)}
    if kind == "input_image":
        return _image(part, where)
    if kind == "input_file":
        return {"type": "text", "text": _file(part, where)}
    raise InvalidRequest(f"'{where}': a content part must be input_text, input_image or input_file "
                         f"(output_text or refusal in an assistant's message), got {kind!r}", where)


def _image(part: dict, where: str) -> dict[str, Any]:
    if part.get("file_id") is not None:
        raise InvalidRequest(f"'{where}.file_id': {NO_FILES_API}; send the image in image_url, as a data: URL or "
                             "an http(s) URL", f"{where}.file_id", "unsupported_file_id")
    url = part.get("image_url")
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"'{where}.image_url' must be a data: or http(s) URL", f"{where}.image_url")
    if part.get("detail") not in IMAGE_DETAILS:  # accepted; the model's own preprocessing decides the size
        raise InvalidRequest(f"'{where}.detail' must be auto, low or high", f"{where}.detail")
    return {"type": "image_url", "image_url": {"url": url}}


def _file(part: dict, where: str) -> str:
    """An input_file's text, headed by its name."""
    if part.get("file_id") is not None:
        raise InvalidRequest(f"'{where}.file_id': {NO_FILES_API}; send the file's content in file_data (base64)",
                             f"{where}.file_id", "unsupported_file_id")
    data, field = part.get("file_data"), "file_data"
    if data is None and part.get("file_url") is not None:
        data, field = part["file_url"], "file_url"
        if not isinstance(data, str) or not data.startswith("data:"):
            raise InvalidRequest(f"'{where}.file_url': files are not fetched from URLs here; send the file's "
                                 "content in file_data (base64) or as a data: URL", f"{where}.file_url",
                                 "unsupported_file")
    if not isinstance(data, str):  # "" is an empty file
        raise InvalidRequest(f"'{where}' needs file_data: the file's content in base64", f"{where}.file_data")
    name = part.get("filename")
    name = text(name, f"{where}.filename") if name is not None else "file"
    body = _utf8_text(_decoded(data, f"{where}.{field}"), f"{where}.{field}")
    return f"[file: {name}]\n{body}"


def _decoded(data: str, where: str) -> bytes:
    """The bytes of base64 data, bare or in a data: URL."""
    if data.startswith("data:"):
        match = DATA_URL.fullmatch(data)
        if match is None or ";base64" not in match["params"]:
            raise InvalidRequest(f"'{where}' must be a base64 data: URL (data:<type>;base64,...)", where)
        data = match["data"]
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"'{where}' is not valid base64", where) from None


def _utf8_text(data: bytes, where: str) -> str:
    try:
        decoded = data.decode("utf-8")
    except UnicodeDecodeError:
        decoded = None
    if decoded is None or "\x00" in decoded:
        raise InvalidRequest(f"'{where}': only text files (UTF-8) are taken; PDFs, office documents and other "
                             "binary files need a document parser this server does not run: send their text "
                             "instead", where, "unsupported_file")
    return decoded
