"""System messages in the middle of a conversation (Anthropic's mid-conversation system messages, a Responses
`developer` item after the first user turn, a chat `system` message anywhere): each stays at its place, in the form
the model's chat template takes there.

Clients send them to steer a long conversation without touching its start, so the prompt's prefix (and the KV
blocks the prefix cache keeps for it) stays the same from turn to turn; moving them up into the top system prompt
would change that prefix every turn. Templates differ: Qwen3's and Llama 3's render a system turn anywhere, DeepSeek
R1's gathers every system message into the top prompt, Mistral Small's drops any after the first, others refuse
one (raise_exception) or two user turns in a row. So the form is decided per template, by rendering a probe conversation and looking where the system text
landed (`placement`), and every non-leading system turn is rewritten to that form before rendering (`placed`):

- SYSTEM: left as a system turn (the template renders it at its place);
- USER: a user turn of its own, its text marked as instructions;
- MERGED: appended to the user turn before it, marked the same way (templates that need roles to alternate); after
  an answer or a tool result, at the start of the next user turn.

Pure functions: the worker probes its template once at load (appliance.worker.prompt) and rewrites each request.
"""

from __future__ import annotations

from typing import Any, Callable

SYSTEM, USER, MERGED = "system", "user", "merged"
DESCRIPTIONS = {SYSTEM: "a system turn at its place", USER: "a user turn at its place, marked as instructions",
                MERGED: "instructions joined to the user turn next to it"}
# How a system message's text reads inside a user turn: marked, so the model can tell it from the person's words.
INSTRUCTIONS = "<system-instructions>\n{}\n</system-instructions>"

# Probe texts: distinct words no template adds by itself.
_TOP, _FIRST, _MID, _ANSWER, _NEXT = ("PROBE-TOP", "PROBE-USER-ONE", "PROBE-SYSTEM-MID", "PROBE-ANSWER",
                                      "PROBE-USER-TWO")

Render = Callable[[list[dict[str, Any]]], str]


def _probes() -> list[list[dict[str, Any]]]:
    """The conversations a template must place a mid-conversation system message in: last (as Claude Code sends it,
    right after the user's turn) and between turns (as it is replayed on the next turn)."""
    top, first = {"role": "system", "content": _TOP}, {"role": "user", "content": _FIRST}
    mid = {"role": "system", "content": _MID}
    return [[top, first, mid],
            [top, first, mid, {"role": "assistant", "content": _ANSWER}, {"role": "user", "content": _NEXT}]]


def _in_place(text: str, conversation: list[dict[str, Any]]) -> bool:
    """The system text was rendered after the user turn before it and before the turns after it."""
    order = [_TOP, _FIRST, _MID] + ([_ANSWER, _NEXT] if len(conversation) > 3 else [])
    found = [text.find(word) for word in order]
    return all(at >= 0 for at in found) and found == sorted(found)


def placement(render: Render) -> str:
    """The form a mid-conversation system message takes with this template: the first of SYSTEM, USER, MERGED whose
    probes render without an error and with the system text at its place; MERGED if none does (it only changes a
    user turn's text, which every template renders)."""
    for form in (SYSTEM, USER):
        ok = True
        for conversation in _probes():
            try:
                text = render(placed(conversation, form))
            except Exception:  # noqa: BLE001 - a template that refuses the form (raise_exception) rules it out
                ok = False
                break
            if not _in_place(text, conversation):
                ok = False
                break
        if ok:
            return form
    return MERGED


def placed(messages: list[dict[str, Any]], form: str) -> list[dict[str, Any]]:
    """The messages with every system turn after the first non-system turn in `form`; the leading system turns (the
    system prompt) and the rest as they were."""
    if form == SYSTEM:
        return messages
    out: list[dict[str, Any]] = []
    pending: list[str] = []  # MERGED: instructions after a turn that is not the user's, for the next user turn
    opened = False  # a non-system turn came: system turns from here on are mid-conversation
    for message in messages:
        if message.get("role") != "system" or not opened:
            opened = opened or message.get("role") != "system"
            if pending:
                message = _flush(out, pending, message)
            out.append(message)
            continue
        instructions = INSTRUCTIONS.format(_text(message.get("content")))
        if form == USER:
            out.append({"role": "user", "content": instructions})
        elif out[-1].get("role") == "user" and not pending:
            previous = out[-1]
            out[-1] = {**previous, "content": _joined(previous.get("content"), instructions)}
        else:
            # after an answer or a tool result: a user turn of its own here would sit next to the user turn that
            # follows, which a template that needs roles to alternate refuses; it opens that turn instead
            pending.append(instructions)
    if pending:
        out.append({"role": "user", "content": "\n\n".join(pending)})
    return out


def _flush(out: list[dict[str, Any]], pending: list[str], message: dict[str, Any]) -> dict[str, Any]:
    """MERGED: the held instructions at the start of the next user turn, else as a user turn of their own before
    a turn that is not the user's; returns the message to append next."""
    instructions = "\n\n".join(pending)
    pending.clear()
    if message.get("role") == "user":
        content = message.get("content")
        if isinstance(content, list):
            return {**message, "content": [{"type": "text", "text": instructions + "\n\n"}, *content]}
        return {**message, "content": f"{instructions}\n\n{content}" if content else instructions}
    out.append({"role": "user", "content": instructions})
    return message


def _text(content: Any) -> str:
    """A system message's text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "\n".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _joined(content: Any, instructions: str) -> Any:
    """A user turn's content with the instructions after it (a string, or one more text part)."""
    if isinstance(content, list):
        return content + [{"type": "text", "text": "\n\n" + instructions}]
    return f"{content}\n\n{instructions}" if content else instructions
