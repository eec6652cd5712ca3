"""A model's lifecycle: its states, the legal moves between them, and how a worker's life ended.

Each model's worker life (appliance.front.worker_life) owns its `Lifecycle` and moves it only through `enter()`,
which refuses a move the table below does not list. Every way a worker's life can end is described by one `Exit`,
and the worker life turns each Exit into state, metrics, a log line and a backoff in one function.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
from dataclasses import dataclass

from appliance.host import faults

log = logging.getLogger("openarc.supervisor")


class ModelState(enum.Enum):
    STOPPED = "stopped"        # no worker, none wanted (before the first start, after a stop)
    UNLOADED = "unloaded"      # load: on_demand (or unloaded by idle_unload_s, an eviction, the API): no worker,
                               # no memory; a request or POST /openarc/models/NAME/load starts its load
    LOADING = "loading"        # a worker is being started and loads the model
    READY = "ready"            # the worker serves requests
    RESTARTING = "restarting"  # the last worker ended; waiting out the backoff before loading again
    DRAINING = "draining"      # a stop was asked: queued and running requests finish, nothing new is admitted
    FAILED = "failed"          # the restart budget is used up; nothing runs until a reload (SIGHUP, even with the
                               # same config: Supervisor.apply) or a restart


# A replicated model's state is its best replica's, in this order (one that serves makes the model serve): the one
# order /openarc/status (Supervisor.models) and openarc_model_state (Metrics.set_state) both read it by.
BEST_FIRST = (ModelState.READY, ModelState.DRAINING, ModelState.LOADING, ModelState.RESTARTING, ModelState.UNLOADED,
              ModelState.STOPPED, ModelState.FAILED)


def best_rank(state: ModelState) -> int:
    """Where a replica's state stands in BEST_FIRST: the lowest speaks for its model."""
    return BEST_FIRST.index(state)


S = ModelState
TRANSITIONS: dict[ModelState, frozenset[ModelState]] = {
    S.STOPPED: frozenset({S.LOADING, S.UNLOADED}),
    S.UNLOADED: frozenset({S.LOADING, S.DRAINING}),
    S.LOADING: frozenset({S.READY, S.RESTARTING, S.FAILED, S.DRAINING}),
    S.READY: frozenset({S.RESTARTING, S.FAILED, S.DRAINING}),
    S.RESTARTING: frozenset({S.LOADING, S.FAILED, S.DRAINING}),
    S.DRAINING: frozenset({S.STOPPED}),
    S.FAILED: frozenset({S.DRAINING}),
}


class Changes:
    """A broadcast "something changed": notify() wakes everyone waiting at that moment, then arms itself again."""

    def __init__(self):
        self._event = asyncio.Event()

    def notify(self) -> None:
        self._event.set()
        self._event = asyncio.Event()

    async def wait(self, timeout: float | None) -> bool:
        """Until the next notify(); False when the timeout passes first. A waiter cancelled as the notify comes ends
        cancelled.

        Why the front's bounded waits use asyncio.timeout, never asyncio.wait_for: on Python 3.11 a wait_for cancelled
        in the loop iteration its awaitable completes returns the result and drops the cancellation (cpython
        gh-86296). A streamed request whose client left just as its model came up was cancelled that way: its lookup
        went on, opened a request handle after the route had ended, and nobody closed it (found by
        tests/test_residency_model.py)."""
        try:
            async with asyncio.timeout(timeout):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


ILLEGAL = "illegal transition"  # the marker the tests look for in every appliance's log


class Lifecycle:
    """A model's current state; awaiting a state wakes on the change itself, not on a polling timer."""

    def __init__(self, name: str, on_change):
        self.name = name
        self.state = ModelState.STOPPED
        self._on_change = on_change  # (old, new) -> None: metrics and log follow every change
        self._changes = Changes()

    def enter(self, new: ModelState) -> None:
        old = self.state
        if new is old:
            return
        if new not in TRANSITIONS[old]:
            # A bug in the supervisor. Serving goes on (the new state is the truth), but loudly: every test's
            # appliance fails on this line in its log.
            log.error("BUG: %s for model %s: %s -> %s", ILLEGAL, self.name, old.value, new.value, stack_info=True)
        self.state = new
        self._on_change(old, new)
        self._changes.notify()

    async def wait_for(self, states: set[ModelState], timeout: float | None) -> bool:
        """Wait until the model is in one of `states`; False when the timeout passes first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while self.state not in states:
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return False
            if not await self._changes.wait(remaining):
                return self.state in states
        return True


class ExitReason(enum.Enum):
    SPAWN_ERROR = "spawn_error"            # the worker process could not be started at all
    PROTOCOL_ERROR = "protocol_error"      # it wrote something that is not a frame of appliance.ipc
    LOAD_ERROR = "load_error"              # it reported that the model cannot be loaded, and left
    LOAD_TIMEOUT = "load_timeout"          # it did not become ready within load_timeout_s; killed
    CRASH = "crash"                        # it died by a signal or exited when nobody asked it to
    WORKER_ERROR = "worker_error"          # it reported an internal error after loading, and left
    STALL = "stall"                        # it made no progress for stall_timeout_s; killed
    DEVICE_LOST = "device_lost"            # it exited 75: the GPU context is gone, a fresh process gets a new one
    OOM_KILL = "oom_kill"                  # the kernel's OOM killer took it
    SUPERVISOR_ERROR = "supervisor_error"  # a bug in the front's supervision of it; killed
    CANARY_FAILED = "canary_failed"        # it loaded, and answered its golden probes otherwise (server.canary: gate)
    STOPPED = "stopped"                    # the front asked it to leave


# Ends a restart would meet again: the model is failed at once (a reload, after a fix, tries it again).
FINAL_REASONS = frozenset({ExitReason.CANARY_FAILED})
# Ends that the worker or the kernel chose, not the front: these count as crashes.
CRASH_REASONS = frozenset({ExitReason.CRASH, ExitReason.WORKER_ERROR, ExitReason.DEVICE_LOST, ExitReason.OOM_KILL})


@dataclass(frozen=True)
class Exit:
    """How one worker's life ended."""

    reason: ExitReason
    returncode: int | None = None  # None: the process never existed, or its status was never read
    detail: str | None = None      # the error text: an exception, the worker's own report, a timeout
    hint: str | None = None        # a known-issue hint for the log and /openarc/status
    ever_ready: bool = False
    served_s: float = 0.0          # time from ready to the end
    public: bool = False           # the detail is openarc's own words (the worker said so), shown to clients too


class RestartBudget:
    """Exponential backoff per consecutive failure, reset after `window_s` of service; failed after too many."""

    def __init__(self, policy):
        self.policy = policy
        self.failures: collections.deque[float] = collections.deque()
        self.consecutive = 0

    def record_failure(self, now: float, served_s: float) -> float | None:
        """Returns the backoff before the next start, or None when the budget is used up."""
        if served_s >= self.policy.window_s:
            self.consecutive = 0
        self.consecutive += 1
        self.failures.append(now)
        while self.failures and now - self.failures[0] > self.policy.window_s:
            self.failures.popleft()
        if len(self.failures) >= self.policy.max_failures:
            return None
        return min(self.policy.backoff_initial_s * 2 ** (self.consecutive - 1), self.policy.backoff_max_s)


def describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).strip()}" if str(exc).strip() else type(exc).__name__


# Ends whose detail is another program's text (the worker's report of a load or internal error, an exception, a
# malformed frame): it can name server paths and the runtime's source files, so a client's error body leaves it out.
FOREIGN_DETAIL = frozenset({ExitReason.SPAWN_ERROR, ExitReason.PROTOCOL_ERROR, ExitReason.LOAD_ERROR,
                            ExitReason.WORKER_ERROR, ExitReason.SUPERVISOR_ERROR})


def describe_exit(exit: Exit, for_client: bool = False) -> str:
    """The one-line account of a worker's end, for the log and /openarc/status; `for_client`: as a client's error
    body says it, without a detail that is another program's text (FOREIGN_DETAIL)."""
    how = faults.signal_name(exit.returncode) if exit.returncode is not None else None
    if exit.reason is ExitReason.CRASH:
        text = f"worker exited: {how}"
    elif exit.reason is ExitReason.DEVICE_LOST:
        text = f"worker exited: device lost ({how}); a fresh worker gets a new device context"
    elif exit.reason is ExitReason.OOM_KILL:
        text = f"worker exited: killed by the kernel OOM killer ({how})"
    elif exit.reason is ExitReason.CANARY_FAILED:  # the front ended it: its signal says nothing
        text = "the golden-answer check failed (server.canary: gate)"
    else:
        text = f"worker ended: {exit.reason.value}" + (f" ({how})" if how else "")
    shown = exit.detail and not (for_client and exit.reason in FOREIGN_DETAIL and not exit.public)
    return text + (f": {exit.detail}" if shown else "")
