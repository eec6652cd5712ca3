"""The engine base class: the part of a worker that every worker kind shares.

The channel reader thread queues frames into the inbox; the engine thread takes them, runs the pipeline and
posts reply frames, which go out as one frame per engine step.
"""

from __future__ import annotations

import logging
import os
import queue
import time
from types import SimpleNamespace
from typing import Any, Callable

from appliance.host import faults
from appliance.ipc import BlockingChannel, FrameTooLarge, frame

log = logging.getLogger("openarc.worker")

PROGRESS_INTERVAL_S = 0.25  # well under any sensible stall_timeout_s
# Streamed text that is not a request's first waits up to this long for the next steps' text, to go out in one frame:
# on a model whose steps take a fraction of a millisecond, a frame per step woke the front (and its client) thousands
# of times a second on the cores the model needs. A step on a GPU takes longer than this: every step still goes out.
TEXT_HOLD_S = 0.002
# Test and benchmark knobs, never set in production: sleep after every engine step, so a fault can land
# mid-generation on a model that otherwise finishes 32 tokens in 8 ms; and raise inside the engine after that many
# steps, to prove that an exception in the engine thread (or the stateful streamer) fails loudly.
STEP_DELAY_ENV = "OPENARC_DEBUG_STEP_DELAY_S"
RAISE_AFTER_STEPS_ENV = "OPENARC_DEBUG_RAISE_AFTER_STEPS"


class InjectedFault(RuntimeError):
    """Raised by the RAISE_AFTER_STEPS_ENV knob."""


class Engine:
    """What every worker kind shares: the inbox the channel reader fills, the outbox sent once per step, and
    failing requests (and the worker, after a lost device) with a classified fault."""

    def __init__(self, spec: dict[str, Any], channel: BlockingChannel):
        self.spec = spec
        self.channel = channel
        self.inbox: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.outbox: list[dict[str, Any]] = []
        self.last_sent = time.monotonic()
        self.urgent = False  # the outbox holds something that must not wait (see post())
        self.pci_family: str | None = None
        self.step_delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
        self.raise_after_steps = int(os.environ.get(RAISE_AFTER_STEPS_ENV, "0") or 0)
        self.steps = 0
        # Share of the KV cache in use after the last step, 0 to 1; None for engines that cannot tell.
        self.kv_cache_usage_ratio: float | None = None

    # called from the channel reader thread
    def submit(self, message: dict[str, Any]) -> None:
        self.inbox.put(("generate", message))

    def cancel(self, request_id: int) -> None:
        self.inbox.put(("cancel", request_id))

    def drain_inbox(self, block: bool) -> None:
        """Take what the channel reader queued; block only when there is nothing else to do."""
        while True:
            try:
                op, arg = self.inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            getattr(self, f"on_{op}")(arg)  # on_generate, on_cancel (and an engine's own ops)

    def on_generate(self, message: dict[str, Any]) -> None:
        raise NotImplementedError

    def on_cancel(self, request_id: int) -> None:
        raise NotImplementedError

    def post(self, frame: dict[str, Any], urgent: bool = True) -> None:
        """Queue a frame for the next flush(); only streamed text that is not a request's first may wait
        (urgent=False) up to TEXT_HOLD_S to share a frame with what follows."""
        self.outbox.append(frame)
        self.urgent = self.urgent or urgent

    def flush(self) -> None:
        """Send what the engine steps since the last send produced as one frame: one syscall and one wake-up of the
        front per step at most, fewer while only streamed text waits (TEXT_HOLD_S).

        While only non-streaming requests run, a step may produce nothing to send: a progress frame at most every
        PROGRESS_INTERVAL_S tells the front's stall timer that generation goes on.
        """
        now = time.monotonic()
        if not self.outbox:
            if self.busy() and now - self.last_sent > PROGRESS_INTERVAL_S:
                self.outbox.append(frame("progress"))
            else:
                return
        elif not self.urgent and self.busy() and now - self.last_sent < TEXT_HOLD_S:
            return
        frames, self.outbox, self.urgent = self.outbox, [], False
        try:
            self.channel.send(frames[0] if len(frames) == 1 else frame("batch", frames=frames))
        except FrameTooLarge:
            self._send_each(frames)
        self.last_sent = now

    def _send_each(self, frames: list[dict[str, Any]]) -> None:
        """Frames that were too large as one batch, one by one; a frame too large on its own (an answer past
        ipc.MAX_FRAME) fails its request with a clear message, and the worker and its other requests go on."""
        for one in frames:
            try:
                self.channel.send(one)
            except FrameTooLarge as exc:
                self.channel.send(frame("error", id=one["id"], kind="internal", code="response_too_large",
                                        message=f"the answer is too large to pass to the front: {exc}",
                                        retryable=False))

    def busy(self) -> bool:
        raise NotImplementedError

    def threads(self) -> list[tuple[str, Callable[[], None]]]:
        """(name, target) of the engine's own threads besides the engine thread, started by the worker through
        its one exit path (appliance.worker.main.run_guarded)."""
        return []

    def ready_info(self) -> dict[str, Any]:
        """What the front should know about this worker, sent with the ready frame."""
        return {}

    def fail(self, request_id: int, fault: faults.Fault, message: str) -> None:
        self.post(frame("error", id=request_id, kind=fault.kind, code=fault.code, hint=fault.hint, message=message,
                        retryable=fault.retryable))

    def exit_if_device_lost(self, fault: faults.Fault) -> None:
        """After a lost device nothing in this process can be trusted: tell the callers, then leave without
        destructors and get restarted with a fresh device context."""
        if fault.kind == "device_lost":
            self.flush()
            log.error("device lost: exiting so the supervisor restarts this model with a fresh device context")
            os._exit(faults.EXIT_DEVICE_LOST)

    def classify(self, message: str) -> faults.Fault:
        return faults.classify_error(message, device=self.spec["device"], pci_family=self.pci_family)

    def fail_all(self, requests: list, exc: BaseException) -> faults.Fault:
        """Fail `requests` with the runtime's exception, classified: its whole text to the log, the classified
        line to the clients (faults.client_message)."""
        message = str(exc).strip() or type(exc).__name__
        fault = self.classify(message)
        log.error("generation failed (%s): %s%s", fault.kind, message, fault.hint_suffix)
        for req in requests:
            self.fail(req.id, fault, faults.client_message(fault))
        return fault

    def live_request_ids(self) -> list[int]:
        """The requests this engine holds: what must be answered with an error if the engine dies."""
        raise NotImplementedError

    def after_step(self) -> None:
        """The test knobs' hook, called after every engine step."""
        self.steps += 1
        if self.step_delay:
            time.sleep(self.step_delay)
        if self.raise_after_steps and self.steps >= self.raise_after_steps:
            raise InjectedFault(f"{RAISE_AFTER_STEPS_ENV}={self.raise_after_steps} reached")


class OwnWords(Exception):
    """A request's failure that the worker found itself and says in openarc's own words: its fault, and a message
    the client's error body carries as it is (a runtime's exception text never does: Engine.fail_all)."""

    def __init__(self, message: str, fault: faults.Fault):
        super().__init__(message)
        self.fault = fault


class InvalidInput(OwnWords, ValueError):
    """Input the worker refuses as the client's to fix (too long, too many, undecodable): a 400 for that request."""

    def __init__(self, message: str, code: str = "invalid_request"):
        super().__init__(message, faults.Fault("invalid_request", code, None, False))


class UnusableOutput(OwnWords):
    """What the model computed cannot be answered (NaN or infinity where a client parses numbers): a 500 for that
    request, saying so; the worker goes on serving."""

    def __init__(self, message: str):
        super().__init__(message, faults.Fault("internal", "internal_error", None, False))


class ResultEngine(Engine):
    """The kinds whose request gets exactly one answer (embedding, rerank, transcription): requests run one at a
    time in arrival order, each through `answer()`, whose dict goes back in one `result` frame.

    InvalidInput from `answer()` is a 400 for that request; any other exception a classified 500 (and a lost
    device ends the worker, as for an LLM). The stall timer bounds one pipeline call (a batch of `in_batches`): a
    call that hangs past stall_timeout_s gets the worker killed and restarted.
    """

    def __init__(self, spec: dict[str, Any], channel: BlockingChannel):
        super().__init__(spec, channel)
        self.waiting: list[dict[str, Any]] = []
        self.current: dict[str, Any] | None = None  # the request in the pipeline

    def run(self) -> None:
        while True:
            self.drain_inbox(block=not self.waiting)
            if self.waiting:
                self._answer(self.waiting.pop(0))
            self.flush()

    def live_request_ids(self) -> list[int]:
        return [m["id"] for m in self.waiting] + ([self.current["id"]] if self.current else [])

    def on_generate(self, message: dict[str, Any]) -> None:
        self.waiting.append(message)

    def on_cancel(self, request_id: int) -> None:
        # A request already in the pipeline runs to its end (one call, nothing to stop mid-way); its result
        # frame then finds no caller and is dropped by the front.
        self.waiting = [m for m in self.waiting if m["id"] != request_id]

    def busy(self) -> bool:
        return self.current is not None

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        """The result of one request, from the body its route validated (the route shapes the result for the
        client), and what it adds to the model's counters (supervisor.RESULT_COUNTERS: prompt_tokens, ...);
        raise InvalidInput for a request the client must fix."""
        raise NotImplementedError

    def in_batches(self, items: list, size: int):
        """(offset, slice) of `items`, `size` at a time, for one pipeline call each: a batch is this kind's engine
        step, so after each comes a progress frame if one is due (the stall timer sees a long request advance)."""
        for start in range(0, len(items), size):
            yield start, items[start:start + size]
            self.flush()
            self.after_step()

    def _answer(self, message: dict[str, Any]) -> None:
        self.current = message
        try:
            result, counts = self.answer(message["body"])
        except OwnWords as exc:
            self.fail(message["id"], exc.fault, str(exc))
        except InjectedFault:
            raise  # the test knob proves that an engine-thread exception fails the worker loudly
        except Exception as exc:  # a pipeline error belongs to this request; the worker goes on serving
            self.exit_if_device_lost(self.fail_all([SimpleNamespace(id=message["id"])], exc))
        else:
            self.post(frame("result", id=message["id"], result=result, counts=counts))
        finally:
            self.current = None
