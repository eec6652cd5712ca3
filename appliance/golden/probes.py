"""The fixed probes of each kind: short, greedy, the same on every box, so that an answer that changes means the
model, its runtime or its driver changed. Changing a probe makes every record stale (compare says so): add probes
only with a new record format.
"""

from __future__ import annotations

import math
import struct

# llm, vlm: greedy chat answers of at most CHAT_MAX_TOKENS tokens.
CHAT_PROMPTS = ("Name three colours.", "What is 12 times 12?")
CHAT_MAX_TOKENS = 16
# embedding: texts; a vector's first VECTOR_VALUES values are kept (enough to see a changed kernel, short to read).
EMBEDDING_TEXTS = ("The quick brown fox jumps over the lazy dog.", "openarc serves models on Intel GPUs.")
VECTOR_VALUES = 64
# rerank: one query, its documents' scores.
RERANK_QUERY = "Which GPU runs the model?"
RERANK_DOCUMENTS = ("The model runs on an Intel Arc GPU.", "Bananas are yellow.", "A CPU can run it too.")
# tts: the audio's length, and a checksum of its first CHECKSUM_SECONDS.
SPEECH_TEXT = "Hello from openarc."
CHECKSUM_SECONDS = 0.25
# transcription: the bundled clip, made here (no file to lose): CLIP_SECONDS of a warbling tone at 16 kHz.
CLIP_NAME = "bundled clip: 2 s warbling 440 Hz tone"
CLIP_RATE = 16000
CLIP_SECONDS = 2.0


def clip_f32() -> bytes:
    """The transcription probe's audio as the worker reads it: little-endian float32 mono samples at CLIP_RATE
    (what the front's audio decoder writes for an upload). The same bytes on every box: computed, not sampled."""
    count = int(CLIP_SECONDS * CLIP_RATE)
    seconds = (i / CLIP_RATE for i in range(count))
    samples = (0.3 * math.sin(2 * math.pi * 440 * t) * (0.6 + 0.4 * math.sin(2 * math.pi * 3 * t)) for t in seconds)
    return struct.pack(f"<{count}f", *samples)


def words(text: str) -> list[str]:
    """A transcript's tokens, as compared: its words (the front never sees Whisper's token ids)."""
    return text.split()


GENERATIVE = ("llm", "vlm")


def speed_unit(kind: str) -> str:
    return "tokens/s" if kind in GENERATIVE else "probes/s"
