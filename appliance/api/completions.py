"""The OpenAI wire format of chat and text completions: validating request bodies, shaping responses and chunks.

Validation raises InvalidRequest (-> HTTP 400) with the offending parameter named, so no client input can reach a
worker malformed or turn into a 500.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from appliance.api.errors import InvalidRequest

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4


@dataclass
class GenerationRequest:
    model: str
    kind: str                      # chat | completion
    stream: bool
    include_usage: bool
    params: dict[str, Any]
    messages: list[dict[str, str]] = field(default_factory=list)
    prompt: str = ""

    def frame(self) -> dict[str, Any]:
        """The generate frame for the worker (the supervisor adds the id)."""
        body = {"messages": self.messages} if self.kind == "chat" else {"prompt": self.prompt}
        return {"kind": self.kind, "params": self.params, "stream": self.stream, **body}


def _number(body: dict, key: str, low: float, high: float, integer: bool = False) -> float | int | None:
    value = body.get(key)
    if value is None:
        return None
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise InvalidRequest(f"'{key}' must be {'an integer' if integer else 'a number'}, got {value!r}", key)
    if not low <= value <= high:
        raise InvalidRequest(f"'{key}' must be between {low:g} and {high:g}, got {value!r}", key)
    return value


def _utf8(text: str, where: str) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"'{where}' holds an unpaired UTF-16 surrogate (not valid Unicode text)", where) from None
    return text


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return [_utf8(s, "stop") for s in stops]


def _common(body: Any) -> tuple[str, dict[str, Any], bool, bool]:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a string", "model")
    _number(body, "n", 1, 1, integer=True)  # only n=1 is served: anything else is refused here
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {
        "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", 1, 1 << 20, integer=True),
        "temperature": _number(body, "temperature", 0, 2),
        "top_p": _number(body, "top_p", 0, 1),
        "seed": _number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
        "stop": _stop(body),
    }
    if params["seed"] is not None:
        params["seed"] %= 1 << 32  # genai's rng_seed is unsigned
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return model, params, stream, bool(options.get("include_usage"))


def _message_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _utf8(content, where)
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequest(f"{where}: only text content parts are supported", where)
            parts.append(_utf8(part["text"], where))
        return "".join(parts)
    raise InvalidRequest(f"{where} must be a string or a list of text parts", where)


def parse_chat(body: Any) -> GenerationRequest:
    model, params, stream, include_usage = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
        content = message.get("content")
        text = "" if content is None and role == "assistant" else _message_text(content, f"{where}.content")
        parsed.append({"role": "system" if role == "developer" else role, "content": text})
    return GenerationRequest(model, "chat", stream, include_usage, params, messages=parsed)


def parse_completion(body: Any) -> GenerationRequest:
    model, params, stream, include_usage = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string (or a list of exactly one string)", "prompt")
    _utf8(prompt, "prompt")
    return GenerationRequest(model, "completion", stream, include_usage, params, prompt=prompt)


class ResponseShaper:
    """Builds the response objects of one request, chat or completion, whole or as chunks."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"

    def _envelope(self, obj: str, choices: list, usage: dict | None) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def whole(self, text: str, finish_reason: str, usage: dict) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                      "logprobs": None}
        else:
            choice = {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": None}
        return self._envelope(self.object, [choice], usage)

    def chunk(self, text: str | None = None, finish_reason: str | None = None, first: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
            if text:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {"index": 0, "text": text or "", "finish_reason": finish_reason, "logprobs": None}
        return self._envelope("text_completion", [choice], None)

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
