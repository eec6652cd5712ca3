"""The config's rules beyond its types: ranges, names that must be unique or must match another key, what a model
of a kind may set, speculative decoding's knobs together, and what has to fit max_loaded and a device's memory_budget.

appliance.config.validator has checked each value's type and built the dataclasses first; these read them (a
model or key that could not be built is None, its problems already reported) and add one line per problem, so one
run of check-config names every mistake. A rule that needs the disk (a draft's tokenizer) asks
appliance.config.model_checks.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance.config.validator import Problems, checked, key_name
from appliance.config.devices import DEVICE_PATTERN, budget_device
from appliance.config.replicas import all_units, device_problems
from appliance.config.model_checks import tokenizer_mismatch
from appliance.config.kinds import GENERATIVE_KINDS, KIND_ONLY_KEYS, kinds_of
from appliance.sizes import parse_size

if TYPE_CHECKING:
    from appliance.config import Config, ModelConfig, ServerConfig

# A model's name: the `model` of API requests, a systemd instance name, a metrics label, a directory name.
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")

# The fields of openvino_genai.SchedulerConfig, listed here so the front never imports OpenVINO.
SCHEDULER_FIELDS = {
    "num_kv_blocks": int,
    "cache_size": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "dynamic_split_fuse": bool,
    "enable_prefix_caching": bool,
    "use_cache_eviction": bool,
    "use_sparse_attention": bool,
}

# The longest ready_wait_s: a request never waits unbounded for its model.
MAX_READY_WAIT_S = 3600.0

# Speculative decoding's knobs, per model and per request: tokens a draft (or prompt lookup) proposes a step, and
# the n-gram prompt lookup matches. Beyond these the main model verifies more than it could ever accept.
MAX_ASSISTANT_TOKENS = 32
MAX_NGRAM_SIZE = 16

# The key the single server.api_key_env is, among server.api_keys.
DEFAULT_KEY_NAME = "default"


def check_rules(config: Config, raw_models: list, problems: Problems) -> None:
    """Every rule, one line in `problems` for each broken one; `raw_models`: the models as written (the keys a model
    of another kind set)."""
    _check_ranges(config, raw_models, problems)
    _check_residency(config, problems)
    _check_aliases(config, problems)
    _check_keys(config.server, problems)
    _check_task_models(config, problems)


def _check_kind_keys(model: ModelConfig, raw: Any, at: str, problems: Problems) -> None:
    """A key written for another kind of model (pooling on an llm, scheduler_config on a reranker) is named."""
    for key in raw if isinstance(raw, dict) else ():
        kinds = KIND_ONLY_KEYS.get(key)
        if kinds is not None and model.kind not in kinds_of(kinds):
            named = " or ".join(repr(k) for k in kinds_of(kinds))
            problems.append(f"{at}.{key}: applies to kind {named} models only (this one is kind {model.kind!r})")


def _check_ranges(config: Config, raw_models: list, problems: Problems) -> None:
    def require(ok: bool, key: str, expected: str) -> None:
        if not ok:
            problems.append(f"{key}: expected {expected}")

    s = config.server
    require(0 < s.port < 65536, "server.port", "a port number 1-65535")
    require(s.max_body_bytes >= 1024, "server.max_body_bytes", "at least 1024")
    require(s.load_concurrency >= 1, "server.load_concurrency", "at least 1")
    require(s.parked_workers >= 0, "server.parked_workers", "a non-negative integer (0: none)")
    require(s.cache_bound != (None, None), "server.cache_max_size",
            f"a size such as 40GiB or a share of the cache directory's disk such as 10% (got {s.cache_max_size!r})")
    require(s.drain_timeout_s >= 0, "server.drain_timeout_s", "a non-negative number")
    require(s.stream_keepalive_s > 0, "server.stream_keepalive_s", "a positive number of seconds")
    f = s.image_fetch
    require(f.max_bytes >= 1024, "server.image_fetch.max_bytes", "at least 1024")
    require(f.timeout_s > 0, "server.image_fetch.timeout_s", "a positive number of seconds")
    require(all(h and "/" not in h for h in f.allow_hosts), "server.image_fetch.allow_hosts",
            "host names (host or host:port, no scheme or path)")
    require(s.stored_responses >= 0, "server.stored_responses", "a non-negative number (0: none kept)")
    require(0 <= s.canary_min_speed <= 1, "server.canary_min_speed",
            "a share of the recorded speed from 0 to 1 (0: speed is not checked)")
    seen: set[str] = set()
    for i, m in enumerate(config.models):
        if m is None:  # its problems are reported already
            continue
        at = f"models[{i}]"
        require(MODEL_NAME.fullmatch(m.name) is not None, f"{at}.name",
                "letters, digits, '.', '_' or '-' (it names a systemd instance and a metric label)")
        require(m.name not in seen, f"{at}.name", f"a unique model name ({m.name!r} appears twice)")
        seen.add(m.name)
        for expected in device_problems(m.device):
            problems.append(f"{at}.device: expected {expected}")
        require(m.port is None or 0 < m.port < 65536, f"{at}.port", "a port number 1-65535")
        for key in ("max_context", "default_max_tokens", "max_running", "max_inputs"):
            require(getattr(m, key) is None or getattr(m, key) >= 1, f"{at}.{key}", "at least 1")
        require(m.max_queue >= 0, f"{at}.max_queue", "a non-negative integer")
        _check_kind_keys(m, raw_models[i] if i < len(raw_models) else {}, at, problems)
        require(all(d >= 1 for d in m.matryoshka_dimensions or ()), f"{at}.matryoshka_dimensions",
                "a list of positive integers")
        require(m.max_audio_seconds > 0, f"{at}.max_audio_seconds", "a positive number of seconds")
        require(m.max_upload_bytes >= 1024, f"{at}.max_upload_bytes", "at least 1024")
        require(m.default_voice is None or m.voices is None or m.default_voice in m.voices, f"{at}.default_voice",
                f"one of the model's voices ({', '.join(m.voices or ())})")
        require(m.max_image_bytes >= 1024, f"{at}.max_image_bytes", "at least 1024")
        require(m.max_image_pixels >= 1, f"{at}.max_image_pixels", "at least 1")
        require(bool(m.image_formats), f"{at}.image_formats", "at least one of png, jpeg, webp, gif")
        problems.extend(_image_problems(m, at))
        require(m.stall_timeout_s > 0 and m.load_timeout_s > 0, f"{at}.stall_timeout_s",
                "positive timeouts (stall_timeout_s, load_timeout_s)")
        require(m.grammar_compile_timeout_s > 0, f"{at}.grammar_compile_timeout_s", "a positive number of seconds")
        require(m.grammar_compile_budget_s > 0, f"{at}.grammar_compile_budget_s", "a positive number of seconds")
        require(m.grammar_step_budget_s > 0, f"{at}.grammar_step_budget_s", "a positive number of seconds")
        require(0 <= m.ready_wait_s <= MAX_READY_WAIT_S, f"{at}.ready_wait_s",
                f"0 to {MAX_READY_WAIT_S:g} seconds (a request never waits unbounded)")
        r = m.restart
        require(0 < r.backoff_initial_s <= r.backoff_max_s, f"{at}.restart.backoff_initial_s",
                "a positive number no larger than backoff_max_s")
        require(r.max_failures >= 1 and r.window_s > 0, f"{at}.restart.max_failures",
                "max_failures >= 1 and window_s > 0")
        require(m.chat_template is None or os.access(m.chat_template, os.R_OK) and Path(m.chat_template).is_file(),
                f"{at}.chat_template", f"a readable .jinja file (cannot read {m.chat_template!r})")
        problems.extend(_speculative_problems(m, at))
        problems.extend(_adapter_problems(m, at))
        for key, value in m.scheduler_config.items():
            expected = SCHEDULER_FIELDS.get(key)
            require(expected is not None, f"{at}.scheduler_config.{key}",
                    "a SchedulerConfig field: " + ", ".join(SCHEDULER_FIELDS))
            if expected is not None:
                checked(value, expected, f"{at}.scheduler_config.{key}", problems)
        require(m.idle_unload_s >= 0, f"{at}.idle_unload_s", "a non-negative number of seconds (0: never)")
        require(m.memory is None or m.memory_bytes is not None, f"{at}.memory",
                f"a size such as 4.5GiB, 800MiB or a number of bytes (got {m.memory!r})")


# An image request's width and height: multiples of this (the VAE's downscale of every diffusion family genai
# runs), between these bounds (max_resolution is the operator's cap inside them).
IMAGE_SIZE_STEP, MIN_IMAGE_SIDE, MAX_IMAGE_SIDE = 8, 64, 4096
MAX_IMAGES_PER_REQUEST = 10  # OpenAI's own bound on n
MAX_INFERENCE_STEPS = 500
ADAPTER_NAME = MODEL_NAME  # a request names an adapter as it names a model
ADAPTER_SEPARATOR = ":"  # a model's adapter is served as BASE:ADAPTER; no model name holds one (MODEL_NAME)
# The pictures of one image request together, n x width x height: a picture goes from its worker in one frame, base64
# of a PNG that for an incompressible picture takes 4.01 bytes a pixel, so a request inside this bound has every
# picture fit the 64 MiB frame (appliance.ipc.MAX_FRAME), its answer held by the front under that, and its denoising
# work under this times max_inference_steps. max_resolution and max_images_per_request alone let 10 pictures of 4096
# x 4096 through: each past the frame, found only once painted.
MAX_IMAGE_REQUEST_PIXELS = 16_000_000


def image_pixels_problem(n: int, width: int, height: int) -> str | None:
    """Why `n` pictures of width x height are too many pixels for one request (MAX_IMAGE_REQUEST_PIXELS), or None."""
    if n * width * height <= MAX_IMAGE_REQUEST_PIXELS:
        return None
    return (f"{n} picture{'s' if n > 1 else ''} of {width}x{height} are {n * width * height:,} pixels; one request "
            f"makes at most {MAX_IMAGE_REQUEST_PIXELS:,} (n x width x height): ask for fewer or smaller pictures")


def adapter_weight_ok(alpha: float) -> bool:
    """An adapter's alpha as the config and a runtime load take it: positive and finite (an infinite one, which YAML's
    .inf and JSON's 1e309 give, turns every logit into NaN: an empty answer)."""
    return math.isfinite(alpha) and alpha > 0


def _image_problems(m: ModelConfig, at: str) -> list[str]:
    """An image model's limits in their ranges (set on a model of another kind, _check_kind_keys names them)."""
    problems = []
    if not MIN_IMAGE_SIDE <= m.max_resolution <= MAX_IMAGE_SIDE or m.max_resolution % IMAGE_SIZE_STEP:
        problems.append(f"{at}.max_resolution: expected a multiple of {IMAGE_SIZE_STEP} from {MIN_IMAGE_SIDE} to "
                        f"{MAX_IMAGE_SIDE} pixels (got {m.max_resolution})")
    if not 1 <= m.max_images_per_request <= MAX_IMAGES_PER_REQUEST:
        problems.append(f"{at}.max_images_per_request: expected 1 to {MAX_IMAGES_PER_REQUEST}")
    if not 1 <= m.max_inference_steps <= MAX_INFERENCE_STEPS:
        problems.append(f"{at}.max_inference_steps: expected 1 to {MAX_INFERENCE_STEPS}")
    return problems


def _check_aliases(config: Config, problems: Problems) -> None:
    """Each alias reaches a configured model (a typo would otherwise be a 404 found by a client)."""
    names = [m.name for m in config.models if m is not None]
    for pattern, target in config.server.model_aliases.items():
        if target not in names:
            problems.append(f"server.model_aliases.{key_name(pattern)}: {target!r} is not a configured model "
                            f"(have: {', '.join(names)})")


ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _check_keys(s: ServerConfig, problems: Problems) -> None:
    """Named keys: unique names (metric labels), one variable each, limits of at least 1."""
    names = {DEFAULT_KEY_NAME} if s.api_key_env else set()
    envs = {s.api_key_env} if s.api_key_env else set()
    if s.api_key_env is not None and ENV_NAME.fullmatch(s.api_key_env) is None:  # "" would be no auth at all
        problems.append("server.api_key_env: expected the name of an environment variable (the key itself never "
                        "lives in the file), or leave it out for no authentication")
    for i, key in enumerate(s.api_keys):
        if key is None:  # its problems are reported already
            continue
        at = f"server.api_keys[{i}]"
        if MODEL_NAME.fullmatch(key.name) is None:
            problems.append(f"{at}.name: expected letters, digits, '.', '_' or '-' (it is a metric label)")
        elif key.name in names:
            problems.append(f"{at}.name: expected a unique key name ({key.name!r} appears twice"
                            + (", and server.api_key_env is the key named 'default')" if key.name == DEFAULT_KEY_NAME
                               and s.api_key_env else ")"))
        names.add(key.name)
        if ENV_NAME.fullmatch(key.key_env) is None:
            problems.append(f"{at}.key_env: expected the name of an environment variable (the key itself never "
                            "lives in the file)")
        elif key.key_env in envs:
            problems.append(f"{at}.key_env: {key.key_env} is another key's variable too; give each key its own")
        envs.add(key.key_env)
        for limit in ("max_concurrent", "requests_per_minute", "tokens_per_minute"):
            if getattr(key, limit) is not None and getattr(key, limit) < 1:
                problems.append(f"{at}.{limit}: expected at least 1 (leave it out for no limit)")
        if key.models is not None and not key.models:
            problems.append(f"{at}.models: expected at least one model name or glob (leave it out for all models)")
        for j, pattern in enumerate(key.models or ()):
            # matched against model names, which hold no ':': an adapter's name here would never let the key in
            if ADAPTER_SEPARATOR in pattern:
                problems.append(f"{at}.models[{j}]: expected a model's name or glob, not an adapter's ({pattern!r}): "
                                f"a key may use the adapters of the models it may use, so name the base model "
                                f"({pattern.partition(ADAPTER_SEPARATOR)[0]!r})")


def _check_task_models(config: Config, problems: Problems) -> None:
    """task_model names another configured chat model; the background knobs are in range."""
    chat = {m.name for m in config.models if m is not None and m.kind in GENERATIVE_KINDS}
    for i, m in enumerate(config.models):
        if m is None:
            continue
        if m.task_model is not None and (m.task_model == m.name or m.task_model not in chat
                                         or m.kind not in GENERATIVE_KINDS):
            problems.append(f"models[{i}].task_model: expected the name of another configured chat model (llm or "
                            f"vlm) for a chat model's background requests; {m.task_model!r} is not one"
                            + (f" (chat models: {', '.join(sorted(chat - {m.name}))})" if chat - {m.name} else ""))
        if m.max_running_background is not None and not 0 <= m.max_running_background <= m.max_running:
            problems.append(f"models[{i}].max_running_background: expected 0 to max_running ({m.max_running})")
        if m.background_max_wait_s <= 0:
            problems.append(f"models[{i}].background_max_wait_s: expected a positive number of seconds")


def _check_residency(config: Config, problems: Problems) -> None:
    """max_loaded and memory_budget must leave room for what has to load at start (else it would fail at start)."""
    s = config.server
    # a replicated model counts once per replica (each holds a slot, and its device's memory)
    models = [(i, unit.model) for i, m in enumerate(config.models) if m is not None  # None: its problems are reported
              for unit in all_units([m])]
    if s.max_loaded < 0:
        problems.append("server.max_loaded: expected a non-negative integer (0: no limit)")
    budgets = _memory_budgets(s.memory_budget, problems)
    s.memory_budget = {device: size for device, (_, size, _) in budgets.items()}  # keys as models' devices count
    at_start = [m.name for _, m in models if m.load == "at_start"]
    if s.max_loaded > 0 and len(at_start) > s.max_loaded:
        problems.append(f"server.max_loaded: {s.max_loaded} is fewer than the {len(at_start)} models with load: "
                        f"at_start ({', '.join(at_start)}); raise it or make some of them load: on_demand"
                        + ("; each replica counts" if len(set(at_start)) < len(at_start) else ""))
    for device, (key, size, budget) in budgets.items():
        declared = [(i, m) for i, m in models if budget_device(m.device) == device and m.memory_bytes]
        seen_big: set[tuple[int, str]] = set()
        for i, m in declared:
            if m.memory_bytes > budget and (i, m.name) not in seen_big:
                seen_big.add((i, m.name))
                problems.append(f"models[{i}].memory: {m.memory} exceeds server.memory_budget.{key} "
                                f"({size}); this model could never load")
        pinned = sum(m.memory_bytes for _, m in declared if m.load == "at_start")
        if pinned > budget:
            problems.append(f"server.memory_budget.{key}: {size} is less than the memory of "
                            f"the load: at_start models on it ({pinned / (1 << 30):.1f} GiB)")


def _memory_budgets(raw: dict[str, Any], problems: Problems) -> dict[str, tuple[str, str | int, int]]:
    """server.memory_budget's valid entries, keyed as models' devices count against them (budget_device: bare GPU
    is GPU.0), each (the key as written, the size as written, bytes); one problem per bad key or value."""
    budgets: dict[str, tuple[str, str | int, int]] = {}
    for key, size in raw.items():
        at = f"server.memory_budget.{key_name(key)}"
        if DEVICE_PATTERN.match(key) is None or ":" in key:
            problems.append(f"{at}: expected a device name such as GPU, GPU.0, GPU.1 or CPU (the key of one device)")
            continue
        budget = parse_size(size) if isinstance(size, (str, int)) else None
        if not budget:  # None, a float, a list, zero: nothing a budget can be
            problems.append(f"{at}: expected a size with its unit such as 14GiB or 32GB, got {size!r}")
            continue
        device = budget_device(key)
        if device in budgets:
            problems.append(f"{at}: names the same device as server.memory_budget.{budgets[device][0]} "
                            f"({device}; bare GPU is GPU.0)")
            continue
        budgets[device] = (key, size, budget)
    return budgets


def _speculative_problems(m: ModelConfig, at: str):
    """A draft model or prompt lookup, not both; knobs in range; a draft with the main model's tokenizer."""
    if m.draft_model and m.prompt_lookup:
        yield (f"{at}.prompt_lookup: a model decodes with a draft_model or with prompt_lookup, not both "
                          "(remove one)")
    if m.speculative and m.pipeline == "stateful":
        yield (f"{at}.{'draft_model' if m.draft_model else 'prompt_lookup'}: speculative decoding needs "
                          "pipeline: continuous_batching (the stateful pipeline has no draft)")
    if m.num_assistant_tokens is not None and not 1 <= m.num_assistant_tokens <= MAX_ASSISTANT_TOKENS:
        yield (f"{at}.num_assistant_tokens: expected 1 to {MAX_ASSISTANT_TOKENS}")
    if m.max_ngram_size is not None and not 1 <= m.max_ngram_size <= MAX_NGRAM_SIZE:
        yield (f"{at}.max_ngram_size: expected 1 to {MAX_NGRAM_SIZE}")
    threshold = m.assistant_confidence_threshold
    if threshold is not None:
        if not 0 < threshold < 1:
            yield (f"{at}.assistant_confidence_threshold: expected a number between 0 and 1")
        if m.num_assistant_tokens is not None:
            yield (f"{at}.assistant_confidence_threshold: set it or num_assistant_tokens, not both")
        if m.prompt_lookup:
            yield (f"{at}.assistant_confidence_threshold: applies to a draft_model (prompt lookup "
                              "proposes num_assistant_tokens)")
    if m.max_ngram_size is not None and not m.prompt_lookup:
        yield (f"{at}.max_ngram_size: applies with prompt_lookup: true only")
    if m.draft_model:
        d = m.draft_model
        if d.device is not None and DEVICE_PATTERN.match(d.device) is None:
            yield (f"{at}.draft_model.device: expected an OpenVINO device name such as CPU, GPU, GPU.0")
        mismatch = tokenizer_mismatch(m.path, d.path)
        if mismatch:
            yield (f"{at}.draft_model.path: {mismatch}")


def _adapter_problems(model: ModelConfig, at: str) -> list[str]:
    """A model's adapters: names that can follow `BASE:` in a model name, at most max_adapters of them, positive
    weights, and no speculative decoding beside them (openarc has not checked genai's draft path with LoRA)."""
    problems = []
    if model.max_adapters < 1:
        problems.append(f"{at}.max_adapters: expected at least 1")
    if len(model.adapters) > model.max_adapters:
        problems.append(f"{at}.adapters: expected at most max_adapters ({model.max_adapters}) adapters, got "
                        f"{len(model.adapters)}")
    for name, entry in model.adapter_entries().items():
        if MODEL_NAME.fullmatch(name) is None:
            problems.append(f"{at}.adapters.{key_name(name)}: expected a name of letters, digits, '.', '_' or '-' (it is served "
                            f"as {model.name}:NAME and labels metrics)")
        if not adapter_weight_ok(entry.alpha):
            problems.append(f"{at}.adapters.{name}.alpha: expected a positive finite weight, got {entry.alpha}")
    if model.adapters and model.scheduler_config.get("enable_prefix_caching"):
        problems.append(f"{at}.scheduler_config.enable_prefix_caching: not with adapters (genai's prefix cache keys "
                        "blocks by tokens alone: one adapter's cached keys and values would serve another's prompt)")
    if model.adapters and model.speculative:
        problems.append(f"{at}.adapters: not with speculative decoding (draft_model, prompt_lookup) on the same model")
    return problems
