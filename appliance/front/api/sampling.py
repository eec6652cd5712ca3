"""Sampling and output parameters of chat and text completions, checked and turned into the worker's `params`.

Each knob maps to one openvino_genai.GenerationConfig field (the worker sets it). A parameter that would change
what the answer means but cannot be honoured is refused with a 400 naming it; parameters that only describe the
caller (`user`, `metadata`, `store`, `service_tier`, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any

from appliance.config.rules import MAX_ASSISTANT_TOKENS, MAX_NGRAM_SIZE
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import flag, number

MAX_TOP_K = 1 << 31
MAX_REPETITION_PENALTY = 10.0  # far beyond any useful value; keeps the division in genai's penalty sane


def sampling_params(body: dict, chat: bool) -> dict[str, Any]:
    """The knobs beyond temperature/top_p/seed/stop: top_k, min_p, the three penalties, logprobs."""
    top_k = number(body, "top_k", -1, MAX_TOP_K, integer=True)
    repetition = number(body, "repetition_penalty", 0, MAX_REPETITION_PENALTY)
    if repetition == 0:
        raise InvalidRequest("'repetition_penalty' must be above 0 (1 means no penalty)", "repetition_penalty")
    params = {
        "top_k": top_k if top_k and top_k > 0 else None,  # -1 and 0 mean "no top-k filter", as in vLLM
        "min_p": _min_p(body),
        "presence_penalty": number(body, "presence_penalty", -2, 2),
        "frequency_penalty": number(body, "frequency_penalty", -2, 2),
        "repetition_penalty": repetition,
        "logprobs": _chat_logprobs(body) if chat else _completion_logprobs(body),
        **speculative_params(body),
    }
    _refuse_unsupported(body, chat)
    return params


def speculative_params(body: dict) -> dict[str, Any]:
    """A request's speculative-decoding knobs (vLLM's and llama.cpp's users pass them): they override the model's
    defaults on a model with a draft or prompt lookup, and change nothing on another (the answer is the same)."""
    params = {
        "num_assistant_tokens": number(body, "num_assistant_tokens", 1, MAX_ASSISTANT_TOKENS, integer=True),
        "assistant_confidence_threshold": number(body, "assistant_confidence_threshold", 0, 1),
        "max_ngram_size": number(body, "max_ngram_size", 1, MAX_NGRAM_SIZE, integer=True),
    }
    if params["num_assistant_tokens"] is not None and params["assistant_confidence_threshold"] is not None:
        raise InvalidRequest("set 'num_assistant_tokens' or 'assistant_confidence_threshold', not both",
                             "assistant_confidence_threshold")
    if params["assistant_confidence_threshold"] in (0, 1):
        raise InvalidRequest("'assistant_confidence_threshold' must be strictly between 0 and 1",
                             "assistant_confidence_threshold")
    return {key: value for key, value in params.items() if value is not None}


def _min_p(body: dict) -> float | None:
    min_p = number(body, "min_p", 0, 1)
    if min_p == 1:
        raise InvalidRequest("'min_p' must be below 1 (genai keeps tokens whose probability is at least min_p "
                             "times the top one's)", "min_p")
    return min_p


def _chat_logprobs(body: dict) -> bool:
    wanted = flag(body, "logprobs")
    top = number(body, "top_logprobs", 0, 20, integer=True)
    if top and not wanted:
        raise InvalidRequest("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    if top:
        raise InvalidRequest("'top_logprobs' above 0 is not supported: OpenVINO GenAI returns only the log "
                             "probability of each chosen token", "top_logprobs")
    return wanted


def _completion_logprobs(body: dict) -> bool:
    count = number(body, "logprobs", 0, 5, integer=True)
    if count:
        raise InvalidRequest("'logprobs' above 0 is not supported: OpenVINO GenAI returns only the log probability "
                             "of each chosen token (use 0)", "logprobs")
    return count == 0


def _refuse_unsupported(body: dict, chat: bool) -> None:
    """Parameters that change the answer and that genai cannot honour: a 400 rather than silence."""
    if body.get("logit_bias"):
        raise InvalidRequest("'logit_bias' is not supported", "logit_bias")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequest("only the 'text' modality is supported", "modalities")
    if body.get("audio") is not None:
        raise InvalidRequest("audio output is not supported", "audio")
    if body.get("prediction") is not None:
        raise InvalidRequest("'prediction' (predicted outputs) is not supported", "prediction")
    if not chat:
        if flag(body, "echo"):
            raise InvalidRequest("'echo' is not supported", "echo")
        if body.get("suffix"):
            raise InvalidRequest("'suffix' is not supported", "suffix")
        best_of = number(body, "best_of", 1, 1 << 10, integer=True)
        if best_of and best_of > 1:
            raise InvalidRequest("'best_of' above 1 is not supported", "best_of")
