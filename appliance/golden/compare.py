"""A check against the record, as a pure function: the first thing that differs, in one line, or None.

Token answers (llm, vlm, transcription) must be identical, token for token: the probes are greedy, so the same
model on a sound runtime gives the same tokens; the line names the first token that differs. Vectors (embedding)
and scores (rerank) may differ by the record's `tolerance` in each component (another runtime's kernels round
differently). tts: the audio's length, and the checksum of its first frames. Speed: below `min_speed` times the
recorded speed (server.canary_min_speed; 0 checks no speed) is a failure too.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from appliance.golden.record import Answer, ModelRecord

# The reasons a check fails, as openarc_canary_failures_total{reason} counts them.
ANSWER, SPEED, LOAD, ERROR = "answer", "speed", "load", "error"
END = "<end>"  # where one answer stops before the other


@dataclass(frozen=True)
class Difference:
    reason: str  # ANSWER, SPEED, LOAD or ERROR
    detail: str  # one line, naming the model and what differs

    def __str__(self) -> str:
        return self.detail


def compare(name: str, recorded: ModelRecord, observed: ModelRecord, min_speed: float) -> Difference | None:
    """The first difference between a model's record and what it answers now, or None when it passes."""
    if recorded.kind != observed.kind:
        return Difference(ANSWER, f"model {name}: recorded as kind {recorded.kind}, now kind {observed.kind}")
    recorded_probes = [a.probe for a in recorded.answers]
    if recorded_probes != [a.probe for a in observed.answers]:
        return Difference(ANSWER, f"model {name}: the record's probes are not this openarc's; record again")
    for i, (want, got) in enumerate(zip(recorded.answers, observed.answers)):
        difference = answer_difference(want, got, recorded.tolerance)
        if difference:
            return Difference(ANSWER, f"model {name}: probe {i + 1} ({_short(want.probe)}): {difference}")
    if min_speed > 0 and recorded.speed > 0 and observed.speed < min_speed * recorded.speed:
        return Difference(SPEED, f"model {name}: {observed.speed:.1f} {observed.speed_unit} is below "
                                 f"canary_min_speed {min_speed:g} of the recorded {recorded.speed:.1f} "
                                 f"{recorded.speed_unit}")
    return None


def answer_difference(want: Answer, got: Answer, tolerance: float) -> str | None:
    """What differs between one probe's recorded answer and its answer now, or None."""
    if want.tokens is not None:
        return token_difference(want.tokens, got.tokens or [])
    if want.vector is not None:
        return vector_difference(want.vector, got.vector or [], tolerance)
    if want.samples is not None and want.samples != got.samples:
        return f"audio of {got.samples} samples, recorded {want.samples}"
    if want.checksum is not None and want.checksum != got.checksum:
        return f"the first frames' checksum is {got.checksum}, recorded {want.checksum}"
    return None


def token_difference(want: list[str], got: list[str]) -> str | None:
    """'differs at token N: recorded X, got Y' for the first token that differs (END where one answer stopped)."""
    for i in range(max(len(want), len(got))):
        a = want[i] if i < len(want) else None  # None: that answer ended (a token may read "<end>")
        b = got[i] if i < len(got) else None
        if a != b:
            return f"differs at token {i + 1}: recorded {_token(a)}, got {_token(b)}"
    return None


def vector_difference(want: list[float], got: list[float], tolerance: float) -> str | None:
    if len(want) != len(got):
        return f"{len(got)} values, recorded {len(want)}"
    for i, (a, b) in enumerate(zip(want, got)):
        if not math.isclose(a, b, rel_tol=0.0, abs_tol=tolerance):
            return f"differs at value {i + 1}: recorded {a:.6g}, got {b:.6g} (tolerance {tolerance:g})"
    return None


def _token(text: str | None) -> str:
    return END if text is None else repr(text)


def _short(text: str, limit: int = 40) -> str:
    return repr(text if len(text) <= limit else text[:limit - 1] + "…")
