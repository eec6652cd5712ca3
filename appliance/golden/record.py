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
import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from appliance.config.kinds import MODEL_KINDS
from appliance.config.validator import Problems, build, key_name
from appliance.sizes import format_size

FORMAT = 1
FILE_NAME = "golden.yaml"
DEFAULT_TOLERANCE = 0.01

MAX_FILE_BYTES = 1 << 20  # a model's record is about 2 KiB: hundreds of models fit


class RecordError(Exception):
    """A golden file that cannot be read: the message names the file and the key, one line per problem."""

    @property
    def summary(self) -> str:
        """One line, for the canary's verdict (a journal line, the failed start's exit line): the first problem."""
        first, *rest = str(self).splitlines() or [""]
        return first + (f" (and {len(rest)} more: `openarc golden check` lists them)" if rest else "")


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
    """Every model's record in the file; {} when there is none. RecordError names each broken key, in one line each,
    for any file: too large, nested too deep, or any value of the wrong type (never a traceback later in a check)."""
    data = _read(path)
    if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
        raise RecordError(f"{path}: models: expected a mapping of model names to records")
    if data.get("format") != FORMAT:
        raise RecordError(f"{path}: format: expected {FORMAT} (record again with `openarc golden record`)")
    problems, records = Problems(), {}
    for name, raw in data["models"].items():
        at = f"models.{key_name(name)}"
        if not isinstance(name, str):
            problems.append(f"{at}: expected a model's name (a string)")
        elif not isinstance(raw, dict):
            problems.append(f"{at}: expected a mapping with kind, speed and a list of answers")
        elif (record := build(ModelRecord, raw, at, problems)) is not None:
            problems.extend(_record_problems(record, at))
            records[name] = record
    if problems:
        raise RecordError("\n".join(f"{path}: {problem}" for problem in problems))
    return records


def _read(path: Path) -> Any:
    """The file's YAML, bounded: a golden record is a few KiB, so a larger file is refused before it is parsed (the
    front reads it on its event loop at each load)."""
    try:
        with path.open("rb") as source:
            raw = source.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {"format": FORMAT, "models": {}}
    except OSError as exc:
        raise RecordError(f"{path}: cannot read the golden record: {exc.strerror or exc}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise RecordError(f"{path}: larger than {format_size(MAX_FILE_BYTES)}: not a golden record")
    try:
        return yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise RecordError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except yaml.YAMLError as exc:
        raise RecordError(f"{path}: not valid YAML: {' '.join(str(exc).split())}") from None
    except RecursionError:  # PyYAML composes nested collections recursively
        raise RecordError(f"{path}: nested too deeply to be a golden record") from None


def _record_problems(record: ModelRecord, at: str) -> list[str]:
    """What the types cannot say: a kind openarc serves, finite non-negative numbers (a NaN tolerance or an infinite
    speed would fail or pass every check whatever the model answers)."""
    problems = [] if record.kind in MODEL_KINDS else [f"{at}.kind: expected one of {', '.join(MODEL_KINDS)}"]
    numbers = {"speed": record.speed, "tolerance": record.tolerance, "load_seconds": record.load_seconds}
    problems += [f"{at}.{key}: expected a finite non-negative number, got {value!r}"
                 for key, value in numbers.items() if value is not None and not 0 <= value < math.inf]
    for i, answer in enumerate(record.answers):
        if answer is None:  # its problem is reported already
            continue
        where = f"{at}.answers[{i}]"
        if answer.vector is not None and not all(math.isfinite(x) for x in answer.vector):
            problems.append(f"{where}.vector: expected finite numbers")
        if answer.samples is not None and answer.samples < 0:
            problems.append(f"{where}.samples: expected a non-negative integer")
    return problems


def save(path: Path, records: dict[str, ModelRecord], version: str) -> None:
    """Write the whole file atomically; models recorded before and not recorded now are kept, from a file that
    reads (a broken one is replaced: `openarc golden record` says so before it runs its probes)."""
    try:
        kept = {**load(path), **records}
    except RecordError:
        kept = records
    data = {"format": FORMAT,
            "recorded_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "openarc": version, "models": {name: kept[name].as_dict() for name in sorted(kept)}}
    header = ("# Golden answers of openarc's models, written by `openarc golden record` and checked by\n"
              "# `openarc golden check` and the canary before READY (server.canary). An edited answer is what the\n"
              "# check expects.\n")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            # allow_unicode off: every character outside ASCII escaped, so a token such as U+0085 (which YAML reads
            # as a line break in a plain scalar) comes back as it was written
            out.write(header + yaml.safe_dump(data, sort_keys=False, allow_unicode=False, width=120))
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
