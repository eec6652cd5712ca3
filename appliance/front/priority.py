"""A request's priority class, as a pure function of its key, its X-OpenArc-Priority header and its body.

`interactive` is a person waiting; `background` is work nobody watches token by token (an indexer, an agent's
loop, a chat UI's housekeeping). A key's `priority` is the highest class its requests get: the header may lower it,
never raise it. Chat UIs' housekeeping requests are background whatever their key: Open WebUI's task prompts
(title, tags, follow-ups, search and retrieval queries, autocomplete; tests/fixtures/open-webui-task-prompts.json
holds them as its source has them) all start with "### Task:" and quote the conversation in <chat_history>, which
a person's own message almost never does.
"""

from __future__ import annotations

import re
from typing import Any

INTERACTIVE = "interactive"
BACKGROUND = "background"
CLASSES = (INTERACTIVE, BACKGROUND)
HEADER = "X-OpenArc-Priority"

# Open WebUI's task prompt: its first line, and the chat history it quotes (custom templates keep both).
TASK_PROMPT_START = re.compile(r"\A\s*### Task:")
CHAT_HISTORY = "<chat_history>"
# Which task, from the output each default template asks for (for the log and the tests).
TASK_MARKERS = (("autocomplete", "autocompletion system"), ("title", '"title"'), ("tags", '"tags"'),
                ("follow_ups", '"follow_ups"'), ("queries", '"queries"'), ("image_prompt", '"prompt"'))


class BadPriority(ValueError):
    """An X-OpenArc-Priority header that names no class."""


def housekeeping_task(body: Any) -> str | None:
    """The chat UI housekeeping task a chat request is (title, tags, follow_ups, queries, autocomplete, image_prompt,
    or "task" for a customised template), or None for anything else. Reads the last message only."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return None
    last = messages[-1]
    text = _text(last.get("content"))
    if last.get("role") != "user" or not TASK_PROMPT_START.match(text) or CHAT_HISTORY not in text:
        return None
    return next((task for task, marker in TASK_MARKERS if marker in text), "task")


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def request_class(key_priority: str, header: str | None, body: Any) -> str:
    """The class a request runs in: its key's, lowered by the header or by being housekeeping, never raised."""
    if header is not None and header.strip().lower() not in CLASSES:
        raise BadPriority(f"{HEADER} must be one of {', '.join(CLASSES)} (got {header[:40]!r})")
    if key_priority == BACKGROUND or (header or "").strip().lower() == BACKGROUND:
        return BACKGROUND
    return BACKGROUND if housekeeping_task(body) else INTERACTIVE
