"""A model's window and an answer's limit (appliance.config.window): pure policy, no processes.

The window: max_context where set, else the model's trained window (config.json) capped by what its KV cache holds
for one sequence. An answer's limit: the request's own, else the operator's default_max_tokens, else the room the
window leaves; never more than that room; only a prompt that leaves no room is refused.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from appliance.config import ModelConfig, parse_config, worker_spec
from appliance.config.window import (BOUND_DEFAULT, BOUND_REQUEST, BOUND_WINDOW, GIB, WindowExceeded, answer_limit,
                                     describe, kv_bytes_per_token, model_window, report, trained_window,
                                     window_of)

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


json_values = st.none() | st.booleans() | st.integers(-10, 1 << 40) | st.floats(allow_nan=False) | st.text(max_size=5)
hf_configs = st.dictionaries(st.sampled_from(["num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                              "head_dim", "hidden_size", "max_position_embeddings", "n_positions",
                                              "text_config"]), json_values | st.dictionaries(st.text(), json_values))
schedulers = st.dictionaries(st.sampled_from(["cache_size", "num_kv_blocks"]), json_values, max_size=1)


@settings(suppress_health_check=[HealthCheck.too_slow])  # the machine is shared: generation time is not ours
@given(hf=hf_configs, scheduler=schedulers, device=st.sampled_from(["CPU", "GPU.0"]))
def test_any_config_json_gives_a_window_of_at_least_one_token(hf, scheduler, device):
    """Whatever a model directory's config.json or a config's scheduler_config holds, the window is a positive
    number of tokens, never more than the model's trained window or its KV cache when it has them."""
    window = window_of(ModelConfig(name="m", path="", device=device, scheduler_config=scheduler), hf)
    assert isinstance(window.tokens, int) and window.tokens >= 1
    assert window.tokens <= min(n for n in (window.trained, window.kv_tokens, 1 << 62) if n)


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
    assert model_window(explicit).kv_bytes_per_token == 2 * 28 * 4 * (128 + 8)  # u8 on the CPU
    assert f"costs {65536 * 2 * 28 * 4 * (128 + 8) >> 20} MiB of KV cache" in report(explicit)[0]
    nothing = ModelConfig(name="m", path=str(tmp_path / "absent"))
    assert (model_window(nothing).tokens, model_window(nothing).source) == (4096, "fallback")
    assert "context window 18724 tokens (what its KV cache holds; trained 32768" in describe(window.status())


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


# --- served: the window as clients see it, and answers that fill it ----------------------------------------------

def open_webui_tools(count: int = 36, total_bytes: int = 24_700) -> list[dict]:
    """`count` function tools of Open WebUI 0.12's size: 36 built-in tools, 24.7 KB in all (measured in a browser,
    docs/coding-agents.md). Their text is made up; their size and shape are what matter to the window."""
    words = "search the knowledge base notes memories chats web page url query results files folder".split()
    tools = []
    for i in range(count):
        description = " ".join(words[(i + j) % len(words)] for j in range(20))
        tools.append({"type": "function", "function": {
            "name": f"builtin_tool_{i}", "description": description,
            "parameters": {"type": "object", "required": ["query"], "properties": {
                "query": {"type": "string", "description": "What to look for, in the user's own words"},
                "count": {"type": "integer", "description": "How many results to return at most"},
                "page": {"type": "integer", "description": "Which page of results, from 1"}}}}})
    size = len(json.dumps(tools))
    pad = (total_bytes - size) // count
    for tool in tools:
        tool["function"]["description"] += " " + "x" * max(0, pad - 1)
    return tools


@pytest.fixture(scope="module")
def served(demo_model, tmp_path_factory):
    from conftest import Appliance, model_entry
    models = [model_entry("demo", demo_model), model_entry("tiny", demo_model, max_context=40),
              model_entry("capped", demo_model, default_max_tokens=5), model_entry("narrow", demo_model, max_context=2048)]
    appliance = Appliance({"models": models}, tmp_path_factory.mktemp("window")).start()
    yield appliance
    appliance.stop()


def test_an_unset_window_is_the_models_own_and_clients_read_it(served):
    from conftest import http
    _, _, listing = http("GET", served.base + "/v1/models")
    lengths = {m["id"]: (m["context_length"], m["max_model_len"]) for m in listing["data"]}
    assert lengths["demo"] == (131072, 131072)  # the demo's config.json; its KV cache holds far more
    assert lengths["tiny"] == (40, 40)
    window = served.model_status("demo")["window"]
    assert window["source"] == "trained" and window["kv_cache_tokens"] > 131072
    assert "context window 131072 tokens (the model's own" in served.logs()


def test_open_webuis_tools_fit_the_demo_window_and_name_the_cause_where_they_do_not(served):
    from conftest import http
    tools = open_webui_tools()
    assert 24_000 <= len(json.dumps(tools)) <= 25_500
    chat = {"messages": [{"role": "user", "content": "Hello"}], "tools": tools}
    status, _, body = http("POST", served.base + "/v1/chat/completions", {"model": "demo", **chat}, timeout=300)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "tool_calls"), body
    assert body["usage"]["prompt_tokens"] > 4096  # the old default window refused it
    status, _, body = http("POST", served.base + "/v1/chat/completions", {"model": "narrow", **chat}, timeout=300)
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    message = body["error"]["message"]
    assert "maximum context length is 2048 tokens" in message and "request's 36 tools" in message
    assert "built-in tools" in message


def test_answers_cut_at_a_limit_are_counted_by_what_cut_them(served):
    from conftest import http
    from test_metrics import samples, value
    question = [{"role": "user", "content": "Hi"}]
    for model, limit, reason in (("tiny", {}, "context_window"), ("demo", {"max_tokens": 3}, "max_tokens"),
                                 ("capped", {}, "default_max_tokens"), ("tiny", {"max_tokens": 1000}, "context_window")):
        before = value(samples(served.metrics()), "openarc_answers_cut_total", model=model, reason=reason)
        status, _, body = http("POST", served.base + "/v1/chat/completions",
                               {"model": model, "messages": question, **limit})
        assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
        if model == "tiny":
            assert body["usage"]["total_tokens"] == 40  # the answer used all the window left
        after = value(samples(served.metrics()), "openarc_answers_cut_total", model=model, reason=reason)
        assert after == before + 1, (model, limit, reason)
    # an answer that ends by itself is not counted
    status, _, body = http("POST", served.base + "/v1/chat/completions", {"model": "demo", "messages": question})
    assert body["choices"][0]["finish_reason"] == "stop"
    assert value(samples(served.metrics()), "openarc_answers_cut_total", model="demo") == 1
