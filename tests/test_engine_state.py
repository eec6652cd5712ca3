"""A long-lived LLM worker keeps no per-request state after its requests are gone, and its grammar-probe thread
cannot die silently. The engine runs in this process on the demo model (OpenVINO GenAI on CPU), driven through the
same calls its channel reader makes (submit, cancel), with a channel that records the frames it would send."""

from __future__ import annotations

import threading

import pytest

from conftest import model_entry, wait_until

SETTLE_S = 60  # only catches a hang


class RecordingChannel:
    def __init__(self):
        self.frames: list[dict] = []
        self.lock = threading.Lock()

    def send(self, message: dict) -> None:
        with self.lock:
            for frame in message["frames"] if message["op"] == "batch" else [message]:
                self.frames.append(frame)

    def ended(self) -> set[int]:
        with self.lock:
            return {f["id"] for f in self.frames if f["op"] in ("done", "error")}

    def of(self, request_id: int) -> list[dict]:
        with self.lock:
            return [f for f in self.frames if f.get("id") == request_id]


def engine_of(demo_model, pipeline: str):
    from appliance.config import parse_config, worker_spec
    from appliance.worker.engines import load_engine
    config = parse_config({"models": [model_entry("m", demo_model, pipeline=pipeline)]}, "test")
    channel = RecordingChannel()
    engine = load_engine(worker_spec(config.models[0], config), channel)
    for name, target in [("engine", engine.run), *engine.threads()]:
        threading.Thread(target=target, name=name, daemon=True).start()
    return engine, channel


def generate(request_id: int, max_tokens: int = 8, constraint: dict | None = None) -> dict:
    return {"op": "generate", "id": request_id, "kind": "completion", "prompt": "Once", "stream": True,
            "params": {"max_tokens": max_tokens}, "constraint": constraint}


def regex(i: int) -> dict:
    """A constraint the probe has not seen: each one is compiled on the probe thread."""
    return {"type": "regex", "regex": f"a{{{i + 1}}}", "kind": "regex", "param": "structured_outputs"}


def held_ids(engine) -> dict[str, int]:
    sets = {name: len(getattr(engine, name)) for name in ("probing", "cancelled_while_probing")}
    if hasattr(engine, "cancelled"):
        sets["cancelled"] = len(engine.cancelled)
    return sets


@pytest.mark.parametrize("pipeline", ["stateful", "continuous_batching"])
def test_cancelled_requests_leave_no_ids_behind(demo_model, pipeline):
    """Three hundred cancels of every kind a client causes: after the request finished, while it waited behind
    another, and while its constraint was still compiling. Every id is forgotten once its request is gone."""
    engine, channel = engine_of(demo_model, pipeline)
    ids = iter(range(1, 10_000))
    # 1. a cancel that arrives after its request finished (the client hung up as the answer came)
    for _ in range(100):
        request_id = next(ids)
        engine.submit(generate(request_id))
        wait_until(lambda: request_id in channel.ended(), SETTLE_S, f"request {request_id} done")
        engine.cancel(request_id)
    # 2. cancels of requests waiting behind a long one, then of the long one
    first = next(ids)
    engine.submit(generate(first, max_tokens=60))
    queued = [next(ids) for _ in range(100)]
    for request_id in queued:
        engine.submit(generate(request_id))
    for request_id in queued + [first]:
        engine.cancel(request_id)
    # 3. cancels that overtake their request on the probe thread
    for i in range(100):
        request_id = next(ids)
        engine.submit(generate(request_id, constraint=regex(i)))
        engine.cancel(request_id)
    last = next(ids)
    engine.submit(generate(last))  # runs after everything above was handled
    wait_until(lambda: last in channel.ended(), SETTLE_S, "the last request done")
    # the probe thread may still hand a cancelled request on: give it a moment, then count
    try:
        wait_until(lambda: not any(held_ids(engine).values()), 10, "every id forgotten")
    except AssertionError:
        raise AssertionError(f"ids still held after 300 cancels: {held_ids(engine)}") from None
    if pipeline == "stateful":
        assert engine.waiting == []
