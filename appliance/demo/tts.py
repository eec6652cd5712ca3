"""A tiny SpeechT5-shaped text-to-speech model in OpenVINO IR, built from nothing (no model hub, no torch).

`openarc demo-model --kind tts DIR` writes it (appliance.demo.catalog builds and caches it); tests serve it with a
real `openvino_genai.Text2SpeechPipeline` on CPU.  It has the files, inputs, outputs and config genai's SpeechT5
backend reads (src/cpp/src/speech_generation/speecht5_tts_model.cpp in openvino.genai):

* `openvino_encoder_model`: input_ids [batch, L] -> last_hidden_state [batch, L, 80 + HIDDEN],
  encoder_attention_mask [batch, L];
* `openvino_decoder_model`, stateful (a KV cache, beam_idx): inputs_embeds [batch, 1, 80] (the last mel frame),
  speaker_embeddings [batch, 512], encoder_hidden_states, encoder_attention_mask -> output_sequence_out (the next
  inputs_embeds), spectrum [batch, 2, 80] (reduction factor 2 frames per step), prob [batch, 2] (stop when the sum
  reaches genai's threshold, 0.5);
* `openvino_postnet`: raw_spectrogram [steps, batch, 2, 80] -> postnet_spectrogram [batch, frames, 80];
* `openvino_vocoder`: spectrogram [batch, frames, 80] -> waveform [batch, frames x HOP] at 16 kHz;
* a character-level tokenizer (one token per byte, then </s>, as SpeechT5's char SentencePiece does), as
  OpenVINO tokenizer IRs converted from a `tokenizers` byte-level BPE without merges (no sentencepiece needed);
* `voices/<name>.bin`: a speaker embedding per OpenAI voice name (512 float32, the format genai's samples read).

It speaks by a fixed rule instead of by learning, so tests can tell inputs apart:

* every character is STEPS_PER_TOKEN decoder steps (4 frames of 256 samples: 64 ms, about 15 characters a
  second); the stop head fires on the last step of the last token (</s>), so the length is 64 ms x (bytes + 1);
* a letter or digit sounds as a chord of a few sine tones chosen by its byte (each bin of the 80-bin "mel"
  spectrum is a harmonic of 62.5 Hz, which fits a 256-sample frame exactly, so tones join without clicks);
  spaces, punctuation and </s> are silence;
* the speaker embedding scales each bin (a voice is a timbre): another voice, other audio; the same text and
  voice, the same samples.

The transformer parts (the encoder's attention, the decoder's prenet, self-attention over its KV cache, the
postnet's convolution) have random weights and do real work, scaled down to a nudge far below the rule.
"""

from __future__ import annotations

import pathlib

import numpy as np

from appliance.demo.llm import (HIDDEN, _bytes_to_unicode, _kv_cache, _merge_heads, _rms_norm, _split_heads, ops,
                                  stateful_model, write_json)
from appliance.model_files import OPENAI_VOICES, VOICE_SUFFIX, VOICES_DIR

MEL_BINS, REDUCTION, HOP, SPEAKER_DIM = 80, 2, 256, 512
SAMPLE_RATE = 16000  # genai's SpeechT5 backend always reports 16 kHz
STEPS_PER_TOKEN = 2
MAX_TEXT_POSITIONS = 600
SPECIALS = ["<s>", "<pad>", "</s>", "<unk>"]  # SpeechT5's ids: bos 0, pad 1, eos 2, unk 3
EOS_ID = 2
ALIGN_SHARPNESS = 50.0  # the alignment's softmax over text positions: next position e^-50 below
STOP_SHARPNESS = 20.0
NUDGE = 1e-4  # the random parts move the spectrum by this much: a space stays below -60 dB
TONES_PER_CHAR, TONE_AMPLITUDE = 3, 0.12



def write_tts_model(out: pathlib.Path, *, seed: int) -> None:
    """Write the model's files (and voices/) into the directory `out`."""
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    tokenizer = _hf_tokenizer()
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(ov_tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "openvino_detokenizer.xml")
    tokenizer.save_pretrained(out)
    vocab_size = len(tokenizer)
    ov.save_model(_build_encoder(_char_tones(tokenizer, rng), rng), out / "openvino_encoder_model.xml")
    ov.save_model(_build_decoder(rng), out / "openvino_decoder_model.xml")
    ov.save_model(_build_postnet(rng), out / "openvino_postnet.xml")
    ov.save_model(_build_vocoder(), out / "openvino_vocoder.xml")
    write_json(out / "config.json", _hf_config(vocab_size))
    write_json(out / "generation_config.json", {"minlenratio": 0.0, "maxlenratio": 20.0, "threshold": 0.5})
    voices = out / VOICES_DIR
    voices.mkdir()
    for name in OPENAI_VOICES:
        rng.normal(0.0, 1.0, SPEAKER_DIM).astype(np.float32).tofile(voices / f"{name}{VOICE_SUFFIX}")


def _hf_config(vocab_size: int) -> dict:
    return {
        "architectures": ["SpeechT5ForTextToSpeech"], "model_type": "speecht5", "torch_dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "num_mel_bins": MEL_BINS, "reduction_factor": REDUCTION,
        "speaker_embedding_dim": SPEAKER_DIM, "max_text_positions": MAX_TEXT_POSITIONS,
        "bos_token_id": 0, "pad_token_id": 1, "eos_token_id": EOS_ID, "decoder_start_token_id": EOS_ID,
        "is_encoder_decoder": True,
    }


# --- tokenizer -------------------------------------------------------------------------------------------------

def _hf_tokenizer():
    """One token per byte (a byte-level BPE with no merges), SpeechT5's four specials first, </s> appended."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    byte_chars = _bytes_to_unicode()
    vocab = {token: i for i, token in enumerate(SPECIALS)}
    vocab.update({byte_chars[b]: len(SPECIALS) + b for b in range(256)})
    bpe = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.add_special_tokens(SPECIALS)
    bpe.post_processor = processors.TemplateProcessing(single="$A </s>", special_tokens=[("</s>", EOS_ID)])
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", pad_token="<pad>", eos_token="</s>",
                                   unk_token="<unk>", model_max_length=MAX_TEXT_POSITIONS)


def _char_tones(tokenizer, rng: np.random.Generator) -> np.ndarray:
    """[vocab, 80]: each letter's or digit's chord (TONES_PER_CHAR bins), silence for everything else."""
    byte_chars = _bytes_to_unicode()
    tones = np.zeros((len(tokenizer), MEL_BINS), np.float32)
    for b in range(256):
        if chr(b).isalnum() and b < 128:
            token = tokenizer.convert_tokens_to_ids(byte_chars[b])
            bins = rng.choice(MEL_BINS, TONES_PER_CHAR, replace=False)
            tones[token, bins] = TONE_AMPLITUDE * rng.uniform(0.6, 1.0, TONES_PER_CHAR)
    return tones


# --- encoder -------------------------------------------------------------------------------------------------------

def _build_encoder(tones: np.ndarray, rng: np.random.Generator):
    """input_ids -> last_hidden_state (each token's chord in the first 80 channels, then an attention layer's
    output) and encoder_attention_mask (all ones)."""
    import openvino as ov

    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    length = ops.gather(ops.shape_of(input_ids), ops.constant([1]), ops.constant(0))
    positions = ops.range(ops.constant(np.int64(0)), ops.squeeze(length, [0]), ops.constant(np.int64(1)), "i64")
    x = ops.add(ops.gather(_weight(rng, len(tones), HIDDEN, std=1.0), input_ids, 0),
                ops.gather(_weight(rng, MAX_TEXT_POSITIONS, HIDDEN, std=0.1), positions, 0))
    h = _rms_norm(x)
    q, k, v = (_split_heads(ops.matmul(h, _weight(rng, HIDDEN, HIDDEN), False, True)) for _ in "qkv")
    x = ops.add(x, ops.matmul(_merge_heads(ops.scaled_dot_product_attention(q, k, v, causal=False)),
                              _weight(rng, HIDDEN, HIDDEN), False, True))
    hidden = ops.result(ops.concat([ops.gather(ops.constant(tones), input_ids, 0), _rms_norm(x)], -1))
    hidden.get_output_tensor(0).set_names({"last_hidden_state"})
    mask = ops.result(ops.convert(ops.greater_equal(input_ids, ops.constant(np.int64(0))), "i64"))
    mask.get_output_tensor(0).set_names({"encoder_attention_mask"})
    return ov.Model([hidden, mask], [input_ids], "openarc-demo-speecht5-encoder")


# --- decoder -------------------------------------------------------------------------------------------------------

def _build_decoder(rng: np.random.Generator):
    """One step: the prenet (last frame + speaker), self-attention over the KV cache (whose length counts the
    steps), then the rule: an alignment that reads text position step // STEPS_PER_TOKEN, its chord scaled by the
    speaker's timbre, and a stop probability that rises on the last step of the last position."""
    import openvino as ov

    frame = ops.parameter([-1, 1, MEL_BINS], ov.Type.f32, name="inputs_embeds")
    speaker = ops.parameter([-1, SPEAKER_DIM], ov.Type.f32, name="speaker_embeddings")
    text = ops.parameter([-1, -1, MEL_BINS + HIDDEN], ov.Type.f32, name="encoder_hidden_states")
    text_mask = ops.parameter([-1, -1], ov.Type.i64, name="encoder_attention_mask")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")

    # SpeechT5's prenet: the last frame through a small MLP, the speaker embedding projected and added.
    x = ops.relu(ops.matmul(frame, _weight(rng, HIDDEN, MEL_BINS), False, True))
    x = ops.add(x, ops.unsqueeze(ops.matmul(speaker, _weight(rng, HIDDEN, SPEAKER_DIM), False, True), [1]))
    h = _rms_norm(x)
    q, k, v = (_split_heads(ops.matmul(h, _weight(rng, HIDDEN, HIDDEN), False, True)) for _ in "qkv")
    caches: list = []
    keys_values = _kv_cache(k, v, "0.decoder", beam_idx, caches)
    x = ops.add(x, ops.matmul(_merge_heads(ops.scaled_dot_product_attention(q, *keys_values, causal=False)),
                              _weight(rng, HIDDEN, HIDDEN), False, True))
    nudge = ops.multiply(ops.matmul(_rms_norm(x), _weight(rng, MEL_BINS, HIDDEN), False, True),
                         ops.constant(np.float32(NUDGE)))  # [batch, 1, 80]

    step = ops.subtract(ops.gather(ops.shape_of(keys_values[0]), ops.constant(2), ops.constant(0)),
                        ops.constant(np.int64(1)))  # steps before this one: the cache's length less this step
    chord = _aligned_chord(text, text_mask, step)
    timbre = ops.add(ops.sigmoid(ops.matmul(speaker, _weight(rng, MEL_BINS, SPEAKER_DIM, std=2 / SPEAKER_DIM ** 0.5),
                                            False, True)), ops.constant(np.float32(0.5)))  # [batch, 80] in 0.5..1.5
    voiced = ops.add(ops.multiply(chord, ops.unsqueeze(timbre, [1])), nudge)  # [batch, 1, 80]
    spectrum = ops.concat([voiced, voiced], 1)  # REDUCTION frames per step
    out_seq = ops.result(voiced)
    out_seq.get_output_tensor(0).set_names({"output_sequence_out"})
    spectrum_result = ops.result(spectrum)
    spectrum_result.get_output_tensor(0).set_names({"spectrum"})
    prob = ops.result(_stop_probability(text, step, voiced))
    prob.get_output_tensor(0).set_names({"prob"})
    model = stateful_model(out_seq, [frame, speaker, text, text_mask, beam_idx], caches,
                           "openarc-demo-speecht5-decoder", frame)
    model.add_results([spectrum_result, prob])
    return model


def _aligned_chord(text, text_mask, step):
    """The chord channels of text position step // STEPS_PER_TOKEN: [batch, 1, 80], a softmax over positions
    sharp enough to be a pick (padding masked out)."""
    length = ops.gather(ops.shape_of(text), ops.constant(1), ops.constant(0))
    positions = ops.convert(ops.range(ops.constant(np.int64(0)), length, ops.constant(np.int64(1)), "i64"), "f32")
    target = ops.convert(ops.divide(step, ops.constant(np.int64(STEPS_PER_TOKEN))), "f32")
    distance = ops.subtract(positions, target)
    scores = ops.multiply(ops.multiply(distance, distance), ops.constant(np.float32(-ALIGN_SHARPNESS)))
    masked = ops.add(ops.unsqueeze(scores, [0]),
                     ops.multiply(ops.subtract(ops.convert(text_mask, "f32"), ops.constant(np.float32(1.0))),
                                  ops.constant(np.float32(1e4))))  # [batch, L]
    weights = ops.unsqueeze(ops.softmax(masked, -1), [1])  # [batch, 1, L]
    chords = ops.slice(text, [0], [MEL_BINS], [1], [2])
    return ops.matmul(weights, chords, False, False)


def _stop_probability(text, step, voiced):
    """[batch, REDUCTION]: about 1 from the last step of the last text position on, about 0 before."""
    length = ops.gather(ops.shape_of(text), ops.constant(1), ops.constant(0))
    last_step = ops.subtract(ops.multiply(length, ops.constant(np.int64(STEPS_PER_TOKEN))), ops.constant(np.int64(1)))
    margin = ops.add(ops.convert(ops.subtract(step, last_step), "f32"), ops.constant(np.float32(0.5)))
    logit = ops.multiply(margin, ops.constant(np.float32(STOP_SHARPNESS)))
    # shaped [batch, REDUCTION] from the spectrum's batch
    shape = ops.concat([ops.gather(ops.shape_of(voiced), ops.constant([0]), ops.constant(0)),
                        ops.constant(np.array([REDUCTION], np.int64))], 0)
    return ops.broadcast(ops.sigmoid(logit), shape)


# --- postnet and vocoder ---------------------------------------------------------------------------------------------

def _build_postnet(rng: np.random.Generator):
    """raw_spectrogram [steps, batch, REDUCTION, 80] -> postnet_spectrogram [batch, frames, 80]: the frames in order
    plus a convolution's residual (SpeechT5's postnet), scaled to a nudge."""
    import openvino as ov

    raw = ops.parameter([-1, -1, REDUCTION, MEL_BINS], ov.Type.f32, name="raw_spectrogram")
    frames = ops.reshape(ops.transpose(raw, [1, 0, 2, 3]), [0, -1, MEL_BINS], special_zero=True)
    conv = ops.convolution(ops.transpose(frames, [0, 2, 1]), _weight(rng, MEL_BINS, MEL_BINS, 5), [1], [2], [2], [1])
    residual = ops.multiply(ops.transpose(ops.tanh(conv), [0, 2, 1]), ops.constant(np.float32(NUDGE)))
    result = ops.result(ops.add(frames, residual))
    result.get_output_tensor(0).set_names({"postnet_spectrogram"})
    return ov.Model([result], [raw], "openarc-demo-speecht5-postnet")


def _build_vocoder():
    """spectrogram [batch, frames, 80] -> waveform [batch, frames x HOP]: bin k is a sine at (k + 2) x 62.5 Hz, a
    whole number of cycles per 256-sample frame, with the bin's value as its amplitude."""
    import openvino as ov

    spectrogram = ops.parameter([-1, -1, MEL_BINS], ov.Type.f32, name="spectrogram")
    n = np.arange(HOP)
    basis = np.sin(2 * np.pi * np.outer(np.arange(MEL_BINS) + 2, n) / HOP).astype(np.float32)  # [80, 256]
    frames = ops.matmul(ops.clamp(spectrogram, 0.0, 1.0), ops.constant(basis), False, False)
    result = ops.result(ops.tanh(ops.reshape(frames, [0, -1], special_zero=True)))
    result.get_output_tensor(0).set_names({"waveform"})
    return ov.Model([result], [spectrogram], "openarc-demo-speecht5-vocoder")


def _weight(rng: np.random.Generator, *shape, std: float | None = None):
    std = shape[-1] ** -0.5 if std is None else std
    return ops.constant(rng.normal(0.0, std, shape).astype(np.float32))
