"""A tool call written by the recording proxy itself, in each dialect's shape, whole or streamed.

Only the first turn of a tool round trip is canned (see bench.clients.proxy): the shapes follow the published
API references of OpenAI's chat completions and Responses and Anthropic's Messages, the fields a client needs to
run the call and nothing more.
"""

from __future__ import annotations

import json
import time

CALL_ID = "call_openarc_proxy_1"
ITEM_ID = "fc_openarc_proxy_1"
TOOL_USE_ID = "toolu_openarc_proxy_1"
USAGE_TOKENS = 1  # the canned turn costs the model nothing; clients only need the fields present


def dialect_of(path: str) -> str | None:
    """Which API a request path speaks: "chat", "responses", "messages", or None for anything else."""
    path = path.rstrip("/")
    for suffix, dialect in (("/chat/completions", "chat"), ("/responses", "responses"), ("/messages", "messages")):
        if path.endswith(suffix):
            return dialect
    return None


def canned_tool_call(dialect: str, body: dict, name: str, arguments: dict) -> tuple[int, str, str]:
    """(status, content type, body) of an answer that is one call to `name` with `arguments`."""
    args = json.dumps(arguments)
    model = body.get("model") or "unknown"
    stream = bool(body.get("stream"))
    build = {"chat": _chat, "responses": _responses, "messages": _messages}[dialect]
    events = build(model, name, args, stream)
    if not stream:
        return 200, "application/json", json.dumps(events)
    return 200, "text/event-stream", "".join(_sse(event) for event in events) + (
        "data: [DONE]\n\n" if dialect == "chat" else "")


def _sse(event: dict) -> str:
    named = f"event: {event['type']}\n" if "type" in event else ""
    return f"{named}data: {json.dumps(event)}\n\n"


def _chat(model: str, name: str, args: str, stream: bool):
    created = int(time.time())
    call = {"id": CALL_ID, "type": "function", "function": {"name": name, "arguments": args}}
    usage = {"prompt_tokens": USAGE_TOKENS, "completion_tokens": USAGE_TOKENS, "total_tokens": 2 * USAGE_TOKENS}
    if not stream:
        return {"id": "chatcmpl-openarc-proxy", "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "finish_reason": "tool_calls",
                             "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                "usage": usage}

    def chunk(delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": "chatcmpl-openarc-proxy", "object": "chat.completion.chunk", "created": created,
                "model": model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}], **extra}

    opening = {**call, "index": 0, "function": {"name": name, "arguments": ""}}
    return [chunk({"role": "assistant", "content": None, "tool_calls": [opening]}),
            chunk({"tool_calls": [{"index": 0, "function": {"arguments": args}}]}),
            chunk({}, "tool_calls"),
            {**chunk({}), "choices": [], "usage": usage}]


def _responses(model: str, name: str, args: str, stream: bool):
    item = {"type": "function_call", "id": ITEM_ID, "call_id": CALL_ID, "name": name, "arguments": args,
            "status": "completed"}
    usage = {"input_tokens": USAGE_TOKENS, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": USAGE_TOKENS, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": 2 * USAGE_TOKENS}
    response = {"id": "resp_openarc_proxy", "object": "response", "created_at": int(time.time()), "model": model,
                "status": "completed", "output": [item], "usage": usage, "error": None, "incomplete_details": None}
    if not stream:
        return response
    started = {**response, "status": "in_progress", "output": [], "usage": None}
    events = [{"type": "response.created", "response": started},
              {"type": "response.in_progress", "response": started},
              {"type": "response.output_item.added", "output_index": 0,
               "item": {**item, "arguments": "", "status": "in_progress"}},
              {"type": "response.function_call_arguments.delta", "item_id": ITEM_ID, "output_index": 0,
               "delta": args},
              {"type": "response.function_call_arguments.done", "item_id": ITEM_ID, "output_index": 0,
               "arguments": args},
              {"type": "response.output_item.done", "output_index": 0, "item": item},
              {"type": "response.completed", "response": response}]
    return [{**event, "sequence_number": n} for n, event in enumerate(events)]


def _messages(model: str, name: str, args: str, stream: bool):
    block = {"type": "tool_use", "id": TOOL_USE_ID, "name": name, "input": json.loads(args)}
    usage = {"input_tokens": USAGE_TOKENS, "output_tokens": USAGE_TOKENS}
    message = {"id": "msg_openarc_proxy", "type": "message", "role": "assistant", "model": model, "content": [block],
               "stop_reason": "tool_use", "stop_sequence": None, "usage": usage}
    if not stream:
        return message
    return [{"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
            {"type": "content_block_start", "index": 0, "content_block": {**block, "input": {}}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": args}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
             "usage": {"output_tokens": USAGE_TOKENS}},
            {"type": "message_stop"}]
