"""Worker kinds: one engine class per kind of pipeline, all run by appliance.worker the same way."""

from __future__ import annotations

from typing import Any

from appliance.worker.engines.base import Engine


def load_engine(spec: dict[str, Any], channel) -> Engine:
    """Build the engine of a worker's spec (by its model's kind); loading the pipeline happens here, in the
    engine's constructor. Each kind's module is imported only by the workers of that kind."""
    kind = spec.get("kind", "llm")
    if kind == "embedding":
        from appliance.worker.engines.embedding import EmbeddingEngine
        return EmbeddingEngine(spec, channel)
    if kind == "rerank":
        from appliance.worker.engines.rerank import RerankEngine
        return RerankEngine(spec, channel)
    if kind == "transcription":
        from appliance.worker.engines.transcription import TranscriptionEngine
        return TranscriptionEngine(spec, channel)
    if kind == "tts":
        from appliance.worker.engines.tts import SpeechEngine
        return SpeechEngine(spec, channel)
    if kind == "image":
        from appliance.worker.engines.image import ImageEngine
        return ImageEngine(spec, channel)
    if kind == "vlm":
        from appliance.worker.engines.vlm import BatchingVLMEngine, SequentialVLMEngine
        return (SequentialVLMEngine if spec["pipeline"] == "stateful" else BatchingVLMEngine)(spec, channel)
    if kind != "llm":
        raise ValueError(f"this openarc has no worker for kind {kind!r}")
    from appliance.worker.engines.batching import BatchingEngine
    from appliance.worker.engines.stateful import SequentialEngine
    engine_cls = SequentialEngine if spec["pipeline"] == "stateful" else BatchingEngine
    return engine_cls(spec, channel)
