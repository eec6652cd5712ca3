"""Tools in chat completions, request side: `tools`, `tool_choice`, `parallel_tool_calls`, and conversation turns
that carry tool calls (assistant `tool_calls`, `tool` messages) in the shape Hugging Face chat templates expect.

Which calls are enforced by constrained decoding (the worker builds genai structural tags in the model's tool-call
format): `tool_choice: required`, a named tool, and `auto` when any tool has `strict: true` or a grammar. Plain
`auto` lets the model choose; what it writes is parsed afterwards (appliance.front.api.tool_parsers).

Custom tools (`{"type": "custom", "custom": {"name", "description", "format"}}`) take one text input, free or in a
Lark grammar or regex; the template sees each as a function with one string parameter `input`, and the grammar
constrains the input itself (written raw between custom-call tags, appliance.worker.engines.constraints). Hosted
tool types the server cannot run (web_search, file_search, ...) are left out and reported in `ignored`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import flag, json_object, text
from appliance.front.api import grammar_helper, lark_grammar
from appliance.front.api.bounds import bounded_regex, bounded_schema

T = TypeVar("T")

# OpenAI's names are 1-64 of these; 128 here, as a Responses namespace's tools are named `<namespace>__<name>`
# (appliance.front.api.response_tools) and Codex's MCP namespaces are long.
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,128}$")
TOOL_CHOICES = ("none", "auto", "required")
# OpenAI's hosted tools: the platform runs them, this server cannot; they are left out of the prompt, never refused.
HOSTED_TOOL_TYPES = ("web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
                     "code_interpreter", "image_generation", "computer_use_preview", "computer_use", "local_shell",
                     "mcp")
GRAMMAR_SYNTAXES = ("lark", "regex")
CUSTOM_INPUT = "input"  # the one parameter a custom tool has in the template's eyes


@dataclass
class ToolRequest:
    """The tools of one request as the template, the constraint and the parser need them."""

    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI shape, as templates take them
    choice: str = "auto"            # none | auto | required | named
    named: str | None = None        # the function of a named tool_choice
    parallel: bool = True
    # custom tools by name: what their input may be, as the worker's constraint takes it ({"type": "text"},
    # {"type": "grammar", "grammar": EBNF}, {"type": "regex", "regex": ...}); they are in `tools` too
    custom: dict[str, dict[str, str]] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # the hosted tool types left out

    @property
    def active(self) -> bool:
        """Tools go into the prompt and the answer is parsed for calls."""
        return bool(self.tools) and self.choice != "none"

    def schemas(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in self.tools}

    def constraint(self) -> dict[str, Any] | None:
        """The structural-tags constraint for the worker, or None where the model chooses freely."""
        strict = any(t["function"].get("strict") for t in self.tools)
        shaped = any(spec["type"] != "text" for spec in self.custom.values())  # a grammar binds even under auto
        if not self.active or (self.choice == "auto" and not strict and not shaped):
            return None
        schemas = self.schemas()
        names = [self.named] if self.named else list(schemas)
        tools = [{"name": n, "custom": self.custom[n]} if n in self.custom
                 else {"name": n, "parameters": json.dumps(schemas[n])} for n in names]
        return {"type": "tool_calls", "kind": "tool_calls", "param": "tools", "after_reasoning": True,
                "tools": tools, "required": self.choice != "auto",
                "single": not self.parallel or self.named is not None}


def parse_tools(body: dict, left_out: list[str] | tuple[str, ...] = ()) -> ToolRequest:
    """`left_out`: the types of tools a dialect already left out (types the server cannot run), counted with the
    hosted ones."""
    tools = body.get("tools")
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list", "tools")
    parallel = True if body.get("parallel_tool_calls") is None else flag(body, "parallel_tool_calls")
    req = ToolRequest(parallel=parallel, ignored=list(left_out))
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOL_TYPES:
            req.ignored.append(kind)
        elif kind == "custom":
            function, spec = _custom_tool(tool, f"tools[{i}]")
            req.custom[function["function"]["name"]] = spec
            req.tools.append(function)
        else:
            req.tools.append(_tool(tool, f"tools[{i}]"))
    names = [t["function"]["name"] for t in req.tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("'tools' names each function once", "tools")
    choice = body.get("tool_choice")
    if choice is None:
        return req
    if not req.tools and not req.ignored:
        raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
    if isinstance(choice, str) and choice in TOOL_CHOICES:
        req.choice = choice
    elif isinstance(choice, dict) and choice.get("type") in ("function", "custom") \
            and isinstance(choice.get(choice["type"]), dict):
        name = choice[choice["type"]].get("name")
        if name not in names or (name in req.custom) != (choice["type"] == "custom"):
            raise InvalidRequest(f"'tool_choice' names a {choice['type']} tool that is not in 'tools': {name!r}",
                                 "tool_choice")
        req.choice, req.named = "required", name
    else:
        raise InvalidRequest("'tool_choice' must be none, auto, required or "
                             "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")
    if req.choice == "required" and not req.tools:
        raise InvalidRequest(f"'tool_choice' requires a tool call, but the only tools are of types this server "
                             f"cannot run ({', '.join(req.ignored)}): add a function or custom tool, or use auto",
                             "tool_choice")
    return req


def lark_grammars(body: Any) -> list[str]:
    """The Lark grammars of a body's custom tools, in chat completions' shape (format.grammar.definition) or the
    Responses API's (format.definition): what appliance.front.api.grammar_helper converts before the body is
    parsed."""
    tools = body.get("tools") if isinstance(body, dict) else None
    out = []
    for tool in tools if isinstance(tools, list) else ():
        custom = tool.get("custom", tool) if isinstance(tool, dict) and tool.get("type") == "custom" else None
        fmt = custom.get("format") if isinstance(custom, dict) else None
        grammar = fmt.get("grammar", fmt) if isinstance(fmt, dict) else None
        if isinstance(grammar, dict) and grammar.get("syntax") == "lark" and isinstance(grammar.get("definition"), str):
            out.append(grammar["definition"])
    return out


def _custom_tool(tool: dict, where: str) -> tuple[dict[str, Any], dict[str, str]]:
    """A custom tool as the template sees it (a function of one string, `input`), and what its input may be."""
    custom = tool.get("custom")
    if not isinstance(custom, dict):
        raise InvalidRequest(f"'{where}' must be {{\"type\": \"custom\", \"custom\": {{\"name\", ...}}}}", where)
    name = _name(custom.get("name"), f"{where}.custom.name")
    description = text(custom.get("description") or "", f"{where}.custom.description", empty=True)
    spec, note = _custom_format(custom.get("format"), f"{where}.custom.format")
    function = {"name": name, "parameters": {"type": "object", "required": [CUSTOM_INPUT], "properties": {
        CUSTOM_INPUT: {"type": "string", "description": f"the tool's whole input as raw text{note}"}}}}
    if description:
        function["description"] = description
    return {"type": "function", "function": function}, spec


def _custom_format(fmt: Any, where: str) -> tuple[dict[str, str], str]:
    """The worker's spec of a custom tool's `format`, and what the template's parameter says about it."""
    if fmt is None or fmt == {"type": "text"}:
        return {"type": "text"}, ""
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "grammar"):
        raise InvalidRequest(f"'{where}.type' must be text or grammar, got "
                             f"{fmt.get('type') if isinstance(fmt, dict) else fmt!r}", f"{where}.type")
    grammar = fmt.get("grammar")
    if not isinstance(grammar, dict):
        raise InvalidRequest(f"'{where}.grammar' must be an object with 'syntax' and 'definition'", f"{where}.grammar")
    syntax, definition = grammar.get("syntax"), text(grammar.get("definition"), f"{where}.grammar.definition")
    if syntax not in GRAMMAR_SYNTAXES:
        raise InvalidRequest(f"'{where}.grammar.syntax' must be lark or regex, got {syntax!r}",
                             f"{where}.grammar.syntax")
    if syntax == "regex":
        bounded_regex(definition, f"{where}.grammar.definition")
        return {"type": "regex", "regex": definition}, f" matching the regular expression /{definition}/"
    # converted before the body was parsed (in the helper process); a caller that did not is converted here
    ebnf, refusal, code = grammar_helper.conversion(definition) or lark_grammar.converted(definition)
    if refusal is not None:
        raise InvalidRequest(f"'{where}.grammar.definition': {refusal}", f"{where}.grammar.definition", code)
    return {"type": "grammar", "grammar": ebnf}, f" in this Lark grammar:\n{definition}"


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise InvalidRequest(f"'{where}' must be 1-128 letters, digits, '_', '.' or '-'", where)
    return name


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequest(f"'{where}' must be {{\"type\": \"function\", \"function\": {{...}}}}", where)
    function = tool["function"]
    out: dict[str, Any] = {"name": _name(function.get("name"), f"{where}.function.name")}
    if function.get("description") is not None:
        out["description"] = text(function["description"], f"{where}.function.description", empty=True)
    if function.get("parameters") is not None:
        out["parameters"] = bounded_schema(json_object(function["parameters"], f"{where}.function.parameters"),
                                           f"{where}.function.parameters")
    if function.get("strict") is not None:
        out["strict"] = flag(function, "strict")
    return {"type": "function", "function": out}


# how parse_tools names a tool: by its place in the list it was given
FLAT_TOOL = re.compile(r"tools\[(\d+)\]", re.ASCII)


def at_origins(check: Callable[[], T], origins: list[str], renames: tuple[tuple[str, str], ...] = ()) -> T:
    """Run parse_tools on a dialect's tools as a chat-shaped list (some left out, some opened up): a refusal names
    the tool where the client's request has it (`origins[i]` for the list's tools[i]), in the dialect's words
    (`renames`)."""
    try:
        return check()
    except InvalidRequest as exc:
        def origin(words: str) -> str:
            words = FLAT_TOOL.sub(lambda m: origins[int(m[1])] if int(m[1]) < len(origins) else m[0], words, count=1)
            for old, new in renames:
                words = words.replace(old, new)
            return words
        raise InvalidRequest(origin(str(exc)), exc.param and origin(exc.param), exc.code) from None


def assistant_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's tool_calls with arguments as objects, which is what templates render (Llama's
    `arguments | tojson` would print a JSON string as a quoted string). A custom tool's call is rendered as a
    function call whose one argument is its input."""
    if not isinstance(calls, list):
        raise InvalidRequest(f"'{where}' must be a list", where)
    out = []
    for i, call in enumerate(calls):
        at = f"{where}[{i}]"
        if isinstance(call, dict) and call.get("type") == "custom" and isinstance(call.get("custom"), dict):
            custom = call["custom"]
            call = {**call, "function": {"name": custom.get("name"), "arguments": {
                CUSTOM_INPUT: text(custom.get("input"), f"{at}.custom.input", empty=True)}}}
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
