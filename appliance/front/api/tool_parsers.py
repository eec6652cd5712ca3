"""Tool calls in a model's answer, per model family (`tool_parser:`), whole or streamed.

The answer's text before the first call marker is content and streams as it comes. From the marker on, a call the
model chose freely is held until it is complete and parses: a malformed call (a model writing one on its own)
comes back as content, so the client sees what the model wrote, never half a call or a 500. A call whose shape
the grammar enforces (required, named or strict tools, streamed) goes out as it is written instead: its name once
the call's head is in, then its arguments fragment by fragment, as OpenAI streams them.

A custom tool's call is the same in every family: `<custom_tool_call name="NAME">input</custom_tool_call>` (the
form its constraint writes, appliance.worker.engines.constraints); its input streams as it is written. A model that
calls a custom tool the family's way instead (`{"name": ..., "arguments": {"input": ...}}`) is read as that call.

An answer cut by max_tokens inside a call never leaks the family's markup as content: a call whose name is in
comes back with the arguments (or input) written so far, and its finish reason stays "length".
"""

from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Any

from appliance.front.api.reasoning import partial_suffix


CUSTOM_CALL_OPEN, CUSTOM_CALL_END = "<custom_tool_call", "</custom_tool_call>"
CUSTOM_CALL_HEAD = re.compile(r'\s*<custom_tool_call name="([^"<>\n]*)">')


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it; a custom tool's input text
    kind: str = "function"  # or "custom"

    def message(self) -> dict[str, Any]:
        if self.kind == "custom":
            return {"id": self.id, "type": "custom", "custom": {"name": self.name, "input": self.arguments}}
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class MalformedCall(ValueError):
    pass


def _call_id(family: str) -> str:
    if family == "mistral":  # Mistral's templates use exactly the last 9 characters of an id
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def _call(family: str, obj: Any, arguments_key: str = "arguments") -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise MalformedCall("a call is an object with a name")
    arguments = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            raise MalformedCall("arguments are not JSON") from None
    if not isinstance(arguments, dict):
        raise MalformedCall("arguments are an object")
    return ToolCall(_call_id(family), obj["name"], json.dumps(arguments, ensure_ascii=False))


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values separated by whitespace, ';' or ','. Control characters inside strings are
    accepted (genai's JSON grammar lets a model write a raw tab there); the arguments are re-serialised anyway."""
    decoder, values, at = json.JSONDecoder(strict=False), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n;,":
            at += 1
        if at == len(text):
            return values
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            raise MalformedCall("not JSON") from None
        values.append(value)


def _name_of(head: re.Match) -> str | None:
    """The call name a CALL_NAME head matched (a JSON string's inside), or None where it is not valid JSON (a bad
    escape, a raw control character: a model writing freely may write either)."""
    try:
        return json.loads(f'"{head[1]}"')
    except ValueError:
        return None


# The start of a JSON call object up to its arguments' key: `{"name": "NAME", ` (the name's inside in group 1).
CALL_NAME = r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*'


class ToolCallParser:
    """One family's format. `markers`: where a call section may begin; `at_start`: only at the answer's start."""

    family = ""
    markers: tuple[str, ...] = ()
    end_marker: str | None = None  # where one call ends, when the format marks it (calls then stream one by one)
    at_start = False
    # JSON formats, for arguments streamed as written: a call's text up to its arguments object (the name in
    # group 1, a JSON string's inside), and what follows that object up to the call's end.
    call_head: re.Pattern | None = None
    call_tail: re.Pattern | None = None

    def __init__(self, schemas: dict[str, dict] | None = None):
        self.schemas = schemas or {}

    def section_start(self, text: str) -> int:
        """Index of the first call marker in text, or -1."""
        if self.at_start:
            head = len(text) - len(text.lstrip())
            return head if any(text[head:].startswith(m) for m in self.markers) else -1
        hits = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        return min(hits, default=-1)

    def may_start(self, text: str) -> int:
        """How many trailing characters could begin a marker (held back while streaming)."""
        if self.at_start:
            head = text.lstrip()
            return len(text) if any(m.startswith(head) for m in self.markers) else 0
        return max((partial_suffix(text, m) for m in self.markers), default=0)

    def parse_section(self, section: str) -> tuple[list[ToolCall], str]:
        """The calls of a section that starts at a marker, and the content written after them."""
        raise NotImplementedError

    def cut_call(self, section: str) -> ToolCall | None:
        """The call a section cut short by max_tokens begins: its name, and its arguments as far as they were
        written; None if its name never came."""
        head = self.call_head.match(section) if self.call_head else None
        name = _name_of(head) if head else None
        if name is None:
            return None
        return ToolCall(_call_id(self.family), name, section[head.end():])


class HermesParser(ToolCallParser):
    family = "hermes"
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
    call_head = re.compile(r'\s*<tool_call>\s*' + CALL_NAME + r'"arguments"\s*:\s*')
    call_tail = re.compile(r"\s*\}\s*</tool_call>")

    def parse_section(self, section):
        calls, rest, at = [], [], 0
        for match in self.BLOCK.finditer(section):
            rest.append(section[at:match.start()])
            values = _json_values(match.group(1))
            if len(values) != 1:
                raise MalformedCall("one JSON object per <tool_call>")
            calls.append(_call(self.family, values[0]))
            at = match.end()
        rest.append(section[at:])
        return calls, "".join(rest).strip()


class Qwen3CoderParser(ToolCallParser):
    family = "qwen3_coder"
    markers = ("<tool_call>",)
    end_marker = "</tool_call>"
    BLOCK = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*(?:</tool_call>|$)", re.DOTALL)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse_section(self, section):
        calls, rest, at = [], [], 0
        for match in self.BLOCK.finditer(section):
            if section[at:match.start()].strip():
                rest.append(section[at:match.start()])
            name = match.group(1).strip()
            properties = (self.schemas.get(name) or {}).get("properties") or {}
            # Whitespace around a value is layout (genai's QwenXMLParametersFormat writes some), not data.
            arguments = {p.strip(): self._value(v.strip(), properties.get(p.strip()))
                         for p, v in self.PARAMETER.findall(match.group(2))}
            calls.append(_call(self.family, {"name": name, "arguments": arguments}))
            at = match.end()
        if not calls:
            raise MalformedCall("no <function=...> block")
        rest.append(section[at:])
        return calls, "".join(rest).strip()

    CUT_HEAD = re.compile(r"\s*<tool_call>\s*<function=([^>\n]+)>")

    def cut_call(self, section):
        """Its arguments are XML, not JSON: the parameters whose end tag came, as a JSON object."""
        head = self.CUT_HEAD.match(section)
        if head is None:
            return None
        name = head.group(1).strip()
        properties = (self.schemas.get(name) or {}).get("properties") or {}
        arguments = {p.strip(): self._value(v.strip(), properties.get(p.strip()))
                     for p, v in self.PARAMETER.findall(section[head.end():])}
        return ToolCall(_call_id(self.family), name, json.dumps(arguments, ensure_ascii=False))

    @staticmethod
    def _value(text: str, schema: Any) -> Any:
        """Parameter values are bare text: strings stay text, other types are read as JSON where they parse."""
        if isinstance(schema, dict) and schema.get("type") == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text


class Llama3JsonParser(ToolCallParser):
    family = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True
    call_head = re.compile(r'[\s;]*(?:<\|python_tag\|>)?\s*' + CALL_NAME + r'"parameters"\s*:\s*')
    call_tail = re.compile(r"\s*\}")

    def parse_section(self, section):
        body = section.strip().removeprefix("<|python_tag|>")
        values = _json_values(body)
        if not values:
            raise MalformedCall("no call")
        return [_call(self.family, v, "parameters") for v in values], ""


class MistralParser(ToolCallParser):
    family = "mistral"
    markers = ("[TOOL_CALLS]",)
    call_head = re.compile(r'\s*\[TOOL_CALLS\]\s*\[\s*' + CALL_NAME + r'"arguments"\s*:\s*')
    call_tail = re.compile(r"\s*\}\s*\]")

    def section_start(self, text):
        start = super().section_start(text)
        if start < 0 and text.lstrip().startswith('[{"name"'):  # the special token itself may be decoded away
            return len(text) - len(text.lstrip())
        return start

    def parse_section(self, section):
        calls = []
        for block in section.split("[TOOL_CALLS]"):
            for value in _json_values(block):
                for obj in value if isinstance(value, list) else [value]:
                    calls.append(_call(self.family, obj))
        if not calls:
            raise MalformedCall("no call")
        return calls, ""


PARSERS = {cls.family: cls for cls in (HermesParser, Qwen3CoderParser, Llama3JsonParser, MistralParser)}


def parser_for(family: str, schemas: dict[str, dict] | None = None) -> ToolCallParser:
    return PARSERS[family](schemas)


class JsonObjectEnd:
    """Finds where a JSON object that arrives in pieces ends: braces counted outside strings."""

    def __init__(self):
        self.depth = 0
        self.in_string = False
        self.escaped = False

    def feed(self, text: str) -> int | None:
        """The index in text just past the object's closing brace, or None while it goes on."""
        for at, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
            elif char == '"':
                self.in_string = True
            elif char == "{":
                self.depth += 1
            elif char == "}":
                self.depth -= 1
                if self.depth == 0:
                    return at + 1
        return None


class ToolCallSplitter:
    """feed() pieces of an answer's content, then finish(). Content streams until a call marker. From there, in a
    format whose calls have an end marker, each call goes out as soon as it is complete; the rest of the section
    is parsed when the answer ends. Returns ("content", text) and ("call", ToolCall) pieces; .calls has them all.

    With stream_arguments (the grammar guarantees the calls' shape) a JSON format's calls go out as written
    instead: ("call_start", ToolCall) once its head is in, then ("arguments", (ToolCall, text)) pieces. Custom
    tools' calls (`custom`: their names) always go out that way.

    With single (parallel_tool_calls: false) the answer holds one call at most: the first; calls the model writes
    after it are dropped (a grammar stops after the first where the calls are constrained)."""

    def __init__(self, parser: ToolCallParser, stream_arguments: bool = False, single: bool = False,
                 custom: frozenset[str] | set[str] = frozenset()):
        self.parser = parser
        self.single = single
        self.custom_names = custom
        self.markers = parser.markers + ((CUSTOM_CALL_OPEN,) if custom else ())
        self.held = ""
        self.seen = ""        # content already released (an at_start marker must be at the answer's start)
        self.in_section = False
        self.broken = False   # a call that does not parse: the rest of the section is content
        self.calls: list[ToolCall] = []
        self.stream_arguments = stream_arguments and parser.call_head is not None
        self.writing: tuple[ToolCall, JsonObjectEnd] | None = None  # the streamed call whose arguments go on
        self.closing: ToolCall | None = None  # a streamed call whose arguments ended, waiting for its tail
        self.custom: ToolCall | None = None   # the custom call whose input goes on
        self.ended_in_call = False  # finish(cut=True) found a call cut short

    def _section_start(self) -> int:
        at_start_done = self.parser.at_start and self.seen.strip()
        starts = [self.parser.section_start(self.held) if not at_start_done else -1]
        if self.custom_names:
            starts.append(self.held.find(CUSTOM_CALL_OPEN))
        return min((s for s in starts if s >= 0), default=-1)

    def _may_start(self) -> int:
        keep = self.parser.may_start(self.held) if not (self.parser.at_start and self.seen.strip()) else 0
        return max(keep, partial_suffix(self.held, CUSTOM_CALL_OPEN) if self.custom_names else 0)

    def feed(self, text: str) -> list[tuple[str, Any]]:
        self.held += text
        if self.in_section:
            return self._complete_calls()
        start = self._section_start()
        if start >= 0:
            self.in_section = True
            released, self.held = self.held[:start], self.held[start:]
        else:
            keep = self._may_start()
            released, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
        self.seen += released
        return ([("content", released)] if released else []) + (self._complete_calls() if self.in_section else [])

    def _complete_calls(self) -> list[tuple[str, Any]]:
        """The calls (or parts of calls) off the front of the section, as far as the held text goes."""
        out: list[tuple[str, Any]] = []
        while self.held and not self.broken:
            if self.custom or (not (self.writing or self.closing)
                               and self.held.lstrip().startswith(CUSTOM_CALL_OPEN)):
                step = self._custom_step()
            elif self.stream_arguments:
                step = self._written_step()
            else:
                step = self._whole_step()
            if step is None:
                break
            out += step
        return out

    def _whole_step(self) -> list[tuple[str, Any]] | None:
        """The next call once its end marker has arrived, parsed off the front of the section; None to wait."""
        end_marker = self.parser.end_marker
        block = self.held.lstrip()
        if not end_marker or not block.startswith(self.parser.markers) or end_marker not in block:
            return None
        end = block.index(end_marker) + len(end_marker)
        try:
            calls, after = self.parser.parse_section(block[:end])
        except MalformedCall:
            self.broken = True
            return None
        self.held = after + block[end:]
        return self._add(calls)

    def _written_step(self) -> list[tuple[str, Any]] | None:
        """A head, an argument fragment or a tail off the front of the held text; None to wait."""
        if self.writing:
            call, object_end = self.writing
            end = object_end.feed(self.held)
            fragment, self.held = (self.held, "") if end is None else (self.held[:end], self.held[end:])
            call.arguments += fragment
            if end is not None:
                self.writing, self.closing = None, call
            return [("arguments", (call, fragment))]
        if self.closing:
            tail = self.parser.call_tail.match(self.held)
            if not tail:
                return None  # more to come (the grammar writes the tail whole, unless the answer is cut short)
            self.held, self.closing = self.held[tail.end():], None
            return []
        head = self.parser.call_head.match(self.held)
        if not head or head.end() == len(self.held):  # the arguments' first character decides
            return None
        name = _name_of(head)
        if self.held[head.end()] != "{" or name is None:
            self.broken = True  # not the shape the grammar writes: the rest is content
            return None
        call = ToolCall(_call_id(self.parser.family), name, "")
        self.held = self.held[head.end():]
        self.writing = (call, JsonObjectEnd())
        self.calls.append(call)
        return [("call_start", call)]

    def _custom_step(self) -> list[tuple[str, Any]] | None:
        """A custom call's head, or the next piece of its input (up to its end tag); None to wait."""
        if self.custom is None:
            if ">" not in self.held:
                return None
            head = CUSTOM_CALL_HEAD.match(self.held)
            if not head or head[1] not in self.custom_names:
                self.broken = True  # a tag naming no custom tool of this request: the rest is content
                return None
            self.custom = ToolCall(_call_id(self.parser.family), head[1], "", kind="custom")
            self.held = self.held[head.end():]
            self.calls.append(self.custom)
            return [("call_start", self.custom)]
        call, end = self.custom, self.held.find(CUSTOM_CALL_END)
        if end >= 0:
            fragment, self.held, self.custom = self.held[:end], self.held[end + len(CUSTOM_CALL_END):], None
        else:
            keep = partial_suffix(self.held, CUSTOM_CALL_END)
            fragment, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
            if not fragment:
                return None
        call.arguments += fragment
        return [("arguments", (call, fragment))] if fragment else []

    @property
    def cut_short(self) -> bool:
        """After finish(): the answer ended inside a call (max_tokens), so that call is not whole."""
        return self.writing is not None or self.custom is not None or self.ended_in_call

    def _add(self, calls: list[ToolCall]) -> list[tuple[str, Any]]:
        if self.single:
            calls = calls[:max(0, 1 - len(self.calls))]
        for call in calls:
            if call.name in self.custom_names:  # a custom tool called the family's way: its input is the call
                call.kind = "custom"
                value = json.loads(call.arguments).get("input")
                call.arguments = value if isinstance(value, str) else call.arguments
        self.calls += calls
        return [("call", call) for call in calls]

    def finish(self, cut: bool = False) -> list[tuple[str, Any]]:
        """The rest of the answer; `cut`: it ended at max_tokens, so a call it ends inside is a call cut short."""
        if self.writing or self.closing or self.custom:  # cut short inside a streamed call or its tail: what was
            self.held = ""                               # sent stays
        held, self.held = self.held, ""
        if not self.in_section or self.broken:
            return [("content", held)] if held else []
        if not held.strip():
            return []
        if held.lstrip().startswith(CUSTOM_CALL_OPEN):  # a custom call whose head never ended
            return [] if cut else [("content", held)]
        try:
            calls, after = self.parser.parse_section(held)
        except MalformedCall:
            return self._cut_call(held) if cut else [("content", held)]
        return self._add(calls) + ([("content", after)] if after else [])

    def _cut_call(self, held: str) -> list[tuple[str, Any]]:
        """A section cut short by max_tokens: its call with the arguments written so far where its name is in,
        else nothing (the family's markup is never content)."""
        call = self.parser.cut_call(held)
        if call is None:
            return []
        self.ended_in_call = True
        self.calls.append(call)
        return [("call_start", call), ("arguments", (call, call.arguments))]
