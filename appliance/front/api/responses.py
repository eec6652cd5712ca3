"""The OpenAI Responses dialect (POST /v1/responses): its request turned into the chat generation request, and the
answer's items turned back into a response object or its typed SSE events.

The request side reuses the chat completions checks (tools, tool_choice, structured outputs) on a chat-shaped copy
of the body; a refusal then names the Responses field (`text.format`, `tools[0].name`), not the chat one. Input
items become chat turns the model's template renders: `function_call` and `custom_tool_call` items are the
assistant's tool calls (a custom call as a function call whose one argument is its `input`), `function_call_output`
and `custom_tool_call_output` items tool results, `reasoning` items the next assistant turn's reasoning_content.

Reasoning items go out with an `encrypted_content` when `include` asks for it (Codex, with `store: false`, keeps
no state here and sends its previous output items back each turn): it is the reasoning text, encoded, not secret,
and read back as that text when it returns. Hosted tool types are left out (appliance.front.api.tools).
"""

from __future__ import annotations

import base64
import binascii
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from appliance.front.api.answer_items import (CALL_ITEM, CUSTOM_CALL_ITEM, REASONING_ITEM, TEXT_ITEM, Events, Item,
                                              ItemStream)
from appliance.front.api.completions import GenerationRequest
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import flag, json_object, model_name, number, text, text_parts
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.route import ErrorShape
from appliance.front.api.structured import constraint
from appliance.front.api.tools import (CUSTOM_INPUT, HOSTED_TOOL_TYPES, assistant_tool_calls, name_tool_results,
                                      parse_tools)
from appliance.front.request import Event, RequestFailed

ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_PREFIXES = {REASONING_ITEM: "rs_", TEXT_ITEM: "msg_", CALL_ITEM: "fc_", CUSTOM_CALL_ITEM: "ctc_"}
# chat completions' names of the fields the Responses API spells otherwise, for the errors the shared checks raise
RENAMES = (("response_format.json_schema.schema", "text.format.schema"),
           ("response_format.json_schema.name", "text.format.name"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           (".function.", "."), (".custom.", "."), ("format.grammar.", "format."),
           ("{\"type\": \"function\", \"function\": {\"name\": ...}}", "{\"type\": \"function\", \"name\": ...}"))
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "message.input_image.image_url")
# Output items of hosted tools a client replays with its history: none of them is anything this server said.
HOSTED_CALL_ITEMS = ("web_search_call", "file_search_call", "code_interpreter_call", "image_generation_call",
                     "computer_call", "computer_call_output", "local_shell_call", "local_shell_call_output",
                     "mcp_call", "mcp_list_tools", "mcp_approval_request", "mcp_approval_response")
ENCRYPTED_PREFIX = "openarc:v1:"  # our encrypted_content; another server's opaque reasoning is left out


class ResponsesErrors(ErrorShape):
    """OpenAI's error bodies before a stream; in a Responses stream, its typed `error` event."""

    event_name = "error"

    def stream_event(self, failure: RequestFailed) -> dict[str, Any]:
        return {"type": "error", "code": failure.code, "message": failure.message, "param": None}


RESPONSES = ResponsesErrors()


@dataclass
class ResponsesRequest:
    gen: GenerationRequest
    echo: dict[str, Any]             # the request's settings as the response object repeats them
    history: list[dict[str, Any]]    # the conversation so far without instructions: what a stored response chains
    store: bool = True
    previous: str | None = None
    encrypted_reasoning: bool = False  # reasoning items carry encrypted_content
    key: str = ""  # the name of the API key it came with: its stored response is that key's alone


def parse_responses(body: Any, store: ResponseStore, key: str) -> ResponsesRequest:
    """The request, its previous_response_id looked up among the responses stored for the same API `key`."""
    model = model_name(body)
    stream = flag(body, "stream")
    keep = True if body.get("store") is None else flag(body, "store")
    previous = body.get("previous_response_id")
    history = []
    if previous is not None:
        history = store.history(key, text(previous, "previous_response_id"))
    history = history + _input(body.get("input"))
    instructions = body.get("instructions")
    system = [{"role": "system", "content": text(instructions, "instructions", empty=True)}] if instructions else []
    messages = _one_system_turn(system + history)
    name_tool_results(messages)
    chat = _chat_shaped(body)
    tools = _renamed(parse_tools, chat)
    tool_constraint, output_constraint = tools.constraint(), _renamed(constraint, chat)
    if output_constraint:  # a schema genai cannot compile is refused naming this field
        output_constraint["param"] = _rename(output_constraint["param"])
    if tool_constraint and output_constraint:
        raise InvalidRequest("a required or strict function call cannot be combined with 'text.format'", "text.format")
    params = {"max_tokens": number(body, "max_output_tokens", 1, 1 << 20, integer=True),
              "temperature": number(body, "temperature", 0, 2), "top_p": number(body, "top_p", 0, 1),
              "top_k": None, "stop": [], "logprobs": False}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        json_object(reasoning, "reasoning")
    include = _include(body.get("include"))
    if body.get("metadata") is not None:
        json_object(body["metadata"], "metadata")
    gen = GenerationRequest(model, "chat", stream, False, params, messages=messages, tools=tools,
                            constraint=tool_constraint or output_constraint)
    echo = {"instructions": instructions, "max_output_tokens": params["max_tokens"],
            "temperature": params["temperature"], "top_p": params["top_p"], "parallel_tool_calls": tools.parallel,
            "tool_choice": body.get("tool_choice") or "auto", "tools": [_response_tool(t, body.get("tools")) for t in tools.tools],
            "text": {"format": (body.get("text") or {}).get("format") or {"type": "text"}},
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
            "metadata": body.get("metadata") or {}, "store": keep, "previous_response_id": previous}
    return ResponsesRequest(gen, echo, history, keep, previous, "reasoning.encrypted_content" in include, key)


def _include(include: Any) -> list[str]:
    if include is None:
        return []
    if not isinstance(include, list) or any(value not in INCLUDABLE for value in include):
        raise InvalidRequest(f"'include' must be a list of: {', '.join(INCLUDABLE)}", "include")
    return include


def _one_system_turn(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The instructions and the system/developer items that open the input as one system turn: Codex sends its
    instructions and then a developer message, and many templates take one system turn, at the start only."""
    leading = 0
    while leading < len(messages) and messages[leading]["role"] == "system":
        leading += 1
    if leading < 2:
        return messages
    joined = "\n\n".join(m["content"] for m in messages[:leading] if m["content"])
    return [{"role": "system", "content": joined}] + messages[leading:]


def _renamed(check, chat: dict):
    """Run a chat completions check on the chat-shaped body; its refusal names the Responses field."""
    try:
        return check(chat)
    except InvalidRequest as exc:
        raise InvalidRequest(_rename(str(exc)), exc.param and _rename(exc.param), exc.code) from None


def _rename(words: str) -> str:
    for old, new in RENAMES:
        words = words.replace(old, new)
    return words


def _chat_shaped(body: dict) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls and text.format as chat completions spells them."""
    chat: dict[str, Any] = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    tools = body.get("tools")
    if isinstance(tools, list):
        chat["tools"] = [_chat_tool(tool, i) for i, tool in enumerate(tools)]
    elif tools is not None:
        chat["tools"] = tools
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") in ("function", "custom"):
        choice = {"type": choice["type"], choice["type"]: {"name": choice.get("name")}}
    if choice is not None:
        chat["tool_choice"] = choice
    fmt = body.get("text")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise InvalidRequest("'text' must be an object with a 'format'", "text")
        fmt = fmt.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema", {})}}
        if fmt is not None:
            chat["response_format"] = fmt
    return chat


def _chat_tool(tool: Any, i: int) -> Any:
    if not isinstance(tool, dict) or tool.get("type") in HOSTED_TOOL_TYPES:
        return tool
    if tool.get("type") == "custom":
        custom = {k: tool[k] for k in ("name", "description") if k in tool}
        fmt = tool.get("format")
        if isinstance(fmt, dict) and fmt.get("type") == "grammar":
            fmt = {"type": "grammar", "grammar": {k: fmt[k] for k in ("syntax", "definition") if k in fmt}}
        if fmt is not None:
            custom["format"] = fmt
        return {"type": "custom", "custom": custom}
    if tool.get("type") != "function":
        raise InvalidRequest(f"'tools[{i}].type' must be function, custom or a hosted tool type "
                             f"({', '.join(HOSTED_TOOL_TYPES)}), got {tool.get('type')!r}", f"tools[{i}].type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    function.setdefault("strict", True)  # the Responses API's default, unlike chat completions'
    if function["strict"] is None:
        function["strict"] = True
    return {"type": "function", "function": function}


def _response_tool(tool: dict[str, Any], body_tools: Any) -> dict[str, Any]:
    function = tool["function"]
    for asked in body_tools if isinstance(body_tools, list) else ():
        if isinstance(asked, dict) and asked.get("type") == "custom" and asked.get("name") == function["name"]:
            return {"type": "custom", "name": function["name"], "description": function.get("description"),
                    "format": asked.get("format") or {"type": "text"}}
    return {"type": "function", "name": function["name"], "description": function.get("description"),
            "parameters": function.get("parameters"), "strict": function.get("strict", True)}


def _input(value: Any) -> list[dict[str, Any]]:
    """The `input` as chat turns."""
    if isinstance(value, str):
        return [{"role": "user", "content": text(value, "input", empty=True)}]
    if not isinstance(value, list) or not value:
        raise InvalidRequest("'input' must be a string or a non-empty list of items", "input")
    turns: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items waiting for the assistant turn they belong to
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            turn = _message(item, where)
            if turn["role"] == "assistant":
                _assistant(turns, reasoning)["content"] += turn["content"]
            else:
                turns.append(turn)
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            _assistant(turns, reasoning).setdefault("tool_calls", []).extend(assistant_tool_calls([call], where))
        elif kind == "custom_tool_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"),
                                 "arguments": {CUSTOM_INPUT: text(item.get("input"), f"{where}.input", empty=True)}}}
            _assistant(turns, reasoning).setdefault("tool_calls", []).extend(assistant_tool_calls([call], where))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turns.append({"role": "tool", "tool_call_id": text(item.get("call_id"), f"{where}.call_id"),
                          "content": _content(item.get("output"), f"{where}.output")})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind not in HOSTED_CALL_ITEMS:
            raise InvalidRequest(f"'{where}.type' must be message, function_call, function_call_output, "
                                 f"custom_tool_call, custom_tool_call_output or reasoning, got {kind!r}",
                                 f"{where}.type")
    return turns


def _assistant(turns: list[dict[str, Any]], reasoning: list[str]) -> dict[str, Any]:
    """The assistant turn an assistant item belongs to: the last turn if it is the assistant's and no tool result
    followed it, else a new one (taking the reasoning items before it)."""
    if not (turns and turns[-1]["role"] == "assistant") or reasoning:
        turns.append({"role": "assistant", "content": ""})
    if reasoning:
        turns[-1]["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    return turns[-1]


def _message(item: dict, where: str) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    return {"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content")}


def _content(content: Any, where: str) -> str:
    return text_parts(content, where, TEXT_PARTS)


def _reasoning_text(item: dict, where: str) -> str:
    encrypted = item.get("encrypted_content")
    if encrypted is not None:
        decoded = decrypted_reasoning(text(encrypted, f"{where}.encrypted_content", empty=True))
        if decoded is not None:
            return decoded
    content = item.get("content") or item.get("summary") or []
    if not isinstance(content, list):
        raise InvalidRequest(f"'{where}.content' must be a list of reasoning_text parts", f"{where}.content")
    return "".join(text(part.get("text") if isinstance(part, dict) else None, f"{where}.content[{j}].text",
                        empty=True) for j, part in enumerate(content))


def encrypted_reasoning(reasoning: str) -> str:
    """A reasoning item's encrypted_content: opaque to the client, readable by this server (not a secret)."""
    return ENCRYPTED_PREFIX + base64.urlsafe_b64encode(reasoning.encode()).decode()


def decrypted_reasoning(encrypted: str) -> str | None:
    """The reasoning text of our encrypted_content; None for anything else (another server's)."""
    if not encrypted.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        return base64.urlsafe_b64decode(encrypted[len(ENCRYPTED_PREFIX):].encode()).decode()
    except (binascii.Error, ValueError):
        return None


def usage(done: Event) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cached_tokens},
            "output_tokens": done.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": done.reasoning_tokens or 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


@dataclass
class ResponseStream(ItemStream):
    """One response's events, in the order the SDK's responses.stream() assembles them; `response` is the whole
    object once finish() or fail() ran."""

    req: ResponsesRequest
    id: str = field(default_factory=lambda: "resp_" + uuid.uuid4().hex)
    created_at: int = field(default_factory=lambda: int(time.time()))
    sequence: int = 0
    response: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__init__()

    def envelope(self, status: str, **fields: Any) -> dict[str, Any]:
        out = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
               "model": self.req.gen.model, "output": [self.item(i) for i in self.items if i.done],
               "error": None, "incomplete_details": None, "usage": None, "truncation": "disabled",
               "user": None, **self.req.echo}
        out.update(fields)
        return out

    def event(self, type_: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.sequence += 1
        return type_, {"type": type_, "sequence_number": self.sequence - 1, **data}

    def start(self, first: Event) -> Events:
        return [self.event("response.created", response=self.envelope("in_progress")),
                self.event("response.in_progress", response=self.envelope("in_progress"))]

    def finish(self, done: Event, finish_reason: str) -> Events:
        cut = finish_reason == "length"
        if cut and self.current:
            self.current.extra["status"] = "incomplete"
        events = self.close_all()
        status = "incomplete" if cut else "completed"
        self.response = self.envelope(status, usage=usage(done), completed_at=int(time.time()),
                                      incomplete_details={"reason": "max_output_tokens"} if cut else None)
        return events + [self.event(f"response.{status}", response=self.response)]

    def fail(self, exc: RequestFailed, payload: dict[str, Any]) -> Events:
        """The route's `error` event (`payload`: ResponsesErrors.stream_event), then response.failed."""
        self.response = self.envelope("failed", error={"code": "server_error", "message": exc.message})
        return [self.event("error", **{key: value for key, value in payload.items() if key != "type"}),
                self.event("response.failed", response=self.response)]

    # --- items ---------------------------------------------------------------------------------------------

    def item(self, item: Item, status: str | None = None) -> dict[str, Any]:
        status = status or item.extra.get("status", "completed")
        item_id = item.extra["id"]
        if item.kind == TEXT_ITEM:
            content = [self.part(item)] if status != "in_progress" else []
            return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}
        if item.kind == REASONING_ITEM:
            content = [self.part(item)] if status != "in_progress" else []
            out = {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
            if self.req.encrypted_reasoning:
                out["encrypted_content"] = encrypted_reasoning(item.text if status != "in_progress" else "")
            return out
        if item.kind == CUSTOM_CALL_ITEM:
            return {"id": item_id, "type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                    "input": item.text if status != "in_progress" else "", "status": status}
        return {"id": item_id, "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.text if status != "in_progress" else "", "status": status}

    @staticmethod
    def part(item: Item, text_: str | None = None) -> dict[str, Any]:
        value = item.text if text_ is None else text_
        if item.kind == REASONING_ITEM:
            return {"type": "reasoning_text", "text": value}
        return {"type": "output_text", "text": value, "annotations": [], "logprobs": []}

    def where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item.extra["id"], "output_index": item.index}

    def opened(self, item: Item) -> Events:
        item.extra["id"] = ITEM_PREFIXES[item.kind] + uuid.uuid4().hex
        events = [self.event("response.output_item.added", output_index=item.index,
                             item=self.item(item, "in_progress"))]
        if item.kind not in (CALL_ITEM, CUSTOM_CALL_ITEM):
            events.append(self.event("response.content_part.added", **self.where(item), content_index=0,
                                     part=self.part(item, "")))
        return events

    def extended(self, item: Item, text_: str) -> Events:
        if item.kind == CUSTOM_CALL_ITEM:
            return [self.event("response.custom_tool_call_input.delta", **self.where(item), delta=text_)]
        if item.kind == CALL_ITEM:
            return [self.event("response.function_call_arguments.delta", **self.where(item), delta=text_)]
        if item.kind == REASONING_ITEM:
            return [self.event("response.reasoning_text.delta", **self.where(item), content_index=0, delta=text_)]
        return [self.event("response.output_text.delta", **self.where(item), content_index=0, delta=text_,
                           logprobs=[])]

    def closed(self, item: Item) -> Events:
        if item.kind == CUSTOM_CALL_ITEM:
            events = [self.event("response.custom_tool_call_input.done", **self.where(item), input=item.text)]
        elif item.kind == CALL_ITEM:
            events = [self.event("response.function_call_arguments.done", **self.where(item), name=item.name,
                                 arguments=item.text)]
        else:
            done = "response.reasoning_text.done" if item.kind == REASONING_ITEM else "response.output_text.done"
            extra = {} if item.kind == REASONING_ITEM else {"logprobs": []}
            events = [self.event(done, **self.where(item), content_index=0, text=item.text, **extra),
                      self.event("response.content_part.done", **self.where(item), content_index=0,
                                 part=self.part(item))]
        return events + [self.event("response.output_item.done", output_index=item.index, item=self.item(item))]

    def turn(self) -> dict[str, Any]:
        """The answer as the assistant's chat turn, for a later request's previous_response_id."""
        content = "".join(i.text for i in self.items if i.kind == TEXT_ITEM)
        turn: dict[str, Any] = {"role": "assistant", "content": content}
        reasoning = "".join(i.text for i in self.items if i.kind == REASONING_ITEM)
        if reasoning:
            turn["reasoning_content"] = reasoning
        calls = [i for i in self.items if i.kind in (CALL_ITEM, CUSTOM_CALL_ITEM)]
        if calls:
            turn["tool_calls"] = [{"id": c.call_id, "type": "function", "function": {
                "name": c.name, "arguments": {CUSTOM_INPUT: c.text} if c.kind == CUSTOM_CALL_ITEM else c.arguments()}}
                for c in calls]
        return turn
