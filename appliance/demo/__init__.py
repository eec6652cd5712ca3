"""Tiny demo models built from nothing in OpenVINO's opset (no hub, no torch): `catalog` builds and caches the
model of each worker kind; `llm`, `encoder` and `whisper` are the builders. Used by `openarc serve` without a
config, by `openarc demo-model`, by the tests and by the bench. Run in a child process of the front, never in it."""

import os

# The tokenizer builders import transformers, which, without torch (never installed here), warns on import that
# "PyTorch was not found. Models won't be available...": an advisory about models openarc never asks it for, and the
# first line a new user saw from `make serve`. Set before any builder imports it; only this child process has it.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
