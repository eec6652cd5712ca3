"""The reasoning split: a `<think>...</think>` block at the start of an answer goes to `reasoning_content`, the
rest to `content`, the same way whole or streamed (text arrives in arbitrary pieces; a tag may be split across
them). When the chat template opened the block in the prompt, the worker sends the opening tag first, so a model
that starts inside the block is split the same way.
"""

from __future__ import annotations

from appliance.chat_formats import THINK_CLOSE, THINK_OPEN

REASONING, CONTENT = "reasoning_content", "content"


def partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (to hold back until the next piece)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningSplitter:
    """feed() pieces of an answer, then finish(); each returns [(field, text)] with field reasoning_content or
    content."""

    def __init__(self) -> None:
        self.state = "start"  # start -> thinking -> answer, or start -> answer
        self.held = ""
        self.trim = False  # newlines right after a tag belong to the tag, even when they come in the next piece

    def feed(self, text: str) -> list[tuple[str, str]]:
        self.held += text
        out: list[tuple[str, str]] = []
        if self.state == "start":
            head = self.held.lstrip()
            if THINK_OPEN.startswith(head):
                return out  # still could be the opening tag
            if head.startswith(THINK_OPEN):
                self.state, self.held, self.trim = "thinking", head[len(THINK_OPEN):], True
            else:
                self.state = "answer"
        self._trim()
        if self.state == "thinking":
            end = self.held.find(THINK_CLOSE)
            if end < 0:
                keep = partial_suffix(self.held, THINK_CLOSE)
                out.append((REASONING, self.held[:len(self.held) - keep]))
                self.held = self.held[len(self.held) - keep:]
                return [piece for piece in out if piece[1]]
            out.append((REASONING, self.held[:end].rstrip("\n")))
            self.state, self.held, self.trim = "answer", self.held[end + len(THINK_CLOSE):], True
            self._trim()
        if self.state == "answer" and self.held:
            out.append((CONTENT, self.held))
            self.held = ""
        return [piece for piece in out if piece[1]]

    def _trim(self) -> None:
        if self.trim:
            self.held = self.held.lstrip("\n")
            self.trim = not self.held

    def finish(self) -> list[tuple[str, str]]:
        """The end of the answer: a block never closed (cut by max_tokens) stays reasoning."""
        held, self.held = self.held, ""
        if not held:
            return []
        return [(REASONING if self.state == "thinking" else CONTENT, held)]
