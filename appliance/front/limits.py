"""A key's limits as a pure policy: concurrent requests, requests a minute and tokens a minute, each refused with
the seconds until it would be admitted. No processes and no event loop: the clock is injected (tests pass their
own), and the server calls admit() before a request takes a queue place, add_tokens() as tokens are produced, and
release() when it ends.

tokens_per_minute holds a reservation for each running request (what it may still use: its budget less what it
used so far), so concurrent requests cannot all pass under an empty window: a request is admitted while the
window's tokens plus the running requests' reservations are under the limit, and one admitted request may then
take the key over the limit by at most its own reservation (docs/sharing.md#limits).
"""

from __future__ import annotations

import collections
import math
import time
from dataclasses import dataclass
from typing import Callable

WINDOW_S = 60.0  # "per minute": a sliding window over the last 60 s


class Limited(Exception):
    """A request over one of its key's limits: `reason` (concurrency, requests or tokens) and `retry_after`, the
    whole seconds until a slot or the window frees (at least 1)."""

    def __init__(self, reason: str, retry_after: float, message: str):
        super().__init__(message)
        self.reason = reason
        self.retry_after = max(1, math.ceil(retry_after))


class SlidingWindow:
    """Amounts added over the last `window_s` seconds, against a limit (None: counted, never full)."""

    def __init__(self, limit: int | None, window_s: float = WINDOW_S):
        self.limit, self.window_s = limit, window_s
        self.entries: collections.deque[tuple[float, int]] = collections.deque()
        self.total = 0

    def _expire(self, now: float) -> None:
        while self.entries and self.entries[0][0] <= now - self.window_s:
            self.total -= self.entries.popleft()[1]

    def used(self, now: float) -> int:
        self._expire(now)
        return self.total

    def add(self, now: float, amount: int) -> None:
        if amount > 0:
            self.entries.append((now, amount))
            self.total += amount

    def full(self, now: float) -> bool:
        return self.limit is not None and self.used(now) >= self.limit

    def frees_in(self, now: float) -> float:
        """Seconds until the window is under its limit again (0 if it is now)."""
        total = self.used(now)
        if not self.full(now):
            return 0.0
        for at, amount in self.entries:  # oldest first: each leaves the window at `at + window_s`
            total -= amount
            if total < self.limit:
                return at + self.window_s - now
        return 0.0


@dataclass(eq=False)
class Reservation:
    """The tokens a running request may still use, held against its key's tokens_per_minute from its admission
    to its end (settled then: what it used is in the window, the rest is given back)."""
    amount: int
    used: int = 0

    @property
    def pending(self) -> int:
        return max(0, self.amount - self.used)


class KeyLimits:
    """One key's limits and what it uses of them; a limit of None is no limit. Use is counted for every key,
    limited or not: /openarc/status shows each key's requests and tokens of the last minute."""

    def __init__(self, name: str, max_concurrent: int | None = None, requests_per_minute: int | None = None,
                 tokens_per_minute: int | None = None, clock: Callable[[], float] = time.monotonic):
        self.name = name
        self.clock = clock
        self.running = 0
        self.reservations: list[Reservation] = []  # one per running request
        self.requests = SlidingWindow(None)
        self.tokens = SlidingWindow(None)
        self.configure(max_concurrent, requests_per_minute, tokens_per_minute)

    def configure(self, max_concurrent: int | None, requests_per_minute: int | None,
                  tokens_per_minute: int | None) -> None:
        """New limits (a reload), keeping what the key uses: its running requests and its last minute."""
        self.max_concurrent = max_concurrent
        self.requests.limit = requests_per_minute or None
        self.tokens.limit = tokens_per_minute or None

    def admit(self, tokens: int = 0) -> Reservation:
        """Take a concurrency slot, count a request and reserve the `tokens` it may use, or raise Limited (nothing
        taken). The reservation goes back to release()."""
        now = self.clock()
        if self.max_concurrent is not None and self.running >= self.max_concurrent:
            # A running request's end cannot be foreseen: retry in a second.
            raise Limited("concurrency", 1, f"API key '{self.name}' has {self.running} requests running "
                                            f"(max_concurrent={self.max_concurrent}); retry when one ends")
        if self.requests.full(now):
            raise Limited("requests", self.requests.frees_in(now),
                          f"API key '{self.name}' made {self.requests.limit} requests in the last minute "
                          f"(requests_per_minute={self.requests.limit})")
        if self.tokens.limit is not None and self.tokens.used(now) + self.reserved() >= self.tokens.limit:
            # The window frees as its tokens age out; a reservation only when its request ends (not foreseeable).
            raise Limited("tokens", self.tokens.frees_in(now) or 1,
                          f"API key '{self.name}' used {self.tokens.used(now)} tokens in the last minute and holds "
                          f"{self.reserved()} for its running requests (tokens_per_minute={self.tokens.limit})")
        self.running += 1
        self.requests.add(now, 1)
        reservation = Reservation(tokens)
        self.reservations.append(reservation)
        return reservation

    def reserved(self) -> int:
        """Tokens the running requests may still use."""
        return sum(r.pending for r in self.reservations)

    def release(self, reservation: Reservation | None = None) -> None:
        """A request ended: its slot and what it did not use of its reservation are given back."""
        self.running -= 1
        if reservation in self.reservations:
            self.reservations.remove(reservation)

    def usage(self) -> dict[str, int]:
        """What the key uses now, for /openarc/status, whether or not it has limits."""
        now = self.clock()
        return {"running": self.running, "requests_last_minute": self.requests.used(now),
                "tokens_last_minute": self.tokens.used(now), "tokens_reserved": self.reserved()}

    def add_tokens(self, n: int, reservation: Reservation | None = None) -> None:
        """Prompt or completion tokens of a running request (drawn from its `reservation`), counted as they are
        produced."""
        self.tokens.add(self.clock(), n)
        if reservation is not None:
            reservation.used += n
