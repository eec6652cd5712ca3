"""The OpenAI wire format of chat and text completions: validating request bodies, shaping responses and chunks.

Validation raises InvalidRequest (-> HTTP 400) with the offending parameter named, so no client input can reach a
worker malformed or turn into a 500.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import MAX_ANSWER_LIMIT, json_object, model_name, number, utf8
from appliance.front.api.images import Content, content_text
from appliance.front.api.lookup import named_adapter
from appliance.front.api.sampling import sampling_params
from appliance.front.api.structured import constraint
from appliance.front.api.tools import ToolRequest, assistant_tool_calls, name_tool_results, parse_tools

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP_SEQUENCES = 4
MAX_CHOICES = 8  # `n`: each choice is its own request in the worker's batch


@dataclass
class GenerationRequest:
    model: str
    kind: str                      # chat | completion
    stream: bool
    include_usage: bool
    params: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    prompt: str = ""
    tools: ToolRequest = field(default_factory=ToolRequest)
    constraint: dict[str, Any] | None = None  # structured output (appliance.front.api.structured / tools)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs
    n: int = 1
    content: Content = field(default_factory=Content)  # the messages' image parts (appliance.front.api.images)
    images: list[dict[str, Any]] = field(default_factory=list)  # their pixel files, once resolved for the model
    ignored_inputs: list[str] = field(default_factory=list)  # types of the input items / blocks skipped (counted)

    def frames(self, sup=None) -> list[dict[str, Any]]:
        """One generate frame per choice: `n` choices are `n` requests batched together (genai's
        num_return_sequences would give n sequences of one request, which the stream and stop-sequence handling
        of one sequence per request do not follow). A seeded request gives choice i the seed + i."""
        frames = []
        for i in range(self.n):
            frame = self.frame(sup)
            if self.params.get("seed") is not None:
                frame["params"] = {**self.params, "seed": (self.params["seed"] + i) % (1 << 32)}
            frames.append(frame)
        return frames

    def frame(self, sup=None) -> dict[str, Any]:
        """The generate frame for the worker (the supervisor adds the id); `sup`: the model's supervisor the lookup
        found, which says whether the request's name picks one of its LoRA adapters (lookup.named_adapter)."""
        if self.kind == "chat":
            body = {"messages": self.messages, "tools": self.tools.tools if self.tools.active else [],
                    "template_kwargs": self.template_kwargs}
        else:
            body = {"prompt": self.prompt}
        if self.images:
            body["images"] = self.images
        adapter = named_adapter(sup, self.model) if sup is not None else ""
        if adapter:
            body["adapter"] = adapter
        return {"kind": self.kind, "params": self.params, "stream": self.stream, "constraint": self.constraint, **body}


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise InvalidRequest("'stop' must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop' takes at most {MAX_STOP_SEQUENCES} sequences", "stop")
    return [utf8(s, "stop") for s in stops]


def _common(body: Any, chat: bool) -> tuple[str, dict[str, Any], bool, bool, int]:
    model = model_name(body)
    choices = number(body, "n", 1, MAX_CHOICES, integer=True) or 1
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {
        "max_tokens": number({"max_tokens": max_tokens}, "max_tokens", 1, MAX_ANSWER_LIMIT, integer=True),
        "temperature": number(body, "temperature", 0, 2),
        "top_p": number(body, "top_p", 0, 1),
        "seed": number(body, "seed", -(1 << 63), (1 << 64) - 1, integer=True),
        "stop": _stop(body),
        **sampling_params(body, chat),
    }
    if params["seed"] is not None:
        params["seed"] %= 1 << 32  # genai's rng_seed is unsigned
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequest("'stream_options' must be an object with a boolean 'include_usage'", "stream_options")
    return model, params, stream, bool(options.get("include_usage")), choices


def parse_chat(body: Any) -> GenerationRequest:
    model, params, stream, include_usage, choices = _common(body, chat=True)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    parsed, content = [], Content()
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise InvalidRequest(f"'{where}' must be an object", where)
        role = message.get("role")
        if role not in ROLES:
            raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
        parsed.append(_message(message, role, where, content))
    name_tool_results(parsed)
    tools = parse_tools(body)
    kwargs = body.get("chat_template_kwargs")
    req = GenerationRequest(model, "chat", stream, include_usage, params, messages=parsed, tools=tools,
                            template_kwargs=json_object(kwargs, "chat_template_kwargs") if kwargs is not None else {},
                            n=choices, content=content)
    tool_constraint, output_constraint = tools.constraint(), constraint(body)
    if tool_constraint and output_constraint:
        raise InvalidRequest("a forced or strict tool call cannot be combined with 'response_format'",
                             "response_format")
    req.constraint = tool_constraint or output_constraint
    return req


def _message(message: dict, role: str, where: str, found: Content) -> dict[str, Any]:
    """One conversation turn in the shape chat templates read: tool calls with their arguments as objects,
    tool results with the id (and name) of the call they answer."""
    content = message.get("content")
    text = "" if content is None and role == "assistant" else content_text(content, f"{where}.content", found)
    out: dict[str, Any] = {"role": "system" if role == "developer" else role, "content": text}
    if role == "assistant" and message.get("tool_calls"):
        out["tool_calls"] = assistant_tool_calls(message["tool_calls"], f"{where}.tool_calls")
    if role == "assistant" and isinstance(message.get("reasoning_content"), str):
        out["reasoning_content"] = utf8(message["reasoning_content"], f"{where}.reasoning_content")
    if role == "tool":
        for key in ("tool_call_id", "name"):
            if isinstance(message.get(key), str):
                out[key] = utf8(message[key], f"{where}.{key}")
    return out


def parse_completion(body: Any) -> GenerationRequest:
    model, params, stream, include_usage, choices = _common(body, chat=False)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest("'prompt' must be a string (or a list of exactly one string)", "prompt")
    utf8(prompt, "prompt")
    return GenerationRequest(model, "completion", stream, include_usage, params, prompt=prompt,
                             constraint=constraint(body), n=choices)


class ResponseShaper:
    """Builds the response objects of one request, chat or completion, whole or as chunks."""

    def __init__(self, req: GenerationRequest):
        self.req = req
        self.chat = req.kind == "chat"
        self.id = ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if self.chat else "text_completion"
        self.text_offsets: dict[int, int] = {}  # completions' logprobs.text_offset runs on across chunks, per choice

    def _envelope(self, obj: str, choices: list, usage: dict | None) -> dict[str, Any]:
        out = {"id": self.id, "object": obj, "created": self.created, "model": self.req.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None,
              cached_tokens: int = 0) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens,
                                 "prompt_tokens_details": {"cached_tokens": cached_tokens}}
        if reasoning_tokens is not None:
            usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
        return usage

    def choice(self, index: int, answer: dict[str, Any] | str, finish_reason: str,
               logprobs: list | None = None) -> dict[str, Any]:
        """One choice of a whole response; `answer`: the chat message (appliance.front.api.answer), or a completion's
        text."""
        key = "message" if self.chat else "text"
        return {"index": index, key: answer, "finish_reason": finish_reason, "logprobs": self.logprobs(logprobs, index)}

    def whole(self, choices: list[dict[str, Any]], usage: dict) -> dict[str, Any]:
        return self._envelope(self.object, choices, usage)

    def chunk(self, delta: dict[str, Any] | str | None = None, finish_reason: str | None = None, first: bool = False,
              logprobs: list | None = None, index: int = 0) -> dict[str, Any]:
        """`delta`: a chat delta ({"content": ...}, {"tool_calls": [...]}, ...), or a completion's text."""
        if self.chat:
            delta = {"role": "assistant", "content": "", **(delta or {})} if first else (delta or {})
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": self.logprobs(logprobs, index)}
            return self._envelope("chat.completion.chunk", [choice], None)
        choice = {"index": index, "text": delta or "", "finish_reason": finish_reason,
                  "logprobs": self.logprobs(logprobs, index)}
        return self._envelope("text_completion", [choice], None)

    def logprobs(self, tokens: list | None, index: int = 0) -> dict[str, Any] | None:
        """Each chosen token's log probability ([text, logprob] pairs from the worker) in the endpoint's shape."""
        if tokens is None:
            return None
        if self.chat:
            return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                for t, lp in tokens]}
        offsets, offset = [], self.text_offsets.get(index, 0)
        for t, _ in tokens:
            offsets.append(offset)
            offset += len(t)
        self.text_offsets[index] = offset
        return {"tokens": [t for t, _ in tokens], "token_logprobs": [lp for _, lp in tokens], "top_logprobs": None,
                "text_offset": offsets}

    def usage_chunk(self, usage: dict) -> dict[str, Any]:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage)
