"""The stateful LLM engine (`pipeline: stateful`): genai's LLMPipeline, one request at a time, its tokens arriving
through a streamer while generate() runs.

A module apart from the shared half (appliance.worker.engines.llm) because its control flow is the opposite of the
batching loop's: genai owns the loop, so the inbox is drained, frames flushed and cancels honoured from inside the
streamer, and an exception raised there is carried out past genai (which would swallow it) by hand. The VLM
engine's VLMPipeline runs through the same streamer (appliance.worker.engines.vlm).
"""

from __future__ import annotations

from typing import Any

from appliance.worker.engines.llm import LLMEngine, Request
from appliance.worker.engines.adapters import Adapters
from appliance.worker.prompt import Refused


class SequentialEngine(LLMEngine):
    """The stateful LLMPipeline (ATTENTION_BACKEND=SDPA): one request at a time, tokens through a streamer."""

    def __init__(self, spec, channel):
        import openvino_genai
        self.adapters = Adapters(spec)  # the stateful pipeline applies each request's own (GenerationConfig.adapters)
        adapters = self.adapters.construction()
        extra = {"adapters": adapters} if adapters is not None else {}
        self.pipe = openvino_genai.LLMPipeline(spec["path"], spec["device"], **spec["properties"], **extra)
        self._init_sequential(spec, channel)

    def _init_sequential(self, spec, channel) -> None:
        """What follows loading self.pipe (an LLMPipeline, or a VLMPipeline in the VLM engine)."""
        LLMEngine.__init__(self, spec, channel, self.pipe.get_tokenizer())
        self.cancelled: set[int] = set()
        self.waiting: list[dict[str, Any]] = []
        self.current: Request | None = None
        self.reports_logprobs = False

    def run(self) -> None:
        while True:
            self.drain_inbox(block=not self.waiting)
            if self.waiting:
                self._generate(self.waiting.pop(0))
            self.flush()

    def busy(self) -> bool:
        return self.current is not None

    def live_request_ids(self) -> list[int]:
        return [m["id"] for m in self.waiting] + ([self.current.id] if self.current else [])

    def on_generate(self, message: dict[str, Any]) -> None:
        self.waiting.append(message)

    def on_cancel(self, request_id: int) -> None:
        """Stop the current request at its next token; drop a waiting one; remember nothing of one that is gone
        (a client that hangs up as its answer comes sends a cancel after the done)."""
        if self.current is not None and self.current.id == request_id:
            self.cancelled.add(request_id)  # read by the streamer; discarded when generate() returns
        elif any(m["id"] == request_id for m in self.waiting):
            self.waiting = [m for m in self.waiting if m["id"] != request_id]
            self.forget(request_id)
        else:
            self.cancel_probing(request_id)

    def _generate(self, message: dict[str, Any]) -> None:
        req = self.prepare(message)
        if req is None:
            return
        try:
            self._generate_prepared(req)
        finally:  # (an exception leaves `current` set: the worker's exit path fails it)
            self.cancelled.discard(req.id)

    def _generate_prepared(self, req: Request) -> None:
        import openvino_genai
        engine = self

        class Streamer(openvino_genai.StreamerBase):
            error: BaseException | None = None

            def write(self, token):
                # genai would print and swallow an exception raised here while generation went on: keep it, stop
                # generating, and raise it once generate() has returned.
                try:
                    if not compiling.done.is_set():
                        compiling.stop()  # the constraint compiled: tokens flow
                    engine.emit_tokens([(req, token if isinstance(token, list) else [token])])
                    engine.flush()
                    engine.drain_inbox(block=False)
                    engine.after_step()
                    if req.stopped or req.id in engine.cancelled:
                        return openvino_genai.StreamingStatus.CANCEL
                    return openvino_genai.StreamingStatus.RUNNING
                except BaseException as exc:
                    self.error = exc
                    return openvino_genai.StreamingStatus.CANCEL

            def end(self):
                pass

        self.current, streamer = req, Streamer()
        try:
            with self.compiling(req.structured is not None) as compiling:  # before the first token
                self.run_pipeline(req, streamer)
        except Refused as refused:  # the request's own fault (a VLM prompt's image tags): the worker goes on
            self.current = None
            self.fail(req.id, refused.fault, str(refused))
            return
        except Exception as exc:
            if streamer.error is None:
                self.current = None
                self.exit_if_device_lost(self.fail_all([req], exc))
                return
        if streamer.error is not None:  # our own code failed, not the pipeline: the engine's guard takes it
            raise streamer.error
        self.current = None
        if req.id not in self.cancelled and not req.stopped:
            self.finish(req, "length" if len(req.generated) >= req.max_tokens else "stop")

    def run_pipeline(self, req: Request, streamer) -> None:
        self.pipe.generate(req.input_ids, req.config, streamer)
