"""The demo models of every worker kind, built from nothing: which builder makes each kind, the build cache, and
atomic installs. Each builder lives in its own module (llm, encoder, whisper, vlm, tts, image) and is imported only
when building, so `openarc demo-model` on a cache hit never loads OpenVINO."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import pathlib
import shutil
import tempfile
from dataclasses import dataclass
from typing import Callable

from appliance.demo.llm import BUILD_FORMAT, checked_params, write_json
from appliance.config.systemd_env import systemd_directory

DEMO_MODEL_NAME = "demo"


MARKER_FILE = "openarc-demo.json"


@dataclass(frozen=True)
class DemoKind:
    """How to build the demo model of one worker kind: `module.function(out_dir, **params)` writes the files
    (imported only when building), `check(**params)` returns the complete, validated parameters."""

    module: str
    function: str
    check: Callable[..., dict]
    format: int  # bump when the kind's construction changes, so cached builds of an older recipe are rebuilt

    def write(self, out: pathlib.Path, params: dict) -> None:
        getattr(importlib.import_module(self.module), self.function)(out, **params)


def _seed_only(*, seed: int = 0) -> dict:
    return {"seed": int(seed)}


def image_params(**params) -> dict:
    """The image demo's build parameters, checked (appliance.demo.image.checked_params)."""
    from appliance.demo.image import checked_params

    return checked_params(**params)


def build_demo_model(dest: os.PathLike, kind: str = "llm", **params) -> pathlib.Path:
    """Write the demo model of worker kind `kind` (a DEMO_KINDS key) into `dest` and return `dest`.

    The chat demo (kind llm) takes `eos_after`: number of text tokens each request generates before the model
    emits EOS (`<|im_end|>`), counted from the first generated token, independent of the prompt; 0 means never
    (see the module doc).  `max_new_tokens` goes into generation_config.json (GenAI's own default is unlimited);
    `logit_scale` below its default makes sampled answers vary (see the module doc).  `seed` fixes the
    random weights and the phrase order: the same parameters give the same model (byte-identical .bin files and
    tokenizer.json; the XML files may differ in OpenVINO's generated node names).

    Built in a temporary directory next to `dest` and renamed into place, so `dest` is never half written.
    An existing `dest` is replaced only if it is empty or holds an earlier demo build.
    The other kinds take only `seed` (see appliance.demo.encoder).
    """
    params = _checked(kind, params)
    dest = pathlib.Path(dest)
    if dest.exists() and any(dest.iterdir()) and _read_marker(dest) is None:
        raise FileExistsError(f"{dest} exists and is not a demo model build; refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide the model from a service running as another user
    try:
        DEMO_KINDS[kind].write(tmp, params)
        write_json(tmp / MARKER_FILE, _marker(kind, params))
        _install_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_demo_model(cache_dir: os.PathLike, kind: str = "llm", **params) -> pathlib.Path:
    """Return `<cache_dir>/models/<demo name>-<hash of params>`, building it unless a complete build is there."""
    params = _checked(kind, params)
    marker = _marker(kind, params)
    dest = pathlib.Path(cache_dir) / "models" / f"{marker['name']}-{_params_hash(marker)}"
    if _read_marker(dest) == marker:
        return dest
    if dest.exists() and _read_marker(dest) is None:
        shutil.rmtree(dest)  # ours (it is in our cache) but not a finished build: someone tampered with it
    return build_demo_model(dest, kind, **params)


def default_cache_dir() -> pathlib.Path:
    """$OPENARC_CACHE_DIR, else systemd's $CACHE_DIRECTORY (first of its colon-separated paths),
    else $XDG_CACHE_HOME/openarc, else ~/.cache/openarc."""
    if os.environ.get("OPENARC_CACHE_DIR"):
        return pathlib.Path(os.environ["OPENARC_CACHE_DIR"])
    systemd_cache = systemd_directory("CACHE_DIRECTORY")
    if systemd_cache:
        return pathlib.Path(systemd_cache)
    xdg = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(xdg) / "openarc"


DEMO_KINDS = {
    "llm": DemoKind("appliance.demo.llm", "_write_model_files", checked_params, BUILD_FORMAT),
    "embedding": DemoKind("appliance.demo.encoder", "write_embedding_model", _seed_only, 2),
    "rerank": DemoKind("appliance.demo.encoder", "write_rerank_model", _seed_only, 2),
    "transcription": DemoKind("appliance.demo.whisper", "write_whisper_model", _seed_only, 1),
    "vlm": DemoKind("appliance.demo.vlm", "write_vlm_model", checked_params, 3),  # 3: the chat demo's tokenizer
    "tts": DemoKind("appliance.demo.tts", "write_tts_model", _seed_only, 1),
    "image": DemoKind("appliance.demo.image", "write_image_model", image_params, 1),
}


# The speculative-decoding demo: a main model made costlier (more layers) and drafts of one layer that share its
# tokenizer, one predicting it exactly and one wrong every fourth token. All have prompt_phrases, so the main
# model also serves prompt lookup: its answer pasted into a prompt encodes to the tokens it will generate.
SPECULATIVE_DEMO = {
    "main": {"layers": 12, "prompt_phrases": True},
    "draft": {"layers": 1, "prompt_phrases": True},
    "draft_miss": {"layers": 1, "draft_miss": 4, "prompt_phrases": True},
}


def ensure_speculative_demo(cache_dir: os.PathLike, **params) -> dict[str, pathlib.Path]:
    """The speculative demo's models by role (SPECULATIVE_DEMO), built or found in the cache; `params` (eos_after,
    max_new_tokens, seed) apply to all of them, as a shared tokenizer needs."""
    return {role: ensure_demo_model(cache_dir, "llm", **params, **extra) for role, extra in SPECULATIVE_DEMO.items()}


def ensure_demo_adapter(cache_dir: os.PathLike, family: str, **params) -> pathlib.Path:
    """The directory of the chat demo's LoRA adapter of phrase family `family` (appliance.demo.llm.FAMILIES) for the
    demo model of these `params` (built or found in the cache too): `<cache_dir>/adapters/demo-<family>-<hash>`."""
    model = ensure_demo_model(cache_dir, "llm", **params)
    marker = {**_read_marker(model), "adapter": family}
    dest = pathlib.Path(cache_dir) / "adapters" / f"{marker['name']}-{family}-{_params_hash(marker)}"
    if _read_marker(dest) == marker:
        return dest
    return build_demo_adapter(dest, family, model, marker)


def build_demo_adapter(dest: os.PathLike, family: str, model_dir: os.PathLike, marker: dict | None = None
                       ) -> pathlib.Path:
    """Write the chat demo's adapter of `family` for the demo model in `model_dir` into `dest` (PEFT layout:
    adapter_model.safetensors, adapter_config.json), built aside and renamed into place as a model is."""
    from appliance.demo.llm import FAMILIES, write_adapter

    if family not in FAMILIES:
        raise ValueError(f"no demo adapter {family!r} (have: {', '.join(FAMILIES)})")
    dest = pathlib.Path(dest)
    if dest.exists() and any(dest.iterdir()) and _read_marker(dest) is None:
        raise FileExistsError(f"{dest} exists and is not a demo adapter build; refusing to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    tmp.chmod(0o755)
    try:
        write_adapter(pathlib.Path(model_dir), tmp, family)
        write_json(tmp / MARKER_FILE, marker or {**(_read_marker(pathlib.Path(model_dir)) or {}), "adapter": family})
        _install_dir(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def image_adapter_path(model_dir: os.PathLike) -> pathlib.Path:
    """The demo image model's LoRA adapter, which its build writes inside its directory (see appliance.demo.image)."""
    from appliance.demo.image import ADAPTER_PATH

    return pathlib.Path(model_dir) / ADAPTER_PATH


def demo_model_name(kind: str) -> str:
    """The demo's model name, in configs and in the cache: "demo" for the chat model, "demo-<kind>" otherwise."""
    return DEMO_MODEL_NAME if kind == "llm" else f"{DEMO_MODEL_NAME}-{kind}"


def _checked(kind: str, params: dict) -> dict:
    if kind not in DEMO_KINDS:
        raise ValueError(f"no demo model of kind {kind!r} (have: {', '.join(DEMO_KINDS)})")
    return DEMO_KINDS[kind].check(**params)


def _marker(kind: str, params: dict) -> dict:
    return {"name": demo_model_name(kind), "format": DEMO_KINDS[kind].format, "params": params}


def _params_hash(marker: dict) -> str:
    return hashlib.sha256(json.dumps(marker, sort_keys=True).encode()).hexdigest()[:12]


def _read_marker(model_dir: pathlib.Path) -> dict | None:
    try:
        return json.loads((model_dir / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def _install_dir(tmp: pathlib.Path, dest: pathlib.Path) -> None:
    """Move the finished build `tmp` to `dest`, swapping out an old build if there is one."""
    try:
        os.rename(tmp, dest)  # atomic; also replaces an empty directory
        return
    except OSError:
        if not dest.exists():
            raise
    old = pathlib.Path(tempfile.mkdtemp(prefix=f".{dest.name}.old.", dir=dest.parent))
    os.rename(dest, old / "model")
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)
