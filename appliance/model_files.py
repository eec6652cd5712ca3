"""What a model directory holds: whether it is an OpenVINO IR model, which kind of worker serves it, and, when it is
not one, how `optimum-cli export openvino` would make it one.

Pure functions of a directory's file names and its config.json, so `openarc pull` (before and after a download),
`check-config` and the server's start judge a directory the same way, and tests run them on plain file lists.
Shared by the CLI and the front; nothing here imports OpenVINO.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

# The IR files (each .xml with its .bin) a worker of each kind opens: genai's pipelines read them by these names.
TOKENIZER = ("openvino_tokenizer",)
TOKENIZER_PAIR = ("openvino_tokenizer", "openvino_detokenizer")
IR_FILES: dict[str, tuple[str, ...]] = {
    "llm": ("openvino_model",) + TOKENIZER_PAIR,
    "vlm": ("openvino_language_model", "openvino_vision_embeddings_model", "openvino_text_embeddings_model")
           + TOKENIZER_PAIR,
    "embedding": ("openvino_model",) + TOKENIZER,
    "rerank": ("openvino_model",) + TOKENIZER,
    "transcription": ("openvino_encoder_model", "openvino_decoder_model") + TOKENIZER_PAIR,
    # SpeechT5 (a Kokoro directory is one openvino_model, see missing_ir)
    "tts": ("openvino_encoder_model", "openvino_decoder_model", "openvino_postnet", "openvino_vocoder") + TOKENIZER,
}
KOKORO_IR = ("openvino_model",)
# A diffusers pipeline exported for OpenVINO (image): model_index.json names its parts, each a subdirectory.
# genai's image pipelines need a denoiser (a UNet, or a transformer for SD3 and FLUX), the VAE decoder, a text
# encoder and its tokenizer; a vae_encoder makes the directory serve edits (image to image, inpainting) too.
IMAGE_INDEX = "model_index.json"
IMAGE_DENOISERS = ("unet/openvino_model", "transformer/openvino_model")
IMAGE_IR = ("vae_decoder/openvino_model", "text_encoder/openvino_model", "tokenizer/openvino_tokenizer")
IMAGE_ENCODER = "vae_encoder/openvino_model"

# `optimum-cli export openvino --task` for each kind, and the weight format that suits it: int4 for the
# generative models (their weights are the memory; int4 keeps quality), int8 for the small encoders and Whisper,
# whose accuracy int4 costs more than the little memory it saves.
EXPORT_TASKS = {
    "llm": "text-generation-with-past",
    "vlm": "image-text-to-text",
    "embedding": "feature-extraction",
    "rerank": "text-classification",
    "transcription": "automatic-speech-recognition-with-past",
    "image": "text-to-image",
    "tts": "text-to-audio",  # SpeechT5 also needs --model-kwargs '{"vocoder": "microsoft/speecht5_hifigan"}'
}
WEIGHT_FORMATS = {"llm": "int4", "vlm": "int4", "embedding": "int8", "rerank": "int8", "transcription": "int8",
                  "tts": "fp16", "image": "int8"}

# A tts model's voices when its config names none: VOICES_DIR/NAME.bin in the model's directory (a speaker
# embedding for SpeechT5, a voice file for Kokoro: raw float32, the layout genai's samples write).
VOICES_DIR, VOICE_SUFFIX = "voices", ".bin"
# OpenAI's voice names (https://platform.openai.com/docs/api-reference/audio/createSpeech): a request naming one the
# model lacks gets the model's default voice, so unmodified clients work.
OPENAI_VOICES = ("alloy", "ash", "ballad", "cedar", "coral", "echo", "fable", "marin", "nova", "onyx", "sage",
                 "shimmer", "verse")

# Files that make a repository a PyTorch/safetensors or a GGUF one (what the exporter or llama.cpp reads).
PYTORCH_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
SENTENCE_TRANSFORMERS = ("modules.json", "config_sentence_transformers.json", "1_Pooling/config.json")


@dataclass(frozen=True)
class Detected:
    """What a directory (or a repository's file list) is: `kind` when it is an OpenVINO IR model openarc serves;
    otherwise `format` says what it is ("pytorch", "gguf", "unknown") and `kind` is the kind it would be."""

    format: str  # "openvino", "pytorch", "gguf", "unknown"
    kind: str | None
    reason: str = ""  # why kind is None, or what is missing

    @property
    def is_openvino(self) -> bool:
        return self.format == "openvino"


def kind_from_config(files: set[str], config: dict[str, Any] | None) -> str | None:
    """The kind a model is by its architecture (config.json) and the files that mark sentence-transformers models."""
    config = config or {}
    architectures = [str(a) for a in config.get("architectures") or ()]
    model_type = str(config.get("model_type", ""))
    if model_type == "whisper" or any(a.startswith("Whisper") for a in architectures):
        return "transcription"
    if is_speech_synthesis(config):
        return "tts"
    if any(a.endswith(("ForConditionalGeneration", "ForImageTextToText")) and "Whisper" not in a
           for a in architectures) and ("vision_config" in config or "image_token_id" in config
                                        or "image_token_index" in config):
        return "vlm"
    if any(f in files for f in SENTENCE_TRANSFORMERS):
        return "embedding"  # before CausalLM: Qwen3-Embedding is a Qwen3ForCausalLM with a pooling module
    if any(a.endswith("ForSequenceClassification") for a in architectures):
        return "rerank"
    if any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        return "llm"
    if any(a.endswith(("Model", "ForMaskedLM")) for a in architectures):
        return "embedding"
    if "generation_config.json" in files:
        return "llm"
    return None


def _has_ir(files: set[str], stem: str) -> bool:
    return f"{stem}.xml" in files and f"{stem}.bin" in files


def is_speech_synthesis(config: dict[str, Any] | None) -> bool:
    """A text-to-speech model genai's Text2SpeechPipeline reads: SpeechT5, or Kokoro (its architecture, or the
    phoneme `vocab` table of its config.json)."""
    config = config or {}
    architectures = [str(a) for a in config.get("architectures") or ()]
    return ("SpeechT5ForTextToSpeech" in architectures or any("Kokoro" in a for a in architectures)
            or isinstance(config.get("vocab"), dict))


def ir_stems(files: set[str], kind: str) -> tuple[str, ...]:
    """The IR files (stems) a worker of `kind` opens in a directory of `files`: a tts directory is SpeechT5's four
    models and tokenizer, or Kokoro's one model."""
    if kind == "tts" and all(_has_ir(files, stem) for stem in KOKORO_IR):
        return KOKORO_IR
    if kind == "image":
        return (next((d for d in IMAGE_DENOISERS if _has_ir(files, d)), IMAGE_DENOISERS[0]),) + IMAGE_IR
    return IR_FILES.get(kind, ())


def missing_ir(files: set[str], kind: str) -> list[str]:
    """The IR files a worker of `kind` needs that `files` lacks (empty: the directory serves as that kind)."""
    return [f"{stem}.xml/.bin" for stem in ir_stems(files, kind) if not _has_ir(files, stem)]


def detect(files: Iterable[str], config: dict[str, Any] | None) -> Detected:
    """What a model directory is, from its file names (relative paths) and its config.json (None if absent)."""
    files = set(files)
    if IMAGE_INDEX in files:  # a diffusers pipeline: its parts sit in subdirectories, config.json has none
        if not any(_has_ir(files, stem) for stem in IMAGE_IR + IMAGE_DENOISERS):
            return Detected("pytorch" if any(name.endswith(PYTORCH_SUFFIXES) for name in files) else "unknown",
                            "image", "a diffusers pipeline without OpenVINO IR files")
        missing = missing_ir(files, "image")
        if missing:
            return Detected("openvino", None, f"an incomplete image model: missing {', '.join(missing)}")
        return Detected("openvino", "image")
    if not any(name.endswith(".xml") and name.startswith("openvino_") for name in files):
        if any(name.endswith(".gguf") for name in files):
            return Detected("gguf", None, "a GGUF repository (llama.cpp's format)")
        kind = kind_from_config(files, config)
        if any(name.endswith(PYTORCH_SUFFIXES) for name in files):
            return Detected("pytorch", kind, "PyTorch/safetensors weights, not OpenVINO IR")
        return Detected("unknown", kind, "no OpenVINO IR files (openvino_*.xml)")
    if _has_ir(files, "openvino_language_model") or _has_ir(files, "openvino_vision_embeddings_model"):
        kind = "vlm"
    elif is_speech_synthesis(config):
        kind = "tts"
    elif _has_ir(files, "openvino_encoder_model") or _has_ir(files, "openvino_decoder_model"):
        kind = "transcription" if kind_from_config(files, config) in (None, "transcription") else None
        if kind is None:
            return Detected("openvino", None, "an encoder-decoder model that is not Whisper (no openarc worker "
                                              "serves it)")
    else:
        kind = kind_from_config(files, config)
        if kind in (None, "vlm", "transcription"):
            return Detected("openvino", None, "config.json does not say what the model is (no architectures "
                                              "openarc knows)")
    missing = missing_ir(files, kind)
    if missing:
        return Detected("openvino", None, f"an incomplete {kind} model: missing {', '.join(missing)}")
    return Detected("openvino", kind)


def voice_files(model_path: str, configured: dict[str, str] | None) -> dict[str, str]:
    """A tts model's voices, name -> file: its config's `voices` (a relative file read from the model's directory),
    else the VOICES_DIR/*.bin files there."""
    base = Path(model_path)
    if configured is not None:
        return {name: str(base / path) for name, path in configured.items()}  # an absolute path stays as it is
    try:
        return {f.name[:-len(VOICE_SUFFIX)]: str(f) for f in sorted((base / VOICES_DIR).iterdir())
                if f.name.endswith(VOICE_SUFFIX) and f.is_file()}
    except OSError:
        return {}


def export_command(repo_id: str, kind: str | None, out_dir: str) -> str:
    """The optimum-cli command that converts a PyTorch repository into what openarc serves."""
    kind = kind or "llm"
    return (f"optimum-cli export openvino --model {repo_id} --task {EXPORT_TASKS[kind]} "
            f"--weight-format {WEIGHT_FORMATS[kind]} {out_dir}")


# --- a directory on disk ---------------------------------------------------------------------------------

def read_dir(path: Path) -> tuple[set[str], dict[str, Any] | None]:
    """A directory's file names (relative, two levels: sentence-transformers keeps 1_Pooling/config.json) and its
    config.json (None if absent or not JSON)."""
    files = set()
    for entry in path.iterdir():
        if not entry.is_dir():
            files.add(entry.name)
            continue
        try:
            files.update(f"{entry.name}/{sub.name}" for sub in entry.iterdir() if sub.is_file())
        except OSError:  # a subdirectory this user cannot list holds nothing a worker could read either
            continue
    return files, read_json(path / "config.json")


def read_json(path: Path) -> dict[str, Any] | None:
    """A config.json's mapping; None if it is absent or not a JSON object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _permits(st: os.stat_result, uid: int, gids: set[int], want: int) -> bool:
    """Whether the permission triplet that applies to the user (owner, group or other) has the `want` bits (r=4,
    x=1)."""
    shift = 6 if st.st_uid == uid else 3 if st.st_gid in gids else 0
    return (st.st_mode >> shift) & want == want


def unreadable_by(path: Path, uid: int, gids: set[int], top: Path | None = None) -> str | None:
    """The first part of `path` (a directory on the way, or the file itself) that user `uid` (groups `gids`) cannot
    pass or read, from the permission bits: what `check-config` run as root says about the service user. `top`: look
    only from there down (a machine's files under a root, as `openarc doctor --root` reads them)."""
    if uid == 0:
        return None
    path = path.absolute()
    for part in [*reversed(path.parents), path]:
        if top is not None and not part.is_relative_to(top):
            continue
        try:
            st = part.stat()
        except OSError:
            return str(part)
        want = 4 | (1 if stat.S_ISDIR(st.st_mode) else 0) if part == path else 1
        if not _permits(st, uid, gids, want):
            return str(part)
    return None


def service_user(name: str) -> tuple[int, set[int]] | None:
    """The uid and groups of the user the units run as, when that user exists here."""
    try:
        import grp
        import pwd
        entry = pwd.getpwnam(name)
    except (ImportError, KeyError):
        return None
    gids = {entry.pw_gid} | {g.gr_gid for g in grp.getgrall() if name in g.gr_mem}
    return entry.pw_uid, gids


SERVICE_USER = "openarc"  # User= of the units (units/openarc.sysusers.conf)


def path_problem(path: str, kind: str, user_name: str | None = SERVICE_USER) -> str | None:
    """Why a model's `path` cannot be served as `kind` (None: it can): it does not exist, is not a directory, is not
    readable (by this process, and, run as root, by the service user `user_name` if that user exists), or lacks the
    IR files of its kind."""
    directory = Path(path)
    try:
        is_dir = stat.S_ISDIR(directory.stat().st_mode)
    except FileNotFoundError:
        return f"expected an OpenVINO model directory; {path!r} does not exist"
    except OSError as exc:
        return f"expected a directory this user can read; cannot reach {path!r} ({exc.strerror})"
    if not is_dir:
        return f"expected an OpenVINO model directory; {path!r} is a file"
    if not os.access(directory, os.R_OK | os.X_OK):
        return f"expected a directory this user can read; cannot read {path!r}"
    files, config = read_dir(directory)
    missing = missing_ir(files, kind)
    if missing:
        found = detect(files, config)
        what = f"it holds a model of kind {found.kind!r}; use kind: {found.kind}" if found.kind else found.reason
        return (f"expected an OpenVINO IR directory for kind {kind!r}; {path!r} lacks {', '.join(missing)} "
                f"({what})")
    ir = [directory / f"{stem}.{ext}" for stem in ir_stems(files, kind) for ext in ("xml", "bin")]
    unreadable = [str(file) for file in ir if not os.access(file, os.R_OK)]
    if unreadable:
        return f"expected files this user can read; cannot read {unreadable[0]!r}"
    user = service_user(user_name) if user_name and os.geteuid() == 0 else None
    for file in ir if user else ():
        blocked = unreadable_by(file, *user)
        if blocked:
            return f"expected files the service user {user_name!r} can read; it cannot read {blocked!r}"
    return None
