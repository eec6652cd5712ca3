"""The ledger of worker processes: every model worker the front has started, from its spawn until it is reaped,
whatever happens to the supervisor that asked for it (gunicorn's arbiter keeps its WORKERS by pid the same way).

A model's WorkerLife writes an entry when its process exists and removes it when the process is reaped; the
residency owner (appliance.front.placement) reads it for /openarc/status (every process holding memory, a leaving
one with why) and for its invariants (appliance.front.invariants: every live worker child of the front is here, and
every entry belongs to a supervisor the owner holds).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class Entry:
    pid: int
    model: str
    owner: object  # the WorkerLife that started it (its ModelSupervisor's, as the residency owner knows it)
    started: float = field(default_factory=time.monotonic)


class Ledger:
    """Worker processes by pid, from spawn to reaped."""

    def __init__(self):
        self.entries: dict[int, Entry] = {}
        self.spawning = 0  # spawns under way: their processes may exist before their entries do

    def started(self, pid: int, model: str, owner: object) -> None:
        self.entries[pid] = Entry(pid, model, owner)

    def reaped(self, pid: int) -> None:
        self.entries.pop(pid, None)

    def of(self, owner: object) -> list[Entry]:
        return [entry for entry in self.entries.values() if entry.owner is owner]
