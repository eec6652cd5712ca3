"""Tiny demo models built from nothing in OpenVINO's opset (no hub, no torch): `catalog` builds and caches the
model of each worker kind; `llm`, `encoder` and `whisper` are the builders. Used by `openarc serve` without a
config, by `openarc demo-model`, by the tests and by the bench. Run in a child process of the front, never in it."""
