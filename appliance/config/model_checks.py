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


def adapter_file(path: str) -> Path:
    """The safetensors file of an adapter `path` (the file itself, or ADAPTER_FILE in a PEFT directory)."""
    return Path(path) / ADAPTER_FILE if Path(path).is_dir() else Path(path)


def adapter_problem(path: str, user_name: str | None = None) -> str | None:
    """Why `path` cannot be served as a LoRA adapter (None: it can): the one check of an adapter's path, for every
    kind that takes `adapters:`, at check-config and at the server's start, so a bad path is a config error naming
    the key, never a failed request. It exists, is readable (by the service user `user_name` too, run as root), and
    is safetensors (8 bytes of header length, then the JSON header)."""
    file = adapter_file(path)
    try:
        with open(file, "rb") as stream:
            head = stream.read(9)
        size = file.stat().st_size
    except FileNotFoundError:
        return f"expected a LoRA adapter (a .safetensors file or a PEFT directory); {path!r} does not exist"
    except OSError as exc:
        return f"expected a file this user can read; cannot read {str(file)!r} ({exc.strerror})"
    user = model_files.service_user(user_name) if user_name and os.geteuid() == 0 else None
    blocked = model_files.unreadable_by(file, *user) if user else None
    if blocked:
        return f"expected files the service user {user_name!r} can read; it cannot read {blocked!r}"
    length = int.from_bytes(head[:8], "little") if len(head) == 9 else 0
    if not 0 < length <= size - 8 or head[8:9] != b"{":
        return f"expected a LoRA adapter in the safetensors format; {str(file)!r} is not one"
    return None
