"""What a model's worker is told, as JSON on its command line: the front-worker contract at spawn.

The front builds it from the model's config and compares it to decide whether a reload must replace a worker; the
worker (appliance.worker) loads its engine from it and never reads the YAML file.
"""

from __future__ import annotations

import copy

import dataclasses
from typing import TYPE_CHECKING, Any

from appliance.config.kinds import KIND_ONLY_KEYS, kinds_of
from appliance.config.model_checks import adapter_file
from appliance.config.window import model_window

if TYPE_CHECKING:
    from appliance.config import Config, ModelConfig

# Keys of one kind (model_kinds.KIND_ONLY_KEYS) that only the front reads: its workers get every other key of
# their kind.
FRONT_ONLY_KIND_KEYS = frozenset({"max_audio_seconds", "max_upload_bytes", "max_image_bytes", "max_image_pixels",
                                  "image_formats", "max_resolution", "max_images_per_request", "max_inference_steps"})


def worker_spec(model: ModelConfig, config: Config) -> dict[str, Any]:
    """What a worker needs to know, as JSON on its command line: the keys of every kind, and those of its own."""
    window = model_window(model)  # max_context as set, else the model's own fitted to its KV cache
    spec = {"name": model.name, "kind": model.kind, "path": model.path, "device": model.device,
            "properties": model.ov_properties(config.ov_cache_dir()), "max_context": window.tokens,
            "window": window.status(), "log_level": config.server.log_level}
    spec.update({key: getattr(model, key) for key, kinds in KIND_ONLY_KEYS.items()
                 if model.kind in kinds_of(kinds) and key not in FRONT_ONLY_KIND_KEYS})
    if model.draft_model:
        d = model.draft_model
        # The draft compiles with the main model's first-class options (cache dir, GPU weightless) on its own device,
        # and its own runtime_config.
        as_model = dataclasses.replace(model, device=d.device or model.device, runtime_config=d.runtime_config)
        spec["draft_model"] = {"path": d.path, "device": as_model.device,
                               "properties": as_model.ov_properties(config.ov_cache_dir())}
    if "adapters" in spec:  # (every kind that takes adapters) by name: the adapter's file and its weight, as JSON
        spec["adapters"] = {name: {"path": str(adapter_file(entry.path)), "alpha": entry.alpha}
                            for name, entry in model.adapter_entries().items()}
    if model.kind == "llm":
        spec["speculative"] = model.speculative_defaults()
        # what the pipeline's LoRA is built for (appliance.worker.engines.adapters): the configured adapters, kept
        # apart from `adapters` (what the model serves), which the runtime admin routes change: a worker that starts
        # after every adapter was unloaded still builds its pipeline with LoRA, so one loaded later applies
        spec["lora_build"] = copy.deepcopy(spec.get("adapters") or {})
    if "scheduler_config" in spec:
        spec["scheduler_config"] = model.scheduler_settings()
    return spec
