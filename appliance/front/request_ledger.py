"""The front's request handles and spool files, each from its opening to its end, kept in one place for the
invariants (appliance.front.invariants) that the residency owner checks after every step with the debug switch on:
every request handle opened is closed once, and no spool file outlives its request.

A handle is opened by RequestRouter.open and closed by RequestRouter.close, which the route that opened it calls
once it is done with it, whatever happened (its answer, a failure, a client gone). A spool file is named by the
route that writes it, or has a helper or its model's worker write it, and removed by that route before it ends.
Both are kept with the HTTP request they belong to (its scope, which the errors middleware opens around every
route and ends when the route has returned, and which tasks the route starts inherit as a context variable): once
the request has ended, a handle still open was never closed, and a spool file still on disk outlived its request.

Kept only with the debug switch (OPENARC_DEBUG_INVARIANTS=1): without it nothing is recorded and nothing is read.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from dataclasses import dataclass, field
from typing import Iterator

DEBUG_INVARIANTS_ENV = "OPENARC_DEBUG_INVARIANTS"


@dataclass
class Scope:
    """One HTTP request's life in the front."""
    ended: bool = False


# The scope of the request the running code serves (None: none, e.g. a pure-function test of a router).
SCOPE: contextvars.ContextVar[Scope | None] = contextvars.ContextVar("openarc_request_scope", default=None)


@dataclass
class RequestLedger:
    enabled: bool = False
    handles: dict[int, tuple[object, Scope | None, str]] = field(default_factory=dict)  # id -> (handle, scope, model)
    spool: dict[str, Scope | None] = field(default_factory=dict)  # path -> the scope of the request that named it
    faults: list[str] = field(default_factory=list)  # closes of handles not open (closed twice), until reported

    def opened(self, handle: object, model: str) -> None:
        if self.enabled:
            self.handles[id(handle)] = (handle, SCOPE.get(), model)

    def closed(self, handle: object, model: str) -> None:
        if self.enabled and self.handles.pop(id(handle), None) is None:
            self.faults.append(f"model {model}: a request handle was closed that was not open (closed twice)")

    def spooled(self, path: str) -> None:
        """`path` is a spool file of the current request: it must be gone when the request ends."""
        if self.enabled:
            self.spool[path] = SCOPE.get()

    def check(self) -> list[str]:
        """What went wrong since the last check, in words: handles closed twice, handles whose request ended with
        them open, spool files still on disk after their request ended. Each is said once: what is reported (and
        what ended well) is forgotten."""
        found, self.faults = self.faults, []
        for key, (_, scope, model) in list(self.handles.items()):
            if scope is not None and scope.ended:
                del self.handles[key]
                found.append(f"model {model}: a request handle was never closed (its request ended)")
        for path, scope in list(self.spool.items()):
            if scope is not None and scope.ended:
                del self.spool[path]
                if os.path.exists(path):
                    found.append(f"spool file {path} outlived its request")
        return found


# The front's one ledger (one process, one event loop).
LEDGER = RequestLedger(enabled=os.environ.get(DEBUG_INVARIANTS_ENV) == "1")


@contextlib.contextmanager
def request_scope() -> Iterator[None]:
    """One HTTP request, around its route (the errors middleware): what it opens or spools is judged when it ends."""
    if not LEDGER.enabled:
        yield
        return
    scope = Scope()
    token = SCOPE.set(scope)
    try:
        yield
    finally:
        scope.ended = True
        SCOPE.reset(token)
