"""Worker kinds: one engine class per kind of pipeline, all run by appliance.worker the same way."""

from __future__ import annotations

from typing import Any

from appliance.engines.base import Engine


def load_engine(spec: dict[str, Any], channel) -> Engine:
    """Build the engine of a worker's spec; loading the pipeline happens here, in the engine's constructor."""
    from appliance.engines.llm import BatchingEngine, SequentialEngine
    engine_cls = SequentialEngine if spec["pipeline"] == "stateful" else BatchingEngine
    return engine_cls(spec, channel)
