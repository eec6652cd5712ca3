"""The generic half of config validation: a mapping checked against a dataclass's type hints, and built.

Every error names the key path and what was expected, in one line, so `openarc check-config` and a failing unit
start say exactly what to fix; the validator goes on past an error, so one run names every mistake (one line each).
A key added to a dataclass gets all of this (type checks, "did you mean", every error at once) without code of its
own. It knows no dataclass of its own: appliance.config builds its dataclasses with `build`, and
appliance.config.rules checks what types cannot say.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from typing import Any, Literal

class ConfigError(ValueError):
    """An invalid config; str() is what the user is shown: one line per problem, each naming file and key."""

    @property
    def lines(self) -> list[str]:
        return str(self).splitlines()


class Problems(list):
    """The problems of one config as they are found, "key.path: what was expected" each. Given to the validator, it
    collects them all; where none is given, the first problem raises (a value inside a union, tried option by
    option)."""


def _report(problems: Problems | None, error: ConfigError) -> None:
    if problems is None:
        raise error
    problems.append(str(error))


_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", dict: "a mapping"}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else _describe(a) for a in typing.get_args(tp))
    if origin is list:
        return "a list"
    if origin is dict:
        return "a mapping"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(value: Any, tp: Any, where: str, problems: Problems | None = None) -> Any:
    """Check value against a type hint and build dataclasses; raise ConfigError naming `where`. With `problems`,
    what is wrong inside a list or a dataclass is collected there and the rest is still checked (an item that cannot
    be built becomes None; its config is rejected anyway)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        sections = [o for o in typing.get_args(tp) if dataclasses.is_dataclass(o) or typing.get_origin(o) is dict]
        if isinstance(value, dict) and len(sections) == 1:  # a section (draft_model, voices): its errors name the key
            return _convert(value, sections[0], where, problems)
        for option in typing.get_args(tp):
            try:
                return _convert(value, option, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: expected {_describe(tp)}, got {value!r}")
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        if value in typing.get_args(tp):
            return value
        # YAML 1.1 (PyYAML) reads an unquoted `off` or `on` as a boolean: a choice spelled so means the word
        word = {False: "off", True: "on"}.get(value) if isinstance(value, bool) else None
        if word in typing.get_args(tp):
            return word
    elif origin is list:
        if isinstance(value, list):
            (item_tp,) = typing.get_args(tp)
            items = (checked(item, item_tp, f"{where}[{i}]", problems) for i, item in enumerate(value))
            return [None if item is INVALID else item for item in items]
    elif origin is dict:
        if isinstance(value, dict):
            value_tp = typing.get_args(tp)[1]
            if value_tp is Any:
                return {str(k): v for k, v in value.items()}
            items = {str(k): checked(v, value_tp, _join(where, key_name(k)), problems) for k, v in value.items()}
            return {k: v for k, v in items.items() if v is not INVALID}
    elif dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            return build(tp, value, where, problems)
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{where}: expected a number, got an integer too large for one") from None
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(value, tp):
        return value
    raise ConfigError(f"{where}: expected {_describe(tp)}, got {value!r}")


INVALID = object()  # what checked() returns for a value whose problem it reported


def checked(value: Any, tp: Any, where: str, problems: Problems | None) -> Any:
    """_convert(), with a problem reported (raised without `problems`) and INVALID in place of the value."""
    try:
        return _convert(value, tp, where, problems)
    except ConfigError as error:
        _report(problems, error)
        return INVALID


def key_name(key: Any) -> str:
    """A key as an error names it: plain names as they are, anything else quoted (a newline stays on one line)."""
    return key if isinstance(key, str) and key.isprintable() and key.strip() == key and ":" not in key else repr(key)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _unknown_key(key: Any, fields: list[str]) -> str:
    """An unknown key's message: the closest valid key when it looks like a misspelling of one, else them all."""
    close = difflib.get_close_matches(key, fields, n=1, cutoff=0.6) if isinstance(key, str) else []
    return f"unknown key (did you mean {close[0]!r}?)" if close else f"unknown key (expected one of: {', '.join(fields)})"


def build(cls: type, data: dict, where: str, problems: Problems | None = None) -> Any:
    """The dataclass `cls` from a mapping; None (with its problems collected) when a key it needs is missing or
    wrong. A wrong optional key is reported and left at its default, so the checks after this see the rest."""
    hints = typing.get_type_hints(cls)
    # Config.source is where a config was read from, set by parse_config: never a key of the file.
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    for key in data:
        if key not in fields:
            _report(problems, ConfigError(f"{_join(where, key_name(key))}: {_unknown_key(key, list(fields))}"))
    kwargs, complete = {}, True
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if name in data:
            value = checked(data[name], hints[name], _join(where, name), problems)
            if value is not INVALID:
                kwargs[name] = value
            complete = complete and (value is not INVALID or not required)
        elif required:
            _report(problems, ConfigError(f"{_join(where, name)}: required key is missing ({_describe(hints[name])})"))
            complete = False
    return cls(**kwargs) if complete else None
