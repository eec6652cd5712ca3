"""A model of genai's prefix cache, to tell each request how many of its prompt tokens the cache served.

genai 2026.4.1 keeps the KV blocks of finished requests (enable_prefix_caching) and restores those whose content
hash matches a new prompt's prefix, but reports no per-request figure (no counter on GenerationHandle, PerfMetrics
or PipelineMetrics). This module mirrors its bookkeeping: blocks of `block_size` tokens, each keyed by the hash of
every token up to its end (so a block matches only after the same prefix), restored from the start of the prompt
while they match, least recently used evicted once `capacity_blocks` are held. genai restores at most all but the
last prompt token (it must compute one to sample from) and also restores a partly filled last block; this model
counts whole blocks only, so it may say up to one block less than genai served, never more.

The cache's capacity is shared with the requests running: each one's generated tokens fill blocks of their own,
which genai takes from the cache by evicting finished prefixes. set_running() counts them against the capacity
(at least as many as they hold: a non-streamed answer's length is bounded by its steps), so under several long
generations the model evicts no later than genai and never says a prefix was served that genai recomputed.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path

# genai's KV block size per device family (its cache manager: 32 tokens on CPU, 16 on GPU).
BLOCK_SIZES = {"CPU": 32, "GPU": 16}
DEFAULT_BLOCK_SIZE = 16


def block_size_for(device: str) -> int:
    """The block size of the device a model runs on (a composite device counts as the first it names)."""
    for name, size in BLOCK_SIZES.items():
        if device.split(":")[-1].startswith(name):
            return size
    return DEFAULT_BLOCK_SIZE


def block_hashes(tokens: Sequence[int], block_size: int) -> list[int]:
    """The key of each whole block of `tokens`: a hash of the previous block's key and this block's tokens."""
    keys, key = [], 0
    for end in range(block_size, len(tokens) + 1, block_size):
        key = hash((key, tuple(tokens[end - block_size:end])))
        keys.append(key)
    return keys


class BlockCacheModel:
    """The blocks the cache holds, least recently used first."""

    def __init__(self, block_size: int, capacity_blocks: int):
        self.block_size, self.capacity_blocks = block_size, max(0, capacity_blocks)
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.running_blocks = 0  # blocks the running requests' generated tokens hold (set_running)

    def lookup(self, prompt: Sequence[int]) -> int:
        """Prompt tokens the cache serves for this prompt (whole matching blocks from its start, at most all but
        its last token); the blocks it uses become the most recently used."""
        served = 0
        for key in block_hashes(prompt, self.block_size):
            if key not in self.blocks:
                break
            self.blocks.move_to_end(key)
            served += self.block_size
        return min(served, max(0, len(prompt) - 1))

    def store(self, tokens: Sequence[int]) -> None:
        """Keep the blocks of a sequence whose KV cache was computed (a prompt, or a prompt and its answer). A partly
        filled last block is never counted as served, but it holds a whole block of genai's cache as long as it is
        kept: it counts against the capacity, or this model would evict later than genai does and say tokens were
        served that genai had evicted."""
        keys = block_hashes(tokens, self.block_size)
        if len(tokens) % self.block_size:
            keys.append(hash((keys[-1] if keys else 0, tuple(tokens[len(keys) * self.block_size:]), "partial")))
        for key in keys:
            self.blocks[key] = None
            self.blocks.move_to_end(key)
        self._evict()

    def set_running(self, generated: Iterable[int]) -> None:
        """The tokens each running request has generated (or may have, at most): their blocks are the cache's
        too, and the least recently used prefixes go to make room for them, as genai's do."""
        self.running_blocks = sum(-(-tokens // self.block_size) for tokens in generated)
        self._evict()

    def _evict(self) -> None:
        room = max(0, self.capacity_blocks - self.running_blocks)
        while len(self.blocks) > room:
            self.blocks.popitem(last=False)


def capacity_blocks(scheduler: dict, block_size: int, kv_bytes_per_token: int | None) -> int:
    """How many blocks the model may hold, bounded like genai's cache: num_kv_blocks when set, else cache_size
    (GB) over a block's bytes; unknown bytes per token (a model without a readable config.json): a cache as large
    as the blocks of 256k tokens, the model then over-remembers only where the real cache evicted."""
    if scheduler.get("num_kv_blocks"):
        return int(scheduler["num_kv_blocks"])
    if scheduler.get("cache_size") and kv_bytes_per_token:
        return int(scheduler["cache_size"] * 10**9 // (kv_bytes_per_token * block_size))
    return (256 * 1024) // block_size


def kv_bytes_per_token(model_dir: str, device: str, properties: dict) -> int | None:
    """A token's KV cache in bytes, from the model's config.json: layers x (K and V) x KV heads x head size x the
    cache precision's bytes (KV_CACHE_PRECISION if set; else u8 on CPU, f16 on GPU, OpenVINO's defaults)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        config = config.get("text_config", config)  # a VLM's language model
        heads = config.get("num_key_value_heads") or config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        layers = config["num_hidden_layers"]
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    precision = str(properties.get("KV_CACHE_PRECISION", "u8" if block_size_for(device) == BLOCK_SIZES["CPU"]
                                   else "f16")).lower()
    width = 1 if precision in ("u8", "i8") else 4 if precision == "f32" else 2
    return int(layers * 2 * heads * head_dim * width)


def for_spec(spec: dict) -> BlockCacheModel | None:
    """The cache model of a worker's continuous-batching pipeline, or None when prefix caching is off."""
    scheduler = spec["scheduler_config"]
    if not scheduler.get("enable_prefix_caching"):
        return None
    size = block_size_for(spec["device"])
    per_token = kv_bytes_per_token(spec["path"], spec["device"], spec.get("properties") or {})
    return BlockCacheModel(size, capacity_blocks(scheduler, size, per_token))
