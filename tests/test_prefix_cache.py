"""The worker's model of genai's prefix cache, the scheduler defaults, and agent-noise canonicalisation: pure
functions, no processes."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.worker import agent_noise
from appliance.config import DEFAULT_BATCHED_TOKENS, DEFAULT_CACHE_SIZE_GB, ModelConfig
from appliance.worker import prefix_cache
from appliance.worker.prefix_cache import BlockCacheModel


def test_a_fresh_prompt_is_served_nothing_and_a_repeat_all_but_its_last_token():
    cache = BlockCacheModel(block_size=4, capacity_blocks=100)
    prompt = list(range(10))
    assert cache.lookup(prompt) == 0
    cache.store(prompt)
    # whole blocks only: 8 of 10 (the partly filled third block is not counted), never the last token
    assert cache.lookup(prompt) == 8
    assert cache.lookup(list(range(8))) == 7


def test_the_next_turn_is_served_its_previous_prompt_and_answer_in_whole_blocks():
    cache = BlockCacheModel(block_size=4, capacity_blocks=100)
    turn1, answer = list(range(100, 118)), [7, 8, 9, 10, 11]
    cache.store(turn1)
    cache.store(turn1 + answer[:-1])
    turn2 = turn1 + answer + [1, 2, 3, 4, 5, 6]
    served = cache.lookup(turn2)
    assert served == 20 and len(turn1 + answer[:-1]) - served < 4  # within one block of what genai holds


def test_a_block_matches_only_after_the_same_prefix():
    cache = BlockCacheModel(block_size=4, capacity_blocks=100)
    cache.store([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert cache.lookup([0, 2, 3, 4, 5, 6, 7, 8, 9]) == 0  # the second block's tokens alone do not match
    assert cache.lookup([1, 2, 3, 4, 0, 6, 7, 8, 9]) == 4  # the first block matches, the change ends it


def test_the_least_recently_used_conversation_is_evicted_first():
    cache = BlockCacheModel(block_size=2, capacity_blocks=6)
    a, b, c = [1] * 6, [2] * 6, [3] * 6  # three blocks each
    cache.store(a)
    cache.store(b)
    assert cache.lookup(a) == 5  # a is used again: b is now the oldest
    cache.store(c)
    assert cache.lookup(b) == 0 and cache.lookup(a) == 5 and cache.lookup(c) == 5
    assert len(cache.blocks) == 6


def test_a_partly_filled_last_block_takes_its_room_so_an_evicted_prompt_is_not_reported_cached():
    cache = BlockCacheModel(block_size=4, capacity_blocks=4)
    a, b, c = [1] * 6, [2] * 6, [3] * 6  # one whole block and a partly filled one each: two of genai's blocks
    for prompt in (a, b, c):
        cache.store(prompt)
    # genai's four blocks held b and c: a's went first, so a's next turn is served nothing
    assert cache.lookup(a + [9, 9]) == 0
    assert cache.lookup(c + [9, 9]) == 4 and len(cache.blocks) == 4


def test_running_generations_take_their_blocks_from_the_cache():
    """Finished prefixes and running requests' generated blocks share genai's cache: with 8 blocks, a stored
    4-block prompt and two generations growing to 3 blocks each, genai evicts the prompt's oldest blocks; the
    model must too, or it reports cached tokens genai recomputed (it counted the whole capacity as room)."""
    cache = BlockCacheModel(block_size=4, capacity_blocks=8)
    prompt = list(range(16))  # 4 blocks
    cache.store(prompt)
    cache.set_running([4, 4])  # one block each: 6 of 8 held
    assert cache.lookup(prompt) == 15
    cache.set_running([12, 10])  # 3 + 3 blocks: room for 2 of the prompt's 4
    assert len(cache.blocks) == 2 and cache.lookup(prompt) == 0  # its first blocks went first: nothing matches
    cache.set_running([])
    cache.store(prompt)
    assert cache.lookup(prompt) == 15  # the generations ended: room again


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=6), st.integers(1, 30))
def test_held_and_running_blocks_never_exceed_the_capacity(running, capacity):
    cache = BlockCacheModel(block_size=4, capacity_blocks=capacity)
    cache.store(list(range(100)))
    cache.set_running(running)
    assert len(cache.blocks) + min(cache.running_blocks, capacity) <= capacity


def test_capacity_follows_the_scheduler_settings():
    assert prefix_cache.capacity_blocks({"num_kv_blocks": 500}, 16, 1000) == 500
    # 2 GB of 16-token blocks at 56 KiB a token (Qwen2.5-7B in f16)
    assert prefix_cache.capacity_blocks({"cache_size": 2}, 16, 57344) == 2 * 10**9 // (57344 * 16)
    assert prefix_cache.capacity_blocks({}, 32, None) == 256 * 1024 // 32


def test_kv_bytes_per_token_reads_the_model_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 28, "num_attention_heads": 28,
                                                      "num_key_value_heads": 4, "hidden_size": 3584}))
    assert prefix_cache.kv_bytes_per_token(str(tmp_path), "GPU.0", {}) == 28 * 2 * 4 * 128 * 2
    assert prefix_cache.kv_bytes_per_token(str(tmp_path), "CPU", {}) == 28 * 2 * 4 * 128
    assert prefix_cache.kv_bytes_per_token(str(tmp_path), "CPU", {"KV_CACHE_PRECISION": "f16"}) == 28 * 2 * 4 * 128 * 2
    assert prefix_cache.kv_bytes_per_token(str(tmp_path / "missing"), "CPU", {}) is None
    assert prefix_cache.block_size_for("GPU.1") == 16 and prefix_cache.block_size_for("CPU") == 32
    assert prefix_cache.block_size_for("HETERO:GPU.1,CPU") == 16


def test_prefix_caching_is_on_by_default_with_a_fixed_cache_and_a_per_device_chunk():
    cpu = ModelConfig(name="m", path="/m").scheduler_settings()
    assert cpu == {"enable_prefix_caching": True, "cache_size": DEFAULT_CACHE_SIZE_GB,
                   "max_num_batched_tokens": DEFAULT_BATCHED_TOKENS["CPU"]}
    gpu = ModelConfig(name="m", path="/m", device="GPU.0").scheduler_settings()
    assert gpu["max_num_batched_tokens"] == DEFAULT_BATCHED_TOKENS["GPU"]
    # the model's own keys win; a num_kv_blocks of its own replaces the default cache_size
    off = ModelConfig(name="m", path="/m", scheduler_config={"enable_prefix_caching": False, "num_kv_blocks": 64,
                                                             "max_num_batched_tokens": 256}).scheduler_settings()
    assert off == {"enable_prefix_caching": False, "num_kv_blocks": 64, "max_num_batched_tokens": 256}
    assert prefix_cache.for_spec({"scheduler_config": off, "device": "CPU", "path": "/m"}) is None
    # a speculative model keeps it off (genai 2026.4.1 fails some of its requests with both), unless it asks
    assert ModelConfig(name="m", path="/m", prompt_lookup=True).scheduler_settings()["enable_prefix_caching"] is False
    asked = ModelConfig(name="m", path="/m", prompt_lookup=True, scheduler_config={"enable_prefix_caching": True})
    assert asked.scheduler_settings()["enable_prefix_caching"] is True


BILLING = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch=1f2e3;"


def test_claude_codes_billing_line_is_dropped_from_system_turns_only():
    messages = [{"role": "system", "content": BILLING + "\nYou are Claude Code."},
                {"role": "user", "content": BILLING}]
    out, dropped = agent_noise.canonical_messages(messages)
    assert out == [{"role": "system", "content": "You are Claude Code."}, {"role": "user", "content": BILLING}]
    assert dropped and messages[0]["content"].startswith(BILLING)  # the caller's list is left alone
    # a system turn that held only the line goes; text parts lose the part
    out, _ = agent_noise.canonical_messages([{"role": "system", "content": BILLING}, {"role": "user", "content": "hi"}])
    assert out == [{"role": "user", "content": "hi"}]
    parts = [{"type": "text", "text": BILLING}, {"type": "text", "text": "Be brief."}]
    out, _ = agent_noise.canonical_messages([{"role": "system", "content": parts}])
    assert out == [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]}]
    # two requests that differ only in cch= are the same conversation after canonicalisation
    other = BILLING.replace("cch=1f2e3", "cch=9a8b7")
    first = agent_noise.canonical_messages([{"role": "system", "content": BILLING + "\nSys"}])[0]
    second = agent_noise.canonical_messages([{"role": "system", "content": other + "\nSys"}])[0]
    assert first == second


def test_messages_without_noise_come_back_unchanged():
    messages = [{"role": "system", "content": "Mention x-anthropic-billing-header: in the middle is kept"},
                {"role": "user", "content": "hi"}]
    assert agent_noise.canonical_messages(messages) == (messages, [])
