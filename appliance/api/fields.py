"""Checks of single request fields, shared by every route family's validation: each raises InvalidRequest
(-> HTTP 400) naming the parameter."""

from __future__ import annotations

from typing import Any

from appliance.api.errors import InvalidRequest


def number(body: dict, key: str, low: float, high: float, integer: bool = False) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not low <= value <= high:
        raise InvalidRequest(f"'{key}' must be between {low:g} and {high:g}, got {value!r}", key)
    return value


def flag(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise InvalidRequest(f"'{key}' must be true or false", key)
    return value


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


def json_object(value: Any, where: str) -> dict:
    """A JSON object whose strings are valid Unicode throughout (it is serialised for the worker and genai)."""
    if not isinstance(value, dict):
        raise InvalidRequest(f"'{where}' must be a JSON object", where)
    _check_strings(value, where)
    return value


def _check_strings(value: Any, where: str) -> None:
    if isinstance(value, str):
        utf8(value, where)
    elif isinstance(value, dict):
        for key, item in value.items():
            utf8(key, where)
            _check_strings(item, where)
    elif isinstance(value, list):
        for item in value:
            _check_strings(item, where)
