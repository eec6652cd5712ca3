"""Stored responses for `previous_response_id`: the last N of each model, in the front's memory.

A stored response keeps the conversation it ended (its input turns, then its answer as the assistant's turn), so
chaining a new request is one lookup, however long the chain. The bound is per model (server.stored_responses),
the oldest goes first; nothing survives a restart of the front, which the docs say.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from appliance.front.api.errors import InvalidRequest


class ResponseStore:
    def __init__(self, per_model: int):
        self.per_model = per_model
        self.models: dict[str, OrderedDict[str, list[dict[str, Any]]]] = {}

    def keep(self, model: str, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if self.per_model <= 0:
            return
        kept = self.models.setdefault(model, OrderedDict())
        kept[response_id] = conversation
        while len(kept) > self.per_model:
            kept.popitem(last=False)

    def history(self, response_id: str) -> list[dict[str, Any]]:
        """The conversation a stored response ended, as chat turns (a copy: the caller extends it)."""
        for kept in self.models.values():
            if response_id in kept:
                return [dict(turn) for turn in kept[response_id]]
        raise InvalidRequest(f"previous response '{response_id}' is not found: it was never stored (store: false), "
                             f"was evicted (the server keeps the last {self.per_model} responses of each model), "
                             f"or the server restarted since", "previous_response_id", "previous_response_not_found")
