"""A tiny Stable-Diffusion-1.5-shaped image model in OpenVINO IR, built from nothing (no model hub, no torch), and a
LoRA adapter for it.

`openarc demo-model --kind image DIR` writes it, its adapter included (appliance.demo.catalog builds and caches it;
`--adapter` prints the adapter's path, ADAPTER_PATH in the model's directory); tests serve it with real genai
pipelines on CPU.  It has the layout an optimum export of a diffusers StableDiffusionPipeline has, and the inputs,
outputs and config fields genai's Stable Diffusion support reads (src/cpp/src/image_generation in openvino.genai),
so `Text2ImagePipeline`, `Image2ImagePipeline` and `InpaintingPipeline` all load the one directory:

* model_index.json (StableDiffusionPipeline: genai's defaults are 50 steps, guidance_scale 7.5, strength 0.8 for
  image to image and 1.0 for inpainting); scheduler/scheduler_config.json: DDIM, epsilon prediction, SD's
  scaled-linear betas, "trailing" timesteps (so one step starts from pure noise), set_alpha_to_one;
* tokenizer/: an uncased WordPiece tokenizer (IRs and its transformers files) whose vocabulary holds the colour
  names, common picture words and every letter, so any text tokenizes;
* text_encoder/openvino_model.xml: input_ids [batch, 77] -> last_hidden_state [batch, 77, HIDDEN];
* unet/openvino_model.xml: sample [batch, 4, h, w], timestep [1] (i64), encoder_hidden_states [batch, 77, HIDDEN]
  -> out_sample, the predicted noise; sample_size 8: genai's default picture is 64 x 64;
* vae_decoder/openvino_model.xml: latent_sample [batch, 4, h, w] -> sample [batch, 3, 8h, 8w] in [-1, 1];
  vae_encoder/openvino_model.xml: sample [batch, 3, H, W] -> latent_sample [batch, 4, H/8, W/8].  Both configs
  say scaling_factor LATENT_SCALE: genai multiplies encoded latents by it and divides by it before decoding.

What it draws (the contract tests rely on)
------------------------------------------
* A flat picture of the colour the prompt names: PALETTE's words (red, green, blue, yellow, cyan, magenta,
  orange, purple, white, black, gray), matched as whole words in any case ("Red," counts, "reddish" does not).
  Every channel is 0, 255 or (for orange's green and purple's red and blue) about 128.  A prompt naming no colour
  gives gray; several colours average ("red and yellow" is orange, "red and blue" purple).  Only the first 77
  tokens count (CLIP's limit; genai truncates).
* guidance_scale above 1 (the default 7.5) runs classifier-free guidance as usual: the negative prompt's colour
  is pushed away from ("gray" with negative_prompt "red" comes out cyan); a palette colour stays itself.
* The seed: the same seed gives the same bytes.  The sampler's noise leaves a faint grain of a few levels in
  channels near 128 (gray, orange's green), so another seed changes those pixels but never the colour; channels at
  0 or 255 are exact.  With 1 step there is no grain at all.
* Steps: genai runs num_inference_steps denoising steps (one unet call and one step callback each).  Each step
  does STEP_WORK products of WORK_SIZE-square matrices (a build parameter, `step_work`; their result moves the
  noise by under 1e-6): about 1 ms on an idle CPU core, so 50 steps at 64 x 64 take well under a second, and a
  step outlasts a cheap callback.  genai runs the callback on a thread of its own and drops the callbacks still
  queued when the last step ends, so a callback slower than a step misses some (tests that count steps need
  steps slower than their callback: raise step_work).
* Image to image: the picture mixes the input picture's colours (per 8 x 8 block) with the prompt's, more of
  the prompt the higher `strength`: the unet denoises towards the prompt's colour only at timesteps from
  COLOUR_FROM up, and keeps the latent at lower ones.  A strength whose first step lies below COLOUR_FROM (up to
  0.5) gives the input picture back (within a level or two); from about 0.9 (and at guidance 7.5 from about
  0.6) the prompt's colour alone.  In between both show: a red picture, prompt "blue", guidance_scale 1, 50
  steps: (162, 0, 92) at strength 0.6, (91, 0, 163) at 0.7, (37, 0, 217) at 0.8.  genai refuses a strength whose
  share of the steps rounds down to none (e.g. 4 steps at strength 0.2).
* Inpainting: where the mask is white the prompt's colour is painted as text to image would; where it is black the
  input picture stays (genai blends the latents; the mask is read per 8 x 8 block).
* The adapter (write_adapter): a rank-1 LoRA on the text encoder that swaps the red and blue channels of the
  colour each word names: at weight 1, "red" draws blue and "blue" red (yellow <-> cyan, orange <-> azure (0,
  128, 255)); green, white, black and gray are unchanged; weight 0.5 draws purple for "red".  Without it (or at
  weight 0) the base colours are back.  Kohya's key layout ("lora_te_text_model_encoder_layers_0_mlp_fc2.
  lora_down.weight", lora_up, alpha), the one genai maps onto a Stable Diffusion text encoder.

How it is wired: each token's embedding carries its colour name's RGB in [-1, 1] (channels 0-2) and a flag
(channel 3), zeroed when the next token continues the word; one linear layer (identity, named as CLIP's
layers.0.mlp.fc2, where the adapter attaches) gives last_hidden_state.  The unet averages the flagged colours over
the prompt into a target latent COLOUR_GAIN x LATENT_SCALE x RGB (a fourth channel 0) and predicts the noise
that DDIM needs to reach it: (sample - sqrt(alpha_t) target) / sqrt(1 - alpha_t) for timesteps from COLOUR_FROM,
0 below (the latent stays).  The decoder takes the latent's first three channels as RGB and repeats each over an
8 x 8 block; the encoder averages 8 x 8 blocks.  The target lies COLOUR_GAIN times past the colour, so what is
left of the start latent (at most SIGMA(COLOUR_FROM - 1) / SIGMA(999), a ninth, from a first step at 999) never
moves a saturated channel off 0 or 255.
"""

from __future__ import annotations

import pathlib

import numpy as np

from appliance.demo.llm import ops, write_json

# Colours by name, as RGB in diffusers' [-1, 1] (pixel = (v + 1) / 2 x 255): corners and edge midpoints of the
# cube only, which guidance's extrapolation (and the clip to [-1, 1]) leaves as they are.
PALETTE = {
    "red": (1, -1, -1), "green": (-1, 1, -1), "blue": (-1, -1, 1),
    "yellow": (1, 1, -1), "cyan": (-1, 1, 1), "magenta": (1, -1, 1),
    "orange": (1, 0, -1), "purple": (0, -1, 0),
    "white": (1, 1, 1), "black": (-1, -1, -1), "gray": (0, 0, 0), "grey": (0, 0, 0),
}
# Common picture words, whole tokens so prompts stay short in tokens (any other word is spelt in letters).
WORDS = """a an the of and or with in on at to from by for is are it its this that photo photograph picture image
painting drawing sketch illustration render portrait landscape scene view close up background foreground light
dark bright pale deep vivid colour color colored coloured big small large tiny tall little old new beautiful
cat dog bird fish horse cow car bus train boat ship plane house home tree forest flower flowers rose grass field
sky sea ocean lake river water sun moon star stars cloud clouds rain snow mountain hill city street road garden
ball box cup apple banana fruit square circle wall door window room table chair book hat dress shirt shoe
man woman child person face people cartoon style art digital oil watercolor high quality detailed simple flat
""".split()
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
MAX_TOKENS = 77  # CLIP's max_position_embeddings: genai pads or cuts every prompt to it
HIDDEN = 32  # the text encoder's width (cross_attention_dim)
COLOUR, FLAG, FEATURES = 0, 3, 4  # embedding channels: COLOUR .. COLOUR + 2 the RGB, FLAG, then random features
LATENT_CHANNELS, VAE_SCALE = 4, 8  # as Stable Diffusion's VAE: 4 channels, 8 x 8 pixels a latent
SAMPLE_SIZE = 8  # latents: genai's default picture is 64 x 64
# Latent units per RGB unit (the VAE's scaling_factor): the sampler's noise (standard normal, scaled by at most
# SIGMA(COLOUR_FROM - 1) where it survives) is a faint grain beside the colours.
LATENT_SCALE = 100.0
COLOUR_GAIN = 1.5  # the unet aims past the colour: the decoder's clip makes saturated channels exact
COLOUR_FROM = 500  # timesteps at or above this denoise towards the prompt's colour; below, the latent stays
TRAIN_TIMESTEPS, BETA_START, BETA_END = 1000, 0.00085, 0.012  # Stable Diffusion 1.5's schedule
# Each denoising step's cost: STEP_WORK products of WORK_SIZE-square matrices, a few milliseconds on a CPU, so a
# step outlasts genai's step callback, which runs on a thread of its own and is dropped for steps that end first
# (ThreadedCallbackWrapper: a generation's end discards the callbacks still queued).
STEP_WORK, WORK_SIZE = 4, 256
LORA_LAYER = "text_model.encoder.layers.0.mlp.fc2"  # CLIP's name for the linear layer the adapter changes
ADAPTER_PATH = "adapters/swap-red-blue.safetensors"  # the adapter, inside the model's directory


def alphas_cumprod() -> np.ndarray:
    """The scaled-linear schedule's cumulative alphas, as genai's DDIMScheduler computes them."""
    betas = np.linspace(BETA_START ** 0.5, BETA_END ** 0.5, TRAIN_TIMESTEPS, dtype=np.float32) ** 2
    return np.cumprod(1.0 - betas.astype(np.float64)).astype(np.float32)


def SIGMA(timestep: int) -> float:  # noqa: N802 (the docstring's notation)
    """The noise-to-signal ratio sqrt((1 - alpha) / alpha) at `timestep`."""
    alpha = float(alphas_cumprod()[timestep])
    return ((1 - alpha) / alpha) ** 0.5


def checked_params(*, seed: int = 0, step_work: int = STEP_WORK) -> dict:
    if not 0 <= step_work <= 1024:
        raise ValueError(f"step_work must be in 0..1024, got {step_work}")
    return {"seed": int(seed), "step_work": int(step_work)}


def write_image_model(out: pathlib.Path, *, seed: int, step_work: int = STEP_WORK) -> None:
    """Write the model's directories and files into the directory `out`; `step_work` as STEP_WORK."""
    import openvino as ov
    import openvino_tokenizers

    rng = np.random.default_rng(seed)
    for sub in ("scheduler", "tokenizer", "text_encoder", "unet", "vae_decoder", "vae_encoder", "adapters"):
        (out / sub).mkdir()
    tokenizer = _hf_tokenizer()
    ov_tokenizer, ov_detokenizer = openvino_tokenizers.convert_tokenizer(tokenizer, with_detokenizer=True)
    ov.save_model(ov_tokenizer, out / "tokenizer" / "openvino_tokenizer.xml")
    ov.save_model(ov_detokenizer, out / "tokenizer" / "openvino_detokenizer.xml")
    tokenizer.save_pretrained(out / "tokenizer")
    models = {"text_encoder": _text_encoder(tokenizer, rng), "unet": _unet(rng, step_work), "vae_decoder": _vae_decoder(),
              "vae_encoder": _vae_encoder()}
    for sub, model in models.items():  # full precision: the schedule's tables, exact as genai's
        ov.save_model(model, out / sub / "openvino_model.xml", compress_to_fp16=False)
    for name, config in _configs(len(tokenizer)).items():
        write_json(out / name, config)
    write_adapter(out / ADAPTER_PATH)


def write_adapter(path: pathlib.Path) -> pathlib.Path:
    """Write the LoRA adapter (see the module doc) to the .safetensors file `path` and return `path`."""
    from safetensors.numpy import save_file

    swap = np.zeros((1, HIDDEN), np.float32)  # the red channel minus the blue one
    swap[0, COLOUR], swap[0, COLOUR + 2] = 1.0, -1.0
    key = "lora_te_" + LORA_LAYER.replace(".", "_")
    # delta W = up @ down = -(e_r - e_b)(e_r - e_b)^T: a colour (r, g, b) becomes (b, g, r)
    save_file({f"{key}.lora_down.weight": swap, f"{key}.lora_up.weight": -swap.T.copy(),
               f"{key}.alpha": np.array(1.0, np.float32)}, str(path))
    return path


def _configs(vocab_size: int) -> dict[str, dict]:
    vae = {"_class_name": "AutoencoderKL", "_diffusers_version": "0.30.0", "in_channels": 3, "out_channels": 3,
           "latent_channels": LATENT_CHANNELS, "block_out_channels": [32, 32, 32, 32],  # 3 halvings: 8 x 8 pixels
           "layers_per_block": 1, "sample_size": SAMPLE_SIZE * VAE_SCALE, "scaling_factor": LATENT_SCALE}
    return {
        "model_index.json": {
            "_class_name": "StableDiffusionPipeline", "_diffusers_version": "0.30.0",
            "feature_extractor": [None, None], "safety_checker": [None, None], "requires_safety_checker": False,
            "scheduler": ["diffusers", "DDIMScheduler"], "text_encoder": ["transformers", "CLIPTextModel"],
            "tokenizer": ["transformers", "BertTokenizer"], "unet": ["diffusers", "UNet2DConditionModel"],
            "vae": ["diffusers", "AutoencoderKL"],
        },
        "scheduler/scheduler_config.json": {
            "_class_name": "DDIMScheduler", "_diffusers_version": "0.30.0", "num_train_timesteps": TRAIN_TIMESTEPS,
            "beta_start": BETA_START, "beta_end": BETA_END, "beta_schedule": "scaled_linear", "clip_sample": False,
            "set_alpha_to_one": True, "steps_offset": 1, "prediction_type": "epsilon", "thresholding": False,
            "timestep_spacing": "trailing", "rescale_betas_zero_snr": False,
        },
        "text_encoder/config.json": {
            "architectures": ["CLIPTextModel"], "model_type": "clip_text_model", "torch_dtype": "float32",
            "vocab_size": vocab_size, "hidden_size": HIDDEN, "intermediate_size": HIDDEN, "projection_dim": HIDDEN,
            "num_hidden_layers": 1, "num_attention_heads": 1, "max_position_embeddings": MAX_TOKENS,
            "pad_token_id": 0,
        },
        "unet/config.json": {
            "_class_name": "UNet2DConditionModel", "_diffusers_version": "0.30.0", "in_channels": LATENT_CHANNELS,
            "out_channels": LATENT_CHANNELS, "sample_size": SAMPLE_SIZE, "cross_attention_dim": HIDDEN,
            "block_out_channels": [32, 32, 32, 32], "layers_per_block": 1, "attention_head_dim": 8,
        },
        "vae_decoder/config.json": vae,
        "vae_encoder/config.json": vae,
    }


# --- tokenizer -------------------------------------------------------------------------------------------------

def _hf_tokenizer():
    """An uncased WordPiece tokenizer over a fixed vocabulary: specials, colour names, WORDS, then every character
    genai's prompts may hold spelt alone and as a word's continuation ("##x"), so nothing is [UNK] but the rare."""
    from transformers import BertTokenizer

    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + [str(d) for d in range(10)]
    punctuation = list(".,;:!?'\"()[]{}-+=/*#@&%$_<>|~`^\\")
    vocab = list(dict.fromkeys([*SPECIAL_TOKENS, *PALETTE, *WORDS, *letters, *punctuation,
                                *(f"##{c}" for c in letters)]))
    return BertTokenizer(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True,
                         model_max_length=MAX_TOKENS)


# --- graphs ----------------------------------------------------------------------------------------------------

def _f32(value) -> object:
    return ops.constant(np.asarray(value, np.float32))


def _text_encoder(tokenizer, rng: np.random.Generator):
    """input_ids -> last_hidden_state: each token's colour and flag (unless the next token continues its word) and
    random features, through one identity linear layer named as CLIP's (see the module doc)."""
    import openvino as ov

    vocab = tokenizer.get_vocab()
    table = np.zeros((len(vocab), HIDDEN), np.float32)
    table[:, FEATURES:] = rng.normal(0.0, 1.0, (len(vocab), HIDDEN - FEATURES))
    for word, rgb in PALETTE.items():
        table[vocab[word], COLOUR:COLOUR + 3] = rgb
        table[vocab[word], FLAG] = 1.0
    continues = np.array([token.startswith("##") for token, _ in sorted(vocab.items(), key=lambda kv: kv[1])],
                         np.float32)

    input_ids = ops.parameter([-1, -1], ov.Type.i64, name="input_ids")
    embeds = ops.gather(ops.constant(table), input_ids, 0)  # [b, seq, HIDDEN]
    # A colour word followed by "##..." is part of a longer word: its colour and flag are dropped.
    next_ids = ops.concat([ops.slice(input_ids, [1], [np.iinfo(np.int64).max], [1], [1]),
                           ops.slice(input_ids, [0], [1], [1], [1])], 1)  # the last position's "next" is [CLS]-like
    whole = ops.subtract(_f32(1.0), ops.gather(ops.constant(continues), next_ids, 0))  # [b, seq]
    keep = ops.concat([ops.broadcast(ops.unsqueeze(whole, [2]), [1, 1, FEATURES], broadcast_spec="BIDIRECTIONAL"),
                       ops.add(ops.multiply(ops.slice(embeds, [FEATURES], [HIDDEN], [1], [2]), _f32(0.0)),
                               _f32(1.0))], 2)
    hidden = ops.multiply(embeds, keep)
    fc2 = ops.matmul(hidden, ops.constant(np.eye(HIDDEN, dtype=np.float32)), False, True)
    fc2.set_friendly_name(f"__module.{LORA_LAYER}/aten::linear/MatMul")
    result = ops.result(fc2)
    result.get_output_tensor(0).set_names({"last_hidden_state"})
    return ov.Model([result], [input_ids], "openarc-demo-image-text-encoder")


def _unet(rng: np.random.Generator, step_work: int):
    """sample, timestep, encoder_hidden_states -> out_sample: the noise DDIM needs to reach the prompt's colour at
    timesteps from COLOUR_FROM, none below (see the module doc), after `step_work` matrix products (_busy)."""
    import openvino as ov

    sample = ops.parameter([-1, LATENT_CHANNELS, -1, -1], ov.Type.f32, name="sample")
    timestep = ops.parameter([1], ov.Type.i64, name="timestep")
    text = ops.parameter([-1, -1, HIDDEN], ov.Type.f32, name="encoder_hidden_states")
    for node, name in ((sample, "sample"), (timestep, "timestep"), (text, "encoder_hidden_states")):
        node.get_output_tensor(0).set_names({name})

    named = ops.reduce_sum(ops.slice(text, [COLOUR], [FLAG + 1], [1], [2]), [1], False)  # [b, 4]: RGB sums, count
    rgb = ops.divide(ops.slice(named, [COLOUR], [COLOUR + 3], [1], [1]),
                     ops.maximum(ops.slice(named, [FLAG], [FLAG + 1], [1], [1]), _f32(1.0)))
    target = ops.concat([ops.multiply(rgb, _f32(COLOUR_GAIN * LATENT_SCALE)),
                         ops.multiply(ops.slice(named, [FLAG], [FLAG + 1], [1], [1]), _f32(0.0))], 1)
    target = ops.unsqueeze(target, [2, 3])  # [b, 4, 1, 1]

    alphas = alphas_cumprod()
    t = ops.clamp(timestep, 0, TRAIN_TIMESTEPS - 1)
    signal, noise = (ops.reshape(ops.gather(ops.constant(table.astype(np.float32)), t, 0), [1, 1, 1, 1], False)
                     for table in (np.sqrt(alphas), np.sqrt(1.0 - alphas)))
    towards_colour = ops.convert(ops.greater_equal(t, ops.constant(np.int64(COLOUR_FROM))), "f32")
    epsilon = ops.add(ops.divide(ops.subtract(sample, ops.multiply(signal, target)), noise),
                      _busy(sample, rng, step_work))
    result = ops.result(ops.multiply(epsilon, ops.reshape(towards_colour, [1, 1, 1, 1], False)))
    result.get_output_tensor(0).set_names({"out_sample"})
    return ov.Model([result], [sample, timestep, text], "openarc-demo-image-unet")


def _busy(sample, rng: np.random.Generator, products: int):
    """A scalar that costs `products` WORK_SIZE-square matrix products to compute from `sample` (so nothing folds
    it away) and is below 1e-6: a denoising step's work, which makes each step take milliseconds."""
    if products == 0:
        return _f32(0.0)
    x = ops.add(ops.constant(rng.normal(0.0, 1.0, (WORK_SIZE, WORK_SIZE)).astype(np.float32)),
                ops.multiply(ops.reduce_mean(sample, [0, 1, 2, 3], False), _f32(1e-3)))
    weight = ops.constant(rng.normal(0.0, WORK_SIZE ** -0.5, (WORK_SIZE, WORK_SIZE)).astype(np.float32))
    for _ in range(products):  # the same weight each time: one constant in the file, norm kept about 1
        x = ops.matmul(x, weight, False, False)
    return ops.multiply(ops.tanh(ops.reduce_mean(x, [0, 1], False)), _f32(1e-6))


def _vae_decoder():
    """latent_sample [b, 4, h, w] (already divided by LATENT_SCALE by genai) -> sample [b, 3, 8h, 8w]: channels
    0-2 as RGB, each latent an 8 x 8 block (a transposed convolution of ones)."""
    import openvino as ov

    latent = ops.parameter([-1, LATENT_CHANNELS, -1, -1], ov.Type.f32, name="latent_sample")
    latent.get_output_tensor(0).set_names({"latent_sample"})
    rgb = ops.slice(latent, [0], [3], [1], [1])
    block = ops.constant(np.ones((3, 1, 1, VAE_SCALE, VAE_SCALE), np.float32))
    pixels = ops.group_convolution_backprop_data(rgb, block, [VAE_SCALE, VAE_SCALE], pads_begin=[0, 0],
                                                 pads_end=[0, 0], dilations=[1, 1])
    result = ops.result(pixels)
    result.get_output_tensor(0).set_names({"sample"})
    return ov.Model([result], [latent], "openarc-demo-image-vae-decoder")


def _vae_encoder():
    """sample [b, 3, H, W] in [-1, 1] -> latent_sample [b, 4, H/8, W/8]: each 8 x 8 block's mean RGB and a zero
    channel (genai multiplies by LATENT_SCALE)."""
    import openvino as ov

    image = ops.parameter([-1, 3, -1, -1], ov.Type.f32, name="sample")
    image.get_output_tensor(0).set_names({"sample"})
    rgb = ops.avg_pool(image, [VAE_SCALE, VAE_SCALE], [0, 0], [0, 0], [VAE_SCALE, VAE_SCALE], True)
    zero = ops.multiply(ops.slice(rgb, [0], [1], [1], [1]), _f32(0.0))
    result = ops.result(ops.concat([rgb, zero], 1))
    result.get_output_tensor(0).set_names({"latent_sample"})
    return ov.Model([result], [image], "openarc-demo-image-vae-encoder")
