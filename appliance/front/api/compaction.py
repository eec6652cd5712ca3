"""POST /v1/responses/compact: the model writes a summary of a conversation that an agent can continue from, and the
answer is the spec's compaction object, whose `compaction` item /v1/responses takes back in `input`.

The conversation is read as /v1/responses reads it (its `input` items after the turns of `previous_response_id`,
`instructions` first), then the model is asked, as one more user turn, for a summary that keeps what an agent needs:
the task, the decisions made, the files and names involved, what is done and what is open. It runs on the chat path
like any request (same admission, keys, queue, metrics, under the endpoint label "responses/compact"). The summary
travels in the item's `encrypted_content`, encoded like our reasoning items (opaque to the client, readable here,
not a secret); appliance.front.api.responses turns the item back into a user turn that carries the summary.
The answer's length is at most COMPACT_MAX_TOKENS, fitted to what the model's context leaves after the conversation.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import model_name
from appliance.front.api.response_store import ResponseStore
from appliance.front.api.responses import (ResponsesRequest, ResponseStream, encrypted_reasoning, parse_responses,
                                           usage)
from appliance.front.api.answer_items import TEXT_ITEM

log = logging.getLogger("openarc.front")

COMPACT_MAX_TOKENS = 1024
# The fields of a compact request (the spec's CompactResponseMethodPublicBody); others are left to /v1/responses.
FIELDS = ("model", "input", "previous_response_id", "instructions", "prompt_cache_key")
SUMMARY_REQUEST = (
    "Summarize our conversation so far so that you can continue the work from the summary alone, without the "
    "conversation. Keep: the task and what the user asked for, in their words where it matters; the decisions "
    "made and why; the files, functions, commands and names involved; what is done; what is still open or was "
    "about to happen next. Be brief and exact; write only the summary.")


def parse_compact(body: Any, store: ResponseStore, key: str) -> ResponsesRequest:
    model_name(body)  # a missing model is a 400 naming it
    if body.get("input") is None and body.get("previous_response_id") is None:
        raise InvalidRequest("give the conversation to compact: 'input' items, a 'previous_response_id', or both",
                             "input")
    chat = {key: body[key] for key in FIELDS if key in body}
    req = parse_responses({**chat, "store": False, "max_output_tokens": COMPACT_MAX_TOKENS}, store, key)
    req.gen.messages.append({"role": "user", "content": SUMMARY_REQUEST})
    return req


class CompactionStream(ResponseStream):
    """The summary's answer; compaction() is the spec's compaction object once it finished."""

    started: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        self.started = time.monotonic()
        self.done_usage: dict[str, Any] | None = None

    def finish(self, done, finish_reason: str):
        self.done_usage = usage(done)
        log.info("compacted %d input tokens into %d in %.2f s (%s)", done.prompt_tokens, done.completion_tokens,
                 time.monotonic() - self.started, self.req.gen.model)
        return super().finish(done, finish_reason)

    def summary(self) -> str:
        return "".join(item.text for item in self.items if item.kind == TEXT_ITEM).strip()

    def compaction(self) -> dict[str, Any]:
        item = {"id": "cmp_" + uuid.uuid4().hex, "type": "compaction",
                "encrypted_content": encrypted_reasoning(self.summary()), "created_by": "openarc"}
        return {"id": self.id, "object": "response.compaction", "created_at": self.created_at, "output": [item],
                "usage": self.done_usage}
