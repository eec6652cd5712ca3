"""A tiny LLaVA-shaped vision-language model in OpenVINO IR, built from nothing (no model hub, no torch).

`openarc demo-model --kind vlm DIR` writes it (appliance.demo.catalog builds and caches it); tests serve it with a
real genai VLM pipeline on CPU.  It has the files, inputs and outputs genai's LLaVA support reads
(src/cpp/src/visual_language/llava in openvino.genai):

* `openvino_vision_embeddings_model`: pixel_values [batch, 3, 32, 32] (CLIP-normalised by genai) -> one embedding
  per 8x8 patch, [batch, 16, HIDDEN]: genai expands each `<image>` tag to 16 image tokens and a newline;
* `openvino_text_embeddings_model`: input_ids -> [batch, seq, HIDDEN];
* `openvino_language_model`: the chat demo's stateful decoder (appliance.demo.llm) fed inputs_embeds instead of
  input_ids; config.json (model_type llava), preprocessor_config.json (CLIP sizes), tokenizer IRs with `<image>`.

What it answers (the contract tests rely on): exactly the chat demo's walk of two-word phrases (see
appliance.demo.llm), except that for a chat prompt that holds an image the answer's first phrase names the images'
dominant colour: "Red" (or "Green", "Blue", "Gray"), then one of "image:", "picture:", "photo:", "scene:" (the
chat demo's variant), e.g. "Red photo: calm lantern ...".  Two images of different colours get different answers
with the same prompt and seed, and a test can tell that the decoded pixels reached the model.  Without an image it
answers as the chat demo.  How it is wired:

* each embedding carries its token in fixed channels: channels 0 and 1 the token id's two base-32 digits (small
  integers stay exact where the CPU plugin computes in bf16, which rounds 1740 to 1744), channel 2 "is an image
  patch", channels 3-6 the patch's colour as one-hot (red, green, blue, gray: the channel
  furthest above the patch's mean, or gray when none is GRAY_MARGIN above it); the rest are random features;
* head 0 of the first layer is wired, not random: every token attends (causally, through the KV cache, so it
  works in batches and chunked prefill) almost only to image patches, and reads their colours' average;
* the token after a prompt token that ends a line (a chat prompt's last) is a line start, as in the chat demo,
  from the group of the colour that head read (a fifth group, the chat demo's own, without an image).  Only the
  group depends on the image, not the variant: under an output constraint (which bans phrases, so the model writes
  prompt-like tokens) the variant still changes with the position, and the model does not repeat one token forever.
"""

from __future__ import annotations

import pathlib

import numpy as np

from appliance.demo import llm
from appliance.demo.llm import HEAD_DIM, HEADS, HIDDEN, ops, write_json

IMAGE_TOKEN = "<image>"
SPECIAL_TOKENS = [*llm.SPECIAL_TOKENS, IMAGE_TOKEN]  # <image> = 3, as in the recipe LLaVA exports use
IMAGE_SIZE, PATCH = 32, 8
PATCHES = (IMAGE_SIZE // PATCH) ** 2  # image tokens per image
COLOURS = ("Red", "Green", "Blue", "Gray")  # a group of line starts each, then the chat demo's own group
NOUNS = ("image", "picture", "photo", "scene")  # one per variant of the chat demo's walk (llm.VARIANTS)
GRAY_MARGIN = 0.08  # a channel this far above the patch's mean RGB (0..1) makes it coloured, else gray
CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
TOKEN, IS_IMAGE, COLOUR = 0, 2, 3  # embedding channels: TOKEN, TOKEN + 1 the id's digits; COLOUR .. COLOUR + 4
DIGIT = 32
FEATURES = COLOUR + len(COLOURS)  # first random channel
BLANK_PENALTY = 100.0
IMAGE_SCORE = 160.0  # the wired head's key on a patch; x 1/sqrt(HEAD_DIM) = 40 logits over any text token

assert len(NOUNS) == llm.VARIANTS


def write_vlm_model(out: pathlib.Path, *, eos_after: int, max_new_tokens: int, seed: int,
                    logit_scale: float = llm.LOGIT_SCALE) -> None:
    """Write the model's files into the directory `out` (parameters as the chat demo's, llm.checked_params)."""
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    bpe_spec = llm._train_bpe(SPECIAL_TOKENS)
    phrases = _phrase_texts(rng, eos_after)
    tokenizer = llm._hf_tokenizer(bpe_spec, phrases)
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(ov_tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "openvino_detokenizer.xml")
    tokenizer.save_pretrained(out)
    image_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    ends_line = llm._bpe_ends_line(bpe_spec, SPECIAL_TOKENS)
    next_token = llm._next_token_table(ends_line, len(phrases), eos_after)
    vocab_size = len(next_token)
    ov.save_model(_text_embeddings(vocab_size, rng), out / "openvino_text_embeddings_model.xml")
    ov.save_model(_vision_embeddings(image_id, rng), out / "openvino_vision_embeddings_model.xml")
    blank = np.array([tokenizer.decode([i]).isspace() for i in range(vocab_size)])
    ov.save_model(_language_model(next_token, ends_line, blank, rng, logit_scale), out / "openvino_language_model.xml")
    write_json(out / "config.json", _hf_config(vocab_size, image_id))
    write_json(out / "preprocessor_config.json", {
        "image_processor_type": "CLIPImageProcessor", "do_resize": True, "size": {"shortest_edge": IMAGE_SIZE},
        "do_center_crop": True, "crop_size": {"height": IMAGE_SIZE, "width": IMAGE_SIZE}, "resample": 3,
        "do_rescale": True, "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": CLIP_MEAN,
        "image_std": CLIP_STD, "do_convert_rgb": True, "patch_size": PATCH,
    })
    write_json(out / "generation_config.json", {
        "eos_token_id": llm.EOS_ID, "pad_token_id": llm.PAD_ID, "max_new_tokens": max_new_tokens, "do_sample": False,
    })


def _phrase_texts(rng: np.random.Generator, eos_after: int) -> list[str]:
    """The chat demo's phrases, with a group of line starts (an answer's first phrase) per colour before its own."""
    texts = llm._phrase_texts(rng, eos_after)
    grid = len(texts) - llm.VARIANTS
    end = "." if eos_after == 1 else ""  # the phrase before a forced EOS ends the sentence, as in the chat demo
    colours = [f"{colour} {noun}:{end}" for colour in COLOURS for noun in NOUNS]
    return texts[:grid] + colours + texts[grid:]


def _hf_config(vocab_size: int, image_id: int) -> dict:
    text = llm._hf_config(vocab_size)
    return {
        "architectures": ["LlavaForConditionalGeneration"], "model_type": "llava", "torch_dtype": "float32",
        "image_token_index": image_id, "image_seq_length": PATCHES, "projector_hidden_act": "gelu",
        "vision_feature_select_strategy": "default", "vision_feature_layer": -2, "tie_word_embeddings": False,
        "text_config": text, "hidden_size": HIDDEN,
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "image_size": IMAGE_SIZE,
                          "patch_size": PATCH, "num_channels": 3, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "intermediate_size": 64, "projection_dim": 32},
    }


def _channels(*columns) -> list:
    return [ops.constant(np.asarray(c, np.float32)) for c in columns]


def _text_embeddings(vocab_size: int, rng: np.random.Generator):
    """input_ids -> embeddings: the token id's digits in channels TOKEN, TOKEN + 1, random features from FEATURES."""
    import openvino as ov

    table = np.zeros((vocab_size, HIDDEN), np.float32)
    table[:, TOKEN], table[:, TOKEN + 1] = np.divmod(np.arange(vocab_size), DIGIT)
    table[:, FEATURES:] = rng.normal(0.0, 1.0, (vocab_size, HIDDEN - FEATURES))
    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    result = ops.result(ops.gather(ops.constant(table), input_ids, 0))
    result.get_output_tensor(0).set_names({"inputs_embeds"})
    return ov.Model([result], [input_ids], "openarc-demo-vlm-text-embeddings")


def _vision_embeddings(image_id: int, rng: np.random.Generator):
    """pixel_values [batch, 3, 32, 32] -> [batch, 16, HIDDEN]: per 8x8 patch, the image token's id, the patch
    flag, the patch's colour (one-hot) and a random patch embedding (a strided convolution, as CLIP's)."""
    import openvino as ov

    pixels = ops.parameter([-1, 3, IMAGE_SIZE, IMAGE_SIZE], ov.Type.f32, name="pixel_values")
    std, mean = _channels(np.reshape(CLIP_STD, (1, 3, 1, 1)), np.reshape(CLIP_MEAN, (1, 3, 1, 1)))
    rgb = ops.add(ops.multiply(pixels, std), mean)  # back to 0..1
    patch_rgb = ops.avg_pool(rgb, [PATCH, PATCH], [0, 0], [0, 0], [PATCH, PATCH], True)  # [b, 3, 4, 4]
    patch_rgb = ops.transpose(ops.reshape(patch_rgb, [0, 3, PATCHES], special_zero=True), [0, 2, 1])  # [b, 16, 3]
    above_mean = ops.subtract(patch_rgb, ops.reduce_mean(patch_rgb, [2], True))
    gray = ops.add(ops.multiply(ops.reduce_sum(patch_rgb, [2], True), ops.constant(np.float32(0))),
                   ops.constant(np.float32(GRAY_MARGIN)))
    scores = ops.concat([above_mean, gray], 2)  # [b, 16, 4]
    colour = ops.topk(scores, ops.constant(np.int64(1)), 2, "max", "none", "i64").output(1)
    one_hot = ops.one_hot(ops.squeeze(colour, [2]), ops.constant(np.int64(len(COLOURS))),
                          ops.constant(np.float32(1)), ops.constant(np.float32(0)), -1)
    weight = rng.normal(0.0, (3 * PATCH * PATCH) ** -0.5, (HIDDEN - FEATURES, 3, PATCH, PATCH)).astype(np.float32)
    patches = ops.convolution(pixels, ops.constant(weight), [PATCH, PATCH], [0, 0], [0, 0], [1, 1])
    features = llm._rms_norm(ops.transpose(ops.reshape(patches, [0, HIDDEN - FEATURES, PATCHES], special_zero=True),
                                           [0, 2, 1]))
    marks = ops.add(ops.multiply(patch_rgb, ops.constant(np.float32(0))),
                    ops.constant(np.array([*divmod(image_id, DIGIT), 1.0], np.float32)))  # [b, 16, 3]: id, flag
    result = ops.result(ops.concat([marks, one_hot, features], 2))
    result.get_output_tensor(0).set_names({"last_hidden_state"})
    return ov.Model([result], [pixels], "openarc-demo-vlm-vision-embeddings")


class _ImageHead:
    """Head 0 of the first layer, wired: a constant query, a key that is IMAGE_SCORE on image patches and 0
    elsewhere, and values that carry the patch flag and colour; its output at any token is (about) the mean colour
    of the image patches before it, and its flag channel 1 if there were any."""

    def __init__(self, embeds):
        self.embeds = embeds
        self.output = None

    def qkv(self, q, k, v):
        zero = ops.multiply(ops.slice(self.embeds, [0], [HEAD_DIM], [1], [2]), ops.constant(np.float32(0)))
        query = np.zeros(HEAD_DIM, np.float32)
        query[0] = 1.0
        key, value = np.zeros((HIDDEN, HEAD_DIM), np.float32), np.zeros((HIDDEN, HEAD_DIM), np.float32)
        key[IS_IMAGE, 0] = IMAGE_SCORE
        for c in range(len(COLOURS)):
            value[COLOUR + c, c] = 1.0
        value[IS_IMAGE, len(COLOURS)] = 1.0
        wired = [ops.unsqueeze(t, [1]) for t in (ops.add(zero, ops.constant(query)),
                                                   ops.matmul(self.embeds, ops.constant(key), False, False),
                                                   ops.matmul(self.embeds, ops.constant(value), False, False))]
        return (ops.concat([w, ops.slice(r, [1], [HEADS], [1], [1])], 1) for w, r in zip(wired, (q, k, v)))

    def group(self):
        """[batch, seq] i64: the images' dominant colour (0..3), or 4 (the chat demo's group) where no image came
        before."""
        head = ops.squeeze(ops.slice(self.output, [0], [1], [1], [1]), [1])  # [b, seq, HEAD_DIM]
        colours = ops.slice(head, [0], [len(COLOURS)], [1], [2])
        best = ops.squeeze(ops.topk(colours, ops.constant(np.int64(1)), 2, "max", "none", "i64").output(1), [2])
        seen = ops.greater(ops.squeeze(ops.slice(head, [len(COLOURS)], [len(COLOURS) + 1], [1], [2]), [2]),
                           ops.constant(np.float32(0.5)))
        return ops.select(seen, best, ops.constant(np.int64(len(COLOURS))))


def _language_model(next_token: np.ndarray, ends_line: np.ndarray, blank: np.ndarray, rng: np.random.Generator,
                    logit_scale: float):
    """The chat demo's decoder on inputs_embeds (see the module doc), whose blank tokens (whitespace only) sit
    BLANK_PENALTY logits lower: the walk never picks them, and under an output constraint (JSON, a tool call) the
    model writes what the grammar allows other than blanks, where it would otherwise pick the same blank each step
    (a blank shares a code digit with the line starts it is steered to)."""
    import openvino as ov

    def weight(*shape, std=0.02):
        return ops.constant(rng.normal(0.0, std, shape).astype(np.float32))

    embeds = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="inputs_embeds")
    attention_mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    position_ids = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    high, low = (ops.convert(ops.round(ops.squeeze(ops.slice(embeds, [c], [c + 1], [1], [2]), [2]), "half_to_even"),
                             "i64") for c in (TOKEN, TOKEN + 1))
    input_ids = ops.clamp(ops.add(ops.multiply(high, ops.constant(np.int64(DIGIT))), low), 0, len(next_token) - 1)
    mask = llm._attention_mask(input_ids, attention_mask)
    head, caches = _ImageHead(embeds), []
    x = embeds
    for layer in range(llm.LAYERS):
        x = llm._decoder_layer(x, layer, mask, beam_idx, weight, caches, head if layer == 0 else None)
    # a line start's group: the colour's where the token ends a line (phrase tokens ignore the offset)
    ends = ops.gather(ops.constant(np.pad(ends_line, (0, len(next_token) - len(ends_line)))), input_ids, 0)
    group = ops.select(ends, ops.multiply(head.group(), ops.constant(np.int64(llm.VARIANTS))),
                       ops.constant(np.int64(0)))
    nxt = llm._next_token(input_ids, position_ids, next_token, len(ends_line), group)
    logits = ops.result(ops.add(llm._logits(x, nxt, len(next_token), len(ends_line), rng, logit_scale),
                                ops.constant(np.where(blank, -BLANK_PENALTY, 0.0).astype(np.float32))))
    logits.get_output_tensor(0).set_names({"logits"})
    return llm.stateful_model(logits, [embeds, attention_mask, position_ids, beam_idx], caches,
                              "openarc-demo-vlm-language", input_ids)

