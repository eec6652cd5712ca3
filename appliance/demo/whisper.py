"""A tiny Whisper-shaped speech-to-text model in OpenVINO IR, built from nothing (no model hub, no torch).

`openarc demo-model --kind transcription DIR` writes it (appliance.demo.catalog builds and caches it); tests
serve it with a real `WhisperPipeline` on CPU.
It has the files, inputs, outputs and token layout genai's WhisperPipeline reads (an encoder over 80 log-mel
bins x 3000 frames, a stateful decoder with self- and cross-attention, Whisper's special tokens, timestamps
last), and it transcribes by a fixed rule instead of by learning:

* Audio with any sound in it (some 20 ms frame whose log-mel spectrum is not flat) is transcribed as
  TRANSCRIPT, " hello world from a tiny model.", one text token after another.  Silence (all-zero samples)
  is transcribed as "" (<|nospeech|>, then end-of-text).  So a test can tell that decoded audio, not
  zeros, reached the model.
* The detected language is always English; `task=translate` gives the same text.
* With timestamps the segment is <|0.00|> ... <|1.00|>; audio over 30 s is cut by genai into 30 s windows,
  each transcribed the same way (segments at 0 s, 30 s, ...).
* Each token's choice leads every other token by LOGIT_MARGIN logits; the transformer's random weights (which
  do real attention over the audio and the KV cache) move logits by far less.

The decision lives in a state machine over the current input token: sot -> <|en|>, a task token ->
<|0.00|>, <|notimestamps|> or <|0.00|> -> the first transcript token (or the silence path), each
transcript token -> the next, the last -> end-of-text, except that in timestamp mode genai's "timestamps
outweigh text" rule picks <|1.00|> first (all timestamps sit TIMESTAMP_DROP logits under end-of-text,
<|1.00|> less), and after any timestamp end-of-text.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

# HIDDEN and the attention heads as the chat demo's, whose attention helpers this shares.
from appliance.demo.llm import (HEADS, HIDDEN, _kv_cache, _merge_heads, _rms_norm, _split_heads, ops,
                                  stateful_model, write_json)

TRANSCRIPT = " hello world from a tiny model."

MEL_BINS, FRAMES, POSITIONS = 80, 3000, 1500  # 30 s of 10 ms frames; the encoder halves the frame rate
MLP_HIDDEN = 128
MAX_TARGET_POSITIONS = 448
TIMESTAMPS = 1501  # <|0.00|> ... <|30.00|> in 20 ms steps
LOGIT_MARGIN = 30.0
TIMESTAMP_DROP, ONE_SECOND_DROP = 6.0, 2.0
SOUND_THRESHOLD = 0.05  # std of a frame's scaled log-mel bins; exactly 0 for silence and for padding

CORPUS = [
    "Say" + TRANSCRIPT + " Then say" + TRANSCRIPT,
    "openarc transcribes speech with a tiny whisper model, built from nothing in a second. "
    "The quick brown fox jumps over the lazy dog. Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100; "
    "punctuation: . , ; : ! ? ( ) ' \" - %.",
]


def write_whisper_model(out: pathlib.Path, *, seed: int) -> None:
    """Write the model's files into the directory `out`."""
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    tokenizer, layout = _hf_tokenizer()
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(ov_tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "openvino_detokenizer.xml")
    tokenizer.save_pretrained(out)
    transcript = tokenizer(TRANSCRIPT, add_special_tokens=False).input_ids
    ov.save_model(_build_encoder(rng), out / "openvino_encoder_model.xml")
    ov.save_model(_build_decoder(_state_logits(layout, transcript), layout, rng), out / "openvino_decoder_model.xml")
    write_json(out / "config.json", _hf_config(layout))
    write_json(out / "generation_config.json", _generation_config(layout))
    write_json(out / "preprocessor_config.json", {
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": MEL_BINS, "sampling_rate": 16000,
        "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": FRAMES,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False,
    })


# --- tokenizer -------------------------------------------------------------------------------------------------

class _Layout:
    """Whisper's token ids: the text BPE, then <|endoftext|>, the other specials, <|notimestamps|>, and the
    timestamps last (genai treats every id above <|notimestamps|> as a timestamp, and every id below
    <|endoftext|> as text)."""

    def __init__(self, text_tokens: int, languages: list[str]):
        self.eos = text_tokens
        self.sot = self.eos + 1
        self.lang = {f"<|{code}|>": self.sot + 1 + i for i, code in enumerate(languages)}
        after_langs = self.sot + 1 + len(languages)
        self.translate, self.transcribe, self.sot_lm, self.sot_prev, self.no_speech, self.no_timestamps = \
            range(after_langs, after_langs + 6)
        self.first_timestamp = self.no_timestamps + 1
        self.vocab_size = self.first_timestamp + TIMESTAMPS

    def timestamp(self, seconds: float) -> int:
        return self.first_timestamp + round(seconds / 0.02)


def _special_tokens(languages: list[str]) -> list[str]:
    return ["<|endoftext|>", "<|startoftranscript|>", *(f"<|{code}|>" for code in languages),
            "<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]


def _hf_tokenizer():
    """A transformers WhisperTokenizer over a byte-level BPE trained on CORPUS, with Whisper's special tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import WhisperTokenizer
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    # No special tokens in training: Whisper's must come after the text vocabulary.
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=[], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    spec = json.loads(bpe.to_str())["model"]
    merges = [tuple(m) if isinstance(m, list) else tuple(m.split(" ")) for m in spec["merges"]]
    tokenizer = WhisperTokenizer(vocab=spec["vocab"], merges=merges)
    languages = list(LANGUAGES)
    specials = _special_tokens(languages)
    tokenizer.add_tokens([AddedToken(s, special=True, normalized=False) for s in specials], special_tokens=True)
    # Without this, all_special_ids is only <|endoftext|> and HF's timestamp decoding miscounts.
    tokenizer.add_special_tokens({"additional_special_tokens": specials[1:]})
    tokenizer.add_tokens([AddedToken(f"<|{i * 0.02:.2f}|>", special=False, normalized=False)
                          for i in range(TIMESTAMPS)])
    tokenizer.set_prefix_tokens(language=None, task=None, predict_timestamps=False)
    layout = _Layout(len(spec["vocab"]), languages)
    assert len(tokenizer) == layout.vocab_size, (len(tokenizer), layout.vocab_size)
    assert tokenizer.convert_tokens_to_ids("<|notimestamps|>") == layout.no_timestamps
    return tokenizer, layout


def _hf_config(layout: _Layout) -> dict:
    return {
        "architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", "torch_dtype": "float32",
        "vocab_size": layout.vocab_size, "num_mel_bins": MEL_BINS, "d_model": HIDDEN,
        "encoder_layers": 1, "encoder_attention_heads": HEADS, "encoder_ffn_dim": MLP_HIDDEN,
        "decoder_layers": 1, "decoder_attention_heads": HEADS, "decoder_ffn_dim": MLP_HIDDEN,
        "max_source_positions": POSITIONS, "max_target_positions": MAX_TARGET_POSITIONS,
        "pad_token_id": layout.eos, "bos_token_id": layout.eos, "eos_token_id": layout.eos,
        "decoder_start_token_id": layout.sot, "begin_suppress_tokens": [220, layout.eos],
    }


def _generation_config(layout: _Layout) -> dict:
    return {
        "bos_token_id": layout.eos, "eos_token_id": layout.eos, "pad_token_id": layout.eos,
        "decoder_start_token_id": layout.sot, "max_length": MAX_TARGET_POSITIONS,
        "begin_suppress_tokens": [220, layout.eos],
        "suppress_tokens": [t for t in range(layout.sot, layout.no_timestamps + 1) if t != layout.no_speech],
        "no_timestamps_token_id": layout.no_timestamps, "prev_sot_token_id": layout.sot_prev,
        "is_multilingual": True, "lang_to_id": layout.lang,
        "task_to_id": {"translate": layout.translate, "transcribe": layout.transcribe},
        "max_initial_timestamp_index": 50, "return_timestamps": False,
        "alignment_heads": [[0, 0], [0, 1]],  # layer 0's cross-attention heads: what word_timestamps reads
    }


# --- the rule ----------------------------------------------------------------------------------------------------

def _state_logits(layout: _Layout, transcript: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(logit rows by state, state of each token when there is sound, state of each token in silence).

    State 0 is "end": end-of-text, with the timestamps close behind it and <|1.00|> closer (see module doc)."""
    assert len(set(transcript)) == len(transcript) and transcript[0] != 220, "transcript tokens must be unique"
    rows: list[np.ndarray] = []

    def state(top: int, timestamps: float | None = None, one_second: float | None = None) -> int:
        row = np.zeros(layout.vocab_size, np.float32)
        if timestamps is not None:
            row[layout.first_timestamp:] = timestamps
            row[layout.timestamp(1.0)] = one_second
        row[top] = LOGIT_MARGIN
        rows.append(row)
        return len(rows) - 1

    end = state(layout.eos, LOGIT_MARGIN - TIMESTAMP_DROP, LOGIT_MARGIN - ONE_SECOND_DROP)
    after_timestamp = state(layout.eos)
    sound = np.full(layout.vocab_size, after_timestamp, np.int64)
    sound[layout.sot] = state(layout.lang["<|en|>"])
    sound[[layout.transcribe, layout.translate]] = state(layout.timestamp(0.0))
    starts = [layout.no_timestamps, layout.timestamp(0.0)]
    sound[starts] = state(transcript[0])
    for token, successor in zip(transcript, transcript[1:]):
        sound[token] = state(successor)
    sound[transcript[-1]] = end
    silence = sound.copy()
    # Whisper never ends on its first step (end-of-text is in begin_suppress_tokens): silence says <|nospeech|>,
    # which the detokenizer drops, then ends.  After <|0.00|> genai itself allows end-of-text.
    silence[layout.no_timestamps] = state(layout.no_speech)
    silence[layout.timestamp(0.0)] = after_timestamp
    return np.stack(rows), sound, silence


# --- encoder -------------------------------------------------------------------------------------------------------

def _build_encoder(rng: np.random.Generator):
    """input_features [batch, 80, 3000] -> last_hidden_state [batch, 1500, HIDDEN]: two convolutions (the second
    halves the frame rate, as Whisper's does), positions, RMS norm; channel 0 carries how far each frame's
    spectrum is from flat (the decoder's sound detector)."""
    import openvino as ov

    features = ops.parameter([-1, MEL_BINS, FRAMES], ov.Type.f32, name="input_features")
    x = _gelu(_conv1d(features, _weight(rng, HIDDEN, MEL_BINS, 3), stride=1))
    x = _gelu(_conv1d(x, _weight(rng, HIDDEN, HIDDEN, 3), stride=2))
    x = ops.transpose(x, [0, 2, 1])
    x = _rms_norm(ops.add(x, _weight(rng, POSITIONS, HIDDEN, std=1.0)))
    spread = ops.sqrt(ops.reduce_mean(ops.squared_difference(
        features, ops.reduce_mean(features, [1], True)), [1], False))  # [batch, 3000]
    spread = ops.reduce_max(ops.reshape(spread, [0, POSITIONS, 2], special_zero=True), [2], True)
    hidden = ops.concat([spread, ops.slice(x, [1], [HIDDEN], [1], [2])], 2)
    result = ops.result(hidden)
    result.get_output_tensor(0).set_names({"last_hidden_state"})
    return ov.Model([result], [features], "openarc-demo-whisper-encoder")


def _gelu(x):
    return ops.gelu(x, "erf")


def _conv1d(x, weight, stride: int):
    return ops.convolution(x, weight, [stride], [1], [1], [1])


def _weight(rng: np.random.Generator, *shape, std: float | None = None):
    std = shape[-1] ** -0.5 if std is None else std
    return ops.constant(rng.normal(0.0, std, shape).astype(np.float32))


# --- decoder -------------------------------------------------------------------------------------------------------

def _build_decoder(state_logits, layout: _Layout, rng: np.random.Generator):
    """Stateful decoder (input_ids, encoder_hidden_states, cache_position, beam_idx -> logits): one layer of
    causal self-attention over a KV cache, cross-attention over the audio (an SDPA named encoder_attn, which
    genai decomposes to read alignment heads for word timestamps), an MLP; logits from the rule (see module doc)
    plus the layer's output, scaled down to a nudge."""
    import openvino as ov

    rows, sound_states, silence_states = state_logits
    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    audio = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="encoder_hidden_states")
    cache_position = ops.parameter([-1], ov.Type.i64, name="cache_position")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")

    x = ops.add(ops.gather(_weight(rng, layout.vocab_size, HIDDEN, std=1.0), input_ids, 0),
                ops.gather(_weight(rng, MAX_TARGET_POSITIONS, HIDDEN, std=0.1), cache_position, 0))
    caches: list = []
    x = ops.add(x, _self_attention(_rms_norm(x), cache_position, beam_idx, rng, caches))
    x = ops.add(x, _cross_attention(_rms_norm(x), audio, rng))
    h = _rms_norm(x)
    x = ops.add(x, ops.matmul(_gelu(ops.matmul(h, _weight(rng, MLP_HIDDEN, HIDDEN), False, True)),
                              _weight(rng, HIDDEN, MLP_HIDDEN), False, True))

    heard = ops.greater(ops.reduce_max(ops.gather(audio, ops.constant(0), 2), [1], True),
                        ops.constant(np.float32(SOUND_THRESHOLD)))  # [batch, 1]
    state = ops.select(heard, ops.gather(ops.constant(sound_states), input_ids, 0),
                       ops.gather(ops.constant(silence_states), input_ids, 0))
    one_hot = ops.gather(ops.constant(np.eye(len(rows), dtype=np.float32)), state, 0)
    nudge = ops.multiply(_rms_norm(x), ops.constant(np.float32(1 / 64)))
    head = np.concatenate([rows.T, rng.normal(0.0, HIDDEN ** -0.5, (layout.vocab_size, HIDDEN))], 1)
    logits = ops.result(ops.matmul(ops.concat([one_hot, nudge], -1), ops.constant(head.astype(np.float32)),
                                   False, True))
    logits.get_output_tensor(0).set_names({"logits"})
    return stateful_model(logits, [input_ids, audio, cache_position, beam_idx], caches, "openarc-demo-whisper-decoder",
                          input_ids)


def _self_attention(h, cache_position, beam_idx, rng, caches: list):
    q, k, v = (_split_heads(ops.matmul(h, _weight(rng, HIDDEN, HIDDEN), False, True)) for _ in "qkv")
    keys_values = _kv_cache(k, v, "0.decoder", beam_idx, caches)
    total = ops.gather(ops.shape_of(keys_values[0]), ops.constant(2), ops.constant(0))
    columns = ops.range(ops.constant(np.int64(0)), total, ops.constant(np.int64(1)), "i64")
    causal = ops.less_equal(ops.unsqueeze(columns, [0]), ops.unsqueeze(cache_position, [1]))  # [new, total]
    attn = ops.scaled_dot_product_attention(q, *keys_values, causal, causal=False)
    return ops.matmul(_merge_heads(attn), _weight(rng, HIDDEN, HIDDEN), False, True)


def _cross_attention(h, audio, rng):
    q = _split_heads(ops.matmul(h, _weight(rng, HIDDEN, HIDDEN), False, True))
    k, v = (_split_heads(ops.matmul(audio, _weight(rng, HIDDEN, HIDDEN), False, True))
            for _ in "kv")
    no_mask = ops.constant(np.zeros((1, 1, 1, 1), np.float32))  # a mask input gives genai's decomposition its Add
    attn = ops.scaled_dot_product_attention(q, k, v, no_mask, causal=False)
    attn.set_friendly_name("model.decoder.layers.0.encoder_attn/ScaledDotProductAttention")
    return ops.matmul(_merge_heads(attn), _weight(rng, HIDDEN, HIDDEN), False, True)
