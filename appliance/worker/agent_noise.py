"""Per-request noise that real agents put in their prompts, dropped before templating so that a conversation's
prompt stays byte-stable from turn to turn and its KV blocks are reused (docs/warm-sessions.md).

- Claude Code sends `x-anthropic-billing-header: cc_version=...; cc_entrypoint=...; cch=<checksum>;` as the text
  of its first system block: billing metadata for Anthropic's servers that changes every request and means nothing
  to a local model. Every system line that starts with it is dropped (a system turn left empty goes too).

Anthropic's `cache_control` fields need nothing here: the dialect routes accept and ignore them.
A pure function: the worker calls it (models[].canonicalize_agent_noise) and logs the first drop.
"""

from __future__ import annotations

from typing import Any

BILLING_HEADER = "x-anthropic-billing-header:"


def _without_billing(text: str) -> str:
    lines = text.split("\n")
    kept = [line for line in lines if not line.lstrip().startswith(BILLING_HEADER)]
    return text if len(kept) == len(lines) else "\n".join(kept).strip("\n")


def canonical_messages(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The messages with known agent noise dropped, and what was dropped (empty: the messages as given)."""
    out, dropped = [], []
    for message in messages:
        content = message.get("content")
        if message.get("role") != "system" or not isinstance(content, (str, list)):
            out.append(message)
            continue
        if isinstance(content, str):
            cleaned: Any = _without_billing(content)
            changed = cleaned != content
        else:  # text parts
            cleaned = [{**part, "text": _without_billing(part["text"])}
                       if isinstance(part, dict) and isinstance(part.get("text"), str) else part for part in content]
            changed = cleaned != content
            cleaned = [part for part in cleaned if not (isinstance(part, dict) and part.get("text") == "")]
        if not changed:
            out.append(message)
            continue
        dropped.append("Claude Code's x-anthropic-billing-header system line")
        if cleaned:
            out.append({**message, "content": cleaned})
    return out, dropped
