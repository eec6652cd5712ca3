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
                 single_call: bool = False):
        self.reasoning = ReasoningSplitter() if reasoning else None
        self.tools = ToolCallSplitter(tool_parser, stream_arguments, single_call) if tool_parser else None

    @property
    def calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools else []

    @property
    def cut_short(self) -> bool:
        """The answer ended inside a streamed call's arguments (max_tokens): its finish is not "tool_calls"."""
        return bool(self.tools and self.tools.cut_short)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """Deltas for a new piece of text: {"reasoning_content": ...}, {"content": ...}, or a call's two deltas."""
        return self._deltas(self.reasoning.feed(text) if self.reasoning else [(CONTENT, text)], finish=False)

    def finish(self) -> list[dict[str, Any]]:
        """Deltas for the held-back rest of the answer."""
        return self._deltas(self.reasoning.finish() if self.reasoning else [], finish=True)

    def _deltas(self, pieces: list[tuple[str, str]], finish: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for field, text in pieces:
            if field == CONTENT and self.tools:
                out += self._tool_deltas(self.tools.feed(text))
            elif text:
                out.append({field: text})
        if finish and self.tools:
            out += self._tool_deltas(self.tools.finish())
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
                out.append(self._call_delta(call, {"arguments": fragment}))
            else:  # "call" or "call_start"
                out.append(self._call_delta(value, {"name": value.name, "arguments": ""}, head=True))
                if kind == "call":
                    out.append(self._call_delta(value, {"arguments": value.arguments}))
        return out

    def _call_delta(self, call: ToolCall, function: dict[str, str], head: bool = False) -> dict[str, Any]:
        delta: dict[str, Any] = {"index": self.calls.index(call)}
        if head:
            delta.update(id=call.id, type="function")
        return {"tool_calls": [{**delta, "function": function}]}

    def message(self, text: str) -> dict[str, Any]:
        """The whole answer as a chat message."""
        parts: dict[str, list[str]] = {REASONING: [], CONTENT: []}
        for delta in self.feed(text) + self.finish():
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
