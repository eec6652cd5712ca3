"""A model's directory judged beyond its config keys' values: its files there and readable, and whether a draft
model shares its main model's tokenizer.

These read the disk, so they run where the files must be right: check-config and the server's start (the path
checks, through `parse_config`'s `checks`), the config's speculative rules and a speculative worker's load (the
tokenizer). What a directory is (its kind, the IR files each kind needs) is appliance.model_files'.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from appliance import model_files

if TYPE_CHECKING:
    from appliance.config import ModelConfig

# What makes two tokenizers the same: the vocabulary and merges (tokenizer.json), else the converted OpenVINO
# tokenizer's weights. Other files (tokenizer_config.json's model_max_length, a chat template) may differ.
TOKENIZER_FILES = ("openvino_tokenizer.bin", "openvino_detokenizer.bin")


def tokenizer_identity(model_dir: str) -> Any:
    """A comparable account of a model directory's tokenizer, or None if there is none to read (yet)."""
    hf = Path(model_dir) / "tokenizer.json"
    try:
        spec = json.loads(hf.read_text())
        model = spec.get("model") or {}
        return ("tokenizer.json", model.get("type"), model.get("vocab"), model.get("merges"),
                sorted((t.get("id"), t.get("content")) for t in spec.get("added_tokens") or ()))
    except (OSError, ValueError):
        pass
    import hashlib
    digests = []
    for name in TOKENIZER_FILES:
        try:
            digests.append(hashlib.sha256((Path(model_dir) / name).read_bytes()).hexdigest())
        except OSError:
            return None
    return ("openvino_tokenizer", *digests)


def tokenizer_mismatch(main_dir: str, draft_dir: str) -> str | None:
    """Why a draft cannot serve a main model (their tokenizers differ), or None. Directories that hold no readable
    tokenizer (not there yet) are not judged here; the worker's load judges them again."""
    main, draft = tokenizer_identity(main_dir), tokenizer_identity(draft_dir)
    if main is None or draft is None or main == draft:
        return None
    how = "vocabularies" if main[0] == draft[0] == "tokenizer.json" else "tokenizers"
    return (f"the draft model {draft_dir!r} and the main model {main_dir!r} have different {how}; a draft must share "
            "its main model's tokenizer (e.g. Qwen2.5-0.5B-Instruct for Qwen2.5-7B-Instruct)")


# A check of one model beyond its keys' values (its files, its device): (key, what was expected) or None.
ModelCheck = Callable[["ModelConfig"], "tuple[str, str] | None"]


def path_check(model: ModelConfig) -> tuple[str, str] | None:
    """check-config's: the model's directory exists, holds the IR files of its kind, and is readable by this user
    and, run as root, by the service user."""
    return served_path_check(model, model_files.SERVICE_USER)


def served_path_check(model: ModelConfig, user_name: str | None = None,
                      locate: Callable[[str], str] = str) -> tuple[str, str] | None:
    """The serving process's: the same, for the user it runs as (its workers read the files as that user), unless
    `user_name` names another to check for too. `locate`: where a configured path is on this machine's files
    (`openarc doctor --root` reads a recorded machine under a directory)."""
    problem = model_files.path_problem(locate(model.path), model.kind, user_name=user_name)
    if problem is None and model.draft_model:  # the draft loads in the same worker: its files count too
        problem = model_files.path_problem(locate(model.draft_model.path), "llm", user_name=user_name)
        return ("draft_model.path", problem) if problem else None
    if problem is None and model.voices:  # read by the worker on a request for the voice: a 400 then, named here
        for name, file in model_files.voice_files(locate(model.path), model.voices).items():
            if not os.access(file, os.R_OK):
                return f"voices.{name}", f"expected a voice file this user can read; cannot read {file!r}"
    if problem is None:
        for name, entry in model.adapter_entries().items():
            problem = adapter_problem(locate(entry.path), user_name)
            if problem:
                return f"adapters.{name}", problem
    return ("path", problem) if problem else None


def model_problems(models: list[ModelConfig | None], checks: list[ModelCheck]) -> list[str]:
    """Every check's problem with every model, one line each naming the key and the model."""
    lines = []
    for i, model in enumerate(models):
        for check in checks if model is not None else ():
            found = check(model)
            if found:
                lines.append(f"models[{i}].{found[0]}: {found[1]} (model {model.name!r})")
    return lines


# A LoRA adapter as OpenVINO GenAI reads it: one safetensors file, or a directory in the PEFT layout holding it.
ADAPTER_FILE = "adapter_model.safetensors"
TORCH_FILES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
TORCH_SUFFIXES = (".bin", ".pt", ".pth")
TORCH_HINT = ("OpenVINO GenAI reads safetensors only; convert it once: python -c \"import torch, safetensors.torch; "
              "safetensors.torch.save_file(torch.load('adapter_model.bin'), 'adapter_model.safetensors')\" "
              "(or PEFT's save_pretrained(..., safe_serialization=True))")


def adapter_file(path: str) -> Path:
    """The safetensors file of an adapter `path` (the file itself, or ADAPTER_FILE in a PEFT directory)."""
    return Path(path) / ADAPTER_FILE if Path(path).is_dir() else Path(path)


def adapter_problem(path: str, user_name: str | None = None) -> str | None:
    """Why `path` cannot be served as a LoRA adapter (None: it can): the one check of an adapter's path, for the
    config (every kind that takes `adapters:`) and for an adapter loaded at runtime. It exists, is readable (by the
    service user `user_name` too, run as root), is safetensors (a torch-only checkpoint gets the conversion hint)
    whose tensors are LoRA pairs (`...lora_A.weight` / `...lora_B.weight`, or kohya's lora_down / lora_up)."""
    where = Path(path)
    if not where.exists():
        return f"expected a LoRA adapter (a .safetensors file or a PEFT directory); {path!r} does not exist"
    if where.is_dir():
        torch_only = [name for name in TORCH_FILES if (where / name).exists()]
        if not (where / ADAPTER_FILE).exists():
            if torch_only:
                return f"{path!r} holds a torch checkpoint ({torch_only[0]}) and no {ADAPTER_FILE}; {TORCH_HINT}"
            return f"expected a PEFT adapter directory; {path!r} has no {ADAPTER_FILE}"
    elif where.suffix in TORCH_SUFFIXES:
        return f"{path!r} is a torch checkpoint; {TORCH_HINT}"
    file = adapter_file(path)
    if not file.is_file():  # a FIFO or a device would block its reader (the front, checking a runtime load) for good
        return f"expected a regular file; {str(file)!r} is not one"
    if not os.access(file, os.R_OK):
        return f"expected a file this user can read; cannot read {str(file)!r}"
    if user_name and os.geteuid() == 0:
        user = model_files.service_user(user_name)
        blocked = model_files.unreadable_by(file, *user) if user else None
        if blocked:
            return f"expected files the service user {user_name!r} can read; it cannot read {blocked!r}"
    try:
        pairs = lora_pairs(file)
    except Exception as exc:  # safetensors raises its own error types for a file that is not one
        return f"expected a safetensors file; cannot read {str(file)!r} as one ({' '.join(str(exc).split())[:160]})"
    if not pairs:
        return f"expected LoRA tensors (lora_A / lora_B) in {str(file)!r}; it holds no LoRA pair"
    for layer, shapes in pairs.items():
        problem = _pair_problem(shapes)
        if problem:
            return f"expected LoRA pairs of one rank in {str(file)!r}; {layer}: {problem}"
    return None


# The two halves of a LoRA pair by the names PEFT and kohya give them: down (A: rank x in) and up (B: out x rank).
LORA_HALVES = {"lora_A": "A", "lora_down": "A", "lora.down": "A", "lora_B": "B", "lora_up": "B", "lora.up": "B"}


def lora_pairs(file: Path | str) -> dict[str, dict[str, list[int]]]:
    """The LoRA pairs of a safetensors file: layer -> {"A": shape, "B": shape} (either may be missing), read from the
    header alone (no tensor is loaded)."""
    from safetensors import safe_open
    pairs: dict[str, dict[str, list[int]]] = {}
    with safe_open(str(file), framework="numpy") as tensors:
        for name in tensors.keys():
            for marker, half in LORA_HALVES.items():
                if marker in name:
                    layer = name.split(marker)[0].rstrip("._")
                    pairs.setdefault(layer, {})[half] = list(tensors.get_slice(name).get_shape())
                    break
    return pairs


def _pair_problem(shapes: dict[str, list[int]]) -> str | None:
    """Why one layer's pair cannot be applied (genai fails the generation that applies it, not the load)."""
    if set(shapes) != {"A", "B"}:
        return f"only the {'down (A)' if 'A' in shapes else 'up (B)'} half of the pair"
    a, b = shapes["A"], shapes["B"]
    if len(a) < 2 or len(b) < 2 or a[0] != b[1]:  # (a convolution's pair has two more kernel dimensions)
        return f"A is {a}, B is {b} (expected A: rank x in, B: out x rank, one rank)"
    return None


def adapter_fit_problem(file: Path | str, reference: Path | str) -> str | None:
    """Why the adapter `file` does not fit the layers the adapter `reference` adapts in the same model (None: it
    does): each layer both adapt must have the same input and output sizes. genai builds a model's LoRA state for the
    adapters it is constructed with; an adapter loaded later with other sizes fails every generation it is applied
    to (an OpenVINO shape error) rather than its load, so a runtime load checks it first."""
    theirs = lora_pairs(reference)
    for layer, shapes in lora_pairs(file).items():
        known = theirs.get(layer)
        if known and {"A", "B"} <= set(known):
            inputs, outputs = shapes["A"][1], shapes["B"][0]
            if (inputs, outputs) != (known["A"][1], known["B"][0]):
                return (f"{layer} of {str(file)!r} maps {inputs} inputs to {outputs} outputs; the model's layer takes "
                        f"{known['A'][1]} and gives {known['B'][0]} (an adapter of another base model?)")
    return None
