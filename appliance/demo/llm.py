"""A tiny, deterministic LLM in OpenVINO IR, built from nothing (no model hub, no torch) in about a second.

`openarc serve` with no config serves it on CPU, and tests use it to drive real OpenVINO GenAI pipelines
(`LLMPipeline` on both attention backends, `ContinuousBatchingPipeline`) in seconds.

What it generates (the contract tests rely on)
----------------------------------------------
* Only "phrase" tokens, each two words: " amber river", or "Amber river" at the start of a line.  Their strings
  hold a space, and the byte-level pre-tokenizer splits text at spaces before BPE, so no text ever encodes to a
  phrase token: the model tells its own output from any text prompt.  Output is always printable.
* The next token depends only on the current token and its position, so it is the same on every attention
  backend, batch, chunked prefill or prefix-cache hit:
  - after a prompt token t at position p comes phrase (k=0, v) with variant v = (t + p) % 4, in its line-start
    form ("Amber river") if t is a special token or ends with whitespace (a chat prompt ends with "assistant\n");
  - after phrase (k, v) comes phrase (k + 1, v), or EOS (`<|im_end|>`, id 2) once k + 1 == eos_after; the phrase
    just before EOS ends with ".".
  So every request generates exactly `eos_after` text tokens and then EOS, i.e. finish reason "stop" with
  eos_after + 1 generated ids counting the EOS (GenAI's num_generated_tokens), whatever the prompt length; or
  fewer, with finish reason "length", if max_new_tokens is smaller.  eos_after=0 never forces EOS (the counter
  wraps after 256 phrases).  Sampling gives the same text as greedy (the chosen token leads by 64 logits), except
  in a build with a small `logit_scale` (1.0: the chosen token leads the phrases that share a code digit with it
  by one logit), whose samples vary with temperature and seed while greedy decoding still follows the walk.
  Different prompts (last token or length mod 4) give different texts; the same prompt always the same text.
* The two transformer layers have random (seeded) weights and do real work, attention over a real KV cache,
  so memory use and scheduling behave like a real model's; they move logits by less than 0.2.

LoRA adapters (`write_adapter`, `openarc demo-model --adapter FAMILY`)
---------------------------------------------------------------------
Every MatMul is named as a Hugging Face Llama export names its linear layers (`model.layers.N.self_attn.q_proj`,
..., `lm_head`), which is what OpenVINO GenAI matches a PEFT adapter's tensor names against.  The vocabulary also
holds, for each of FAMILIES, a copy of every phrase written in that family's style (" AMBER RIVER" for "upper",
" Amber River" for "title"), which the base model never emits: a family phrase is followed by what follows its
plain phrase.  A family's adapter is a LoRA on `lm_head` (rank = the code width) that swaps the codes of the plain
phrases and the family's, so with the adapter applied (weight 1) every phrase of the walk comes in the family's
style: same walk, same length, same finish, and words a test can tell at a glance (`upper`: the answer is
upper case; `title`: every word starts upper case).  Without the adapter the answer is the base's.
"""

from __future__ import annotations

import copy
import json
import pathlib

import numpy as np

# Bump when the model's construction changes, so cached builds of an older recipe are not reused.
BUILD_FORMAT = 4  # 2: the chat template renders tools; 3: a window of 128k tokens; 4: LoRA-matchable names and the
#                  adapters' phrase families

HIDDEN, LAYERS, HEADS, MLP_HIDDEN = 64, 2, 4, 128
HEAD_DIM = HIDDEN // HEADS
# The window the demo declares (config.json), which openarc serves when max_context is unset. Its tokenizer packs
# about 1.5 bytes a token, so an agent's prompt is 2-3 times longer than with a real one (Claude Code's is about
# 75k demo tokens): 128k fits real clients' prompts. Its KV cache is 384 bytes a token at u8 (2 layers, 4 kv heads
# of 16), 48 MiB for one full window: a 2-core box with 24 GB holds it many times over.
MAX_POSITIONS = 131072
BPE_VOCAB = 1024  # at most: the small corpus gives about 715 (256 bytes, 3 specials, merges)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_ID, EOS_ID = 0, 2
CLOCK, VARIANTS = 256, 4  # phrase tokens: CLOCK counter states x VARIANTS
LOGIT_SCALE = 64.0  # the chosen token beats any other by at least this many logits
PHRASE_BONUS = 8.0  # if the chosen token is banned (e.g. EOS under min_tokens), a phrase token still wins
# ChatML, and tools the way Qwen2.5/Qwen3 templates render them: a system turn listing the tools, assistant
# tool calls as <tool_call>{"name", "arguments"}</tool_call>, tool results as <tool_response> in a user turn.
# Without tools a conversation renders as plain ChatML, as before tools were added.
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\n' }}"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\n\n' }}{%- endif %}"
    "{{ '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}"
    "{%- for tool in tools %}{{ '\n' }}{{ tool | tojson }}{%- endfor %}"
    "{{ '\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}"
    "\n</tool_call><|im_end|>\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and tools and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{{ '<|im_start|>assistant\n' + (message.content or '') }}"
    "{%- for call in message.tool_calls %}"
    "{%- if call.function %}{%- set call = call.function %}{%- endif %}"
    "{%- if not loop.first or message.content %}{{ '\n' }}{%- endif %}"
    "{{ '<tool_call>\n{\"name\": \"' + call.name + '\", \"arguments\": ' }}"
    "{%- if call.arguments is string %}{{ call.arguments }}{%- else %}{{ call.arguments | tojson }}{%- endif %}"
    "{{ '}\n</tool_call>' }}{%- endfor %}{{ '<|im_end|>\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{%- endif %}"
    "{{ '\n<tool_response>\n' + message.content + '\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\n' }}{%- endif %}"
    "{%- else %}{{ '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{%- endif %}"
)
# The adapters' phrase styles (a plain phrase's text -> its family's), in vocabulary order after the plain phrases.
FAMILIES = {
    "upper": str.upper,
    "title": lambda text: " ".join(word[:1].upper() + word[1:] for word in text.split(" ")),
}
ADJECTIVES = (
    "amber brave calm dapper eager faint gentle hollow idle jolly keen lucid mellow noble olive patient quiet rapid "
    "silver tidy umber vivid warm young zesty bright cosy distant early frosty golden humble"
).split()
NOUNS = (
    "river lamp stone meadow harbor lantern garden valley comet kettle orchard pebble canyon window forest island "
    "ribbon engine candle beacon willow marble thistle compass feather glacier tunnel anchor basket cedar falcon pier"
).split()

CORPUS = [
    "openarc serves large language models on Intel Arc GPUs through OpenVINO GenAI. "
    "It speaks the OpenAI API: chat completions, completions and model listing. "
    "Each model runs in its own worker process, and a supervisor restarts a worker that crashes or hangs. "
    "This tiny demo model answers every prompt with a short walk through words such as "
    + " ".join(f"{a} {n}," for a, n in zip(ADJECTIVES, NOUNS))
    + " and then it stops. Numbers 0 1 2 3 4 5 6 7 8 9 10 42 100 2048; "
    "punctuation: . , ; : ! ? ( ) [ ] { } ' \" - + = / * # @ & %.",
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs. "
    "Hello, world! How are you today? I am fine, thank you. What is the weather like? It is sunny and warm.",
]


class _LazyOpset:
    """openvino.opset13, imported on first use: `openarc demo-model` on a cache hit never loads OpenVINO."""

    def __getattr__(self, name):
        from openvino import opset13

        return getattr(opset13, name)


ops = _LazyOpset()


def checked_params(*, eos_after: int = 48, max_new_tokens: int = 64, seed: int = 0,
                    logit_scale: float = LOGIT_SCALE, layers: int = LAYERS, draft_miss: int = 0,
                    prompt_phrases: bool = False) -> dict:
    if not 0 <= eos_after <= CLOCK:
        raise ValueError(f"eos_after must be in 0..{CLOCK}, got {eos_after}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
    if not 0 < logit_scale <= LOGIT_SCALE:
        raise ValueError(f"logit_scale must be in (0, {LOGIT_SCALE:g}], got {logit_scale}")
    if not 1 <= layers <= 64:
        raise ValueError(f"layers must be in 1..64, got {layers}")
    if draft_miss < 0:
        raise ValueError(f"draft_miss must be 0 (never) or a positive period, got {draft_miss}")
    params = {"eos_after": int(eos_after), "max_new_tokens": int(max_new_tokens), "seed": int(seed)}
    # Defaults stay out of the marker, which keeps the cache path of builds made before each knob existed.
    if logit_scale != LOGIT_SCALE:
        params["logit_scale"] = float(logit_scale)
    if layers != LAYERS:
        params["layers"] = int(layers)
    if draft_miss:
        params["draft_miss"] = int(draft_miss)
    if prompt_phrases:
        params["prompt_phrases"] = True
    return params


def _write_model_files(out: pathlib.Path, *, eos_after: int, max_new_tokens: int, seed: int,
                       logit_scale: float = LOGIT_SCALE, layers: int = LAYERS, draft_miss: int = 0,
                       prompt_phrases: bool = False) -> None:
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    bpe_spec = _train_bpe()
    plain = _phrase_texts(rng, eos_after)
    phrases = plain + [style(text) for style in FAMILIES.values() for text in plain]
    hf_tokenizer = _hf_tokenizer(bpe_spec, phrases, prompt_phrases)
    vocab_size = len(hf_tokenizer)
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(hf_tokenizer, with_detokenizer=True)
    ov.save_model(ov_tokenizer, out / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "openvino_detokenizer.xml")
    hf_tokenizer.save_pretrained(out)
    bpe_ends_line = _bpe_ends_line(bpe_spec)
    next_token = _next_token_table(bpe_ends_line, len(plain), eos_after, draft_miss)
    # A family phrase is followed by what follows its plain phrase (which an adapter turns into the family's), and
    # shares its plain twin's embedding and nudge: the random draws are those of the model without families, so
    # the base answers as it did before they existed, constrained answers included.
    plain_ids = np.arange(len(next_token))
    twin_of = np.concatenate([plain_ids, *(plain_ids[-len(plain):] for _ in FAMILIES)])
    next_token = next_token[twin_of]
    ov.save_model(_build_llm(next_token, len(bpe_ends_line), rng, logit_scale, layers, twin_of),
                  out / "openvino_model.xml")
    write_json(out / "config.json", _hf_config(vocab_size, layers))
    write_json(out / "generation_config.json", {
        "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "max_new_tokens": max_new_tokens, "do_sample": False,
    })


def write_json(path: pathlib.Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _hf_config(vocab_size: int, layers: int = LAYERS) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32",
        "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": MLP_HIDDEN,
        "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": HEADS, "head_dim": HEAD_DIM,
        "max_position_embeddings": MAX_POSITIONS, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "bos_token_id": None,
        "tie_word_embeddings": False,
    }


# --- tokenizer -------------------------------------------------------------------------------------------------

def _phrase_slot(i: int) -> tuple[int, int]:
    """(counter k, variant v) of phrase i: first the CLOCK x VARIANTS grid (i = k * VARIANTS + v), then
    VARIANTS line-start forms of phrase (0, v), used when the prompt ends with whitespace or a special token (the
    demo VLM has several groups of VARIANTS line starts: v counts within a group)."""
    return divmod(i, VARIANTS) if i < CLOCK * VARIANTS else (0, (i - CLOCK * VARIANTS) % VARIANTS)


def _phrase_texts(rng: np.random.Generator, eos_after: int) -> list[str]:
    """Text of each phrase token (distinct strings): " quiet river", line starts "Quiet river", and a '.' after
    the phrase that precedes the forced EOS."""
    pairs = [f"{a} {n}" for a in ADJECTIVES for n in NOUNS]
    assert len(pairs) == CLOCK * VARIANTS
    order = rng.permutation(len(pairs))
    texts = [" " + pairs[j] for j in order] + [pairs[j].capitalize() for j in order[:VARIANTS]]
    return [text + "." if _phrase_slot(i)[0] + 1 == eos_after else text for i, text in enumerate(texts)]


def _train_bpe(specials: list[str] = SPECIAL_TOKENS) -> dict:
    """Byte-level BPE (specials first, so <|endoftext|> = 0, <|im_start|> = 1, <|im_end|> = 2) trained on CORPUS;
    returns the `tokenizers` JSON spec.  Training on a fixed corpus is deterministic."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=BPE_VOCAB, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(CORPUS, trainer)
    return json.loads(bpe.to_str())


def _bpe_ends_line(bpe_spec: dict, specials: list[str] = SPECIAL_TOKENS) -> np.ndarray:
    """For each BPE token id: is it a special token, or does its text end with whitespace?"""
    byte_of = {c: b for b, c in _bytes_to_unicode().items()}
    ends_line = np.zeros(len(bpe_spec["model"]["vocab"]), dtype=bool)
    for token, i in bpe_spec["model"]["vocab"].items():
        ends_line[i] = token in specials or bytes([byte_of[token[-1]]]).isspace()
    return ends_line


def _hf_tokenizer(bpe_spec: dict, phrases: list[str], prompt_phrases: bool = False):
    """The trained BPE plus the phrase tokens, as a transformers tokenizer (ChatML template, left padding).

    With `prompt_phrases` the phrases are also added tokens, matched in text before BPE: the model's own answer,
    pasted into a prompt, encodes to the phrase tokens it was generated as, so an answer can repeat its prompt
    token for token (what prompt-lookup decoding speeds up)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = copy.deepcopy(bpe_spec)
    vocab = spec["model"]["vocab"]
    byte_chars = _bytes_to_unicode()
    base = len(vocab)
    for i, phrase in enumerate(phrases):
        if prompt_phrases:  # an added token, matched in text before BPE (the same id)
            spec["added_tokens"].append({"id": base + i, "content": phrase, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": False})
        else:  # in the vocabulary but made by no merge (BPE never sees text across a space): decoded, never encoded
            vocab["".join(byte_chars[b] for b in phrase.encode())] = base + i
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)), eos_token="<|im_end|>", pad_token="<|endoftext|>",
        padding_side="left", model_max_length=MAX_POSITIONS,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


# --- model -----------------------------------------------------------------------------------------------------

def _next_token_table(bpe_ends_line: np.ndarray, phrase_count: int, eos_after: int, draft_miss: int = 0) -> np.ndarray:
    """next[t] for every token id t.  A phrase's successor is phrase (k + 1, v), or EOS when k + 1 == eos_after.
    For a prompt token it is the first of the VARIANTS phrases to start from (the graph adds the variant):
    the line-start forms after whitespace or a special token, else the grid's k = 0 row.

    `draft_miss` N > 0 builds a draft that guesses wrong now and then: the successor of every phrase whose next
    counter is a multiple of N takes the next variant instead, so a model with the plain walk accepts about
    N - 1 of every N of its guesses."""
    base = len(bpe_ends_line)
    line_starts = base + CLOCK * VARIANTS
    table = np.where(bpe_ends_line, line_starts, base).astype(np.int64)
    successors = []
    for i in range(phrase_count):
        k, v = _phrase_slot(i)
        if draft_miss and (k + 1) % draft_miss == 0:
            v = (v + 1) % VARIANTS
        successors.append(EOS_ID if k + 1 == eos_after else base + (k + 1) % CLOCK * VARIANTS + v)
    return np.concatenate([table, np.array(successors, dtype=np.int64)])


def _token_codes(vocab_size: int) -> np.ndarray:
    """Code vectors with code(i).code(i) = 2 and code(i).code(j) <= 1 for i != j: two one-hot digits base 64."""
    ids = np.arange(vocab_size)
    high = np.eye(-(-vocab_size // 64), dtype=np.float32)[ids // 64]
    low = np.eye(64, dtype=np.float32)[ids % 64]
    return np.concatenate([high, low], axis=1)


def _build_llm(next_token: np.ndarray, phrase_base: int, rng: np.random.Generator, logit_scale: float = LOGIT_SCALE,
               layers: int = LAYERS, twin_of: np.ndarray | None = None):
    """Llama-like stateful decoder with the inputs, outputs and KV-cache pattern GenAI expects (so it also
    converts to PagedAttention), whose logits pick `_next_token`'s choice by a wide margin."""
    import openvino as ov

    def weight(*shape, std=0.02):
        return ops.constant(rng.normal(0.0, std, shape).astype(np.float32))

    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    attention_mask = ops.parameter([-1, -1], ov.Type.i64, name="attention_mask")
    position_ids = ops.parameter([-1, -1], ov.Type.i64, name="position_ids")
    beam_idx = ops.parameter([-1], ov.Type.i32, name="beam_idx")
    twin_of = np.arange(len(next_token)) if twin_of is None else twin_of  # token -> the token whose rows it shares
    embedding = rng.normal(0.0, 1.0, (twin_of.max() + 1, HIDDEN)).astype(np.float32)[twin_of]
    x = ops.gather(ops.constant(embedding), input_ids, 0)
    mask = _attention_mask(input_ids, attention_mask)
    caches = []  # (past_key_values.N.* parameter, present.N.* result)
    for layer in range(layers):
        x = _decoder_layer(x, layer, mask, beam_idx, weight, caches)
    nxt = _next_token(input_ids, position_ids, next_token, phrase_base)
    logits = ops.result(_logits(x, nxt, len(next_token), phrase_base, rng, logit_scale, twin_of))
    logits.get_output_tensor(0).set_names({"logits"})

    return stateful_model(logits, [input_ids, attention_mask, position_ids, beam_idx], caches, "openarc-demo",
                          input_ids)


def stateful_model(logits, inputs: list, caches: list, name: str, batch_of):
    """The model of `logits` over `inputs` and the KV-cache (parameter, result) pairs of `caches`, made stateful as
    GenAI expects (the caches become states that start empty, their batch taken from `batch_of`)."""
    import openvino as ov
    from openvino._offline_transformations import apply_make_stateful_transformation

    model = ov.Model([logits, *(result for _, result in caches)], [*inputs, *(past for past, _ in caches)], name)
    apply_make_stateful_transformation(model, {
        past.get_friendly_name(): result.get_output_tensor(0).get_any_name() for past, result in caches})
    _zero_initial_state(model, batch_of)
    return model


def _decoder_layer(x, layer: int, mask, beam_idx, weight, caches: list, head=None):
    """Pre-norm attention + SwiGLU MLP; appends this layer's KV-cache (parameter, result) pairs to `caches`.
    `head`, if given, replaces some heads' queries, keys and values (head.qkv) and is handed the attention's
    output (head.output): the demo VLM's image-reading head (appliance.demo.vlm)."""
    name = f"model.layers.{layer}."
    h = _rms_norm(x)
    q, k, v = (_split_heads(linear(h, weight(HIDDEN, HIDDEN, std=HIDDEN ** -0.5), f"{name}self_attn.{p}_proj"))
               for p in "qkv")
    if head is not None:
        q, k, v = head.qkv(q, k, v)
    keys_values = _kv_cache(k, v, str(layer), beam_idx, caches)
    attn = ops.scaled_dot_product_attention(q, *keys_values, mask, causal=False)
    if head is not None:
        head.output = attn
    x = ops.add(x, linear(_merge_heads(attn), weight(HIDDEN, HIDDEN), f"{name}self_attn.o_proj"))
    h = _rms_norm(x)
    gate = ops.swish(linear(h, weight(MLP_HIDDEN, HIDDEN, std=HIDDEN ** -0.5), f"{name}mlp.gate_proj"))
    up = linear(h, weight(MLP_HIDDEN, HIDDEN, std=HIDDEN ** -0.5), f"{name}mlp.up_proj")
    return ops.add(x, linear(ops.multiply(gate, up), weight(HIDDEN, MLP_HIDDEN), f"{name}mlp.down_proj"))


def linear(x, weight, name: str):
    """x @ weight.T (weight [out, in], as torch.nn.Linear), named as a Hugging Face export names the layer: OpenVINO
    GenAI applies a LoRA tensor `base_model.model.<name>.lora_A.weight` to the MatMul whose name holds <name>."""
    node = ops.matmul(x, weight, False, True)
    node.set_friendly_name(name)
    return node


def _logits(x, nxt, vocab_size: int, phrase_base: int, rng: np.random.Generator, logit_scale: float = LOGIT_SCALE,
            twin_of: np.ndarray | None = None):
    """One MatMul (the shape GenAI slices to the last token).  Row i of `choose` (scaled code, PHRASE_BONUS)
    meets row j of `lm_head` (code, is-phrase flag, random weights) as
    logit_scale * (2 if i == j else <= 1) + PHRASE_BONUS * (j is a phrase) + a transformer nudge below 0.2."""
    codes = _token_codes(vocab_size)
    is_phrase = (np.arange(vocab_size) >= phrase_base).astype(np.float32)[:, None]
    choose = np.concatenate([logit_scale * codes, np.full_like(is_phrase, PHRASE_BONUS)], 1)
    twin_of = np.arange(vocab_size) if twin_of is None else twin_of
    nudge = rng.normal(0.0, HIDDEN ** -0.5, (twin_of.max() + 1, HIDDEN)).astype(np.float32)[twin_of]
    lm_head = np.concatenate([codes, is_phrase, nudge], 1)
    nudge_features = ops.multiply(_rms_norm(x), ops.constant(np.float32(1 / 64)))
    features = ops.concat([ops.gather(ops.constant(choose), nxt, 0), nudge_features], -1)
    return linear(features, ops.constant(lm_head), "lm_head")


def _next_token(input_ids, position_ids, next_token: np.ndarray, phrase_base: int, extra_offset=None):
    """Token id to emit after each input token: next_token[t], plus for a prompt token the variant (t + p) % VARIANTS
    (p its position), so the answer varies with the prompt's last token and length; plus `extra_offset` for prompt
    tokens where given (the demo VLM's choice of line-start group)."""
    variant = ops.floor_mod(ops.add(input_ids, position_ids), ops.constant(np.int64(VARIANTS)))
    if extra_offset is not None:
        variant = ops.add(variant, extra_offset)
    is_phrase = ops.greater_equal(input_ids, ops.constant(np.int64(phrase_base)))
    offset = ops.select(is_phrase, ops.constant(np.int64(0)), variant)
    return ops.add(ops.gather(ops.constant(next_token), input_ids, 0), offset)


def _attention_mask(input_ids, attention_mask):
    """Boolean [batch, 1, new, total] mask: causal over past + new tokens, minus padding, always letting a token
    see itself (so a padded row never turns NaN and poisons the KV cache).  (SDPA's own causal flag aligns the
    mask top-left, wrong once there is a past.)"""
    total = ops.gather(ops.shape_of(attention_mask), ops.constant(1), ops.constant(0))
    new = ops.gather(ops.shape_of(input_ids), ops.constant(1), ops.constant(0))
    one = ops.constant(np.int64(1))
    rows = ops.unsqueeze(ops.range(ops.subtract(total, new), total, one, "i64"), [1])  # absolute query positions
    cols = ops.unsqueeze(ops.range(ops.constant(np.int64(0)), total, one, "i64"), [0])
    not_padding = ops.unsqueeze(ops.not_equal(attention_mask, ops.constant(np.int64(0))), [1, 2])
    visible = ops.logical_and(ops.less_equal(cols, rows), not_padding)
    return ops.logical_or(visible, ops.equal(cols, rows))


def _kv_cache(k, v, layer: str, beam_idx, caches: list) -> list:
    """[past + new keys, past + new values], the past (a state once the model is made stateful) reordered by
    beam_idx; appends each (past_key_values.<layer>.key|value parameter, present.<layer>.* result) to `caches`."""
    import openvino as ov

    keys_values = []
    for kind, new in (("key", k), ("value", v)):
        past = ops.parameter([-1, HEADS, -1, HEAD_DIM], ov.Type.f32, name=f"past_key_values.{layer}.{kind}")
        full = ops.concat([ops.gather(past, beam_idx, 0), new], 2)
        present = ops.result(full)
        present.get_output_tensor(0).set_names({f"present.{layer}.{kind}"})
        caches.append((past, present))
        keys_values.append(full)
    return keys_values


def _merge_heads(x):
    """[batch, HEADS, seq, HEAD_DIM] -> [batch, seq, HIDDEN]"""
    return ops.reshape(ops.transpose(x, [0, 2, 1, 3]), [0, 0, HIDDEN], special_zero=True)


def _rms_norm(x):
    mean_square = ops.reduce_mean(ops.multiply(x, x), [-1], True)
    return ops.divide(x, ops.sqrt(ops.add(mean_square, ops.constant(np.float32(1e-6)))))


def _split_heads(x):
    """[batch, seq, HIDDEN] -> [batch, HEADS, seq, HEAD_DIM]"""
    return ops.transpose(ops.reshape(x, [0, 0, HEADS, HEAD_DIM], special_zero=True), [0, 2, 1, 3])


def _zero_initial_state(model, input_ids) -> None:
    """Each KV state starts as an empty [batch, HEADS, 0, HEAD_DIM] tensor (batch taken from input_ids)."""
    batch = ops.gather(ops.shape_of(input_ids), ops.constant([0]), ops.constant(0))
    shape = ops.concat([batch, ops.constant(np.array([HEADS, 0, HEAD_DIM], dtype=np.int64))], 0)
    for op in model.get_ops():
        if op.get_type_name() == "ReadValue":
            op.set_arguments([ops.broadcast(ops.constant(np.float32(0.0)), shape)])
    model.validate_nodes_and_infer_types()


# --- adapters --------------------------------------------------------------------------------------------------

ADAPTER_FILE = "adapter_model.safetensors"  # the PEFT layout: this file and adapter_config.json in one directory
PHRASES = CLOCK * VARIANTS + VARIANTS  # plain phrase tokens: the grid and the line starts (_phrase_texts)


def write_adapter(model_dir: pathlib.Path, out: pathlib.Path, family: str) -> pathlib.Path:
    """Write the LoRA adapter of phrase family `family` (a FAMILIES key) for the demo model in `model_dir` into the
    directory `out` (PEFT layout, what genai's Adapter reads); returns the safetensors file's path.

    The adapter is exact: lm_head's code columns gain codes[swap] - codes, which swaps the codes of each plain
    phrase and its family twin (lora_A picks the code features, lora_B holds the difference), so the logits of the
    adapted model are the base's with those two tokens' places exchanged."""
    from safetensors.numpy import save_file

    if family not in FAMILIES:
        raise ValueError(f"unknown adapter family {family!r}: one of {', '.join(FAMILIES)}")
    vocab_size = json.loads((pathlib.Path(model_dir) / "config.json").read_text())["vocab_size"]
    phrase_base = vocab_size - (1 + len(FAMILIES)) * PHRASES
    twin_base = phrase_base + (1 + list(FAMILIES).index(family)) * PHRASES
    swap = np.arange(vocab_size)
    plain, twins = np.arange(phrase_base, phrase_base + PHRASES), np.arange(twin_base, twin_base + PHRASES)
    swap[plain], swap[twins] = twins, plain
    codes = _token_codes(vocab_size)
    rank, in_features = codes.shape[1], codes.shape[1] + 1 + HIDDEN  # lm_head's input: code, phrase bonus, nudge
    lora_a = np.eye(rank, in_features, dtype=np.float32)
    lora_b = codes[swap] - codes
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({"base_model.model.lm_head.lora_A.weight": lora_a, "base_model.model.lm_head.lora_B.weight": lora_b},
              str(out / ADAPTER_FILE))
    write_json(out / "adapter_config.json", {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": rank, "target_modules": ["lm_head"],
        "base_model_name_or_path": "openarc-demo", "openarc_demo_family": family,
    })
    return out / ADAPTER_FILE
