"""Tools in chat completions, request side: `tools`, `tool_choice`, `parallel_tool_calls`, and conversation turns
that carry tool calls (assistant `tool_calls`, `tool` messages) in the shape Hugging Face chat templates expect.

Which calls are enforced by constrained decoding (the worker builds genai structural tags in the model's tool-call
format): `tool_choice: required`, a named function, and `auto` when any tool has `strict: true`. Plain `auto` lets
the model choose; what it writes is parsed afterwards (appliance.front.api.tool_parsers).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import flag, json_object, text

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
TOOL_CHOICES = ("none", "auto", "required")


@dataclass
class ToolRequest:
    """The tools of one request as the template, the constraint and the parser need them."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, as templates take them
    choice: str = "auto"            # none | auto | required | named
    named: str | None = None        # the function of a named tool_choice
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Tools go into the prompt and the answer is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def schemas(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    def constraint(self) -> dict[str, Any] | None:
        """The structural-tags constraint for the worker, or None where the model chooses freely."""
        strict = any(t["function"].get("strict") for t in self.tools)
        if not self.active or (self.choice == "auto" and not strict):
            return None
        names = [self.named] if self.named else list(self.schemas())
        return {"type": "tool_calls", "kind": "tool_calls", "param": "tools", "after_reasoning": True,
                "tools": [{"name": n, "parameters": json.dumps(self.schemas()[n])} for n in names],
                "required": self.choice != "auto", "single": not self.parallel or self.named is not None}


def parse_tools(body: dict) -> ToolRequest:
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", "tools")
    parallel = True if body.get("parallel_tool_calls") is None else flag(body, "parallel_tool_calls")
    req = ToolRequest(tools=[_tool(t, f"tools[{i}]") for i, t in enumerate(tools)], parallel=parallel)
    names = [t["function"]["name"] for t in req.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("'tools' names each function once", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return req
    if not req.tools:
        raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        req.choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise InvalidRequest(f"'tool_choice' names a function that is not in 'tools': {name!r}", "tool_choice")
        req.choice, req.named = "required", name
    else:
        raise InvalidRequest("'tool_choice' must be none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    return req


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidRequest(f"'{where}.function.name' must be 1-64 letters, digits, '_', '.' or '-'",
                             f"{where}.function.name")
    out: dict[str, Any] = {"name": name}
    if function.get("description") is not None:
        out["description"] = text(function["description"], f"{where}.function.description", empty=True)
    if function.get("parameters") is not None:
        out["parameters"] = json_object(function["parameters"], f"{where}.function.parameters")
    if function.get("strict") is not None:
        out["strict"] = flag(function, "strict")
    return {"type": "function", "function": out}


def assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls with arguments as objects, which is what templates render (Llama's
    `arguments | tojson` would print a JSON string as a quoted string)."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}' must be a list", where)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
            raise InvalidRequest(f"'{at}' must be {{\"id\", \"type\": \"function\", \"function\": {{...}}}}", at)
        function = call["function"]
        arguments = _arguments(function.get("arguments", "{}"), f"{at}.function.arguments")
        call_id = call.get("id")
        out.append({"id": text(call_id, f"{at}.id") if call_id is not None else f"call_{i}", "type": "function",
                    "function": {"name": text(function.get("name"), f"{at}.function.name"), "arguments": arguments}})
    return out


def _arguments(raw: Any, where: str) -> dict | str:
    """A call's arguments as an object where they are one (a JSON object, or its text); other text as it was."""
    if isinstance(raw, str):
        try:
            parsed = json.loads(text(raw, where, empty=True) or "{}")
        except (ValueError, RecursionError):
            return raw
        if not isinstance(parsed, dict):
            return raw
        raw = parsed
    if not isinstance(raw, dict):
        raise InvalidRequest(f"'{where}' must be a JSON string", where)
    return json_object(raw, where)


def name_tool_results(messages: list[dict[str, Any]]) -> None:
    """Give each `tool` message the function name of the call it answers (Hermes-style templates print it)."""
    names: dict[str, str] = {}
    for message in messages:
        for call in message.get("tool_calls") or ():
            names[call["id"]] = call["function"]["name"]
        if message["role"] == "tool" and "name" not in message and message.get("tool_call_id") in names:
            message["name"] = names[message["tool_call_id"]]
