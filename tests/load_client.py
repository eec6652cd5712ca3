"""A client that keeps a model busy across a restart or a reload and counts what its user sees."""

from __future__ import annotations

import collections
import json
import threading
import time
from http.client import HTTPConnection, HTTPException

from conftest import wait_until

HANG_S = 60  # bounds that only catch hangs


class Load:
    """One client sending short chat requests back to back, each on a new connection, until stopped."""

    def __init__(self, port: int, model: str):
        self.port, self.model = port, model
        self.outcomes: list[tuple[str, float]] = []  # (200, 503, refused, a cut connection's error; seconds)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stopping.set()
        self.thread.join(HANG_S)

    def _run(self) -> None:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8})
        while not self.stopping.is_set():
            started = time.monotonic()
            conn = HTTPConnection("127.0.0.1", self.port, timeout=HANG_S)
            try:
                conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                response.read()
                outcome = str(response.status)
            except ConnectionRefusedError:
                outcome = "refused"
            except (HTTPException, OSError) as exc:
                outcome = type(exc).__name__
            finally:
                conn.close()
            self.outcomes.append((outcome, time.monotonic() - started))
            if outcome == "refused":
                time.sleep(0.01)  # as a client's retry loop would; keeps the count meaningful

    def wait_for_answers(self, count: int) -> None:
        """Until `count` more requests have been answered 200."""
        target = self.ok() + count
        wait_until(lambda: self.ok() >= target, HANG_S, f"{count} more answers", interval=0.05)

    def ok(self) -> int:
        return sum(1 for outcome, _ in self.outcomes if outcome == "200")

    def summary(self) -> dict:
        counts = collections.Counter(outcome for outcome, _ in self.outcomes)
        return {"requests": len(self.outcomes), "ok": counts.pop("200", 0), "refused": counts.pop("refused", 0),
                "failed": dict(counts), "slowest_s": round(max((s for _, s in self.outcomes), default=0), 2)}
