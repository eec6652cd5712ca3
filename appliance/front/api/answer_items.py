"""A chat answer as a sequence of items, the shape the Responses and Messages dialects share: reasoning, text and
tool calls, each opened, extended and closed in the order the model wrote them.

The answer's chat deltas (appliance.front.api.answer: {"reasoning_content": ...}, {"content": ...}, a call's head
and argument fragments) go in; a dialect's subclass turns each item's opening, growth and end into its own events
and builds its whole object from the same items, so a streamed answer and a whole one cannot disagree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from appliance.front.api.reasoning import CONTENT, REASONING

REASONING_ITEM, TEXT_ITEM, CALL_ITEM, CUSTOM_CALL_ITEM = "reasoning", "text", "call", "custom_call"
Events = list[tuple[str, dict[str, Any]]]  # (SSE event name, its data)


@dataclass
class Item:
    kind: str                 # reasoning | text | call | custom_call
    index: int                # its place among the answer's items
    text: str = ""            # reasoning or text; a call's arguments (JSON text) or custom input as written so far
    call_id: str = ""
    name: str = ""
    done: bool = False
    extra: dict[str, Any] = field(default_factory=dict)  # the dialect's own ids

    def arguments(self) -> dict[str, Any]:
        """A call's arguments as an object ({} for arguments cut short, which no client should run)."""
        try:
            value = json.loads(self.text or "{}")
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class ItemStream:
    """feed() each chat delta, then finish() or fail(); each returns the dialect's events (ignored for a whole
    answer). Subclasses implement opened, extended and closed (the events of an item) and the envelope."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.calls: dict[int, Item] = {}  # a call's index in the chat deltas -> its item

    @property
    def current(self) -> Item | None:
        return self.items[-1] if self.items and not self.items[-1].done else None

    def feed(self, delta: dict[str, Any]) -> Events:
        if REASONING in delta:
            return self._text(REASONING_ITEM, delta[REASONING])
        if CONTENT in delta:
            return self._text(TEXT_ITEM, delta[CONTENT])
        events: Events = []
        for call in delta.get("tool_calls", ()):
            custom = "custom" in call
            function = call["custom"] if custom else call.get("function", {})
            if "id" in call:  # a call's head: a new item
                events += self._close()
                item = self._open(CUSTOM_CALL_ITEM if custom else CALL_ITEM, call_id=call["id"],
                                  name=function.get("name", ""))
                self.calls[call["index"]] = item
                events += self.opened(item)
            written = function.get("input" if custom else "arguments")
            if written:
                item = self.calls[call["index"]]
                item.text += written
                events += self.extended(item, written)
        return events

    def _text(self, kind: str, text: str) -> Events:
        if not text:
            return []
        events: Events = []
        item = self.current
        if item is None or item.kind != kind:
            events += self._close()
            item = self._open(kind)
            events += self.opened(item)
        item.text += text
        return events + self.extended(item, text)

    def _open(self, kind: str, **fields: Any) -> Item:
        item = Item(kind, len(self.items), **fields)
        self.items.append(item)
        return item

    def _close(self) -> Events:
        item = self.current
        if item is None:
            return []
        item.done = True
        return self.closed(item)

    def close_all(self) -> Events:
        return self._close()

    # --- the dialect's events -----------------------------------------------------------------------------

    def opened(self, item: Item) -> Events:
        raise NotImplementedError

    def extended(self, item: Item, text: str) -> Events:
        raise NotImplementedError

    def closed(self, item: Item) -> Events:
        raise NotImplementedError
