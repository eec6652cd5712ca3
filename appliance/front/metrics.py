"""Every Prometheus metric the appliance exports, in one registry owned by the front.

Workers do not write metrics: they send figures over their channel and the front records them here, so there is
no multiprocess directory and a crashed worker cannot leave a half-written file behind.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from appliance.config.window import BOUND_DEFAULT, BOUND_REQUEST, BOUND_WINDOW
from appliance.front.lifecycle import ModelState, best_rank
from appliance.front.priority import CLASSES
from appliance.host.doctor import build_info

MODEL_STATES = tuple(state.value for state in ModelState)
LOAD_REASONS = ("start", "demand", "api", "reload")
UNLOAD_REASONS = ("idle", "evicted", "api")
LOAD_SOURCES = ("cache", "compiled")  # a load found its compiled blobs, or compiled (appliance.host.compile_cache)
CUT_REASONS = (BOUND_REQUEST, BOUND_DEFAULT, BOUND_WINDOW)  # what ends an answer with finish_reason "length"


# A replica's gauges (ModelMetrics field, its replica family, whether the model's gauge is their mean, not sum).
REPLICA_GAUGES = (("requests_running", "replica_requests_running", False),
                  ("requests_waiting", "replica_requests_waiting", False),
                  ("kv_cache_usage", "replica_kv_cache_usage", True), ("worker_rss", "replica_rss", False))


class ReplicaGauge:
    """A replica's gauge as its supervisor writes it: the replica's own series, and its model's (the sum or mean
    over the model's replicas), so the model's existing series stay whole."""

    def __init__(self, metrics: Metrics, name: str, field: str, own: Any, model: Any, mean: bool):
        self.metrics, self.name, self.field, self.own, self.model, self.mean = metrics, name, field, own, model, mean

    def set(self, value: float) -> None:
        self.own.set(value)
        if self.metrics.model_of(self.name) in self.metrics.replicated:  # not a replica left behind by a reload
            self.model.set(self.metrics.replica_value(self.name, self.field, value, self.mean))


@dataclass
class DraftTokens:
    """A model's openarc_draft_tokens_total series and their totals since it was configured (for /openarc/status)."""

    accepted_series: Any
    rejected_series: Any
    accepted: int = 0
    rejected: int = 0

    def add(self, accepted: int, rejected: int) -> None:
        """One speculative request's proposals (its done frame's draft_accepted / draft_rejected)."""
        self.accepted_series.inc(accepted)
        self.rejected_series.inc(rejected)
        self.accepted, self.rejected = self.accepted + accepted, self.rejected + rejected

    def status(self) -> dict[str, Any]:
        total = self.accepted + self.rejected
        return {"draft_tokens_accepted": self.accepted, "draft_tokens_rejected": self.rejected,
                "draft_acceptance_ratio": round(self.accepted / total, 4) if total else None}


@dataclass
class ModelMetrics:
    """One model's series, labelled once: labels() is a locked dict lookup, too dear on every token."""

    worker_restarts: Any
    worker_rss: Any
    requests_running: Any
    requests_waiting: Any
    ttft: Any  # source="computed": most of the prompt computed
    ttft_cached: Any  # source="cache": at least half of the prompt served by the prefix cache
    itl: Any
    model_load: dict[str, Any]  # by where the compiled model came from (LOAD_SOURCES)
    kv_cache_usage: Any
    embedding_inputs: Any
    audio_seconds: Any
    speech_audio_seconds: Any
    speech_characters: Any
    time_to_first_audio: Any
    images_generated: Any
    image_seconds: Any
    image_step_seconds: Any
    draft: DraftTokens  # labelled by outcome too: built apart in for_model
    queue_time: dict[str, Any]  # by priority class
    answers_cut: dict[str, Any]  # by the limit that cut them (CUT_REASONS)
    token_series: Any  # (key, priority) -> TokenSeries, labelled once per pair
    lora_info: Any  # (running adapters, waiting adapters, max_lora) -> None: Metrics.set_lora_info for this model
    adapter: Any  # adapter name -> AdapterSeries: Metrics.adapter_series for this model
    drop_adapter: Any  # adapter name -> None: Metrics.drop_adapter_series for this model (an adapter unloaded)

    def tokens(self, key: str, priority: str) -> TokenSeries:
        """The model's prompt and generation token counters of one key and class (a request labels them once)."""
        return self.token_series(key, priority)


@dataclass
class TokenSeries:
    prompt: Any  # source="computed"
    cached_prompt: Any  # source="cache"
    generation: Any


@dataclass
class AdapterSeries:
    requests: Any
    prompt: Any
    generation: Any


# ModelMetrics fields that are not one child labelled by model alone.
SPECIAL_SERIES = frozenset({"draft", "queue_time", "answers_cut", "token_series", "ttft", "ttft_cached",
                            "model_load", "lora_info", "adapter", "drop_adapter"})


class Metrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.model_kinds: dict[str, str] = {}
        self.requests = Counter("openarc_requests", "HTTP requests, by final status code "
                                "(499: the client hung up before the answer was complete), API key name and class",
                                ["model", "endpoint", "status", "key", "priority"], registry=r)
        self.rate_limited = Counter("openarc_rate_limited", "Requests refused with 429 for their API key's limits, "
                                    "by which: concurrency, requests (a minute) or tokens (a minute)",
                                    ["key", "reason"], registry=r)
        self.request_errors = Counter("openarc_request_errors", "Requests that ended in an error, by kind",
                                      ["model", "kind", "endpoint"], registry=r)
        self.answers_cut = Counter("openarc_answers_cut", "Answers that ended at a token limit (finish_reason "
                                   "length), by the limit: max_tokens (the request's own), default_max_tokens (the "
                                   "model's, for a request that set none) or context_window (what the window left "
                                   "after the prompt)", ["model", "reason"], registry=r)
        self.tool_calls = Counter("openarc_tool_calls", "Tool calls returned to clients", ["model"], registry=r)
        self.ignored_tools = Counter("openarc_ignored_tools", "Tools a request listed whose type the server cannot "
                                     "run (hosted tools: web_search, file_search, ...; Anthropic's server tools) and "
                                     "left out of the prompt, by tool type", ["type"], registry=r)
        self.ignored_inputs = Counter("openarc_ignored_inputs", "Input items and content blocks of a type the model "
                                      "does not need (a hosted tool's call, a server tool's result) that a request "
                                      "carried and the server skipped, by endpoint and type", ["endpoint", "type"],
                                      registry=r)
        self.structured_requests = Counter("openarc_structured_requests",
                                           "Requests whose output was constrained, by constraint kind",
                                           ["model", "kind"], registry=r)
        self.worker_crashes = Counter("openarc_worker_crashes", "Worker processes that died unexpectedly, by signal "
                                      "or exit status and why (crash, worker_error, device_lost, oom_kill)",
                                      ["model", "signal", "reason"], registry=r)
        self.worker_exits = Counter("openarc_worker_exits", "Worker lives that ended, by why (appliance.front.lifecycle."
                                    "ExitReason: crash, stall, spawn_error, load_timeout, stopped, ...)",
                                    ["model", "reason"], registry=r)
        self.canary_failures = Counter("openarc_canary_failures", "Golden-answer checks a model failed after it "
                                       "loaded (server.canary), by why: answer (a different answer), speed (below "
                                       "canary_min_speed of the record), error (a probe failed, the record unreadable), "
                                       "load (a model with a record that failed without loading)",
                                       ["model", "reason"], registry=r)
        self.worker_restarts = Counter("openarc_worker_restarts", "Worker processes started after the first",
                                       ["model"], registry=r)
        self.worker_up = Gauge("openarc_worker_up", "1 while the model's worker is ready", ["model"], registry=r)
        # Always 1: joins any per-model series to the model's kind (`* on (model) group_left (kind)`).
        self.model_info = Gauge("openarc_model_info", "The model's worker kind (llm, vlm, embedding, rerank, transcription, tts)",
                                ["model", "kind"], registry=r)
        self.model_state = Gauge("openarc_model_state", "1 for the model's current state", ["model", "state"], registry=r)
        self.gpu_resets = Counter("openarc_gpu_resets", "GPU hangs and resets seen in the kernel log",
                                  ["device"], registry=r)
        self.gpu_mitigations = Counter("openarc_gpu_mitigations", "Automatic mitigations applied to a card's "
                                       "workers (sdpa_off: restarted with GPU_ENABLE_SDPA_OPTIMIZATION false after "
                                       "repeated fence timeouts or hangs on the card)", ["card", "mitigation"],
                                       registry=r)
        self.device_memory_used = Gauge("openarc_device_memory_used_bytes", "Device (VRAM) memory used by workers",
                                        ["device"], registry=r)
        self.device_memory_total = Gauge("openarc_device_memory_total_bytes", "Device (VRAM) memory size",
                                         ["device"], registry=r)
        self.model_device_memory = Gauge("openarc_model_device_memory_bytes", "GPU buffers of the model's worker by "
                                         "where they are resident (DRM fdinfo): vram, or system memory (evicted)",
                                         ["model", "region"], registry=r)
        self.worker_rss = Gauge("openarc_worker_resident_memory_bytes", "Host RAM resident in the model's worker",
                                ["model"], registry=r)
        self.requests_running = Gauge("openarc_requests_running", "Requests generating in the worker", ["model"], registry=r)
        self.requests_waiting = Gauge("openarc_requests_waiting", "Requests queued in the front, or waiting for the model to be ready", ["model"], registry=r)
        self.prompt_tokens = Counter("openarc_prompt_tokens", "Prompt tokens, by source (computed, or served by the "
                                     "prefix cache: cache), API key name and class",
                                     ["model", "source", "key", "priority"], registry=r)
        self.generation_tokens = Counter("openarc_generation_tokens", "Tokens generated, by API key name and class",
                                         ["model", "key", "priority"], registry=r)
        self.ttft = Histogram("openarc_time_to_first_token_seconds", "Time from request to its first token, by "
                              "where most of its prompt came from (cache: the prefix cache served at least half)",
                              ["model", "source"],
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        self.itl = Histogram("openarc_inter_token_latency_seconds", "Time between tokens of one request", ["model"],
                             buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5), registry=r)
        self.request_duration = Histogram("openarc_request_duration_seconds", "Time to answer a request",
                                          ["model", "endpoint"],
                                          buckets=(.01, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.queue_time = Histogram("openarc_queue_time_seconds", "Time a request waited before reaching the worker, "
                                    "by priority class", ["model", "priority"], buckets=(.001, .005, .01, .05, .1, .5, 1, 5, 10, 30, 60), registry=r)
        self.kv_cache_usage = Gauge("openarc_kv_cache_usage_ratio",
                                    "Share of the model's KV-cache blocks in use by running requests, 0 to 1",
                                    ["model"], registry=r)
        self.model_load = Histogram("openarc_model_load_seconds", "Time to load a model in its worker, by where its "
                                    "compiled model came from: cache (OpenVINO's compiled-model cache held it) or "
                                    "compiled", ["model", "source"],
                                    buckets=(.1, .5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200), registry=r)
        self.embedding_inputs = Counter("openarc_embedding_inputs", "Texts embedded (inputs of /v1/embeddings)",
                                        ["model"], registry=r)
        self.audio_seconds = Counter("openarc_audio_seconds", "Seconds of audio transcribed or translated",
                                     ["model"], registry=r)
        self.speech_audio_seconds = Counter("openarc_speech_audio_seconds", "Seconds of audio synthesised "
                                            "(/v1/audio/speech, before any speed change)", ["model"], registry=r)
        self.speech_characters = Counter("openarc_speech_characters", "Characters of text synthesised to speech",
                                         ["model"], registry=r)
        self.time_to_first_audio = Histogram("openarc_time_to_first_audio_seconds", "Time from a speech request to "
                                             "its first audio (the first sentence synthesised and encoded)", ["model"],
                                             buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30), registry=r)
        # Image models (/v1/images/generations and edits): pictures made, and what one picture and one denoising step
        # took in the worker (a step's time is what stall_timeout_s must exceed).
        self.images_generated = Counter("openarc_images_generated", "Pictures generated by image models (one "
                                        "/v1/images request may make several)", ["model"], registry=r)
        self.image_seconds = Histogram("openarc_image_seconds", "Time to generate one picture (all its denoising "
                                       "steps and its decoding)", ["model"],
                                       buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300), registry=r)
        self.image_step_seconds = Histogram("openarc_image_step_seconds", "Time of one denoising step of an image "
                                            "model", ["model"],
                                            buckets=(.001, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30),
                                            registry=r)
        self.images = Counter("openarc_images", "Images sent to vision models (decoded and checked)", ["model"],
                              registry=r)
        self.image_rejections = Counter("openarc_image_rejections", "Images refused with a 400, by reason "
                                        "(bad_url, bad_base64, too_large, unsupported_format, too_many_pixels, "
                                        "undecodable, fetch_disabled, host_not_allowed, fetch_failed)",
                                        ["model", "reason"], registry=r)
        self.draft_tokens = Counter("openarc_draft_tokens", "Tokens a draft model or prompt lookup proposed, by whether "
                                    "the main model accepted them", ["model", "outcome"], registry=r)
        # Models on demand (appliance.front.residency): what is loaded, why loads and unloads happened, and what
        # the requests that had to wait for a load paid.
        self.model_loaded = Gauge("openarc_model_loaded", "1 while the model is loaded and ready (0: unloaded, "
                                  "loading, restarting, failed)", ["model"], registry=r)
        self.model_loads = Counter("openarc_model_loads", "Model loads, by why: start (load: at_start), demand (a "
                                   "request for an unloaded model), api (POST /openarc/models/NAME/load), reload",
                                   ["model", "reason"], registry=r)
        self.model_unloads = Counter("openarc_model_unloads", "Model unloads, by why: idle (idle_unload_s), evicted "
                                     "(to make room for another model), api (POST /openarc/models/NAME/unload)",
                                     ["model", "reason"], registry=r)
        self.model_load_wait = Histogram("openarc_model_load_wait_seconds", "Time requests spent waiting for their "
                                         "model to load (on demand, at start, or after a restart)", ["model"],
                                         buckets=(.05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        self.model_switch = Histogram("openarc_model_switch_seconds", "What a load on demand (a switch between "
                                      "models) cost, by stage: eviction_wait, old_exit, spawn or handover (a parked "
                                      "worker), startup, construction, first_token, total", ["model", "stage"],
                                      buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60), registry=r)
        # Always 1: what this server runs on, to line a regression up with the update that brought it
        # (appliance.host.doctor.build_info).
        self.build_info = Gauge("openarc_build_info", "openarc's version and what it runs on: OpenVINO, GenAI, "
                                "the kernel, the GPU's kernel driver, the compute runtime and the card",
                                list(build_info.LABELS), registry=r)
        # Replicas (device: [GPU.0, GPU.1]): each replica's gauges by its `device` label (the device, or DEVICE#INDEX
        # where one repeats), beside the model's own series, which add its replicas up (states: the best one's).
        self.replica_up = Gauge("openarc_replica_up", "1 while the replica's worker is ready (models with replicas "
                                "only)", ["model", "device"], registry=r)
        self.replica_state = Gauge("openarc_replica_state", "1 for the replica's current state (models with "
                                   "replicas only)", ["model", "device", "state"], registry=r)
        self.replica_requests_running = Gauge("openarc_replica_requests_running", "Requests generating in the "
                                              "replica's worker", ["model", "device"], registry=r)
        self.replica_requests_waiting = Gauge("openarc_replica_requests_waiting", "Requests queued in the front for "
                                              "the replica, or waiting for it to be ready", ["model", "device"],
                                              registry=r)
        self.replica_kv_cache_usage = Gauge("openarc_replica_kv_cache_usage_ratio", "Share of the replica's KV-cache "
                                            "blocks in use by running requests, 0 to 1", ["model", "device"],
                                            registry=r)
        self.replica_rss = Gauge("openarc_replica_resident_memory_bytes", "Host RAM resident in the replica's "
                                 "worker", ["model", "device"], registry=r)
        self.replicas: dict[str, tuple[str, str]] = {}  # a replica's unit key -> (its model, its device label)
        self.replica_values: dict[tuple[str, str], dict[str, float]] = {}  # (gauge, model) -> unit key -> value
        self.replica_states: dict[str, dict[str, str]] = {}  # model -> unit key -> state
        self.replicated: set[str] = set()  # models whose config has replicas now: their replicas write their state
        self.event_loop_lag = Gauge("openarc_event_loop_lag_seconds", "How late the front's event loop ran a timer",
                                    registry=r)
        self.spool_bytes = Gauge("openarc_spool_bytes", "Bytes of decoded media (chat images, image edits' pictures "
                                 "and masks, audio samples) the front holds in spool files for requests in flight "
                                 "(appliance.front.spool_budget)", registry=r)
        # LoRA (docs/lora.md): vLLM's vllm:lora_requests_info under openarc's prefix, and requests and tokens by
        # adapter for the models that have adapters (the model-wide series above stay as they are).
        self.lora_requests_info = Gauge("openarc_lora_requests_info", "The LoRA adapters of the model's running and "
                                        "waiting requests (comma separated) and max_lora (its max_adapters); the "
                                        "value is when they were set (vLLM's lora_requests_info)",
                                        ["model", "running_lora_adapters", "waiting_lora_adapters", "max_lora"],
                                        registry=r)
        self.lora_labels: dict[str, tuple[str, ...]] = {}
        self.adapter_requests = Counter("openarc_adapter_requests", "Generation requests of a model with LoRA "
                                        "adapters, by adapter (\"\": the base model)", ["model", "adapter"], registry=r)
        self.adapter_prompt_tokens = Counter("openarc_adapter_prompt_tokens", "Prompt tokens of a model with LoRA "
                                             "adapters, by adapter", ["model", "adapter"], registry=r)
        self.adapter_generation_tokens = Counter("openarc_adapter_generation_tokens", "Tokens generated by a model "
                                                 "with LoRA adapters, by adapter", ["model", "adapter"], registry=r)
        self.adapter_labelled: dict[tuple[str, str], AdapterSeries] = {}

    def set_lora_info(self, model: str, running: list[str], waiting: list[str], max_lora: int) -> None:
        """vLLM's lora_requests_info in its shape (what the Gateway API Inference Extension's endpoint picker reads
        for LoRA affinity): one series a model, its labels the adapters of running and waiting requests (comma
        separated) and max_lora, its value the time they were set (the picker reads the latest). The model's
        previous series goes, so the page holds one a model."""
        labels = (model, ",".join(sorted(set(running))), ",".join(sorted(set(waiting))), str(max_lora))
        previous = self.lora_labels.get(model)
        if previous == labels:
            return
        if previous is not None:
            self.lora_requests_info.remove(*previous)
        self.lora_labels[model] = labels
        self.lora_requests_info.labels(*labels).set(time.time())

    def adapter_series(self, model: str, adapter: str) -> AdapterSeries:
        """The request and token counters of one adapter of a model that has adapters ("": its base)."""
        key = (model, adapter)
        if key not in self.adapter_labelled:
            self.adapter_labelled[key] = AdapterSeries(
                *(counter.labels(model=model, adapter=adapter) for counter in
                  (self.adapter_requests, self.adapter_prompt_tokens, self.adapter_generation_tokens)))
        return self.adapter_labelled[key]

    def drop_adapter_series(self, model: str, adapter: str) -> None:
        """An adapter unloaded at runtime: its series go (else every name ever loaded would stay a series on the page
        for as long as the server runs)."""
        if self.adapter_labelled.pop((model, adapter), None) is not None:
            for counter in (self.adapter_requests, self.adapter_prompt_tokens, self.adapter_generation_tokens):
                counter.remove(model, adapter)

    def add_replica(self, key: str, model: str, device: str) -> None:
        """A replica's unit key (appliance.config.replicas): its series are its model's, its gauges its own."""
        self.replicas[key] = (model, device)
        self.replicated.add(model)

    def add_model(self, name: str) -> None:
        """A model served by one worker (again: a reload may have taken its replicas away). From now on its own
        supervisor writes its state; a leaving replica's last states no longer do."""
        self.replicated.discard(name)
        self.replica_states.pop(name, None)
        for field, model in [k for k in self.replica_values if k[1] == name]:
            del self.replica_values[field, model]

    def model_of(self, name: str) -> str:
        """The `model` label of a model's or a replica's series."""
        return self.replicas.get(name, (name,))[0]

    def for_model(self, name: str, kind: str = "llm") -> ModelMetrics:
        """The model's series, created at zero so dashboards and rate() see the model before its first event. A
        replica's (`name` its unit key) counts into its model's counters; its gauges are the replica's own, and
        the model's gauge adds its replicas up."""
        model = self.model_of(name)
        self.set_state(name, "stopped")
        previous = self.model_kinds.get(model)
        if previous not in (None, kind):  # a reload changed the model's kind
            self.model_info.remove(model, previous)
        self.model_kinds[model] = kind
        self.model_info.labels(model=model, kind=kind).set(1)
        series = {field: getattr(self, field).labels(model=model) for field in ModelMetrics.__annotations__
                  if field not in SPECIAL_SERIES}
        series["ttft"] = self.ttft.labels(model=model, source="computed")
        series["ttft_cached"] = self.ttft.labels(model=model, source="cache")
        draft = DraftTokens(*(self.draft_tokens.labels(model=model, outcome=o) for o in ("accepted", "rejected")))
        queue_time = {priority: self.queue_time.labels(model=model, priority=priority) for priority in CLASSES}
        model_load = {source: self.model_load.labels(model=model, source=source) for source in LOAD_SOURCES}
        answers_cut = {reason: self.answers_cut.labels(model=model, reason=reason) for reason in CUT_REASONS}
        for reason in LOAD_REASONS:
            self.model_loads.labels(model=model, reason=reason)
        for reason in UNLOAD_REASONS:
            self.model_unloads.labels(model=model, reason=reason)
        if name in self.replicas:
            device = self.replicas[name][1]
            for field, family, mean in REPLICA_GAUGES:
                series[field] = ReplicaGauge(self, name, field, getattr(self, family).labels(model=model, device=device),
                                             series[field], mean)
        return ModelMetrics(**series, draft=draft, queue_time=queue_time, answers_cut=answers_cut, model_load=model_load,
                            token_series=self._token_series(model),
                            lora_info=functools.partial(self.set_lora_info, model),
                            adapter=functools.partial(self.adapter_series, model),
                            drop_adapter=functools.partial(self.drop_adapter_series, model))

    def replica_value(self, name: str, field: str, value: float, mean: bool) -> float:
        """A replica's figure recorded; what its model's gauge shows now (the sum, or the mean, over replicas)."""
        values = self.replica_values.setdefault((field, self.model_of(name)), {})
        values[name] = value
        return sum(values.values()) / (len(values) if mean else 1)

    def _token_series(self, model: str):
        labelled: dict[tuple[str, str], TokenSeries] = {}

        def tokens(key: str, priority: str) -> TokenSeries:
            if (key, priority) not in labelled:
                labelled[key, priority] = TokenSeries(
                    *(self.prompt_tokens.labels(model=model, source=source, key=key, priority=priority)
                      for source in ("computed", "cache")),
                    self.generation_tokens.labels(model=model, key=key, priority=priority))
            return labelled[key, priority]
        return tokens

    def set_build_info(self, labels: dict[str, str]) -> None:
        self.build_info.clear()
        self.build_info.labels(**labels).set(1)

    def set_device_memory(self, name: str, regions: dict[str, int]) -> None:
        """A worker's {vram, system} resident bytes (its telemetry frame's device_memory_regions); a replica's add
        up to its model's, as its resident memory does."""
        model = self.model_of(name)
        for region, size in regions.items():
            if region in ("vram", "system"):
                if name in self.replicas and model in self.replicated:
                    size = self.replica_value(name, f"device_memory_{region}", size, mean=False)
                self.model_device_memory.labels(model=model, region=region).set(size)

    def set_state(self, name: str, state: str) -> None:
        """A model's state, or a replica's (its unit key): then its model's state is its best replica's."""
        if name in self.replicas:
            model, device = self.replicas[name]
            for each in MODEL_STATES:
                self.replica_state.labels(model=model, device=device, state=each).set(1 if each == state else 0)
            self.replica_up.labels(model=model, device=device).set(1 if state == "ready" else 0)
            if model not in self.replicated:  # a replica leaving after a reload to one device: not the model's state
                return
            states = self.replica_states.setdefault(model, {})
            states[name] = state
            name, state = model, min(states.values(), key=lambda each: best_rank(ModelState(each)))
        elif name in self.replicated:  # a single worker leaving after a reload to replicas: theirs is the state
            return
        model = name
        for name in MODEL_STATES:
            self.model_state.labels(model=model, state=name).set(1 if name == state else 0)
        self.worker_up.labels(model=model).set(1 if state == "ready" else 0)
        self.model_loaded.labels(model=model).set(1 if state == "ready" else 0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
