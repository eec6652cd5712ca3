"""The Anthropic Messages dialect (POST /v1/messages, /v1/messages/count_tokens): its request turned into the chat
generation request, and the answer's items turned back into a message object or Anthropic's SSE events.

Content blocks become chat turns the model's template renders: an assistant's `tool_use` blocks its tool calls,
a user's `tool_result` blocks tool results (before the user's text, as they answer the turn before), `thinking`
blocks the assistant turn's reasoning_content. `thinking: {"type": "enabled"}` switches a template's
`enable_thinking` on (off otherwise, as Claude does not think unless asked); what the model writes inside its think
block comes back as `thinking` blocks either way (empty, with `thinking.display: "omitted"`).

A `system` message inside `messages` (Anthropic's mid-conversation system messages) stays at its place: the worker
renders it in the form the model's template takes there (appliance.worker.system_turns), never in the top system
prompt, whose text would then change every turn. `output_config.effort` is accepted (a local model has one effort);
`output_config.format` constrains the answer to its JSON schema. Tools with `defer_loading` are served like the
others: their definitions go into the prompt. Tool types the server cannot run (Anthropic's server tools) are left
out and counted, as the Responses route does with hosted tools; content block types that carry nothing the model
reads (a server tool's result, a container upload) are skipped and counted; an image or a document, which the model
would need, is a 400.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from appliance.front.api.answer_items import CALL_ITEM, REASONING_ITEM, TEXT_ITEM, Events, Item, ItemStream
from appliance.front.api.completions import GenerationRequest
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.route import ErrorShape
from appliance.front.api.fields import MAX_ANSWER_LIMIT, flag, json_object, model_name, number, text, text_parts
from appliance.front.api.structured import constraint as output_constraint
from appliance.front.api.tools import ToolRequest, at_origins, name_tool_results, parse_tools
from appliance.front.request import Event, RequestFailed

MAX_STOP_SEQUENCES = 8
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens", "stop": "end_turn"}
# Content blocks the model would need and this route cannot give it: a 400 rather than an answer without them.
NEEDED_BLOCKS = ("image", "document", "search_result")
CLIENT_TOOL = "custom"  # Anthropic's client tools (name, description, input_schema); every other type is a server's
# The worker's too-long message (appliance.worker.engines.llm), read back for Anthropic's wording of it.
TOO_LONG = re.compile(r"maximum context length is (\d+) tokens; the prompt has (\d+) tokens", re.ASCII)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
               429: "rate_limit_error", 503: "overloaded_error", 504: "timeout_error"}


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrors(ErrorShape):
    """Anthropic's error body, the same before a stream (with the status) and as its `error` event; it has no code
    or param, so the message names the field."""

    event_name = "error"

    def body(self, failure: RequestFailed, param: str | None) -> dict[str, Any]:
        return error_body(failure.status, anthropic_message(failure))


ANTHROPIC = AnthropicErrors()


def anthropic_message(failure: RequestFailed) -> str:
    """The error's message; a prompt over the window in Anthropic's documented words, which agent clients match to
    compact the conversation and retry."""
    if failure.code == "context_length_exceeded":
        figures = getattr(failure, "details", None) or {}  # the worker's figures where its error frame has them
        # the maximum is the longest prompt that fits: one token short of the window, which the answer needs
        if "prompt_tokens" in figures and "max_context" in figures:
            return f"prompt is too long: {figures['prompt_tokens']} tokens > {figures['max_context'] - 1} maximum"
        too_long = TOO_LONG.search(failure.message)  # else read back from its words
        if too_long:
            return f"prompt is too long: {too_long[2]} tokens > {int(too_long[1]) - 1} maximum"
    return f"{failure.message} ({failure.hint})" if failure.hint else failure.message


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   hint: str | None = None, retry_after: float | None = None) -> web.Response:
    """errors.error_response in Anthropic's shape, for the middlewares' errors on its routes (401, 404, 413)."""
    return ANTHROPIC.response(RequestFailed(status, code or "error", message, code, hint, retry_after), param)


@dataclass
class MessagesRequest:
    gen: GenerationRequest
    thinking_omitted: bool = False  # thinking.display: omitted: thinking blocks come back empty


@dataclass
class Conversation:
    """What a message and a token count share: the model, the chat turns (system first), the tools, the
    template's keyword arguments and the content block types skipped (counted by the route)."""

    model: str
    messages: list[dict[str, Any]]
    tools: ToolRequest
    template_kwargs: dict[str, Any]
    skipped: list[str]


def parse_conversation(body: Any) -> Conversation:
    model = model_name(body)
    skipped: list[str] = []
    messages = _system(body.get("system")) + _messages(body.get("messages"), skipped)
    name_tool_results(messages)
    chat, left_out, origins = _chat_tools(body)
    tools = at_origins(lambda: parse_tools(chat, left_out), origins, ANTHROPIC_TOOL_FIELDS)
    _output_config(body.get("output_config"), "output_config")
    return Conversation(model, messages, tools, {"enable_thinking": _thinking(body)}, skipped)


def parse_messages(body: Any) -> MessagesRequest:
    conversation = parse_conversation(body)
    model, messages, tools, kwargs = (conversation.model, conversation.messages, conversation.tools,
                                      conversation.template_kwargs)
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        raise InvalidRequest("'max_tokens' is required", "max_tokens")
    params = {"max_tokens": number(body, "max_tokens", 1, MAX_ANSWER_LIMIT, integer=True),
              "temperature": number(body, "temperature", 0, 1), "top_p": number(body, "top_p", 0, 1),
              "top_k": number(body, "top_k", 1, 1 << 31, integer=True), "stop": _stop_sequences(body),
              "logprobs": False}
    # only an enabled block has a budget (_thinking checked it is an integer); adaptive's is not read
    if kwargs["enable_thinking"] and body["thinking"]["type"] == "enabled" \
            and body["thinking"]["budget_tokens"] >= params["max_tokens"]:
        raise InvalidRequest("'thinking.budget_tokens' must be less than 'max_tokens'", "thinking.budget_tokens")
    if body.get("metadata") is not None:
        json_object(body["metadata"], "metadata")
    tool_constraint, format_constraint = tools.constraint(), _format_constraint(body.get("output_config"))
    if tool_constraint and format_constraint:
        raise InvalidRequest("a forced tool call cannot be combined with 'output_config.format'",
                             "output_config.format")
    gen = GenerationRequest(model, "chat", flag(body, "stream"), False, params, messages=messages, tools=tools,
                            constraint=tool_constraint or format_constraint, template_kwargs=kwargs,
                            ignored_inputs=conversation.skipped)
    return MessagesRequest(gen, _thinking_omitted(body))


def count_frame(body: Any) -> tuple[str, dict[str, Any]]:
    """/v1/messages/count_tokens: the model, and the body of the worker's `request` frame that counts the prompt."""
    c = parse_conversation(body)
    return c.model, {"messages": c.messages, "tools": c.tools.tools if c.tools.active else [],
                     "template_kwargs": c.template_kwargs}


def _system(system: Any) -> list[dict[str, Any]]:
    if system is None:
        return []
    content = _blocks_text(system, "system", "\n")
    return [{"role": "system", "content": content}] if content else []


def _blocks_text(content: Any, where: str, separator: str = "") -> str:
    """A string, or text blocks joined (a tool result's content; a system message's, a line apart)."""
    return text_parts(content, where, ("text",), separator)


def _messages(messages: Any, skipped: list[str]) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest("'messages' must be a non-empty list", "messages")
    turns: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant", "system"):
            raise InvalidRequest(f"'{where}' must be an object with role user, assistant or system", f"{where}.role")
        _output_config(message.get("output_config"), f"{where}.output_config")
        content = message.get("content")
        if message["role"] == "system":  # at its place (see the module's docstring)
            turns.append({"role": "system", "content": _blocks_text(content, f"{where}.content", "\n")})
            continue
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise InvalidRequest(f"'{where}.content' must be a string or a list of content blocks", f"{where}.content")
        turns += (_assistant(blocks, f"{where}.content", skipped) if message["role"] == "assistant"
                  else _user(blocks, f"{where}.content", skipped))
    return turns


def _block(block: Any, where: str, allowed: tuple[str, ...], skipped: list[str]) -> str | None:
    """The block's type, or None for a type the model does not need (skipped, and noted in `skipped`)."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind in allowed:
        return kind
    if not isinstance(kind, str) or kind in NEEDED_BLOCKS:
        raise InvalidRequest(f"'{where}.type' must be one of {', '.join(allowed)} (got {kind!r})", f"{where}.type")
    skipped.append(kind)
    return None


def _user(blocks: list, where: str, skipped: list[str]) -> list[dict[str, Any]]:
    results, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block(block, at, ("text", "tool_result"), skipped)
        if kind == "text":
            texts.append(text(block.get("text"), f"{at}.text", empty=True))
        elif kind == "tool_result":
            content = block.get("content", "")
            result = _blocks_text(content, f"{at}.content")
            if flag(block, "is_error"):
                result = f"Error: {result}"
            results.append({"role": "tool", "tool_call_id": text(block.get("tool_use_id"), f"{at}.tool_use_id"),
                            "content": result})
    return results + ([{"role": "user", "content": "".join(texts)}] if texts or not results else [])


def _assistant(blocks: list, where: str, skipped: list[str]) -> list[dict[str, Any]]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block(block, at, ("text", "thinking", "redacted_thinking", "tool_use"), skipped)
        if kind == "text":
            turn["content"] += text(block.get("text"), f"{at}.text", empty=True)
        elif kind == "thinking":
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text(block.get("thinking"),
                                                                               f"{at}.thinking", empty=True)
        elif kind == "tool_use":
            turn.setdefault("tool_calls", []).append(
                {"id": text(block.get("id"), f"{at}.id"), "type": "function",
                 "function": {"name": text(block.get("name"), f"{at}.name"),
                              "arguments": json_object(block.get("input"), f"{at}.input")}})
    return [turn]


# chat completions' names of a tool's fields as Anthropic spells them, for the refusals of the shared checks
ANTHROPIC_TOOL_FIELDS = ((".function.name", ".name"), (".function.description", ".description"),
                         (".function.parameters", ".input_schema"), (".function.strict", ".strict"))


def _chat_tools(body: dict) -> tuple[dict[str, Any], list[str], list[str]]:
    """tools and tool_choice as chat completions spells them (checked there), the types of the tools left out
    (server tools: a tool_choice that forces one is a 400), and where each chat tool is in the request."""
    chat: dict[str, Any] = {}
    origins: list[str] = []
    tools = body.get("tools")
    left_out: dict[str, str] = {}  # name -> type
    if tools is not None:
        if not isinstance(tools, list):
            raise InvalidRequest("'tools' must be a list", "tools")
        chat["tools"] = []
        for i, tool in enumerate(tools):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind is not None and not isinstance(kind, str):
                raise InvalidRequest(f"'tools[{i}].type' must be a string", f"tools[{i}].type")
            if kind not in (None, CLIENT_TOOL):
                left_out[str(tool.get("name"))] = kind
            else:
                chat["tools"].append(_chat_tool(tool, f"tools[{i}]"))
                origins.append(f"tools[{i}]")
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("auto", "none") and not tools:
        choice = None  # Anthropic accepts these without tools; chat completions' check would refuse them
    if choice is not None:
        if not isinstance(choice, dict) or choice.get("type") not in ("auto", "any", "tool", "none"):
            raise InvalidRequest("'tool_choice.type' must be auto, any, tool or none", "tool_choice")
        if choice["type"] == "tool":
            name = text(choice.get("name"), "tool_choice.name")
            if name in left_out:
                raise InvalidRequest(f"'tool_choice' forces the tool {name!r} of type {left_out[name]!r}, a server "
                                     f"tool this server cannot run: only client tools (name, description, "
                                     f"input_schema) can be called here", "tool_choice")
            chat["tool_choice"] = {"type": "function", "function": {"name": name}}
        else:
            chat["tool_choice"] = {"any": "required"}.get(choice["type"], choice["type"])
        chat["parallel_tool_calls"] = not flag(choice, "disable_parallel_tool_use")
    return chat, list(left_out.values()), origins


def _chat_tool(tool: Any, where: str) -> dict[str, Any]:
    """A client tool as chat completions spells it; `defer_loading` (load on demand, Anthropic's tool search) and
    `cache_control` need nothing here: its definition goes into the prompt like any other's."""
    if not isinstance(tool, dict):
        raise InvalidRequest(f"'{where}': only client tools (name, description, input_schema) are supported", where)
    schema = tool.get("input_schema")
    function = {"name": tool.get("name"), "parameters": json_object(schema, f"{where}.input_schema")}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    if tool.get("strict") is not None:
        function["strict"] = tool["strict"]
    return {"type": "function", "function": function}


def _thinking(body: dict) -> bool:
    thinking = body.get("thinking")
    if thinking is None:
        return False
    if not isinstance(thinking, dict) or thinking.get("type") not in ("enabled", "disabled", "adaptive"):
        raise InvalidRequest("'thinking.type' must be enabled, disabled or adaptive", "thinking")
    if thinking["type"] == "enabled":
        number(thinking, "budget_tokens", 1, 1 << 20, integer=True)  # accepted: genai cannot end a block early
        if thinking.get("budget_tokens") is None:
            raise InvalidRequest("'thinking.budget_tokens' is required when thinking is enabled",
                                 "thinking.budget_tokens")
    return thinking["type"] != "disabled"


def _thinking_omitted(body: dict) -> bool:
    display = (body.get("thinking") or {}).get("display")
    if display is not None and display not in ("summarized", "omitted"):
        raise InvalidRequest("'thinking.display' must be summarized or omitted", "thinking.display")
    return display == "omitted"


def _output_config(config: Any, where: str) -> None:
    """output_config is an object; its `effort` one of Anthropic's levels (each the same here: a local model has one
    effort); its `format` is read by _format_constraint."""
    if config is None:
        return
    json_object(config, where)
    if config.get("effort") is not None and not isinstance(config["effort"], str):
        raise InvalidRequest(f"'{where}.effort' must be a string (low, medium, high, ...)", f"{where}.effort")


def _format_constraint(config: Any) -> dict[str, Any] | None:
    """output_config.format ({"type": "json_schema", "schema": ...}) as the worker's output constraint."""
    fmt = config.get("format") if isinstance(config, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        raise InvalidRequest("'output_config.format.type' must be json_schema", "output_config.format")
    found = output_constraint({"response_format": {"type": "json_schema", "json_schema": {
        "name": "output", "schema": json_object(fmt.get("schema"), "output_config.format.schema")}}})
    found["param"] = "output_config.format"
    return found


def _stop_sequences(body: dict) -> list[str]:
    stops = body.get("stop_sequences")
    if stops is None:
        return []
    if not isinstance(stops, list) or len(stops) > MAX_STOP_SEQUENCES:
        raise InvalidRequest(f"'stop_sequences' must be a list of at most {MAX_STOP_SEQUENCES} strings",
                             "stop_sequences")
    return [text(s, "stop_sequences") for s in stops]


def usage(event: Event | None, output: bool = True) -> dict[str, int]:
    """Anthropic's usage: input_tokens is the part of the prompt computed, cache_read_input_tokens the part the
    prefix cache served (their sum the whole prompt, as Claude Code adds them up); nothing is written to a cache
    on request, so cache_creation_input_tokens is 0."""
    prompt, cached = (event.prompt_tokens, event.cached_tokens) if event else (0, 0)
    return {"input_tokens": prompt - cached, "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached,
            "output_tokens": event.completion_tokens if event and output else 0}


@dataclass
class MessageStream(ItemStream):
    """One message's events, in the order the SDK's messages.stream() assembles them; `message` is the whole object
    once finish() ran."""

    req: MessagesRequest
    id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)
    message: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__init__()

    def envelope(self, done: Event | None, stop_reason: str | None = None,
                 stop_sequence: str | None = None) -> dict[str, Any]:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.req.gen.model,
                "content": [self.block(i) for i in self.items], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence, "usage": usage(done)}

    def start(self, first: Event | RequestFailed) -> Events:
        """`first`: the request's first event, which carries the prompt's tokens, or its failure before any (a
        worker that crashed or stalled in prefill: the `error` event follows)."""
        message = self.envelope(None)
        message["usage"] = usage(first if isinstance(first, Event) else None, output=False)
        return [("message_start", {"type": "message_start", "message": message}), ("ping", {"type": "ping"})]

    def finish(self, done: Event, finish_reason: str) -> Events:
        events = self.close_all()
        reason = "stop_sequence" if done.stop_sequence is not None else STOP_REASONS.get(finish_reason, "end_turn")
        if reason == "max_tokens" and done.completion_tokens < self.req.gen.params["max_tokens"]:
            reason = "model_context_window_exceeded"  # cut where the context ran out, short of max_tokens
        self.message = self.envelope(done, reason, done.stop_sequence)
        return events + [("message_delta", {"type": "message_delta",
                                            "delta": {"stop_reason": reason, "stop_sequence": done.stop_sequence},
                                            "usage": usage(done)}),
                         ("message_stop", {"type": "message_stop"})]

    @staticmethod
    def fail(failure: RequestFailed, payload: dict[str, Any]) -> Events:
        """`payload`: the route's error event (AnthropicErrors.stream_event)."""
        return [("error", payload)]

    def block(self, item: Item, start: bool = False) -> dict[str, Any]:
        if item.kind == TEXT_ITEM:
            return {"type": "text", "text": "" if start else item.text}
        if item.kind == REASONING_ITEM:
            omitted = start or self.req.thinking_omitted
            return {"type": "thinking", "thinking": "" if omitted else item.text, "signature": ""}
        return {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {} if start else item.arguments()}

    def opened(self, item: Item) -> Events:
        return [("content_block_start", {"type": "content_block_start", "index": item.index,
                                         "content_block": self.block(item, start=True)})]

    def extended(self, item: Item, text_: str) -> Events:
        if item.kind == REASONING_ITEM and self.req.thinking_omitted:
            return []
        delta = {TEXT_ITEM: {"type": "text_delta", "text": text_},
                 REASONING_ITEM: {"type": "thinking_delta", "thinking": text_},
                 CALL_ITEM: {"type": "input_json_delta", "partial_json": text_}}[item.kind]
        return [("content_block_delta", {"type": "content_block_delta", "index": item.index, "delta": delta})]

    def closed(self, item: Item) -> Events:
        return [("content_block_stop", {"type": "content_block_stop", "index": item.index})]

