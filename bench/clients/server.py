"""The server the real clients meet, in the tests and the bench alike: demo models and the aliases that
docs/coding-agents.md gives for the agents' own model names."""

from __future__ import annotations

from pathlib import Path

OLD_CAP = 256  # the hidden default_max_tokens of before (issue 42): a longer answer shows there is no cap
DEMO = "demo"          # no max_context: the model's own window, which Claude Code's prompt must fit
DEMO_32K = "demo-32k"  # a 32k window: opencode and Kilo ask for 32000 tokens of answer on a model they do not know
ALIASES = {"claude-*": DEMO, "gpt-5*": DEMO}
CODEX_CATALOG_NAME = "gpt-5.5"  # a name in Codex 0.171's own catalog: it then sends tool_search and apply_patch
KV_CACHE_GB = 1  # the KV of over a million demo tokens, and not the default 2 GB for each of the two workers


def build_model(directory: Path) -> Path:
    """The demo chat model, answering every prompt with OLD_CAP phrase tokens and EOS: every answer is longer than
    the old hidden cap, so an answer cut short anywhere fails the run."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(directory, eos_after=OLD_CAP, max_new_tokens=4 * OLD_CAP)


def models(path: Path) -> list[dict]:
    cache = {"cache_size": KV_CACHE_GB}
    return [{"name": DEMO, "path": str(path), "device": "CPU", "scheduler_config": cache},
            {"name": DEMO_32K, "path": str(path), "device": "CPU", "max_context": 32768, "scheduler_config": cache}]
