"""A chat answer as the client sees it: the model's text split into reasoning, content and tool calls, either
whole (one message) or as OpenAI stream deltas.

Parsing happens here in the front, not in the worker: the worker stays a text generator whose frames are the same
for every request, the front holds the request's tools and the model's formats, and the parsers are plain Python
(genai's own parsers cover reasoning and Llama 3 only, and produce whole messages rather than OpenAI deltas).
"""

from __future__ import annotations

from typing import Any

from appliance.front.api.reasoning import CONTENT, REASONING, ReasoningSplitter
from appliance.front.api.tool_parsers import ToolCall, ToolCallParser, ToolCallSplitter


class AnswerParser:
    def __init__(self, reasoning: bool, tool_parser: ToolCallParser | None, stream_arguments: bool = False,
                 single_call: bool = False, custom_tools: frozenset[str] = frozenset()):
        self.reasoning = ReasoningSplitter() if reasoning else None
        self.tools = (ToolCallSplitter(tool_parser, stream_arguments, single_call, custom_tools) if tool_parser
                      else None)

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    @property
    def cut_short(self) -> bool:
        """The answer ended inside a call (max_tokens): its finish is not "tool_calls"."""
        return bool(self.tools and self.tools.cut_short)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for a new piece of text: {"reasoning_content": ...}, {"content": ...}, or a call's two deltas."""
        return self._deltas(self.reasoning.feed(text) if self.reasoning else [(CONTENT, text)])

    def finish(self, cut: bool = False) -> list[dict[str, Any]]:
        """Deltas for the held-back rest of the answer; `cut`: it ended at max_tokens (a call it ends inside
        comes back as a call cut short, never as the family's markup)."""
        out = self._deltas(self.reasoning.finish() if self.reasoning else [])
        return out + (self._tool_deltas(self.tools.finish(cut)) if self.tools else [])

    def _deltas(self, pieces: list[tuple[str, str]]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for field, text in pieces:
            if field == CONTENT and self.tools:
                out += self._tool_deltas(self.tools.feed(text))
            elif text:
                out.append({field: text})
        return out

    def _tool_deltas(self, pieces: list[tuple[str, Any]]) -> list[dict[str, Any]]:
        """Content as it is; a call as OpenAI streams one: index, id, type and name first, then the arguments
        (whole, or in the fragments a call streamed as written comes in)."""
        out: list[dict[str, Any]] = []
        for kind, value in pieces:
            if kind == CONTENT:
                out.append({CONTENT: value})
            elif kind == "arguments":
                call, fragment = value
                out.append(self._call_delta(call, fragment))
            else:  # "call" or "call_start"
                out.append(self._call_delta(value, "", head=True))
                if kind == "call":
                    out.append(self._call_delta(value, value.arguments))
        return out

    def _call_delta(self, call: ToolCall, arguments: str, head: bool = False) -> dict[str, Any]:
        """A function call's delta ({"function": {"name", "arguments"}}), or a custom tool call's ({"custom":
        {"name", "input"}}, as OpenAI's chat completions spell one)."""
        delta: dict[str, Any] = {"index": self.calls.index(call)}
        body: dict[str, str] = {"input" if call.kind == "custom" else "arguments": arguments}
        if head:
            delta.update(id=call.id, type=call.kind)
            body = {"name": call.name, **body}
        return {"tool_calls": [{**delta, call.kind: body}]}

    def message(self, text: str, cut: bool = False) -> dict[str, Any]:
        """The whole answer as a chat message; `cut`: it ended at max_tokens."""
        parts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        for delta in self.feed(text) + self.finish(cut):
            for field in (REASONING, CONTENT):
                if field in delta:
                    parts[field].append(delta[field])
        content = "".join(parts[CONTENT])
        message: dict[str, Any] = {"role": "assistant", "content": content if content or not self.calls else None}
        if self.reasoning:
            message[REASONING] = "".join(parts[REASONING]) or None
        if self.calls:
            message["tool_calls"] = [call.message() for call in self.calls]
        return message
