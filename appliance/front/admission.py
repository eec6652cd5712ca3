"""Which queued request a model admits next to its running set: the ordering policy as a pure class (no event
loop; the caller passes the time).

Interactive requests go first, first come first served within a class. A background request is admitted while
fewer than the model's background slots (max_running_background) run background requests, so the rest stays free
for people. A background request that has waited `max_wait_s` ages into the interactive class: it is then ordered
by its arrival among the interactive ones and no longer bound by the background slots, so it never starves (its
wait is bounded by max_wait_s plus the time until a running request ends). Nothing else happens when it ages, so
the queue's owner asks ages_at() for the next such moment and looks at the queue again then (RequestRouter's
aging timer): on a quiet model, a free slot takes the aged request at once.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Iterator

from appliance.front.priority import BACKGROUND, INTERACTIVE


@dataclass
class Queued:
    item: Any
    priority: str
    since: float  # when it was queued
    order: int = 0  # arrival order, the tie-breaker within a class

    def effective(self, now: float, max_wait_s: float) -> str:
        """Its class now: a background request that waited max_wait_s counts as interactive."""
        if self.priority == BACKGROUND and now - self.since < max_wait_s:
            return BACKGROUND
        return INTERACTIVE


@dataclass
class AdmissionQueue:
    max_wait_s: float
    entries: list[Queued] = field(default_factory=list)
    arrivals: Any = field(default_factory=itertools.count)

    def push(self, item: Any, priority: str, now: float) -> None:
        self.entries.append(Queued(item, priority, now, next(self.arrivals)))

    def remove(self, item: Any) -> bool:
        for i, entry in enumerate(self.entries):
            if entry.item is item:
                del self.entries[i]
                return True
        return False

    def priority_of(self, item: Any) -> str | None:
        return next((entry.priority for entry in self.entries if entry.item is item), None)

    def next(self, now: float, background_running: int, background_slots: int) -> Queued | None:
        """The entry to admit now, or None (empty, or only background requests while their slots are taken)."""
        best, best_key = None, None
        for entry in self.entries:
            cls = entry.effective(now, self.max_wait_s)
            if cls == BACKGROUND and background_running >= background_slots:
                continue
            key = (cls != INTERACTIVE, entry.order)
            if best_key is None or key < best_key:
                best, best_key = entry, key
        return best

    def ages_at(self, now: float) -> float | None:
        """The earliest time after `now` at which a waiting background request ages into the interactive class
        (None: none will), when the order may change with no request opening or ending."""
        deadlines = [entry.since + self.max_wait_s for entry in self.entries
                     if entry.effective(now, self.max_wait_s) == BACKGROUND]
        return min(deadlines, default=None)

    def pop_next(self, now: float, background_running: int, background_slots: int) -> Queued | None:
        entry = self.next(now, background_running, background_slots)
        if entry is not None:
            self.entries.remove(entry)
        return entry

    def clear(self) -> None:
        self.entries.clear()

    def __len__(self) -> int:
        return len(self.entries)

    def __iter__(self) -> Iterator[Any]:
        return (entry.item for entry in self.entries)

    def __contains__(self, item: Any) -> bool:
        return any(entry.item is item for entry in self.entries)
