"""Stored responses for `previous_response_id`: the last N of each API key and model, in the front's memory.

A stored response keeps the conversation it ended (its input turns, then its answer as the assistant's turn), so
chaining a new request is one lookup, however long the chain. A response is found only by requests of the key that
stored it (another key's id is "not found", as one never stored: ids are not secrets, conversations are). The bound
is per key and model (server.stored_responses), the oldest goes first; nothing survives a restart of the front,
which the docs say.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from appliance.front.api.errors import InvalidRequest


class ResponseStore:
    def __init__(self, per_model: int):
        self.per_model = per_model
        self.kept: dict[tuple[str, str], OrderedDict[str, list[dict[str, Any]]]] = {}  # (key, model) -> id -> turns

    def keep(self, key: str, model: str, response_id: str, conversation: list[dict[str, Any]]) -> None:
        if self.per_model <= 0:
            return
        kept = self.kept.setdefault((key, model), OrderedDict())
        kept[response_id] = conversation
        while len(kept) > self.per_model:
            kept.popitem(last=False)

    def history(self, key: str, response_id: str) -> list[dict[str, Any]]:
        """The conversation a response stored by this key ended, as chat turns (a copy: the caller extends it)."""
        for (owner, _), kept in self.kept.items():
            if owner == key and response_id in kept:
                return [dict(turn) for turn in kept[response_id]]
        raise InvalidRequest(f"previous response '{response_id}' is not found: it was never stored (store: false) "
                             f"with this API key, was evicted (the server keeps the last {self.per_model} responses "
                             f"of each key and model), or the server restarted since", "previous_response_id",
                             "previous_response_not_found")
