"""A model's window and an answer's limit (appliance.config.window): pure policy, no processes.

The window: max_context where set, else the model's trained window (config.json) capped by what its KV cache holds
for one sequence. An answer's limit: the request's own, else the operator's default_max_tokens, else the room the
window leaves; never more than that room; only a prompt that leaves no room is refused.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from appliance.config import ModelConfig, parse_config, worker_spec
from appliance.config.window import (BOUND_DEFAULT, BOUND_REQUEST, BOUND_WINDOW, GIB, WindowExceeded, answer_limit,
                                     describe, kv_bytes_per_token, kv_cost, model_window, trained_window)

# Qwen2.5-7B-Instruct's config.json, the fields the window reads (28 layers, 4 kv heads of 128, 32k trained).
QWEN_7B = {"num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584,
           "max_position_embeddings": 32768}


def model_dir(tmp_path, hf: dict) -> str:
    (tmp_path / "config.json").write_text(json.dumps(hf))
    return str(tmp_path)


@given(prompt=st.integers(0, 10_000), requested=st.none() | st.integers(1, 1 << 20),
       window=st.integers(1, 10_000), default=st.none() | st.integers(1, 1 << 20))
def test_an_answer_limit_never_passes_the_room_and_names_its_bound(prompt, requested, window, default):
    room = window - prompt
    if room < 1:
        with pytest.raises(WindowExceeded):
            answer_limit(prompt, requested, window, default)
        return
    limit, bound = answer_limit(prompt, requested, window, default)
    assert 1 <= limit <= room
    wanted = requested or default
    if wanted is None:
        assert (limit, bound) == (room, BOUND_WINDOW)  # no limit anywhere: all the room
    elif wanted <= room:
        assert (limit, bound) == (wanted, BOUND_REQUEST if requested else BOUND_DEFAULT)
    else:
        assert (limit, bound) == (room, BOUND_WINDOW)  # fitted, never refused


def test_the_trained_window_and_kv_size_come_from_config_json():
    assert trained_window(QWEN_7B) == 32768
    assert trained_window({"text_config": {"max_position_embeddings": 8192}}) == 8192  # a VLM's language model
    assert trained_window({"n_positions": 1024}) == 1024
    assert trained_window({}) is None
    # keys and values, 28 layers x 4 kv heads x 128: f16 2 bytes each, u8 1 byte plus its scale and zero point
    assert kv_bytes_per_token(QWEN_7B, "f16") == 2 * 28 * 4 * 128 * 2
    assert kv_bytes_per_token(QWEN_7B, "u8") == 2 * 28 * 4 * (128 + 8)
    assert kv_bytes_per_token({"max_position_embeddings": 10}, "f16") is None


def test_unset_max_context_is_the_trained_window_capped_by_the_kv_cache(tmp_path):
    path = model_dir(tmp_path, QWEN_7B)
    on_gpu = ModelConfig(name="m", path=path, device="GPU", scheduler_config={"cache_size": 1})  # f16: 18724 tokens
    window = model_window(on_gpu)
    assert (window.tokens, window.source, window.trained) == (GIB // (2 * 28 * 4 * 128 * 2), "kv_cache", 32768)
    bigger = ModelConfig(name="m", path=path, device="GPU", scheduler_config={"cache_size": 8})
    assert (model_window(bigger).tokens, model_window(bigger).source) == (32768, "trained")
    stateful = ModelConfig(name="m", path=path, device="GPU", pipeline="stateful")  # its cache grows: no cap
    assert model_window(stateful).tokens == 32768
    blocks = ModelConfig(name="m", path=path, scheduler_config={"num_kv_blocks": 100})  # CPU blocks of 32
    assert model_window(blocks).tokens == 3200
    explicit = ModelConfig(name="m", path=path, max_context=65536)  # the operator's word wins, even past trained
    assert (model_window(explicit).tokens, model_window(explicit).source) == (65536, "max_context")
    assert kv_cost(explicit, 65536) == 65536 * 2 * 28 * 4 * (128 + 8)  # u8 on the CPU
    nothing = ModelConfig(name="m", path=str(tmp_path / "absent"))
    assert (model_window(nothing).tokens, model_window(nothing).source) == (4096, "fallback")
    assert "context window 18724 tokens (kv_cache; trained 32768" in describe(window.status())


def test_the_spec_carries_the_window_and_default_max_tokens_is_unset_by_default(tmp_path):
    path = model_dir(tmp_path, QWEN_7B)
    config = parse_config({"models": [{"name": "m", "path": path, "scheduler_config": {"cache_size": 8}},
                                      {"name": "capped", "path": path, "max_context": 8192, "default_max_tokens": 256}]},
                          "test.yaml")
    spec = worker_spec(config.models[0], config)
    assert spec["max_context"] == 32768 and spec["window"]["source"] == "trained"
    assert spec["default_max_tokens"] is None
    capped = worker_spec(config.models[1], config)  # configs that set both keep working
    assert (capped["max_context"], capped["default_max_tokens"]) == (8192, 256)
