"""Checks of a request's JSON body and its single fields, shared by every route family's validation: each
raises InvalidRequest (-> HTTP 400) naming the parameter."""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from appliance.front.api.errors import InvalidRequest


async def json_body(request: web.Request) -> Any:
    try:
        text = await request.text()
    except (ValueError, LookupError):  # not in its charset, or an unknown charset
        raise InvalidRequest("the request body is not valid JSON") from None
    return parse_json(text)


def parse_json(text: str | bytes) -> Any:
    """A request body's JSON (bytes: UTF-8, -16 or -32, as JSON allows)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # bad JSON, too deep, too long a number
        raise InvalidRequest("the request body is not valid JSON") from None


def model_name(body: Any) -> str:
    """The body's `model`, checking first that the body is a JSON object."""
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", "model")
    return model


# The largest answer limit a request may name (max_tokens and its kin): any whole number a client sends, since the
# worker fits it to what the window leaves (appliance.config.window.answer_limit); only what no integer field holds
# is refused.
MAX_ANSWER_LIMIT = (1 << 63) - 1


def number(body: dict, key: str, low: float, high: float, integer: bool = False) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not low <= value <= high:
        raise InvalidRequest(f"'{key}' must be between {_bound(low)} and {_bound(high)}, got {value!r}", key)
    return value


# A number in a multipart form field, written as JSON writes one, in ASCII: int() and float() also read "\uff11",
# "\u0663", " 5 ", "1_000", "nan" and "infinity", none of which a client means as a form's number (a JSON body's
# parser reads none of them either).
FORM_INTEGER = re.compile(r"-?[0-9]+")
FORM_NUMBER = re.compile(r"-?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def form_number(text: str, key: str, integer: bool = False) -> int | float:
    """A form field's text as the number a JSON body would hold in its place; a 400 naming `key` for any other."""
    try:
        if (FORM_INTEGER if integer else FORM_NUMBER).fullmatch(text):
            return int(text) if integer else float(text)
    except ValueError:  # past int()'s 4,300 digits
        pass
    raise InvalidRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {text[:40]!r}", key)


def _bound(limit: float) -> str:
    """A bound as a client reads it: an integer whole (1048576, never %g's 1.04858e+06), a fraction as written."""
    return str(int(limit)) if float(limit).is_integer() else f"{limit:g}"


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be true or false", key)
    return value


def required_text(body: dict, key: str, max_chars: int, what: str) -> str:
    """The body's `key`: a non-empty string (`what` it is, for the error) of valid UTF-8, at most `max_chars`
    characters (a 400 `string_above_max_length` past them)."""
    text = body.get(key)
    if not isinstance(text, str) or not text.strip():
        raise InvalidRequest(f"'{key}' must be a non-empty string: {what}", key)
    utf8(text, key)
    if len(text) > max_chars:
        raise InvalidRequest(f"'{key}' is {len(text)} characters; the limit is {max_chars}", key,
                             "string_above_max_length")
    return text


def utf8(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{where}' holds an unpaired UTF-16 surrogate (not valid Unicode text)", where) from None
    return text


def text(value: Any, where: str, empty: bool = False) -> str:
    """A string field that must be valid Unicode (and non-empty unless `empty`)."""
    if not isinstance(value, str) or (not empty and not value):
        raise InvalidRequest(f"'{where}' must be a {'' if empty else 'non-empty '}string", where)
    return utf8(value, where)


def text_parts(content: Any, where: str, kinds: tuple[str, ...], separator: str = "") -> str:
    """Message content as the dialects write it: a string, or a list of text parts ({"type": one of `kinds`,
    "text": ...}) joined with `separator`."""
    if isinstance(content, str):
        return text(content, where, empty=True)
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}' must be a string or a list of {' or '.join(kinds)} parts", where)
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in kinds:
            raise InvalidRequest(f"'{where}[{j}]': only text parts ({', '.join(kinds)}) are supported",
                                 f"{where}[{j}]")
        parts.append(text(part.get("text"), f"{where}[{j}].text", empty=True))
    return separator.join(parts)


MAX_JSON_DEPTH = 32  # schemas nest far less; genai's schema compile time grows steeply with depth (8 s at 300)


def json_object(value: Any, where: str) -> dict:
    """A JSON object, at most MAX_JSON_DEPTH deep, whose strings are valid Unicode throughout (it is serialised for
    the worker and compiled by genai)."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{where}' must be a JSON object", where)
    pending = [(value, 1)]  # iterative: a deep value must not exhaust Python's recursion limit here
    while pending:
        item, depth = pending.pop()
        if depth > MAX_JSON_DEPTH:
            raise InvalidRequest(f"'{where}' nests deeper than {MAX_JSON_DEPTH} levels", where)
        if isinstance(item, str):
            utf8(item, where)
        elif isinstance(item, dict):
            for key in item:
                utf8(key, where)
            pending += [(child, depth + 1) for child in item.values()]
        elif isinstance(item, list):
            pending += [(child, depth + 1) for child in item]
    return value
