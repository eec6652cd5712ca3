"""The kinds of model a worker runs, and which config keys belong to which kind.

The config refuses a kind's key on a model of another kind (naming both), the worker of a kind is told that kind's
keys, and the front routes chat and completions to the generative kinds only: all of them read these tables.
"""

from __future__ import annotations

# What a model's worker runs: a chat/completion LLM, or one of the request-in, result-out kinds.
MODEL_KINDS = ("llm", "vlm", "embedding", "rerank", "transcription", "tts", "image")
# The kinds that generate text (chat and text completions); vlm also takes images in chat.
GENERATIVE_KINDS = ("llm", "vlm")
# Keys that mean something for some kinds only (a kind, or a tuple of kinds): set for another kind they are a
# mistake worth naming.
KIND_ONLY_KEYS: dict[str, str | tuple[str, ...]] = {
    "pipeline": GENERATIVE_KINDS, "scheduler_config": GENERATIVE_KINDS, "default_max_tokens": GENERATIVE_KINDS,
    "tool_parser": GENERATIVE_KINDS, "reasoning_parser": GENERATIVE_KINDS, "chat_template": GENERATIVE_KINDS,
    "grammar_compile_timeout_s": GENERATIVE_KINDS, "canonicalize_agent_noise": GENERATIVE_KINDS,
    "grammar_compile_budget_s": GENERATIVE_KINDS, "grammar_step_budget_s": GENERATIVE_KINDS,
    "max_image_bytes": "vlm", "max_image_pixels": "vlm", "image_formats": "vlm",
    "adapters": ("llm", "image"), "max_adapters": ("llm", "image"),
    "draft_model": "llm", "prompt_lookup": "llm", "num_assistant_tokens": "llm",
    "assistant_confidence_threshold": "llm", "max_ngram_size": "llm",
    "pooling": "embedding", "normalize": "embedding", "matryoshka_dimensions": "embedding",
    "max_audio_seconds": "transcription", "max_upload_bytes": "transcription", "word_timestamps": "transcription",
    "voices": "tts", "default_voice": "tts",
    "max_resolution": "image", "max_images_per_request": "image", "max_inference_steps": "image",
}


def kinds_of(kinds: str | tuple[str, ...]) -> tuple[str, ...]:
    """A KIND_ONLY_KEYS value as a tuple of kinds."""
    return (kinds,) if isinstance(kinds, str) else kinds
