"""The embedding worker kind: openvino_genai.TextEmbeddingPipeline, one request's inputs embedded as batches.

Request body: {"input": [text, ...] or [[token id, ...], ...], "dimensions": int | None, "truncate": bool,
"encoding_format": "float" | "base64"}.
Result: {"embeddings": [one vector per input]}, in the encoding the client asked for: base64 of little-endian
float32, or a JSON array as text, which the front places into its response as it is (printing thousands of floats is
the dearest part of an answer: here it runs on the worker's core, not on the front's event loop).
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np

from appliance.worker.engines.base import InvalidInput, ResultEngine, UnusableOutput

# Inputs per pipeline call: padding to the longest of a batch is paid by all of it, and a progress frame between
# batches keeps a long request clear of the stall timer.
BATCH_SIZE = 32
# sentence-transformers' pooling config (1_Pooling/config.json) key -> genai PoolingType name
SENTENCE_TRANSFORMERS_POOLING = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN",
                                 "pooling_mode_lasttoken": "LAST_TOKEN"}


def model_json(path: str, name: str) -> dict[str, Any]:
    """A JSON file of the model directory, {} if it is missing or unreadable (it only refines defaults)."""
    try:
        data = json.loads((Path(path) / name).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def input_token_limit(spec: dict[str, Any]) -> int:
    """Tokens one input may have: max_context, never more than the model's position embeddings."""
    positions = model_json(spec["path"], "config.json").get("max_position_embeddings")
    return min(spec["max_context"], positions) if isinstance(positions, int) and positions > 0 else spec["max_context"]


def token_counts(tokenizer, *texts: list[str]) -> list[int]:
    """Tokens of each input as the pipeline sees it (special tokens included); two lists are encoded as pairs."""
    return [int(n) for n in tokenizer.encode(*texts).attention_mask.data.sum(axis=1)]


def encode(vector: np.ndarray) -> str:
    """OpenAI's base64 embedding: the float32 values, little-endian."""
    return base64.b64encode(vector.astype("<f4").tobytes()).decode()


def check_token_limit(counts: list[int], limit: int, truncate: bool, what: str) -> None:
    if truncate:
        return
    for i, count in enumerate(counts):
        if count > limit:
            raise InvalidInput(f"{what}[{i}] has {count} tokens; this model takes at most {limit} per input "
                               "(send truncate: true to cut it)", "context_length_exceeded")


def pipeline_config(spec: dict[str, Any]):
    """The TextEmbeddingPipeline.Config of a model's spec (also what the bench's in-process baseline runs)."""
    import openvino_genai
    config = openvino_genai.TextEmbeddingPipeline.Config()
    config.pooling_type = getattr(openvino_genai.TextEmbeddingPipeline.PoolingType, pooling(spec))
    config.normalize = spec["normalize"]
    config.max_length = input_token_limit(spec)  # only reached by a request that asked to be truncated
    return config


def pooling(spec: dict[str, Any]) -> str:
    """The configured pooling, else what the model's sentence-transformers config says, else CLS."""
    if spec["pooling"]:
        return spec["pooling"].upper()
    pooling_config = model_json(spec["path"], "1_Pooling/config.json")
    return next((mode for key, mode in SENTENCE_TRANSFORMERS_POOLING.items() if pooling_config.get(key)), "CLS")


class EmbeddingEngine(ResultEngine):
    """One request at a time, its inputs BATCH_SIZE per pipeline call. Requests are not coalesced: embedding the
    texts of concurrent requests in one call was measured no faster through the server (bench.embeddings;
    docs/performance.md, "Embeddings through the server"), and it would make each request wait for its neighbours'
    inputs."""

    def __init__(self, spec: dict[str, Any], channel):
        import openvino_genai
        super().__init__(spec, channel)
        self.limit = input_token_limit(spec)
        self.pipe = openvino_genai.TextEmbeddingPipeline(spec["path"], spec["device"], pipeline_config(spec),
                                                         **spec["properties"])
        self.tokenizer = openvino_genai.Tokenizer(spec["path"])
        self.vocab_size = len(self.tokenizer.get_vocab())
        # One embedding at load: the model's own size, and the first call's one-off costs paid before `ready`.
        self.native_dimensions = len(self.pipe.embed_documents(["openarc"])[0])
        dimensions = spec["matryoshka_dimensions"]
        if dimensions is None:
            dimensions = model_json(spec["path"], "config.json").get("matryoshka_dimensions") or []
        self.dimensions = sorted({int(d) for d in dimensions if int(d) <= self.native_dimensions})

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        texts = self._texts(body["input"])
        counts = token_counts(self.tokenizer, texts)
        check_token_limit(counts, self.limit, body.get("truncate", False), "input")
        dimensions = self._checked_dimensions(body.get("dimensions"))
        matrix = np.concatenate([np.asarray(self.pipe.embed_documents(batch), dtype=np.float32)
                                 for _, batch in self.in_batches(texts, BATCH_SIZE)])
        if dimensions:
            matrix = matrix[:, :dimensions]
            matrix /= np.maximum(np.linalg.norm(matrix, axis=1, keepdims=True), 1e-12)
        if not np.isfinite(matrix).all():  # a broken model: no client can parse NaN, and base64 would hide it
            raise UnusableOutput("the model returned non-finite values (NaN or infinity)")
        embeddings = [encode(row) for row in matrix] if body.get("encoding_format") == "base64" else [
            json.dumps(row.tolist()) for row in matrix]
        return {"embeddings": embeddings}, {"prompt_tokens": sum(min(count, self.limit) for count in counts),
                                            "embedding_inputs": len(texts)}

    def _texts(self, inputs: list) -> list[str]:
        """Text inputs as they are; token-id inputs decoded to text (genai's pipeline takes text only)."""
        if not inputs or isinstance(inputs[0], str):
            return inputs
        for i, ids in enumerate(inputs):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise InvalidInput(f"input[{i}] holds token id {bad}, outside this model's vocabulary "
                                   f"(0..{self.vocab_size - 1})")
        return self.tokenizer.decode(inputs, skip_special_tokens=True)

    def _checked_dimensions(self, dimensions: int | None) -> int | None:
        """None for the model's own size; else a Matryoshka size the model was trained for, or a 400."""
        if dimensions is None or dimensions == self.native_dimensions:
            return None
        if dimensions not in self.dimensions:
            allowed = ", ".join(str(d) for d in sorted({*self.dimensions, self.native_dimensions}))
            raise InvalidInput(f"this model cannot give dimensions={dimensions}: it gives {allowed}",
                               "invalid_dimensions")
        return dimensions
