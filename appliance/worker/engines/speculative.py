"""Speculative decoding in the batching engine: building the pipeline with a draft model or prompt lookup, the
per-request knobs, and counting how many proposed tokens the main model accepted.

genai's ContinuousBatchingPipeline takes the draft (`draft_model(...)`) or prompt lookup (`prompt_lookup=True`) as
construction properties; every request of such a pipeline must then say how many tokens to propose
(`num_assistant_tokens`, or `assistant_confidence_threshold` for a draft) and, for prompt lookup, the n-gram size.
The main model verifies every proposal, so greedy answers are the tokens it would produce alone.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from appliance.config.model_checks import tokenizer_mismatch

log = logging.getLogger("openarc.worker")


def pipeline_properties(spec: dict[str, Any]) -> dict[str, Any]:
    """The main model's properties plus the draft or prompt lookup; a draft that cannot serve this model (missing,
    another tokenizer) is refused here, naming both, before anything loads."""
    import openvino_genai
    properties = dict(spec["properties"])
    draft = spec.get("draft_model")
    if draft:
        if not os.path.isdir(draft["path"]):
            raise RuntimeError(f"draft_model {draft['path']!r}: no such model directory")
        mismatch = tokenizer_mismatch(spec["path"], draft["path"])
        if mismatch:
            raise RuntimeError(mismatch)
        try:  # reads the draft's files here
            properties["draft_model"] = openvino_genai.draft_model(draft["path"], draft["device"], **draft["properties"])
        except Exception as exc:
            raise RuntimeError(f"draft_model {draft['path']!r} failed to load: {exc}") from None
    elif spec.get("prompt_lookup"):
        properties["prompt_lookup"] = True
    return properties


def load_pipeline(spec: dict[str, Any], scheduler, adapters=None):
    """ContinuousBatchingPipeline for the spec, with its draft or prompt lookup, or its LoRA adapters (an
    openvino_genai.AdapterConfig: appliance.worker.engines.adapters); a failure names the draft."""
    import openvino_genai
    properties = pipeline_properties(spec)
    if adapters is not None:
        properties["adapters"] = adapters
    try:
        pipe = openvino_genai.ContinuousBatchingPipeline(spec["path"], scheduler, spec["device"], properties)
    except Exception as exc:
        draft = spec.get("draft_model")
        if draft:  # genai's message rarely says which of the two models it could not load
            raise RuntimeError(f"loading {spec['path']!r} with draft_model {draft['path']!r} on {draft['device']} "
                               f"failed: {exc}") from None
        raise
    log.info("model %s decodes %s", spec["name"], mode_line(spec))
    return pipe


def mode_line(spec: dict[str, Any]) -> str:
    """The load log's account of how this model decodes."""
    knobs = ", ".join(f"{k}={v}" for k, v in (spec.get("speculative") or {}).items())
    if spec.get("draft_model"):
        draft = spec["draft_model"]
        return f"speculatively with draft model {draft['path']} on {draft['device']} ({knobs})"
    if spec.get("prompt_lookup"):
        return f"speculatively with prompt lookup ({knobs})"
    return "without speculative decoding (no draft_model, no prompt_lookup)"


def apply(config, defaults: dict[str, Any], params: dict[str, Any]) -> int:
    """Set a request's speculative knobs on its GenerationConfig: the model's defaults, overridden by the request's
    own (the front checked their ranges). Returns the tokens proposed a step at most (0 for a plain model, whose
    requests' knobs are ignored: they could not change its answer)."""
    if not defaults:
        return 0
    knobs = dict(defaults)
    # A request's num_assistant_tokens replaces a configured threshold and vice versa: genai takes one of the two.
    if params.get("num_assistant_tokens") is not None:
        knobs.pop("assistant_confidence_threshold", None)
        knobs["num_assistant_tokens"] = params["num_assistant_tokens"]
    elif params.get("assistant_confidence_threshold") is not None and "max_ngram_size" not in knobs:
        knobs.pop("num_assistant_tokens", None)
        knobs["assistant_confidence_threshold"] = params["assistant_confidence_threshold"]
    if params.get("max_ngram_size") is not None and "max_ngram_size" in knobs:
        knobs["max_ngram_size"] = params["max_ngram_size"]
    for key, value in knobs.items():
        setattr(config, key, value)
    return knobs.get("num_assistant_tokens") or 0


@dataclass
class DraftTally:
    """One request's proposals and acceptances, from the tokens each step gave it.

    genai's step API reports no per-request counts, so they are derived: each read() of a handle is one step's
    output, and a speculative step gives 1 + accepted tokens (the main model's own token after the proposals it
    accepted); with a fixed proposal size K, the rest of the K proposals (fewer near max_tokens) were rejected.
    With a confidence threshold (proposals of varying size) rejections are unknown and only acceptances count;
    prompt lookup that found no match proposed nothing, yet its K slots count as rejected (what a user tuning K
    wants to see). A stop string can hold a step's tokens back to the next read: the total stays right."""

    proposal: int  # K, tokens proposed a step; 0 when unknown (confidence threshold)
    max_tokens: int
    accepted: int = 0
    rejected: int = 0
    generated: int = 0

    def read(self, produced: int) -> None:
        """One step's output of `produced` tokens."""
        if self.generated:  # the prompt's step proposes nothing
            accepted = max(produced - 1, 0)
            self.accepted += accepted
            if self.proposal:
                self.rejected += max(min(self.proposal, self.max_tokens - self.generated - 1) - accepted, 0)
        self.generated += produced

    def frame_fields(self) -> dict[str, int]:
        return {"draft_accepted": self.accepted, "draft_rejected": self.rejected}
