"""What a recorded exchange says, in each dialect: the answer's text, how it ended, its length, and the tool
result a client replayed. Pure functions over bench.clients.proxy.Exchange, whole answers and streams alike."""

from __future__ import annotations

from bench.clients.canned import CALL_ID, TOOL_USE_ID
from bench.clients.proxy import Exchange


def _final(exchange: Exchange) -> dict:
    """The whole answer: the JSON body, or what a stream's last full object says (Responses' final response,
    Messages' message_start merged with its message_delta, chat's chunks merged)."""
    if not exchange.streamed:
        return exchange.response_json() or {}
    final: dict = {}
    for event in exchange.events():
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            final = event["response"]
        elif kind == "message_start":
            final = dict(event["message"])
        elif kind == "message_delta":
            final.update(event.get("delta") or {})
            final["usage"] = {**final.get("usage", {}), **(event.get("usage") or {})}
        elif event.get("object") == "chat.completion.chunk":
            for choice in event.get("choices") or ():
                if choice.get("finish_reason"):
                    final["finish_reason"] = choice["finish_reason"]
            if event.get("usage"):
                final["usage"] = event["usage"]
    return final


def answer_text(exchange: Exchange) -> str:
    """The text the answer carried to the client."""
    if exchange.streamed:
        parts = []
        for event in exchange.events():
            kind = event.get("type", "")
            if kind == "content_block_delta" and (event.get("delta") or {}).get("type") == "text_delta":
                parts.append(event["delta"]["text"])
            elif kind == "response.output_text.delta":
                parts.append(event["delta"])
            elif event.get("object") == "chat.completion.chunk":
                parts.extend((c.get("delta") or {}).get("content") or "" for c in event.get("choices") or ())
        return "".join(parts)
    body = exchange.response_json() or {}
    if exchange.dialect == "messages":
        return "".join(b.get("text", "") for b in body.get("content") or () if b.get("type") == "text")
    if exchange.dialect == "responses":
        return "".join(part.get("text", "") for item in body.get("output") or () if item.get("type") == "message"
                       for part in item.get("content") or ())
    return "".join((c.get("message") or {}).get("content") or "" for c in body.get("choices") or ())


def ending(exchange: Exchange) -> str | None:
    """How the answer ended: Responses' status, Messages' stop_reason, chat's finish_reason."""
    final = _final(exchange)
    if exchange.dialect == "responses":
        return final.get("status")
    if exchange.dialect == "messages":
        return final.get("stop_reason")
    return final.get("finish_reason") or next((c.get("finish_reason") for c in final.get("choices") or ()), None)


COMPLETE = {"responses": "completed", "messages": "end_turn", "chat": "stop"}


def output_tokens(exchange: Exchange) -> int | None:
    usage = _final(exchange).get("usage") or {}
    return usage.get("output_tokens", usage.get("completion_tokens"))


def asked_limit(exchange: Exchange) -> int | None:
    """The output limit the request sent, in any dialect's field, or None."""
    body = exchange.request or {}
    return next((body[k] for k in ("max_output_tokens", "max_completion_tokens", "max_tokens") if k in body), None)


def _text_of(content) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(_text_of(part.get("text", part.get("output", part.get("content", ""))))
                       for part in content if isinstance(part, dict))
    return ""


def replayed_result(exchange: Exchange) -> str | None:
    """The result a client sent back for the proxy's canned call (bench.clients.canned), when the request
    replays both the call and its result; else None."""
    body = exchange.request or {}
    if exchange.dialect == "messages":
        blocks = [b for m in body.get("messages") or () if isinstance(m.get("content"), list) for b in m["content"]]
        called = any(b.get("type") == "tool_use" and b.get("id") == TOOL_USE_ID for b in blocks)
        results = [_text_of(b.get("content")) for b in blocks
                   if b.get("type") == "tool_result" and b.get("tool_use_id") == TOOL_USE_ID]
    elif exchange.dialect == "responses":
        items = [i for i in body.get("input") or () if isinstance(i, dict)]
        called = any(i.get("type") == "function_call" and i.get("call_id") == CALL_ID for i in items)
        results = [_text_of(i.get("output")) for i in items
                   if i.get("type") == "function_call_output" and i.get("call_id") == CALL_ID]
    else:
        messages = body.get("messages") or ()
        called = any(c.get("id") == CALL_ID for m in messages for c in m.get("tool_calls") or ())
        results = [_text_of(m.get("content")) for m in messages
                   if m.get("role") == "tool" and m.get("tool_call_id") == CALL_ID]
    return results[0] if called and results else None


def refusals(exchanges: list[Exchange]) -> list[str]:
    """Every exchange the server refused (4xx/5xx), as summary lines with the error body."""
    return [e.summary() for e in exchanges if e.status >= 400]


def prompt_tokens(exchange: Exchange) -> tuple[int | None, int | None]:
    """The prompt's tokens and how many of them the prefix cache held, as the answer's usage says."""
    usage = _final(exchange).get("usage") or {}
    prompt = usage.get("input_tokens", usage.get("prompt_tokens"))
    details = usage.get("input_tokens_details") or usage.get("prompt_tokens_details") or {}
    return prompt, details.get("cached_tokens", usage.get("cache_read_input_tokens"))


def dumps(exchanges: list[Exchange]) -> str:
    """The record in short, for a failing assertion and the bench's reports: each exchange on a line, with the
    prompt's size, the part the cache held, and how long the answer took."""
    lines = []
    for e in exchanges:
        prompt, cached = prompt_tokens(e) if e.status == 200 and not e.by_proxy else (None, None)
        size = f" [prompt {prompt} tokens, {cached} cached, {e.seconds:.1f}s]" if prompt is not None else ""
        lines.append(e.summary() + size)
    return "\n".join(lines) or "(no requests)"
