"""The LoRA adapters an LLM worker holds, by name, as OpenVINO GenAI objects: what the pipeline is built with, the
AdapterConfig of one request's group, and loads and unloads at runtime.

What genai 2026.4 allows (measured on the demo model, docs/lora.md): the LoRA is built into the model when the
pipeline is constructed with `adapters=AdapterConfig(...)` (dynamic mode: each adapted MatMul gains state tensors);
a pipeline built without adapters ignores any given later. An adapter read after construction works if it adapts
the same layers. The stateful LLMPipeline applies GenerationConfig.adapters on every generate(); the continuous
batching pipeline only in generate(), never in add_request(), and generate() is refused while requests run, so
appliance.worker.adapter_rotation decides when its one adapter set changes (tests/test_lora.py holds these facts).
"""

from __future__ import annotations

from typing import Any

from appliance.worker.adapter_rotation import BASE


class Adapters:
    """name -> (openvino_genai.Adapter, alpha) of one worker; BASE ("") is the model without adapters."""

    def __init__(self, spec: dict[str, Any]):
        self.loaded: dict[str, tuple[Any, float]] = {}
        for name, entry in (spec.get("adapters") or {}).items():
            self.load(name, entry["path"], entry["alpha"])
        # what the pipeline is built with: the adapters served and those of the config (spec["lora_build"]) unloaded
        # at runtime before this worker started (built without any, a pipeline ignores every adapter loaded later)
        self.build = list(self.loaded.values()) + [
            self._read(entry["path"], entry["alpha"]) for name, entry in (spec.get("lora_build") or {}).items()
            if name not in self.loaded]
        # the adapter a BASE config names at alpha 0 (config_for), kept when it is unloaded
        self.anchor = self.build[0][0] if self.build else None

    def __bool__(self) -> bool:
        """Whether the pipeline was built with LoRA (adapters unloaded since leave it so)."""
        return self.anchor is not None

    def __contains__(self, name: str) -> bool:
        return name == BASE or name in self.loaded

    def load(self, name: str, path: str, alpha: float) -> None:
        self.loaded[name] = self._read(path, alpha)

    @staticmethod
    def _read(path: str, alpha: float) -> tuple[Any, float]:
        import openvino_genai
        return openvino_genai.Adapter(path), float(alpha)

    def unload(self, name: str) -> None:
        self.loaded.pop(name, None)

    def construction(self):
        """The AdapterConfig a pipeline is built with (every adapter held, dynamic mode, so any of them, or none,
        can be applied later), or None for a model without adapters."""
        import openvino_genai
        if not self.build:
            return None
        config = openvino_genai.AdapterConfig(openvino_genai.AdapterConfig.Mode.MODE_DYNAMIC)
        for adapter, alpha in self.build:
            config.add(adapter, alpha)
        return config

    def config_for(self, group: str):
        """The AdapterConfig of a request of `group`: its adapter at its alpha; for BASE, an adapter at alpha 0.

        Always exactly one adapter, never none: genai 2026.4.1 mis-applies a switch back to an adapter after an empty
        AdapterConfig (28 of 40 switches wrong on the demo, both pipelines; the lora test has the sequence), and
        detects an alpha change in a config of several adapters only for the last one (compare_configs overwrites
        its flag in a loop, src/cpp/src/lora/adapter.cpp). One adapter a config avoids both."""
        import openvino_genai
        if group == BASE:
            adapter, alpha = self.anchor, 0.0
        else:
            adapter, alpha = self.loaded[group]
        return openvino_genai.AdapterConfig(adapter, alpha)
