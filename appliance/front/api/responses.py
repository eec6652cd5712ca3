"""The OpenAI Responses dialect (POST /v1/responses): its request turned into the chat generation request, and the
answer's items turned back into a response object or its typed SSE events.

The request side reuses the chat completions checks (tools, tool_choice, structured outputs) on a chat-shaped copy
of the body; a refusal then names the Responses field (`text.format`, `tools[0].name`), not the chat one. Input
items become chat turns the model's template renders: `function_call` and `custom_tool_call` items are the
assistant's tool calls (a custom call as a function call whose one argument is its `input`), `function_call_output`
and `custom_tool_call_output` items tool results, `reasoning` items the next assistant turn's reasoning_content.

Reasoning items go out with an `encrypted_content` when `include` asks for it (Codex, with `store: false`, keeps
no state here and sends its previous output items back each turn): it is the reasoning text, encoded, not secret,
and read back as that text when it returns. Tool types beyond function and custom (namespace, tool_search, hosted
and unknown ones) are appliance.front.api.response_tools'. Input items of a type the server cannot represent (a
hosted tool's call, a type it does not know) are skipped and counted, never refused.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

from appliance.front.api.answer_items import (CALL_ITEM, CUSTOM_CALL_ITEM, REASONING_ITEM, TEXT_ITEM, Events, Item,
                                              ItemStream)
from appliance.front.api.completions import GenerationRequest
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import MAX_ANSWER_LIMIT, flag, json_object, model_name, number, text
from appliance.front.api.images import Content, content_text
from appliance.front.api.input_parts import chat_parts
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.response_tools import TOOL_SEARCH, FlatTools, ToolNames, joined_name
from appliance.front.api.route import ErrorShape
from appliance.front.api.structured import constraint
from appliance.front.api.tools import (CUSTOM_INPUT, assistant_tool_calls, at_origins, name_tool_results,
                                      parse_tools)
from appliance.front.request import Event, RequestFailed

IMAGE_TAGS = re.compile(r"<ov_genai_image_\d+>", re.ASCII)
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
# Marks on a chat turn while the input is read: the item a tool result came from, a compaction's turn.
WHERE, COMPACTED = "_where", "_compacted"
COMPACTION_PREFIX = "A summary of our conversation so far, for you to continue from:\n\n"
ITEM_PREFIXES = {REASONING_ITEM: "rs_", TEXT_ITEM: "msg_", CALL_ITEM: "fc_", CUSTOM_CALL_ITEM: "ctc_"}
TOOL_SEARCH_PREFIX = "tsc_"  # a call to the client tool_search: a tool_search_call item
# chat completions' names of the fields the Responses API spells otherwise, for the errors the shared checks raise
RENAMES = (("response_format.json_schema.schema", "text.format.schema"),
           ("response_format.json_schema.name", "text.format.name"),
           ("response_format.json_schema", "text.format"), ("response_format", "text.format"),
           (".function.", "."), (".custom.", "."), ("format.grammar.", "format."),
           ("{\"type\": \"function\", \"function\": {\"name\": ...}}", "{\"type\": \"function\", \"name\": ...}"))
INCLUDABLE = ("reasoning.encrypted_content", "message.output_text.logprobs", "file_search_call.results",
              "web_search_call.results", "web_search_call.action.sources", "code_interpreter_call.outputs",
              "computer_call_output.output.image_url", "message.input_image.image_url")
ENCRYPTED_PREFIX = "openarc:v1:"  # our encrypted_content; another server's opaque reasoning is left out
SERVICE_TIERS = ("auto", "default", "flex", "priority")  # accepted; every request is served by the one tier, "default"


class ResponsesErrors(ErrorShape):
    """OpenAI's error bodies before a stream; in a Responses stream, its typed `error` event: the spec's `error`
    object (type, code, message, param), and the same code, message and param at the top, where the OpenAI SDK's
    ResponseErrorEvent reads them today."""

    event_name = "error"

    def stream_event(self, failure: RequestFailed) -> dict[str, Any]:
        error = self.body(failure, None)["error"]
        return {"type": "error", "code": failure.code, "message": failure.message, "param": None,
                "error": {key: error[key] for key in ("type", "code", "message", "param")}}


RESPONSES = ResponsesErrors()


@dataclass
class ResponsesRequest:
    gen: GenerationRequest
    echo: dict[str, Any]             # the request's settings as the response object repeats them
    history: list[dict[str, Any]]    # the conversation so far without instructions: what a stored response chains
    store: bool = True
    previous: str | None = None
    encrypted_reasoning: bool = False  # reasoning items carry encrypted_content
    names: ToolNames = field(default_factory=ToolNames)  # namespaced tools and tool_search: how calls go out
    key: str = ""  # the name of the API key it came with: its stored response is that key's alone


def conversation(body: Any, history: list[dict[str, Any]], flat: FlatTools) -> tuple[
        list[dict[str, Any]], list[dict[str, Any]], Content]:
    """The body's `instructions` and `input` after `history` (a stored response's turns): the chat messages, the
    history they extend (without instructions), and the image parts the messages hold; `flat` takes the tools of
    tool_search_output items and the types of items skipped."""
    found = Content()
    if body.get("input") is not None or not history:  # previous_response_id alone continues as it is
        history = history + _input(body.get("input"), flat, found)
    check_call_outputs(history)
    instructions = body.get("instructions")
    system = [{"role": "system", "content": text(instructions, "instructions", empty=True)}] if instructions else []
    messages = _one_system_turn(system + history)
    name_tool_results(messages)
    return messages, history, found


def parse_responses(body: Any, store: ResponseStore, key: str,
                    stored: Callable[[str], list] | None = None) -> ResponsesRequest:
    """The request, its previous_response_id looked up in `stored` first (a WebSocket's own responses), then among
    the responses stored for the same API `key`."""
    model = model_name(body)
    stream = flag(body, "stream")
    keep = True if body.get("store") is None else flag(body, "store")
    previous = body.get("previous_response_id")
    history = []
    if previous is not None:
        response_id = text(previous, "previous_response_id")
        history = stored(response_id) if stored is not None else store.history(key, response_id)
    flat = FlatTools()
    messages, history, found = conversation(body, history, flat)
    chat = _chat_shaped(body, flat)
    origins = [flat.where(tool) for tool in flat.all]
    tools = _renamed(lambda shaped: at_origins(lambda: parse_tools(shaped, list(flat.left_out.values())), origins),
                     chat)
    tool_constraint, output_constraint = tools.constraint(), _renamed(constraint, chat)
    if output_constraint:  # a schema genai cannot compile is refused naming this field
        output_constraint["param"] = _rename(output_constraint["param"])
    if tool_constraint and output_constraint:
        raise InvalidRequest("a required or strict function call cannot be combined with 'text.format'", "text.format")
    params = {"max_tokens": number(body, "max_output_tokens", 1, MAX_ANSWER_LIMIT, integer=True),
              "temperature": number(body, "temperature", 0, 2), "top_p": number(body, "top_p", 0, 1),
              "presence_penalty": number(body, "presence_penalty", -2, 2),
              "frequency_penalty": number(body, "frequency_penalty", -2, 2),
              "top_k": None, "stop": [], "logprobs": False}
    reasoning = body.get("reasoning")
    if reasoning is not None:
        json_object(reasoning, "reasoning")
    include = _include(body.get("include"))
    if body.get("metadata") is not None:
        json_object(body["metadata"], "metadata")
    gen = GenerationRequest(model, "chat", stream, False, params, messages=messages, tools=tools,
                            constraint=tool_constraint or output_constraint, ignored_inputs=flat.skipped,
                            content=found)
    echo = {"instructions": body.get("instructions"), "max_output_tokens": params["max_tokens"],
            **sampling_echo(body, params), "parallel_tool_calls": tools.parallel,
            "tool_choice": body.get("tool_choice") or "auto", "tools": [_response_tool(t) for t in flat.echo],
            "text": {"format": _format_echo((body.get("text") or {}).get("format"))},
            "reasoning": {"effort": (reasoning or {}).get("effort"), "summary": (reasoning or {}).get("summary")},
            "metadata": body.get("metadata") or {}, "store": keep, "previous_response_id": previous}
    return ResponsesRequest(gen, echo, history, keep, previous, "reasoning.encrypted_content" in include,
                            flat.names, key)


def sampling_echo(body: dict, params: dict[str, Any]) -> dict[str, Any]:
    """The response object's settings as this server used them. An unset temperature is greedy decoding (the
    worker samples only with a temperature above 0), so it is repeated as 0; top_p as asked, else 1 (no nucleus
    cut); the penalties as asked, else 0. top_logprobs is 0 (logprobs are not returned here: asking for them is
    refused), max_tool_calls as asked (no built-in tool runs here, so the bound always holds), background false
    (refused), service_tier "default" (one tier)."""
    if number(body, "top_logprobs", 0, 20, integer=True):
        raise InvalidRequest("'top_logprobs' is not supported on /v1/responses (no log probabilities are returned "
                             "here; /v1/chat/completions has logprobs)", "top_logprobs")
    if body.get("background") is not None and flag(body, "background"):
        raise InvalidRequest("'background' mode is not supported: responses are not kept to be fetched later; "
                             "use stream: true for a long answer", "background")
    tier = body.get("service_tier")
    if tier is not None and tier not in SERVICE_TIERS:
        raise InvalidRequest(f"'service_tier' must be one of {', '.join(SERVICE_TIERS)}", "service_tier")
    echo = {"temperature": params["temperature"] or 0, "top_p": 1 if params["top_p"] is None else params["top_p"],
            "presence_penalty": params["presence_penalty"] or 0, "frequency_penalty": params["frequency_penalty"] or 0,
            "top_logprobs": 0, "max_tool_calls": number(body, "max_tool_calls", 1, 1 << 20, integer=True),
            "background": False, "service_tier": "default"}
    for key in ("safety_identifier", "prompt_cache_key"):
        value = body.get(key)
        if value is not None and (not isinstance(value, str) or len(value) > 64):
            raise InvalidRequest(f"'{key}' must be a string of at most 64 characters", key)
        echo[key] = value
    return echo


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


def _chat_shaped(body: dict, flat: FlatTools) -> dict[str, Any]:
    """tools, tool_choice, parallel_tool_calls and text.format as chat completions spells them; `flat` holds the
    tools the input's tool_search_output items loaded, and takes the request's own."""
    chat: dict[str, Any] = {"parallel_tool_calls": body.get("parallel_tool_calls")}
    tools = body.get("tools")
    if isinstance(tools, list):
        flat.add(tools, "tools")
    elif tools is not None:
        chat["tools"] = tools
    if flat.all or flat.left_out:
        chat["tools"] = [_chat_tool(tool, flat.where(tool)) for tool in flat.all]
    choice = flat.choice(body.get("tool_choice"))
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


def _chat_tool(tool: Any, where: str) -> Any:
    if not isinstance(tool, dict):
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
        raise InvalidRequest(f"'{where}.type' must be a string (function, custom, namespace, tool_search or a "
                             f"hosted tool type), got {tool.get('type')!r}", f"{where}.type")
    function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}
    function.setdefault("strict", True)  # the Responses API's default, unlike chat completions'
    if function["strict"] is None:
        function["strict"] = True
    return {"type": "function", "function": function}


def _format_echo(fmt: Any) -> dict[str, Any]:
    """text.format as the response object repeats it: a json_schema format with every field the spec requires (no
    description: null; strict as sent, else true, as for a function tool: the schema is always enforced here)."""
    if not fmt:
        return {"type": "text"}
    if fmt.get("type") != "json_schema":
        return fmt
    strict = fmt.get("strict")
    return {**fmt, "description": fmt.get("description"), "strict": True if strict is None else strict}


def _response_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A served tool as the response object repeats it (a namespace or tool_search as it was sent)."""
    if tool.get("type") == "custom":
        return {"type": "custom", "name": tool.get("name"), "description": tool.get("description"),
                "format": tool.get("format") or {"type": "text"}}
    if tool.get("type") == "function":
        strict = tool.get("strict")
        return {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                "parameters": tool.get("parameters"), "strict": True if strict is None else strict}
    return tool


def _input(value: Any, flat: FlatTools, found: Content) -> list[dict[str, Any]]:
    """The `input` as chat turns; `flat` takes the tools of tool_search_output items and the types of the items
    skipped; the image parts its messages hold are added to `found`."""
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
            turn = _message(item, where, found)
            if turn["role"] == "assistant":
                _assistant(turns, reasoning)["content"] += turn["content"]
            elif turn["role"] == "user" and turns and turns[-1].get(COMPACTED):
                turns[-1]["content"] += "\n\n" + turn["content"]  # one user turn: templates alternate roles
            else:
                turns.append(turn)
        elif kind in ("function_call", "custom_tool_call") or (kind == "tool_search_call" and _client(item)):
            _assistant(turns, reasoning).setdefault("tool_calls", []).extend(
                assistant_tool_calls([_replayed_call(item, kind, where)], where))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            turns.append({"role": "tool", "tool_call_id": text(item.get("call_id"), f"{where}.call_id"),
                          "content": _content(item.get("output"), f"{where}.output", found), WHERE: where})
        elif kind == "tool_search_output" and _client(item):
            turns.append(_loaded_tools(item, where, flat))
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(item, where))
        elif kind == "compaction":
            turns.append(compacted_turn(item, where))
        else:  # a hosted tool's item, or a type this server cannot represent: nothing the model said here
            flat.skipped.append(str(kind))
    return turns


def _client(item: dict) -> bool:
    """A tool_search item the client ran (a server-run search is a hosted tool's item)."""
    return item.get("execution", "client") == "client"


def _replayed_call(item: dict, kind: str, where: str) -> dict[str, Any]:
    """A call item of an earlier answer as the assistant's tool call, under the name the model sees."""
    if kind == "tool_search_call":
        arguments = item.get("arguments") if item.get("arguments") is not None else {}
        return {"id": item.get("call_id"), "type": "function",
                "function": {"name": TOOL_SEARCH, "arguments": arguments}}
    name = joined_name(item.get("namespace"), item.get("name"))
    if kind == "custom_tool_call":
        arguments: Any = {CUSTOM_INPUT: text(item.get("input"), f"{where}.input", empty=True)}
    else:
        arguments = item.get("arguments", "{}")
    return {"id": item.get("call_id"), "type": "function", "function": {"name": name, "arguments": arguments}}


def _loaded_tools(item: dict, where: str, flat: FlatTools) -> dict[str, Any]:
    """A tool_search_output: its tools join the request's, and the tool result names them."""
    tools = item.get("tools")
    if not isinstance(tools, list):
        raise InvalidRequest(f"'{where}.tools' must be a list of tools", f"{where}.tools")
    names = [tool.get("name") for tool in flat.add(tools, f"{where}.tools", loaded=True) if isinstance(tool, dict)]
    loaded = ", ".join(str(name) for name in names) if names else "none"
    return {"role": "tool", "tool_call_id": text(item.get("call_id"), f"{where}.call_id"),
            "content": f"Tools loaded: {loaded}", WHERE: where}  # checked like any tool result


def check_call_outputs(turns: list[dict[str, Any]]) -> None:
    """Every tool result (a function's, a custom tool's, a tool search's) answers a call made before it (in the
    input, or in the stored response it chains): one whose call_id matches none would reach the model as an answer
    to a question nobody asked. The turns lose the mark of where each result came from."""
    calls: set[str] = set()
    for turn in turns:
        calls.update(call["id"] for call in turn.get("tool_calls") or ())
        where = turn.pop(WHERE, None)
        turn.pop(COMPACTED, None)
        if turn["role"] == "tool" and where is not None and turn["tool_call_id"] not in calls:
            raise InvalidRequest(f"'{where}.call_id': no call with call_id '{turn['tool_call_id']}' (a function_call, "
                                 "custom_tool_call or tool_search_call) comes before this output (in the input or the "
                                 "previous response)", f"{where}.call_id",
                                 "unknown_call_id")


def compacted_turn(item: dict, where: str) -> dict[str, Any]:
    """A compaction item (POST /v1/responses/compact made it) as the user turn that hands its summary on."""
    summary = decrypted_reasoning(text(item.get("encrypted_content"), f"{where}.encrypted_content"))
    if summary is None:
        raise InvalidRequest(f"'{where}.encrypted_content' was not made by this server's /v1/responses/compact "
                             "(another server's compaction cannot be read here)", f"{where}.encrypted_content",
                             "invalid_compaction")
    return {"role": "user", "content": COMPACTION_PREFIX + summary, COMPACTED: True}


def _assistant(turns: list[dict[str, Any]], reasoning: list[str]) -> dict[str, Any]:
    """The assistant turn an assistant item belongs to: the last turn if it is the assistant's and no tool result
    followed it, else a new one (taking the reasoning items before it)."""
    if not (turns and turns[-1]["role"] == "assistant") or reasoning:
        turns.append({"role": "assistant", "content": ""})
    if reasoning:
        turns[-1]["reasoning_content"] = "\n".join(reasoning)
        reasoning.clear()
    return turns[-1]


def _message(item: dict, where: str, found: Content) -> dict[str, Any]:
    role = item.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"'{where}.role' must be one of {', '.join(ROLES)}", f"{where}.role")
    return {"role": ROLES[role], "content": _content(item.get("content"), f"{where}.content", found)}


def _content(content: Any, where: str, found: Content) -> str:
    """Content parts as the text the template renders; an image is its tag there (appliance.front.api.images)."""
    return content_text(chat_parts(content, where), where, found)


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
    """The reasoning text of our encrypted_content; None for anything else (another server's, or a damaged one).
    Only encrypted_reasoning()'s exact output is read: the base64 decoder skips characters outside its alphabet
    and stray bits, which would turn a damaged item into some other (or an empty) text."""
    if not encrypted.startswith(ENCRYPTED_PREFIX):
        return None
    try:
        decoded = base64.urlsafe_b64decode(encrypted[len(ENCRYPTED_PREFIX):].encode()).decode()
    except (binascii.Error, ValueError):
        return None
    return decoded if encrypted_reasoning(decoded) == encrypted else None


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
               "user": None, "completed_at": None, **self.req.echo}
        out.update(fields)
        return out

    def event(self, type_: str, **data: Any) -> tuple[str, dict[str, Any]]:
        self.sequence += 1
        return type_, {"type": type_, "sequence_number": self.sequence - 1, **data}

    def start(self, first: Event) -> Events:
        if isinstance(first, Event) and first.max_tokens is not None:  # the limit the worker fitted to the window is the one the answer has
            self.req.echo["max_output_tokens"] = first.max_tokens
        return [self.event("response.created", response=self.envelope("in_progress")),
                self.event("response.in_progress", response=self.envelope("in_progress"))]

    def finish(self, done: Event, finish_reason: str) -> Events:
        cut = finish_reason == "length"
        if cut and self.current:
            self.current.extra["status"] = "incomplete"
        events = self.close_all()
        status = "incomplete" if cut else "completed"
        self.response = self.envelope(status, usage=usage(done), completed_at=None if cut else int(time.time()),
                                      incomplete_details={"reason": "max_output_tokens"} if cut else None)
        return events + [self.event(f"response.{status}", response=self.response)]

    def fail(self, exc: RequestFailed, payload: dict[str, Any]) -> Events:
        """The route's `error` event (`payload`: ResponsesErrors.stream_event), then response.failed."""
        self.response = self.envelope("failed", error={"code": exc.code or "server_error", "message": exc.message})
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
        if self._searching(item):
            return {"id": item_id, "type": "tool_search_call", "call_id": item.call_id, "execution": "client",
                    "arguments": item.arguments() if status != "in_progress" else {}, "status": status}
        if item.kind == CUSTOM_CALL_ITEM:
            return {"id": item_id, "type": "custom_tool_call", "call_id": item.call_id, "name": item.name,
                    "input": item.text if status != "in_progress" else "", "status": status,
                    **self.req.names.call_item(item.name)}
        return {"id": item_id, "type": "function_call", "call_id": item.call_id, "name": item.name,
                "arguments": item.text if status != "in_progress" else "", "status": status,
                **self.req.names.call_item(item.name)}

    @staticmethod
    def part(item: Item, text_: str | None = None) -> dict[str, Any]:
        value = item.text if text_ is None else text_
        if item.kind == REASONING_ITEM:
            return {"type": "reasoning_text", "text": value}
        return {"type": "output_text", "text": value, "annotations": [], "logprobs": []}

    def where(self, item: Item) -> dict[str, Any]:
        return {"item_id": item.extra["id"], "output_index": item.index}

    def opened(self, item: Item) -> Events:
        prefix = TOOL_SEARCH_PREFIX if self._searching(item) else ITEM_PREFIXES[item.kind]
        item.extra["id"] = prefix + uuid.uuid4().hex
        events = [self.event("response.output_item.added", output_index=item.index,
                             item=self.item(item, "in_progress"))]
        if item.kind not in (CALL_ITEM, CUSTOM_CALL_ITEM):
            events.append(self.event("response.content_part.added", **self.where(item), content_index=0,
                                     part=self.part(item, "")))
        return events

    def extended(self, item: Item, text_: str) -> Events:
        if self._searching(item):
            return []  # a tool_search_call has no argument deltas: its arguments come whole with the item
        if item.kind == CUSTOM_CALL_ITEM:
            return [self.event("response.custom_tool_call_input.delta", **self.where(item), delta=text_)]
        if item.kind == CALL_ITEM:
            return [self.event("response.function_call_arguments.delta", **self.where(item), delta=text_)]
        if item.kind == REASONING_ITEM:
            return [self.event("response.reasoning_text.delta", **self.where(item), content_index=0, delta=text_)]
        return [self.event("response.output_text.delta", **self.where(item), content_index=0, delta=text_,
                           logprobs=[])]

    def _searching(self, item: Item) -> bool:
        return item.kind == CALL_ITEM and self.req.names.is_tool_search(item.name)

    def closed(self, item: Item) -> Events:
        if self._searching(item):
            events = []
        elif item.kind == CUSTOM_CALL_ITEM:
            events = [self.event("response.custom_tool_call_input.done", **self.where(item), input=item.text)]
        elif item.kind == CALL_ITEM:
            events = [self.event("response.function_call_arguments.done", **self.where(item),
                                 name=self.req.names.call_item(item.name).get("name", item.name),
                                 arguments=item.text)]
        else:
            done = "response.reasoning_text.done" if item.kind == REASONING_ITEM else "response.output_text.done"
            extra = {} if item.kind == REASONING_ITEM else {"logprobs": []}
            events = [self.event(done, **self.where(item), content_index=0, text=item.text, **extra),
                      self.event("response.content_part.done", **self.where(item), content_index=0,
                                 part=self.part(item))]
        return events + [self.event("response.output_item.done", output_index=item.index, item=self.item(item))]

    def stored(self) -> list[dict[str, Any]]:
        """The conversation this response ended, as a later request's previous_response_id continues it: its
        images' tags become words (their pixels are gone once it ends; a tag without its image would fail)."""
        history = [dict(turn) for turn in self.req.history] + [self.turn()]
        if self.req.gen.content.images:
            for turn in history:
                if isinstance(turn.get("content"), str):
                    turn["content"] = IMAGE_TAGS.sub("[image]", turn["content"])
        return history

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
