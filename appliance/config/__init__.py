"""The declarative YAML config: its dataclasses, and `parse_config` / `load_config` that build them from a file.

The dataclasses are the schema: appliance.config.validator checks a file against their type hints (every error
names the file, the key path and what was expected, in one line, every mistake at once), so a key added here gets
its checks without code of its own; appliance.config.rules checks what types cannot say (ranges, names that must
match, what fits a device's memory).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import os
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from appliance.config.rules import DEFAULT_KEY_NAME, check_rules
from appliance.config.validator import ConfigError, Problems, build
from appliance.sizes import parse_size
from appliance.config.devices import gpu_indices
from appliance.config.replicas import all_units, devices_of
from appliance.config.model_checks import ModelCheck, model_problems
from appliance.config.systemd_env import credential, systemd_directory

# Names that moved to modules of their own, still importable from here: the tests, the bench and code written
# before the split import them from appliance.config.
from appliance.config.rules import MAX_ASSISTANT_TOKENS, MAX_NGRAM_SIZE, MODEL_NAME  # noqa: F401
from appliance.config.devices import available_devices, budget_device, missing_devices  # noqa: F401
from appliance.config.launch_spec import worker_spec  # noqa: F401
from appliance.config.model_checks import path_check, served_path_check, tokenizer_mismatch  # noqa: F401
from appliance.config.model_checks import adapter_problem  # noqa: F401
from appliance.config.kinds import GENERATIVE_KINDS, MODEL_KINDS  # noqa: F401

DEFAULT_CONFIG_PATH = Path("/etc/openarc/openarc.yaml")

# What openarc sets in a continuous-batching model's SchedulerConfig where its scheduler_config does not (genai's own
# defaults keep nothing between requests and prefill a prompt 256 tokens a step; docs/warm-sessions.md):
# - enable_prefix_caching: every conversation's KV blocks stay for its next turn, least recently used evicted.
# - cache_size (GB, unless num_kv_blocks is set): a fixed cache, so finished conversations stay warm (genai's
#   dynamic cache grows only as far as the running requests need, and reuses the rest at once).
# - max_num_batched_tokens: prompt tokens per scheduler step, per device family: larger prefills a long prompt in
#   fewer steps (a faster first token), smaller lets running streams step between its chunks (docs/performance.md).
DEFAULT_CACHE_SIZE_GB = 2
DEFAULT_BATCHED_TOKENS = {"CPU": 2048, "GPU": 1024}

# The speculative knobs of a model that sets none (config_rules has their bounds); its requests may set their own.
DEFAULT_ASSISTANT_TOKENS = 5
DEFAULT_NGRAM_SIZE = 3


@dataclass
class RestartPolicy:
    # Defaults suit a real GPU box: a crash-looping driver gets room to settle, and five crashes in ten
    # minutes mean something a restart will not fix.
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 60.0
    max_failures: int = 5
    window_s: float = 600.0


@dataclass
class DraftModelConfig:
    """A smaller model with the same tokenizer that proposes tokens for the main model to verify (speculative
    decoding). It loads in the main model's worker; device None means the main model's device."""
    path: str
    device: str | None = None
    runtime_config: dict[str, Any] = field(default_factory=dict)


@dataclass
class LoraAdapter:
    """A LoRA adapter of a model (docs/lora.md, docs/images.md): `path`, a .safetensors file or a PEFT directory
    holding adapter_model.safetensors; `alpha`, the weight it is applied at when a request names it without one
    (1.0: as trained)."""
    path: str
    alpha: float = 1.0


@dataclass
class ModelConfig:
    name: str
    path: str
    kind: Literal["llm", "vlm", "embedding", "rerank", "transcription", "tts", "image"] = "llm"
    # One device ("GPU.1"), or a list of them: one replica of the model per listed device, under one name
    # (appliance.config.replicas; docs/operations.md "Replicas"). The front serves each replica as a model of its own.
    device: str | list[str] = "CPU"
    # Replicas only: which replica takes a request (appliance.front.replica_choice): affinity, the one whose recent
    # prompts share the longest prefix with it unless its queue is long, else the least loaded; round_robin, each in
    # turn (the bench's baseline).
    replica_routing: Literal["affinity", "round_robin"] = "affinity"
    # Port of this model's own listener under `openarc serve --model NAME` (openarc@NAME.service).
    port: int | None = None
    # continuous_batching batches concurrent requests; stateful (ATTENTION_BACKEND=SDPA) runs one at a
    # time, the fallback many Arc users need.
    pipeline: Literal["continuous_batching", "stateful"] = "continuous_batching"
    runtime_config: dict[str, Any] = field(default_factory=dict)
    scheduler_config: dict[str, Any] = field(default_factory=dict)
    # GPU_ENABLE_SDPA_OPTIMIZATION; false stops the fence-timeout hangs seen on Arc A770.
    sdpa_optimization: bool | None = None
    # auto: after repeated fence timeouts or hangs on this model's card (kernel log), its worker is restarted with
    # sdpa_optimization false (appliance.front.gpu_sentinel); an explicit sdpa_optimization always wins. off: never.
    gpu_mitigations: Literal["auto", "off"] = "auto"
    # ENABLE_WEIGHTLESS; None means true on GPU (9-17 GB -> ~0.2 GB host RAM per 14B load).
    enable_weightless: bool | None = None
    # llm, vlm: prompt plus answer; unset, the model's own trained window (config.json) capped by what its KV cache
    # holds for one sequence (appliance.config.window). embedding, rerank: tokens of one input (a longer one is a
    # 400 unless the request says truncate: true); never more than the model's own max_position_embeddings.
    max_context: int | None = None
    # The answer limit of a request that sends none (an operator's cap on unbounded answers); unset, such an
    # answer may use what the window leaves after the prompt. Any limit is fitted to that room.
    default_max_tokens: int | None = None
    # embedding: texts per request; rerank: documents per request.
    max_inputs: int = 2048
    # embedding: genai's TextEmbeddingPipeline pooling (None: the model's 1_Pooling/config.json, else cls),
    # L2 normalisation, and the sizes a request's `dimensions` may ask for (Matryoshka-trained models only;
    # None: the model's config.json `matryoshka_dimensions`, else none).
    pooling: Literal["cls", "mean", "last_token"] | None = None
    normalize: bool = True
    matryoshka_dimensions: list[int] | None = None
    # transcription: the longest audio (decoded) and the largest upload a request may send (413 beyond), and
    # whether the pipeline is built for word timestamps (genai then decomposes the cross-attention to read
    # its alignment heads: slower decoding, so off unless asked for).
    max_audio_seconds: float = 1800.0
    max_upload_bytes: int = 25 << 20
    word_timestamps: bool = False
    # tts: speaker-embedding (SpeechT5) or voice (Kokoro) files by voice name, a relative path read from the model's
    # directory (None: the files voices/NAME.bin there), and the voice of a request that names none or names one
    # of OpenAI's voices the model lacks (None: the first voice by name, else the pipeline's own default).
    voices: dict[str, str] | None = None
    default_voice: str | None = None
    # vlm: the largest image a request may send (encoded bytes, after base64), the most pixels it may decode to
    # (width x height, checked from the header before decoding: decompression bombs), and the formats taken.
    max_image_bytes: int = 10 << 20
    max_image_pixels: int = 25_000_000
    image_formats: list[Literal["png", "jpeg", "webp", "gif"]] = field(
        default_factory=lambda: ["png", "jpeg", "webp", "gif"])
    # image: LoRA adapters a request may apply by name (`lora: [{name, weight}]`), as a path or {path, alpha}; the
    # largest width or height a request may ask for, the most pictures one request may ask for (n), and the most
    # denoising steps (num_inference_steps). A request that names no size or steps gets the model's own (genai's
    # defaults for its family).
    adapters: dict[str, str | LoraAdapter] = field(default_factory=dict)
    max_resolution: int = 1024
    max_images_per_request: int = 4
    max_inference_steps: int = 50
    # llm, vlm: drop known per-request agent noise (Claude Code's billing header line) before templating, so a
    # conversation's prompt stays the same from turn to turn and the prefix cache serves it (appliance.worker.agent_noise).
    canonicalize_agent_noise: bool = True
    # llm: LoRA adapters by name (docs/lora.md), each served as the model name BASE:NAME; a path, or {path, alpha}.
    # max_adapters: the most adapters the model holds at once, these and those loaded at runtime
    # (POST /openarc/models/BASE/adapters).
    adapters: dict[str, str | LoraAdapter] = field(default_factory=dict)
    max_adapters: int = 4
    max_running: int = 8
    max_queue: int = 32
    stall_timeout_s: float = 60.0
    load_timeout_s: float = 900.0
    # llm: a constraint's grammar compiling on the worker's probe thread counts as progress for this long (a large
    # schema can take longer than stall_timeout_s); a compile still running after it is treated as hung, and the
    # stall timer ends the worker stall_timeout_s later.
    grammar_compile_timeout_s: float = 300.0
    # llm: what a constraint may cost the engine thread, where every other request of the model waits while genai
    # compiles it (once) and applies it (every step). The worker's probe times both before the request joins the
    # batch and refuses past them (400 invalid_grammar naming the field); measured in docs/api.md's limits table.
    grammar_compile_budget_s: float = 5.0
    grammar_step_budget_s: float = 0.5
    # A request for this model while it loads or restarts waits this long for it to be ready, then gets 503 with
    # Retry-After. 60 s covers a worker restart on a GPU box (backoff, then a cached-compile load of a 7-14B
    # model) and a whole-service restart behind the socket unit; 0 answers 503 at once.
    ready_wait_s: float = 60.0
    # How `systemctl reload` replaces this model when its settings change: `side_by_side` loads the new worker
    # while the old one serves, then switches (two copies in memory for a moment); `restart` drains the old one
    # first, for models two of which do not fit, and requests wait out the gap (ready_wait_s).
    reload: Literal["side_by_side", "restart"] = "side_by_side"
    restart: RestartPolicy = field(default_factory=RestartPolicy)
    # Chat formats (appliance.chat_formats); unset = detected from the model's chat template, none = off.
    tool_parser: Literal["hermes", "qwen3_coder", "llama3_json", "mistral", "none"] | None = None
    reasoning_parser: Literal["qwen3", "deepseek_r1", "none"] | None = None
    # A .jinja file that replaces the chat template the model was converted with (converted models often carry
    # an old or broken one).
    chat_template: str | None = None
    # Speculative decoding (continuous_batching only): a draft model, or drafts copied from the prompt (prompt
    # lookup), verified by this model so greedy answers are unchanged. The three knobs are defaults a request may
    # override: tokens proposed a step (or a confidence threshold for the draft's proposals instead), and the
    # n-gram prompt lookup matches.
    draft_model: DraftModelConfig | None = None
    prompt_lookup: bool = False
    num_assistant_tokens: int | None = None
    assistant_confidence_threshold: float | None = None
    max_ngram_size: int | None = None
    # Models on demand (docs/on-demand.md): at_start loads with the server and is never evicted for another model;
    # on_demand starts unloaded and loads on its first request. idle_unload_s: a model with no request running or
    # waiting for that long is unloaded (0: never). memory: its footprint on its device ("4.5GiB"), counted against
    # server.memory_budget; unset, the footprint measured at its last load counts.
    load: Literal["at_start", "on_demand"] = "at_start"
    idle_unload_s: float = 0.0
    memory: str | int | None = None
    # Sharing one GPU (docs/sharing.md): background-class chat requests for this model go to the chat model
    # task_model names instead; at most max_running_background of the running requests are background ones
    # (None: half of max_running, at least 1), and a background request that waited background_max_wait_s in the
    # queue is admitted as if it were interactive (it never starves).
    task_model: str | None = None
    max_running_background: int | None = None
    background_max_wait_s: float = 30.0

    @property
    def speculative(self) -> str | None:
        """"draft", "prompt_lookup" or None: how this model decodes."""
        return "draft" if self.draft_model else "prompt_lookup" if self.prompt_lookup else None

    def speculative_defaults(self) -> dict[str, Any]:
        """The generation knobs every request of a speculative model starts from (genai refuses a request of such
        a pipeline without them)."""
        if not self.speculative:
            return {}
        defaults: dict[str, Any] = {}
        if self.assistant_confidence_threshold is not None:
            defaults["assistant_confidence_threshold"] = self.assistant_confidence_threshold
        else:
            defaults["num_assistant_tokens"] = self.num_assistant_tokens or DEFAULT_ASSISTANT_TOKENS
        if self.prompt_lookup:
            defaults["max_ngram_size"] = self.max_ngram_size or DEFAULT_NGRAM_SIZE
        return defaults

    def adapter_entries(self) -> dict[str, LoraAdapter]:
        """Each configured adapter as a LoraAdapter (a bare path is one at alpha 1)."""
        return {name: entry if isinstance(entry, LoraAdapter) else LoraAdapter(entry)
                for name, entry in self.adapters.items()}

    @property
    def memory_bytes(self) -> int | None:
        return None if self.memory is None else parse_size(self.memory)

    @property
    def is_gpu(self) -> bool:
        return any(device.startswith("GPU") for device in devices_of(self.device))

    def ov_properties(self, cache_dir: str | None) -> dict[str, Any]:
        """The OpenVINO properties a worker compiles with: first-class options, then runtime_config wins."""
        props: dict[str, Any] = {}
        if cache_dir:
            props["CACHE_DIR"] = cache_dir
        if self.is_gpu:
            props["ENABLE_WEIGHTLESS"] = True if self.enable_weightless is None else self.enable_weightless
            if self.sdpa_optimization is not None:
                props["GPU_ENABLE_SDPA_OPTIMIZATION"] = self.sdpa_optimization
        elif self.enable_weightless is not None:
            props["ENABLE_WEIGHTLESS"] = self.enable_weightless
        if self.pipeline == "stateful":
            props["ATTENTION_BACKEND"] = "SDPA"
        props.update(self.runtime_config)
        return props

    def scheduler_settings(self) -> dict[str, Any]:
        """The SchedulerConfig fields its worker sets: openarc's defaults (prefix caching on, a fixed cache, a
        per-device prefill chunk), then the model's scheduler_config wins. A speculative model keeps prefix caching
        off unless its scheduler_config turns it on: with both, genai 2026.4.1 failed a streamed request with "Cannot
        remove more tokens than has been generated" (sequence_group.hpp), seen in tests/test_speculative.py. A model
        with LoRA adapters keeps it off: genai's cache keys blocks by tokens alone, so one adapter's keys and values
        would serve another's prompt (config.rules refuses turning it on there)."""
        settings: dict[str, Any] = {"enable_prefix_caching": not self.speculative and not self.adapters}
        if not {"cache_size", "num_kv_blocks"} & self.scheduler_config.keys():
            settings["cache_size"] = DEFAULT_CACHE_SIZE_GB
        family = "GPU" if self.is_gpu else "CPU"
        settings["max_num_batched_tokens"] = DEFAULT_BATCHED_TOKENS[family]
        return {**settings, **self.scheduler_config}

    @property
    def effective_max_running(self) -> int:
        return 1 if self.pipeline == "stateful" else self.max_running

    @property
    def background_slots(self) -> int:
        """How many running requests may be background ones (the rest stays for people)."""
        if self.max_running_background is not None:
            return min(self.max_running_background, self.effective_max_running)
        return max(1, self.effective_max_running // 2)


@dataclass
class ImageFetch:
    """Remote (http/https) image URLs in chat: off by default (a server that fetches any URL for anyone is an SSRF
    hole); on, only from the hosts listed, each answer at most max_bytes and timeout_s."""
    enabled: bool = False
    allow_hosts: list[str] = field(default_factory=list)
    max_bytes: int = 10 << 20
    timeout_s: float = 10.0


@dataclass
class ApiKeyConfig:
    """One named API key (docs/sharing.md): the secret is in the environment variable key_env, never in the file.
    Limits unset are no limit; `models`: names or globs (fnmatch) of the models it may use, unset: all."""
    name: str
    key_env: str
    priority: Literal["interactive", "background"] = "interactive"
    max_concurrent: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    models: list[str] | None = None


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # Name of the environment variable that holds the API key; the key itself never lives in the file. It is the
    # key named `default`, beside any api_keys.
    api_key_env: str | None = None
    api_keys: list[ApiKeyConfig] = field(default_factory=list)
    metrics_require_key: bool = False
    max_body_bytes: int = 1 << 20
    drain_timeout_s: float = 30.0
    # An open event stream is never silent longer than this: a keep-alive (an SSE comment, Anthropic's ping) goes out
    # while its request waits in the queue, for its model to load, or through a long prefill, so no proxy (nginx:
    # 60 s) or client cuts it.
    stream_keepalive_s: float = 15.0
    # Parallel loads of two 14B models OOM-killed a 32 GB host: load one model at a time by default.
    load_concurrency: int = 1
    # Spare worker processes started ahead, OpenVINO imported, nothing loaded: a load (a switch between models on
    # demand, a restart after a crash) takes one and costs the pipeline's construction only. 0: none.
    parked_workers: int = 1
    cache_dir: str | None = None
    # The compiled-model cache's bound (appliance.host.compile_cache): a size ("40GiB") or a share of the cache
    # directory's disk ("10%"); beyond it the least recently used stale blobs go first.
    cache_max_size: str | int = "10%"
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    image_fetch: ImageFetch = field(default_factory=ImageFetch)
    # /v1/responses with store on: the last N responses of each model stay in memory for previous_response_id.
    stored_responses: int = 100
    # At most this many models have a worker at once (0: no limit), and the footprints of the models loaded on a
    # device stay within its memory_budget ({GPU.0: 14GiB, CPU: 32GiB}): a load evicts idle models first.
    max_loaded: int = 0
    memory_budget: dict[str, Any] = field(default_factory=dict)  # values checked by _memory_budgets, one line each
    # Other names clients may ask for: glob pattern -> a configured model ({"claude-*": coder}), tried in order
    # after the exact names (Claude Code asks for claude-* models whatever the server holds).
    model_aliases: dict[str, str] = field(default_factory=dict)
    # The golden-answer check before a model serves, for each model with a record in golden.yaml beside this file
    # (`openarc golden record`; docs/updating.md): gate refuses a model that answers otherwise, and a start whose
    # model fails exits without READY (systemd, podman auto-update roll back); warn logs it and serves; off: none.
    canary: Literal["off", "warn", "gate"] = "warn"
    # The check fails too below this share of the recorded speed (tokens/s; 0: speed is not checked).
    canary_min_speed: float = 0.5

    def alias_target(self, name: str) -> str | None:
        """The configured model a name that is no model's own reaches through model_aliases, or None."""
        return next((target for pattern, target in self.model_aliases.items() if fnmatch.fnmatchcase(name, pattern)),
                    None)

    @property
    def cache_bound(self) -> tuple[float | None, int | None]:
        """cache_max_size as (share of the disk, None) or (None, bytes); (None, None) when it is neither."""
        value = self.cache_max_size
        if isinstance(value, str) and value.strip().endswith("%"):
            try:
                share = float(value.strip()[:-1]) / 100
            except ValueError:
                return None, None
            return (share, None) if 0 < share <= 1 else (None, None)
        return None, parse_size(value)

    @property
    def memory_budget_bytes(self) -> dict[str, int]:
        """Bytes per device (keys as _check_residency normalised them: GPU.0 for bare GPU)."""
        return {device: parse_size(size) for device, size in self.memory_budget.items()}


@dataclass
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    models: list[ModelConfig] = field(default_factory=list)
    source: str = "<built-in>"

    def model(self, name: str) -> ModelConfig:
        for model in self.models:
            if model.name == name:
                return model
        raise ConfigError(f"{self.source}: models: no model named {name!r} (have: {', '.join(m.name for m in self.models)})")

    def keys_at(self) -> list[tuple[str, ApiKeyConfig]]:
        """Every API key with the config key its variable is named at: server.api_key_env as the key named
        `default`, then server.api_keys."""
        single = [("server.api_key_env", ApiKeyConfig(DEFAULT_KEY_NAME, self.server.api_key_env))] \
            if self.server.api_key_env else []
        return single + [(f"server.api_keys[{i}].key_env", key) for i, key in enumerate(self.server.api_keys)]

    def api_keys(self) -> list[ApiKeyConfig]:
        return [key for _, key in self.keys_at()]

    def key_secrets(self, environ: typing.Mapping[str, str] = os.environ) -> dict[str, str]:
        """Each key's name -> its secret, read from its environment variable; a ConfigError naming every variable
        that is unset or empty (authentication would silently be off) and keys that share one value. The values
        are never part of an error."""
        problems, secrets, owners = [], {}, {}
        for at, key in self.keys_at():
            value = environ.get(key.key_env) or credential(environ, key.key_env)
            if not value.strip():
                problems.append(f"{self.source}: {at}: the environment variable {key.key_env} is "
                                f"{'empty' if key.key_env in environ else 'not set'} (nor a systemd credential of that "
                                "name); set it to the key (refusing to serve without authentication)")
            elif value in owners:
                problems.append(f"{self.source}: {at}: key {key.name!r} has the same value as key "
                                f"{owners[value]!r}; give each key its own")
            else:
                owners[value], secrets[key.name] = key.name, value
        if problems:
            raise ConfigError("\n".join(problems))
        return secrets

    def ov_cache_dir(self) -> str | None:
        if self.server.cache_dir:
            return self.server.cache_dir
        systemd_cache = systemd_directory("CACHE_DIRECTORY")
        return str(Path(systemd_cache) / "ov") if systemd_cache else None

    def shared_gpu_warnings(self) -> list[str]:
        """One line per GPU that several models are pinned to: each loads its own copy of its weights and KV cache
        into that card, so one card often cannot hold them (a mistake when the box has a card per model).

        Only configs that name GPU indices pin: where no model says GPU.N (one card, or a Kubernetes pod that sees
        only its own card), bare "GPU" is the one card there is, and models sharing it are what the user meant.
        """
        indexed = any(index is not None for m in self.models for d in devices_of(m.device) for index in gpu_indices(d))
        if not indexed:
            return []
        pinned: dict[int, list[int]] = {}
        for i, model in enumerate(self.models):
            # a model's replicas are on distinct cards (rules): the model is named once per card
            for index in {index or 0 for d in devices_of(model.device) for index in gpu_indices(d)}:
                pinned.setdefault(index, []).append(i)
        return [f"{self.source}: {', '.join(f'models[{i}].device' for i in at)}: models "
                f"{', '.join(repr(self.models[i].name) for i in at)} share GPU.{index} (bare GPU is GPU.0) and its "
                f"memory; give each model its own card (GPU.0, GPU.1, ...) unless that is meant"
                for index, at in sorted(pinned.items()) if len(at) > 1]

    def only(self, name: str) -> Config:
        """The config of one instance (openarc@NAME): that model alone, on its own port if it has one."""
        # openarc@MODEL is one model, always loaded: residency is `openarc serve`'s business.
        model = dataclasses.replace(self.model(name), load="at_start", idle_unload_s=0.0)
        server = dataclasses.replace(self.server, port=model.port or self.server.port, max_loaded=0, memory_budget={})
        return Config(server=server, models=[model], source=self.source)


def parse_config(data: Any, source: str, checks: list[ModelCheck] = ()) -> Config:
    """The config in `data`, or a ConfigError naming every problem (with `checks`: of each model too)."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: top level: expected a mapping with 'server' and 'models'")
    problems = Problems()
    config = build(Config, data, "", problems)
    check_rules(config, data.get("models") if isinstance(data.get("models"), list) else [], problems)
    problems.extend(model_problems(config.models, list(checks)))
    if problems:
        raise ConfigError("\n".join(f"{source}: {problem}" for problem in problems))
    config.source = source
    return config


class ConfigLoader(yaml.SafeLoader):
    """yaml.safe_load's reader with what YAML itself forbids or this config never holds as errors with their place:
    a key twice in one mapping (PyYAML keeps the last one: a second `models:` dropped the first's models without a
    word) and an integer past Python's conversion limit (a ValueError traceback, not a config error)."""

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = self.construct_object(key_node)
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"{key!r} appears twice in one mapping (first at line {seen[key].line + 1})",
                        key_node.start_mark)
                seen[key] = key_node.start_mark
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        try:
            return super().construct_yaml_int(node)
        except ValueError:  # (more digits than int() converts: sys.get_int_max_str_digits)
            raise yaml.constructor.ConstructorError(
                None, None, f"the number has more than {sys.get_int_max_str_digits()} digits", node.start_mark) from None


ConfigLoader.add_constructor("tag:yaml.org,2002:int", ConfigLoader.construct_yaml_int)


def load_config(path: os.PathLike | str, checks: list[ModelCheck] = ()) -> Config:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    try:
        data = yaml.load(text, ConfigLoader)  # (safe_load's reader, stricter: ConfigLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())  # ReaderError has no .problem
        raise ConfigError(f"{path}: not valid YAML{at}: {problem}") from None
    except RecursionError:  # the reader recurses once per level of nesting
        raise ConfigError(f"{path}: not valid YAML: nested too deeply") from None
    if data is None:  # an editor's save caught half-way reads as no document: a reload would drain every model
        raise ConfigError(f"{path}: top level: empty (no server settings, no models): a file still being written? "
                          "A server without models says so: `models: []`")
    return parse_config(data, str(path), checks)


def demo_config(**server: Any) -> Config:
    """The built-in config of `openarc serve` without a config file: the tiny chat and embedding demo models on
    the CPU.  Their paths are empty: the CLI builds (or finds in its cache) each kind's demo model."""
    restart = RestartPolicy(backoff_initial_s=0.5, backoff_max_s=10.0, max_failures=10, window_s=300.0)
    chat = ModelConfig(name="demo", path="", device="CPU", restart=restart)  # its own window (appliance.demo.llm)
    embedding = ModelConfig(name="demo-embedding", path="", kind="embedding", device="CPU", max_context=512,
                            restart=dataclasses.replace(restart))
    return Config(server=ServerConfig(**server), models=[chat, embedding])
