"""The golden record file: `golden.yaml` beside the config (/etc/openarc/golden.yaml for /etc/openarc/openarc.yaml).

    format: 1
    recorded_at: '2026-12-03T10:40:00Z'
    openarc: 0.1.0
    models:
      demo:                         # a model's name in the config
        kind: llm
        load_seconds: 0.41          # the worker's own measure of its load
        speed: 212.5                # llm, vlm: tokens/s of the probes' answers; other kinds: probes/s
        speed_unit: tokens/s
        tolerance: 0.01             # embedding, rerank: the largest difference allowed in a vector component
        answers:
          - probe: 'Name three colours.'
            tokens: [' Red', ',', ' green']   # llm, vlm, transcription: the answer's tokens (words for a transcript)
          # embedding: {probe, vector: [...]}, rerank: {probe, vector: [scores]}, tts: {probe, samples, checksum}

Written whole and renamed into place (never half written); read with every problem named by file and key.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

FORMAT = 1
FILE_NAME = "golden.yaml"
DEFAULT_TOLERANCE = 0.01


class RecordError(Exception):
    """A golden file that cannot be read: the message names the file and the key."""


@dataclass
class Answer:
    """One probe's answer, in the form its kind is compared in (appliance.golden.compare)."""

    probe: str                           # the probe's input, as text (what the record's reader sees)
    tokens: list[str] | None = None      # llm, vlm: token texts in order; transcription: the transcript's words
    vector: list[float] | None = None    # embedding: the vector; rerank: the documents' scores
    samples: int | None = None           # tts: the audio's length in samples
    checksum: str | None = None          # tts: sha256 of its first frames (the same runtime gives the same bytes)

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


@dataclass
class ModelRecord:
    kind: str
    answers: list[Answer] = field(default_factory=list)
    speed: float = 0.0                   # work per second: tokens/s (llm, vlm), probes/s (the others)
    speed_unit: str = "tokens/s"
    load_seconds: float | None = None
    tolerance: float = DEFAULT_TOLERANCE

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "load_seconds": _round(self.load_seconds), "speed": _round(self.speed),
                "speed_unit": self.speed_unit, "tolerance": self.tolerance,
                "answers": [a.as_dict() for a in self.answers]}


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)


def renewed(records: dict[str, ModelRecord], name: str, observed: ModelRecord) -> ModelRecord:
    """A new record of a model, keeping the tolerance an operator set in its old one."""
    old = records.get(name)
    return dataclasses.replace(observed, tolerance=old.tolerance) if old else observed


def golden_path(config_source: str) -> Path | None:
    """The record beside the config file; None for the built-in demo config, which has no file."""
    if config_source.startswith("<"):
        return None
    return Path(config_source).parent / FILE_NAME


def load(path: Path) -> dict[str, ModelRecord]:
    """Every model's record in the file; {} when there is none. RecordError names a broken file's key."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as exc:
        raise RecordError(f"{path}: cannot read the golden record: {exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RecordError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise RecordError(f"{path}: models: expected a mapping of model names to records")
    if data.get("format") != FORMAT:
        raise RecordError(f"{path}: format: expected {FORMAT} (record again with `openarc golden record`)")
    return {name: _model(path, name, raw) for name, raw in data["models"].items()}


def _model(path: Path, name: str, raw: Any) -> ModelRecord:
    at = f"{path}: models.{name}"
    if not isinstance(raw, dict) or not isinstance(raw.get("answers"), list):
        raise RecordError(f"{at}: expected kind, speed and a list of answers")
    answer_keys = {f.name for f in dataclasses.fields(Answer)}
    answers = []
    for i, item in enumerate(raw["answers"]):
        if not isinstance(item, dict) or "probe" not in item or set(item) - answer_keys:
            raise RecordError(f"{at}.answers[{i}]: expected probe and its answer ({', '.join(sorted(answer_keys))})")
        answers.append(Answer(**item))
    try:
        return ModelRecord(kind=str(raw["kind"]), answers=answers, speed=float(raw.get("speed") or 0.0),
                           speed_unit=str(raw.get("speed_unit", "tokens/s")),
                           load_seconds=None if raw.get("load_seconds") is None else float(raw["load_seconds"]),
                           tolerance=float(raw.get("tolerance", DEFAULT_TOLERANCE)))
    except (KeyError, TypeError, ValueError) as exc:
        raise RecordError(f"{at}: {exc}") from None


def save(path: Path, records: dict[str, ModelRecord], version: str) -> None:
    """Write the whole file atomically; models recorded before and not recorded now are kept."""
    kept = {**load(path), **records} if path.exists() else records
    data = {"format": FORMAT,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "openarc": version, "models": {name: kept[name].as_dict() for name in sorted(kept)}}
    header = ("# Golden answers of openarc's models, written by `openarc golden record` and checked by\n"
              "# `openarc golden check` and the canary before READY (server.canary). An edited answer is what the\n"
              "# check expects.\n")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
