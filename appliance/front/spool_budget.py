"""One byte budget for every spool file the front holds for requests in flight: a chat request's image pixels
(appliance.front.api.images), an image edit's picture and mask (appliance.front.api.image_generation) and an
upload's decoded audio samples (appliance.front.api.audio). Each file lives while its request waits in its model's
queue and runs, so without one bound the files of N queued requests across models took N times their size on disk
(or in RAM, where the spool is a tmpfs); bounded per route, the routes together still took the sum of their bounds.

The front makes one SpoolBudget (appliance.front.server.Appliance; the routes reach it through ServerView) and
every route that writes a spool file reserves its bytes here, by the file's path, when its decoder takes the file
(the decoder is held to what was reserved, and stops early past it), settles the claim to the file's size once
decoded, and removes the file through remove() when its request ends, however it ends (a try/finally). A claim
past the budget is a 503 with Retry-After: the server has no room now, not the client's fault. Keyed by path, a file's bytes are given back exactly once
however many times it is removed, and never for a file that was not claimed.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable

from appliance.front.request import RequestFailed

# The bytes all requests in flight may hold in spool files together: the chat images' bound before it was shared.
MAX_SPOOL_BYTES = 1 << 30
SPOOL_FULL = "spool_full"  # the 503's code on the edit and audio routes (chat images keep image_spool_full)


class SpoolBudget:
    """The spool bytes the front holds, by file; one instance per server, its one writer the event loop."""

    def __init__(self, capacity: int = MAX_SPOOL_BYTES, on_change: Callable[[int], None] | None = None):
        self.capacity = capacity
        self.on_change = on_change  # called with the bytes held after each change (the openarc_spool_bytes gauge)
        self.files: dict[str, int] = {}  # path -> the bytes claimed for it
        self.held = 0

    def room(self) -> int:
        """The bytes a claim may take now."""
        return max(0, self.capacity - self.held)

    def claim(self, path: str, size: int, what: str, code: str = SPOOL_FULL) -> None:
        """Count the spool file `path` (`size` bytes) against the budget; a 503 with `code` saying `what` (the
        file, in the client's words) when it does not fit now. A path is claimed once."""
        if path in self.files:
            raise ValueError(f"the spool file {path} is claimed twice")
        if size > self.room():
            raise spool_full(what, self.capacity, code)
        self.files[path] = size
        self._change(size)

    def reserve(self, path: str, at_most: int) -> int:
        """Claim for `path`, before its file is written, the bytes its writer may write: `at_most`, or the room left
        if that is less (0 if none is). Returns them; settle() brings the claim down to the file's size once it is
        known. A decoder given the room as it starts, reserved, writes bytes no other decoder sees as free: the
        files being written and the files held stay within the capacity together (a claim made only once a file was
        written let each of the front's decoders write the whole room at once, and be refused after)."""
        size = max(0, min(at_most, self.room()))
        self.claim(path, size, "the reservation")  # (it fits: at most the room)
        return size

    def settle(self, path: str, size: int) -> None:
        """`path`'s reserved claim brought down to its file's `size`, at most what was reserved (its writer was held
        to that)."""
        reserved = self.files[path]
        if size > reserved:
            raise ValueError(f"the spool file {path} has {size} bytes, past the {reserved} reserved for it")
        self.files[path] = size
        self._change(size - reserved)

    def release(self, path: str) -> None:
        """Give `path`'s bytes back: once, whatever number of times it is called; nothing for a path not claimed
        (a file refused, or never decoded)."""
        size = self.files.pop(path, 0)
        if size:
            self._change(-size)

    def remove(self, path: str) -> None:
        """The end of a request's spool file: unlinked (gone already is fine) and its bytes released."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        self.release(path)

    def _change(self, delta: int) -> None:
        self.held += delta
        if self.on_change is not None:
            self.on_change(self.held)


def spool_full(what: str, capacity: int, code: str = SPOOL_FULL) -> RequestFailed:
    """The server's spool has no room for a decoded file now: a 503 worth a retry once requests in flight end."""
    return RequestFailed(503, "overloaded", f"{what}: more than the server's spool has free now ({capacity} bytes "
                         "in all, shared by the decoded images and audio of requests in flight); retry later", code,
                         retry_after=1)
