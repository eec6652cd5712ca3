"""Tiny BERT-like encoders in OpenVINO IR, built from nothing (no hub, no torch) in about a second: the
embedding and rerank demo models that `openarc demo-model --kind embedding|rerank` writes and tests serve.

Both are what genai's TextEmbeddingPipeline / TextRerankPipeline load from an optimum export of a BERT model:
`openvino_model.xml` with inputs input_ids, attention_mask, token_type_ids (i64 [batch, seq]), a WordPiece
tokenizer converted by openvino_tokenizers (`openvino_tokenizer.xml`, paired input for rerank) and config.json.

What they compute (the contract tests rely on)
----------------------------------------------
* A real two-layer post-LN transformer (random seeded weights, multi-head attention over the padding mask)
  runs over every token, so cost grows with batch and length as in a real encoder.  Its output is scaled down
  (TRANSFORMER_SHARE) and added to a bag-of-words vector: the masked mean of a fixed random vector per word
  piece, special tokens excluded.  So similarity means shared words, as a user would expect of a real model:
  "the cat sat on the mat" lies closer to "a cat on a mat" than to "GPU drivers crash".
* embedding: output `last_hidden_state` [batch, seq, HIDDEN], the bag-of-words vector at every position, so
  CLS, MEAN and LAST_TOKEN pooling all give (nearly) the same direction.
* rerank: output `logits` [batch, 1] = RERANK_SCALE * cos(query words, document words) + RERANK_BIAS (query and
  document told apart by token_type_ids); genai applies a sigmoid, so a document sharing the query's words
  scores near 1 and an unrelated one near sigmoid(RERANK_BIAS).
"""

from __future__ import annotations

import pathlib
from typing import Mapping

import numpy as np

from appliance.demo.llm import CORPUS, write_json, ops

HIDDEN, LAYERS, HEADS, MLP_HIDDEN = 128, 2, 4, 256  # 128 dimensions: random word vectors nearly orthogonal
MAX_POSITIONS = 512
WORDPIECE_VOCAB = 2000
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TRANSFORMER_SHARE = 0.005 # the transformer's part of each vector, next to a bag-of-words part of norm ~1
RERANK_SCALE, RERANK_BIAS = 8.0, -3.0
# The Matryoshka sizes the embedding demo is served with: its bag-of-words vectors truncate gracefully.
MATRYOSHKA_DIMENSIONS = [32, 64, 128]
PIECE_WEIGHT = 0.25  # word pieces ("##s") and single letters mean less than whole words

# Words for everyday retrieval examples, so their vectors are whole words, not '##' pieces.
ENCODER_CORPUS = CORPUS + [
    "The cat sat on the mat. A dog ran in the park. Cats and dogs are pets that sleep on the sofa.",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is in Italy.",
    "The GPU driver crashed and the server restarted the worker. Intel Arc graphics cards run OpenVINO models.",
    "Bake the bread in a hot oven. Boil the pasta in salted water. Fresh tomato soup with basil and garlic.",
    "The weather today is rainy and cold; tomorrow will be sunny and warm. Snow fell in the mountains.",
    "Python is a programming language. The function returns a list of numbers. Install the package with pip.",
    "Football players kick the ball into the goal. Tennis and basketball are popular sports.",
    "The bank raised interest rates. Stock prices fell, and investors bought gold and bonds.",
    "Embeddings map text to vectors; a reranker scores how well each document answers a query.",
    "Speech to text turns audio into words. Music, song, voice, sound, listen, speak, read, write, search.",
]


def write_embedding_model(out: pathlib.Path, *, seed: int) -> None:
    _write(out, seed, rerank=False)


def write_rerank_model(out: pathlib.Path, *, seed: int) -> None:
    _write(out, seed, rerank=True)


def _write(out: pathlib.Path, seed: int, rerank: bool) -> None:
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    hf_tokenizer = _hf_tokenizer()
    vocab_size = len(hf_tokenizer)
    # Rerank tokenizes (query, document) pairs: [CLS] q [SEP] d [SEP] with token_type_ids 0 then 1.
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(
        hf_tokenizer, with_detokenizer=True, number_of_inputs=2 if rerank else 1)
    ov.save_model(ov_tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "openvino_detokenizer.xml")
    hf_tokenizer.save_pretrained(out)
    ov.save_model(_build_encoder(hf_tokenizer, rng, rerank), out / "openvino_model.xml")
    config = {
        "architectures": ["BertForSequenceClassification" if rerank else "BertModel"], "model_type": "bert",
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "intermediate_size": MLP_HIDDEN, "max_position_embeddings": MAX_POSITIONS, "type_vocab_size": 2,
        "pad_token_id": 0, "torch_dtype": "float32",
    }
    if rerank:
        config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    else:
        config["matryoshka_dimensions"] = MATRYOSHKA_DIMENSIONS
    write_json(out / "config.json", config)


def _hf_tokenizer():
    """An uncased WordPiece tokenizer trained on ENCODER_CORPUS (deterministic), as transformers' BertTokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers
    from transformers import BertTokenizer

    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=WORDPIECE_VOCAB, special_tokens=SPECIAL_TOKENS,
                                        continuing_subword_prefix="##", show_progress=False)
    wordpiece.train_from_iterator(ENCODER_CORPUS, trainer)
    return BertTokenizer(vocab=wordpiece.get_vocab(), do_lower_case=True, model_max_length=MAX_POSITIONS)


# --- graph -----------------------------------------------------------------------------------------------------

def _build_encoder(hf_tokenizer, rng: np.random.Generator, rerank: bool):
    import openvino as ov

    inputs = bert_inputs()
    input_ids, attention_mask, token_type_ids = inputs
    hidden = bert_encoder(inputs, _random_bert_weights(len(hf_tokenizer), rng), HEADS)
    word_vectors = _word_vectors(hf_tokenizer, rng)
    mask = ops.convert(attention_mask, "f32")
    if rerank:
        document = ops.convert(token_type_ids, "f32")
        query_words = _bag_of_words(input_ids, ops.multiply(mask, ops.subtract(ops.constant(np.float32(1)), document)),
                                    word_vectors)
        document_words = _bag_of_words(input_ids, ops.multiply(mask, document), word_vectors)
        cls = ops.gather(hidden, ops.constant(0), 1)
        head = rng.normal(0.0, HIDDEN ** -0.5, (1, HIDDEN)).astype(np.float32)
        nudge = ops.matmul(cls, ops.constant(head), False, True)
        relevance = ops.multiply(_cosine(query_words, document_words), ops.constant(np.float32(RERANK_SCALE)))
        logits = ops.add(ops.add(relevance, ops.constant(np.float32(RERANK_BIAS))),
                         ops.multiply(nudge, ops.constant(np.float32(TRANSFORMER_SHARE))))
        output, name = logits, "logits"
    else:
        words = ops.unsqueeze(_bag_of_words(input_ids, mask, word_vectors), [1])
        output = ops.add(words, ops.multiply(hidden, ops.constant(np.float32(TRANSFORMER_SHARE))))
        name = "last_hidden_state"
    result = ops.result(output)
    result.get_output_tensor(0).set_names({name})
    return ov.Model([result], list(inputs), "openarc-demo-" + ("rerank" if rerank else "embedding"))


def bert_inputs():
    """The three i64 [batch, seq] parameters genai's embedding and rerank pipelines feed a BERT model."""
    import openvino as ov
    return tuple(ops.parameter([-1, -1], ov.Type.i64, name=name)
                 for name in ("input_ids", "attention_mask", "token_type_ids"))


def bert_encoder(inputs, weights: Mapping[str, np.ndarray], heads: int, eps: float = 1e-12):
    """BERT's encoder as OpenVINO ops, [batch, seq, hidden]: word + position + token-type embeddings, then post-LN
    blocks of multi-head attention (over the padding mask) and a GELU MLP. `weights` are named as in a Hugging Face
    BertModel's state dict (`embeddings.word_embeddings.weight`, `encoder.layer.0.attention.self.query.weight`, ...),
    so the same graph runs the demo's random weights and a real checkpoint's."""
    input_ids, attention_mask, token_type_ids = inputs

    def const(name: str):
        return ops.constant(np.ascontiguousarray(weights[name], dtype=np.float32))

    def dense(x, name: str):
        return ops.add(ops.matmul(x, const(f"{name}.weight"), False, True), const(f"{name}.bias"))

    def layer_norm(x, name: str):
        return ops.add(ops.multiply(_layer_norm(x, eps), const(f"{name}.weight")), const(f"{name}.bias"))

    length = ops.gather(ops.shape_of(input_ids), ops.constant(1), ops.constant(0))
    positions = ops.range(ops.constant(np.int64(0)), length, ops.constant(np.int64(1)), "i64")
    x = ops.add(ops.add(ops.gather(const("embeddings.word_embeddings.weight"), input_ids, 0),
                        ops.gather(const("embeddings.position_embeddings.weight"), positions, 0)),
                ops.gather(const("embeddings.token_type_embeddings.weight"), token_type_ids, 0))
    x = layer_norm(x, "embeddings.LayerNorm")
    # [batch, 1, 1, seq]: padding keys are never attended to
    keep = ops.unsqueeze(ops.not_equal(attention_mask, ops.constant(np.int64(0))), [1, 2])
    hidden = weights["embeddings.word_embeddings.weight"].shape[1]
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in weights:
        at = f"encoder.layer.{layer}"
        q, k, v = (_split_heads(dense(x, f"{at}.attention.self.{part}"), heads) for part in ("query", "key", "value"))
        attn = ops.scaled_dot_product_attention(q, k, v, keep, causal=False)
        attn = ops.reshape(ops.transpose(attn, [0, 2, 1, 3]), [0, 0, hidden], special_zero=True)
        x = layer_norm(ops.add(x, dense(attn, f"{at}.attention.output.dense")), f"{at}.attention.output.LayerNorm")
        up = ops.gelu(dense(x, f"{at}.intermediate.dense"), "erf")
        x = layer_norm(ops.add(x, dense(up, f"{at}.output.dense")), f"{at}.output.LayerNorm")
        layer += 1
    return x


def _random_bert_weights(vocab_size: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A BertModel state dict of the demo's size: random embeddings and projections, identity layer norms."""
    def normal(*shape, std=0.02):
        return rng.normal(0.0, std, shape).astype(np.float32)

    weights = {"embeddings.word_embeddings.weight": normal(vocab_size, HIDDEN, std=1.0),
               "embeddings.position_embeddings.weight": normal(MAX_POSITIONS, HIDDEN, std=1.0),
               "embeddings.token_type_embeddings.weight": normal(2, HIDDEN, std=1.0)}
    norms = ["embeddings.LayerNorm"]
    for layer in range(LAYERS):
        at = f"encoder.layer.{layer}"
        projections = {**{f"{at}.attention.self.{part}": (HIDDEN, HIDDEN, HIDDEN ** -0.5)
                          for part in ("query", "key", "value")},
                       f"{at}.attention.output.dense": (HIDDEN, HIDDEN, 0.02),
                       f"{at}.intermediate.dense": (MLP_HIDDEN, HIDDEN, HIDDEN ** -0.5),
                       f"{at}.output.dense": (HIDDEN, MLP_HIDDEN, 0.02)}
        for name, (rows, columns, std) in projections.items():
            weights[f"{name}.weight"] = normal(rows, columns, std=std)
            weights[f"{name}.bias"] = np.zeros(rows, np.float32)
        norms += [f"{at}.attention.output.LayerNorm", f"{at}.output.LayerNorm"]
    for name in norms:
        weights[f"{name}.weight"] = np.ones(HIDDEN, np.float32)
        weights[f"{name}.bias"] = np.zeros(HIDDEN, np.float32)
    return weights


def _word_vectors(hf_tokenizer, rng: np.random.Generator) -> np.ndarray:
    """A random vector per token, of length IDF over ENCODER_CORPUS's sentences (so "the" counts for little and
    "cat" for much; less again for word pieces), zero for the special tokens: [CLS]/[SEP]/[PAD] carry no meaning."""
    sentences = [s for text in ENCODER_CORPUS for s in text.split(".") if s.strip()]
    seen_in = np.zeros(len(hf_tokenizer))
    for sentence in sentences:
        seen_in[list(set(hf_tokenizer(sentence, add_special_tokens=False)["input_ids"]))] += 1
    vectors = rng.normal(0.0, 1.0, (len(hf_tokenizer), HIDDEN)).astype(np.float32)
    weights = np.log((len(sentences) + 1) / (seen_in + 1))
    for token, i in hf_tokenizer.get_vocab().items():
        if token.startswith("##") or len(token) == 1:
            weights[i] *= PIECE_WEIGHT
    vectors *= (weights / np.linalg.norm(vectors, axis=1))[:, None]
    vectors[:len(SPECIAL_TOKENS)] = 0.0
    return vectors


def _bag_of_words(input_ids, weights, word_vectors: np.ndarray):
    """[batch, HIDDEN]: the `weights`-masked mean of the tokens' word vectors."""
    summed = ops.reduce_sum(ops.multiply(ops.gather(ops.constant(word_vectors), input_ids, 0),
                                         ops.unsqueeze(weights, [2])), [1], False)
    count = ops.maximum(ops.reduce_sum(weights, [1], True), ops.constant(np.float32(1)))
    return ops.divide(summed, count)


def _cosine(a, b):
    """[batch, 1] cosine similarity of two [batch, HIDDEN] tensors (0 when either is all zeros)."""
    def norm(x):
        return ops.sqrt(ops.add(ops.reduce_sum(ops.multiply(x, x), [1], True), ops.constant(np.float32(1e-12))))

    return ops.divide(ops.reduce_sum(ops.multiply(a, b), [1], True), ops.multiply(norm(a), norm(b)))


def _layer_norm(x, eps: float = 1e-12):
    centered = ops.subtract(x, ops.reduce_mean(x, [-1], True))
    variance = ops.reduce_mean(ops.multiply(centered, centered), [-1], True)
    return ops.divide(centered, ops.sqrt(ops.add(variance, ops.constant(np.float32(eps)))))


def _split_heads(x, heads: int):
    """[batch, seq, hidden] -> [batch, heads, seq, hidden / heads]"""
    return ops.transpose(ops.reshape(x, [0, 0, heads, -1], special_zero=True), [0, 2, 1, 3])
