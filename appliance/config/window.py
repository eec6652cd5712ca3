"""A model's context window, and what one answer may use of it: pure policy, read by the front (the spec a worker
is launched with, /v1/models, /openarc/status, check-config, doctor) and by the worker (every request's limit).

The window (`model_window`): models[].max_context where the config sets it; left unset, the model's own trained
window (its config.json: max_position_embeddings and the like), capped by what its KV cache holds for one sequence
(scheduler_config cache_size or num_kv_blocks, at the model's KV precision: layers x kv heads x head dim). A client
that reads the window from /v1/models then sizes its prompts to what the server can really hold.

An answer's limit (`answer_limit`): the request's own limit, else the operator's default_max_tokens if set, else all
the window leaves after the prompt; whichever it is, never more than the window leaves. Only a prompt that leaves
no room at all is refused. The bound that applied is named, so an answer cut short is counted by what cut it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.config import ModelConfig

# The window of a model whose config.json names none (and of max_context's old default).
FALLBACK_WINDOW = 4096
# config.json keys that name a model's trained window, in the order they are trusted.
WINDOW_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions", "max_seq_len")
# Bytes per KV element by precision (OpenVINO's KV_CACHE_PRECISION names), and the per-token, per-head bytes an
# 8-bit (or smaller) cache adds for its scale and zero point (two f32 each for keys and for values).
PRECISION_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "u8": 1.0, "i8": 1.0, "u4": 0.5, "i4": 0.5}
QUANT_GROUP_BYTES = 8
# OpenVINO's defaults where a model's runtime_config sets no KV_CACHE_PRECISION: u8 on the CPU (2026.4:
# Core().get_property("CPU", "KV_CACHE_PRECISION")), f16 on a GPU (counted as the larger, never overstating).
DEFAULT_PRECISION = {"CPU": "u8", "GPU": "f16"}
# genai's KV block size by device family (num_kv_blocks counts blocks of this many tokens).
BLOCK_TOKENS = {"CPU": 32, "GPU": 16}
GIB = 1 << 30

# The bounds an answer's limit can come from (openarc_answers_cut_total's reason label).
BOUND_REQUEST, BOUND_DEFAULT, BOUND_WINDOW = "max_tokens", "default_max_tokens", "context_window"


@dataclass(frozen=True)
class Window:
    """A model's window (`tokens`: prompt plus answer) and where it comes from."""

    tokens: int
    source: str                      # "max_context" (configured), "trained", "kv_cache" or "fallback"
    trained: int | None = None       # the model's own, from its config.json
    kv_tokens: int | None = None     # what its KV cache holds for one sequence (None: no fixed cache)
    kv_bytes_per_token: float | None = None
    kv_precision: str | None = None

    def status(self) -> dict[str, Any]:
        """The window as /openarc/status shows it."""
        return {"context_length": self.tokens, "source": self.source, "trained": self.trained,
                "kv_cache_tokens": self.kv_tokens, "kv_bytes_per_token": self.kv_bytes_per_token,
                "kv_precision": self.kv_precision}

def describe(status: dict[str, Any]) -> str:
    """A window (Window.status(), as a worker's spec carries it) in one line for the log: its size and why."""
    why = {"max_context": "max_context", "trained": "the model's own", "kv_cache": "what its KV cache holds",
           "fallback": "its config.json names none"}[status["source"]]
    if status["trained"] is not None and status["source"] != "trained":
        why += f"; trained {status['trained']}"
    if status["kv_cache_tokens"] is not None:
        why += (f"; its KV cache holds {status['kv_cache_tokens']} at {status['kv_precision']}, "
                f"{status['kv_bytes_per_token']:g} bytes a token")
    return f"context window {status['context_length']} tokens ({why})"


def hf_config(path: str) -> dict[str, Any]:
    """The model directory's config.json, {} if it is missing or unreadable (it only refines defaults)."""
    try:
        data = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _text_config(hf: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (a VLM nests it under text_config or llm_config)."""
    for key in ("text_config", "llm_config"):
        if isinstance(hf.get(key), dict):
            return {**hf, **hf[key]}
    return hf


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def trained_window(hf: dict[str, Any]) -> int | None:
    """The window the model was trained for, as its config.json says (None: it says none)."""
    text = _text_config(hf)
    return next((n for n in (_positive(text.get(key)) for key in WINDOW_KEYS) if n), None)


def kv_bytes_per_token(hf: dict[str, Any], precision: str) -> float | None:
    """KV cache bytes one token takes: keys and values of every layer's kv heads (None: the config lacks the
    shape)."""
    text = _text_config(hf)
    layers, heads = _positive(text.get("num_hidden_layers")), _positive(text.get("num_attention_heads"))
    kv_heads = _positive(text.get("num_key_value_heads")) or heads
    head_dim = _positive(text.get("head_dim")) or (
        _positive(text.get("hidden_size")) // heads if heads and _positive(text.get("hidden_size")) else None)
    if not (layers and kv_heads and head_dim):
        return None
    element = PRECISION_BYTES.get(precision, 2.0)
    group = QUANT_GROUP_BYTES if element <= 1 else 0
    return 2 * layers * kv_heads * (head_dim * element + group)


def kv_precision(model: ModelConfig) -> str:
    """The KV cache precision the model's worker compiles with: its runtime_config's, else the device's default."""
    configured = model.runtime_config.get("KV_CACHE_PRECISION")
    if isinstance(configured, str) and configured.lower() in PRECISION_BYTES:
        return configured.lower()
    return DEFAULT_PRECISION["GPU" if model.is_gpu else "CPU"]


def cache_tokens(model: ModelConfig, bytes_per_token: float) -> int | None:
    """Tokens the model's KV cache holds (None: a pipeline without a fixed cache, the stateful one's grows)."""
    if model.pipeline == "stateful":
        return None
    settings = model.scheduler_settings()
    blocks, size = settings.get("num_kv_blocks"), settings.get("cache_size")
    if _positive(blocks):
        return blocks * BLOCK_TOKENS["GPU" if model.is_gpu else "CPU"]
    if isinstance(size, (int, float)) and not isinstance(size, bool) and size > 0:
        return max(1, int(size * GIB // bytes_per_token))
    return None  # genai's dynamic cache (or a value genai itself will refuse at load)


def model_window(model: ModelConfig) -> Window:
    """The model's window: max_context if set, else its trained window capped by its KV cache (see the module)."""
    return window_of(model, hf_config(model.path) if model.path else {})


def window_of(model: ModelConfig, hf: dict[str, Any]) -> Window:
    """model_window, given the model directory's config.json (`hf`)."""
    trained = trained_window(hf)
    generative = model.kind in ("llm", "vlm")
    precision = kv_precision(model) if generative else None
    per_token = kv_bytes_per_token(hf, precision) if precision else None
    kv = cache_tokens(model, per_token) if per_token else None
    if model.max_context is not None:
        return Window(model.max_context, "max_context", trained, kv, per_token, precision)
    if trained is None:
        return Window(min(FALLBACK_WINDOW, kv or FALLBACK_WINDOW), "fallback", None, kv, per_token, precision)
    if kv is not None and kv < trained:
        return Window(kv, "kv_cache", trained, kv, per_token, precision)
    return Window(trained, "trained", trained, kv, per_token, precision)


def report(model: ModelConfig) -> tuple[str, str | None]:
    """What check-config and doctor say of a generative model's window: one line (the window, why, and what an
    explicit max_context costs in KV memory), and a problem with it, if any (None)."""
    window = model_window(model)
    line = f"model {model.name}: {describe(window.status())}"
    if window.source != "max_context":
        return line, None
    if window.kv_bytes_per_token:
        line += (f"; max_context {window.tokens} costs {window.tokens * window.kv_bytes_per_token / (1 << 20):.0f} "
                 f"MiB of KV cache for one full sequence")
    if window.kv_tokens is not None and window.tokens > window.kv_tokens:
        needed = math.ceil(window.tokens * window.kv_bytes_per_token / GIB)
        return line, (f"model {model.name}: max_context {window.tokens} is more than its KV cache holds for one "
                      f"sequence ({window.kv_tokens} tokens): set scheduler_config.cache_size to at least "
                      f"{needed} (GB), or lower max_context (unset, it is fitted to the cache)")
    if window.trained is not None and window.tokens > window.trained:
        return line, (f"model {model.name}: max_context {window.tokens} is more than the model was trained for "
                      f"({window.trained}, its config.json): answers past that are unreliable")
    return line, None


class WindowExceeded(Exception):
    """A prompt that leaves the answer no room in the window."""

    def __init__(self, prompt_tokens: int, window: int):
        super().__init__(f"the prompt has {prompt_tokens} tokens; the window is {window}")
        self.prompt_tokens, self.window = prompt_tokens, window


def answer_limit(prompt_tokens: int, requested: int | None, window: int, default: int | None) -> tuple[int, str]:
    """The most tokens an answer may have, and the bound that set it (BOUND_*): the request's own limit, else the
    operator's default (default_max_tokens) if set, else none; each fitted to what the window leaves after the
    prompt. WindowExceeded when the prompt leaves nothing."""
    room = window - prompt_tokens
    if room < 1:
        raise WindowExceeded(prompt_tokens, window)
    if requested:
        limit, bound = requested, BOUND_REQUEST
    elif default:
        limit, bound = default, BOUND_DEFAULT
    else:
        return room, BOUND_WINDOW
    return (limit, bound) if limit <= room else (room, BOUND_WINDOW)
