"""systemd's notify protocol, through `sdnotify` (a silent no-op without NOTIFY_SOCKET).

The watchdog ping means something: it is sent from a task on the front's event loop, so a wedged loop stops
pinging, and only while the loop answers within a bound and every model's supervising task is alive. When every
model of the service has used up its restart budget, WATCHDOG=trigger asks systemd for a restart of the whole
unit: a fresh process gets a fresh device context.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Callable

import sdnotify

log = logging.getLogger("openarc.notify")

LAG_SAMPLE_INTERVAL_S = 0.25
# A loop that runs a 0.25 s timer this late is not serving anyone: stop vouching for it.
UNHEALTHY_LAG_S = 2.0
LOAD_EXTEND_USEC = 60_000_000


class Notifier:
    def __init__(self) -> None:
        self.enabled = bool(os.environ.get("NOTIFY_SOCKET"))
        self._sd = self._connect() if self.enabled else None
        self.watchdog_usec = watchdog_usec()
        self.last_status = ""

    def send(self, *lines: str) -> None:
        if not self.enabled:
            return
        message = "\n".join(lines)
        try:
            self._sd.notify(message)
        except OSError as exc:  # systemd must hear READY/WATCHDOG: a lost one has to show in the journal
            log.error("sd_notify %s failed (%s); reconnecting", lines[0].split("=")[0], exc)
            try:
                self._sd = self._connect()  # sdnotify connects once; a re-executed systemd needs a new socket
                self._sd.notify(message)
            except OSError as again:
                log.error("sd_notify failed again: %s", again)

    @staticmethod
    def _connect() -> sdnotify.SystemdNotifier:
        # debug=True: sdnotify raises instead of swallowing send errors, so they can be logged above.
        return sdnotify.SystemdNotifier(debug=True)

    def ready(self, status: str) -> None:
        self.send("READY=1", f"STATUS={status}")

    def status(self, text: str) -> None:
        if text != self.last_status:
            self.last_status = text
            self.send(f"STATUS={text}")

    def extend_start_timeout(self) -> None:
        """While models load, keep a short TimeoutStartSec= from firing: a 14B load can take minutes."""
        self.send(f"EXTEND_TIMEOUT_USEC={LOAD_EXTEND_USEC}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets a Type=notify-reload systemd (253+) match this to its reload; 252 ignores it.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
                  "STATUS=reloading the config")

    def stopping(self) -> None:
        self.send("STOPPING=1", "STATUS=draining requests and stopping workers")

    def trigger_watchdog(self, reason: str) -> None:
        log.error("asking systemd to restart the service: %s", reason)
        self.send(f"STATUS={reason}", "WATCHDOG=trigger")


def watchdog_usec() -> int | None:
    """WATCHDOG_USEC, if systemd set it for this very process (WATCHDOG_PID, when present, must be us)."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    return int(usec)


class LoopHealth:
    """Measures the front's event loop lag: how late a short timer fires."""

    def __init__(self, on_sample: Callable[[float], None] = lambda lag: None):
        self.lag = 0.0
        self.last_sample = time.monotonic()
        self._on_sample = on_sample

    async def run(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(LAG_SAMPLE_INTERVAL_S)
            self.last_sample = time.monotonic()
            self.lag = max(0.0, self.last_sample - before - LAG_SAMPLE_INTERVAL_S)
            self._on_sample(self.lag)

    def healthy(self) -> bool:
        return self.lag < UNHEALTHY_LAG_S and time.monotonic() - self.last_sample < UNHEALTHY_LAG_S + LAG_SAMPLE_INTERVAL_S


async def watchdog_loop(notifier: Notifier, is_healthy: Callable[[], bool], should_trigger: Callable[[], str | None],
                        status_text: Callable[[], str]) -> None:
    """Ping at half of WATCHDOG_USEC while healthy; trigger a restart when the service can no longer serve."""
    interval = notifier.watchdog_usec / 2e6 if notifier.watchdog_usec else 1.0
    triggered = False
    while True:
        await asyncio.sleep(min(interval, 1.0))
        notifier.status(status_text())
        reason = should_trigger()
        if reason and not triggered:
            notifier.trigger_watchdog(reason)
            triggered = True
        if notifier.watchdog_usec and is_healthy() and not triggered:
            notifier.send("WATCHDOG=1")
