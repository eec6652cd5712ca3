"""The YAML config as a user writes it: valid files load, every mistake is one line naming file and key."""

from __future__ import annotations

import copy
import os
import re
import socket
import subprocess
import sys

import pytest
import yaml

from appliance.config import ConfigError, load_config
from conftest import REPO, model_entry


def write(tmp_path, data) -> str:
    path = tmp_path / "openarc.yaml"
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return str(path)


def error_of(tmp_path, data) -> str:
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(path + ": "), message
    assert "\n" not in message
    return message


FULL = {
    "server": {"host": "0.0.0.0", "port": 9000, "api_key_env": "OPENARC_KEY", "max_body_bytes": 65536,
               "drain_timeout_s": 5, "load_concurrency": 1},
    "models": [
        {"name": "qwen-14b", "path": "/models/qwen", "device": "GPU.0", "port": 9001, "sdpa_optimization": False,
         "runtime_config": {"KV_CACHE_PRECISION": "u8"}, "scheduler_config": {"cache_size": 4, "max_num_seqs": 8},
         "max_context": 8192, "max_queue": 16, "stall_timeout_s": 30,
         "restart": {"backoff_initial_s": 2, "backoff_max_s": 120, "max_failures": 3, "window_s": 900}},
        {"name": "small", "path": "/models/small", "device": "CPU", "pipeline": "stateful"},
    ],
}


def test_full_config_loads_with_values_and_defaults(tmp_path):
    config = load_config(write(tmp_path, FULL))
    gpu, cpu = config.models
    assert config.server.port == 9000 and gpu.port == 9001
    assert gpu.restart.max_failures == 3 and gpu.restart.backoff_initial_s == 2.0
    assert cpu.max_queue == 32 and cpu.restart.max_failures == 5  # defaults
    assert config.only("qwen-14b").server.port == 9001
    assert config.only("small").server.port == 9000


def test_gpu_models_default_to_weightless_and_map_sdpa_option(tmp_path):
    config = load_config(write(tmp_path, FULL))
    gpu, cpu = config.models
    props = gpu.ov_properties(cache_dir="/var/cache/openarc/ov")
    assert props == {"CACHE_DIR": "/var/cache/openarc/ov", "ENABLE_WEIGHTLESS": True,
                     "GPU_ENABLE_SDPA_OPTIMIZATION": False, "KV_CACHE_PRECISION": "u8"}
    assert cpu.ov_properties(None) == {"ATTENTION_BACKEND": "SDPA"}


def test_runtime_config_overrides_first_class_options(tmp_path):
    data = {"models": [{"name": "m", "path": "/m", "device": "GPU", "runtime_config": {"ENABLE_WEIGHTLESS": False}}]}
    assert load_config(write(tmp_path, data)).models[0].ov_properties(None)["ENABLE_WEIGHTLESS"] is False


@pytest.mark.parametrize("data, expected", [
    ({"server": {"prot": 1}}, "server.prot: unknown key (did you mean 'port'?)"),
    ({"server": {"colour": 1}}, "server.colour: unknown key (expected one of: host, port,"),
    ({"server": {"port": "8000"}}, "server.port: expected an integer, got '8000'"),
    ({"server": {"port": True}}, "server.port: expected an integer, got True"),
    ({"server": {"port": 70000}}, "server.port: expected a port number 1-65535"),
    ({"models": [{"name": "a"}]}, "models[0].path: required key is missing (a string)"),
    ({"models": [{"name": "a", "path": "/a", "device": "cpu"}]},
     "models[0].device: expected an OpenVINO device name such as CPU, GPU, GPU.0 or AUTO (names are upper case), "
     "or auto (the placer picks the card with room)"),
    ({"models": [{"name": "a", "path": "/a", "device": "GPU.\u0661"}]},  # an Arabic-Indic one: no card's number
     "models[0].device: expected an OpenVINO device name such as CPU, GPU, GPU.0 or AUTO"),
    ({"models": [{"name": "a", "path": "/a", "pipeline": "paged"}]},
     "models[0].pipeline: expected one of 'continuous_batching', 'stateful', got 'paged'"),
    ({"models": [{"name": "a", "path": "/a", "scheduler_config": {"num_blocks": 4}}]},
     "models[0].scheduler_config.num_blocks: expected a SchedulerConfig field"),
    ({"models": [{"name": "a", "path": "/a", "scheduler_config": {"num_kv_blocks": "4"}}]},
     "models[0].scheduler_config.num_kv_blocks: expected an integer, got '4'"),
    ({"models": [{"name": "a", "path": "/a", "restart": {"max_failures": 0}}]}, "models[0].restart.max_failures: expected"),
    ({"models": [{"name": "a", "path": "/a", "restart": {"window": 5}}]}, "models[0].restart.window: unknown key"),
    ({"models": [{"name": "a b", "path": "/a"}]}, "models[0].name: expected letters, digits"),
    ({"models": [{"name": "a", "path": "/a", "ready_wait_s": -1}]}, "models[0].ready_wait_s: expected 0 to 3600 seconds"),
    ("models: [{name: a, path: /a, ready_wait_s: .inf}]\n", "models[0].ready_wait_s: expected 0 to 3600 seconds"),
    ({"models": [{"name": "a", "path": "/a", "reload": "rolling"}]},
     "models[0].reload: expected one of 'side_by_side', 'restart', got 'rolling'"),
    ({"models": [{"name": "a", "path": "/a"}, {"name": "a", "path": "/b"}]}, "models[1].name: expected a unique model name"),
    ({"models": {"name": "a"}}, "models: expected a list"),
    ({"models": [{"name": "a", "path": "/a", "kind": "speech"}]},
     "models[0].kind: expected one of 'llm', 'vlm', 'embedding', 'rerank', 'transcription', 'tts', 'image', got 'speech'"),
    ({"models": [{"name": "a", "path": "/a", "voices": {"x": "x.bin"}}]},
     "models[0].voices: applies to kind 'tts' models only (this one is kind 'llm')"),
    ({"models": [{"name": "a", "path": "/a", "kind": "tts", "voices": {"x": 3}}]}, "models[0].voices.x: expected"),
    ({"models": [{"name": "a", "path": "/a", "kind": "tts", "voices": {"x": "x.bin"}, "default_voice": "y"}]},
     "models[0].default_voice: expected one of the model's voices (x)"),
    ({"models": [{"name": "a", "path": "/a", "pooling": "mean"}]},
     "models[0].pooling: applies to kind 'embedding' models only (this one is kind 'llm')"),
    ({"models": [{"name": "a", "path": "/a", "kind": "rerank", "scheduler_config": {}}]},
     "models[0].scheduler_config: applies to kind 'llm' or 'vlm' models only (this one is kind 'rerank')"),
    ({"models": [{"name": "a", "path": "/a", "kind": "embedding", "pooling": "max"}]},
     "models[0].pooling: expected one of 'cls', 'mean', 'last_token' or null, got 'max'"),
    ({"models": [{"name": "a", "path": "/a", "kind": "embedding", "matryoshka_dimensions": [64, 0]}]},
     "models[0].matryoshka_dimensions: expected a list of positive integers"),
    ({"models": [{"name": "a", "path": "/a", "kind": "embedding", "max_inputs": 0}]},
     "models[0].max_inputs: expected at least 1"),
    ({"models": [{"name": "a", "path": "/a", "word_timestamps": True}]},
     "models[0].word_timestamps: applies to kind 'transcription' models only (this one is kind 'llm')"),
    ({"models": [{"name": "a", "path": "/a", "kind": "transcription", "max_audio_seconds": 0}]},
     "models[0].max_audio_seconds: expected a positive number of seconds"),
    ({"models": [{"name": "a", "path": "/a", "kind": "transcription", "max_upload_bytes": 100}]},
     "models[0].max_upload_bytes: expected at least 1024"),
    ({"server": {"model_aliases": {"claude-*": "coder"}}, "models": [{"name": "a", "path": "/a"}]},
     "server.model_aliases.claude-*: 'coder' is not a configured model (have: a)"),
    ({"server": {"model_aliases": {"gpt-5*": 5}}, "models": [{"name": "a", "path": "/a"}]},
     "server.model_aliases.gpt-5*"),
    ({"server": {"canary": "sometimes"}}, "server.canary: expected one of 'off', 'warn', 'gate', got 'sometimes'"),
    ({"server": {"canary_min_speed": 2}},
     "server.canary_min_speed: expected a share of the recorded speed from 0 to 1 (0: speed is not checked)"),
    # (a key twice: YAML forbids it, and PyYAML kept the last one, silently dropping the first's models or settings)
    ("models: [{name: a, path: /a}]\nserver: {port: 80}\nmodels: []\n",
     "not valid YAML (line 3, column 1): 'models' appears twice in one mapping (first at line 1)"),
    ("models:\n  - {name: a, path: /a, device: CPU, device: GPU}\n",
     "not valid YAML (line 2, column 38): 'device' appears twice in one mapping (first at line 2)"),
    ("server: {port: " + "9" * 5000 + "}\n", "not valid YAML (line 1, column 16): the number has more than "),
    ("- just\n- a list\n", "top level: expected a mapping"),
    ("server: {port: 80\n", "not valid YAML (line 2, column 1)"),
])
def test_each_mistake_is_one_line_naming_file_and_key(tmp_path, data, expected):
    assert expected in error_of(tmp_path, data)


@pytest.mark.parametrize("text", [
    "server:\n  memory_budget: " + "[" * 5000 + "]" * 5000 + "\n",
    "models:\n" + "".join("  " * depth + "a:\n" for depth in range(1, 2000)),
], ids=["flow", "block"])
def test_yaml_nested_past_the_readers_depth_is_a_config_error(tmp_path, text):
    """The YAML reader recurses per level: a config nested thousands deep is a one-line config error naming the
    file, not a RecursionError traceback from `openarc serve` or a reload."""
    assert "not valid YAML: nested too deeply" in error_of(tmp_path, text)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="missing.yaml: cannot read config: No such file"):
        load_config(tmp_path / "missing.yaml")


def run_cli(*args, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **env} if env else None)


def with_paths(data: dict, *paths) -> dict:
    """`data` with its models' paths replaced by real model directories (check-config reads them)."""
    data = copy.deepcopy(data)
    for model, path in zip(data["models"], paths):
        model["path"] = str(path)
    return data


def test_check_config_exits_zero_on_a_valid_file(tmp_path, demo_model):
    path = write(tmp_path, with_paths(FULL, demo_model, demo_model))
    done = run_cli("check-config", path, env={"OPENARC_KEY": "k"})  # server.api_key_env's variable must be set
    assert done.returncode == 0, done.stderr
    assert "OK: qwen-14b (GPU.0), small (CPU)" in done.stdout
    unset = {k: v for k, v in os.environ.items() if k != "OPENARC_KEY"}
    done = subprocess.run([sys.executable, "-m", "appliance", "check-config", path], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env=unset)
    assert done.returncode == 2 and "server.api_key_env: the environment variable OPENARC_KEY is not set" in done.stderr


def test_check_config_names_each_model_kind_but_llm(tmp_path, demo_model, embedding_model, rerank_model):
    data = {"models": [{"name": "chat", "path": str(demo_model)},
                       {"name": "bge", "path": str(embedding_model), "kind": "embedding", "device": "GPU.0",
                        "pooling": "mean"},
                       {"name": "rank", "path": str(rerank_model), "kind": "rerank"}]}
    done = run_cli("check-config", write(tmp_path, data))
    assert done.returncode == 0, done.stderr
    assert "OK: chat (CPU), bge (GPU.0, embedding), rank (CPU, rerank)" in done.stdout


def test_check_config_exits_nonzero_with_one_clear_line(tmp_path, demo_model):
    path = write(tmp_path, {"models": [{"name": "a", "path": str(demo_model), "devise": "GPU"}]})
    done = run_cli("check-config", path)
    assert done.returncode == 2
    assert done.stderr.strip() == f"openarc: config error: {path}: models[0].devise: unknown key (did you mean 'device'?)"
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_check_config_prints_every_error_at_once(tmp_path, demo_model):
    """Five mistakes of five kinds: five lines, each with file, key path and what was expected."""
    data = {"server": {"port": "8000", "log_levle": "debug"},
            "models": [{"name": "chat", "path": str(demo_model), "devise": "GPU"},
                       {"name": "lost", "path": str(tmp_path / "no-such-model")},
                       {"name": "third", "path": str(demo_model), "device": "gpu"}]}
    path = write(tmp_path, data)
    done = run_cli("check-config", path)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [f"openarc: config error: {path}: {line}" for line in (
        "server.log_levle: unknown key (did you mean 'log_level'?)",
        "server.port: expected an integer, got '8000'",
        "models[0].devise: unknown key (did you mean 'device'?)",
        "models[2].device: expected an OpenVINO device name such as CPU, GPU, GPU.0 or AUTO (names are upper case), "
        "or auto (the placer picks the card with room)",
        f"models[1].path: expected an OpenVINO model directory; {str(tmp_path / 'no-such-model')!r} does not exist "
        "(model 'lost')")]


def test_check_config_refuses_a_directory_that_is_not_its_kinds_model(tmp_path, demo_model, embedding_model):
    path = write(tmp_path, {"models": [{"name": "asr", "path": str(embedding_model), "kind": "transcription"},
                                       {"name": "chat", "path": str(demo_model)}]})
    done = run_cli("check-config", path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"openarc: config error: {path}: models[0].path: expected an OpenVINO IR directory for kind 'transcription'; "
        f"{str(embedding_model)!r} lacks openvino_encoder_model.xml/.bin, openvino_decoder_model.xml/.bin "
        "(it holds a model of kind 'embedding'; use kind: embedding) (model 'asr')")


def test_strict_checks_each_models_device_is_present(tmp_path, demo_model):
    """This machine has no GPU (OpenVINO lists CPU only): --strict says so; without it the device is not checked."""
    path = write(tmp_path, {"models": [{"name": "cpu", "path": str(demo_model)},
                                       {"name": "gpu", "path": str(demo_model), "device": "HETERO:GPU.1,CPU"}]})
    assert run_cli("check-config", path).returncode == 0
    done = run_cli("check-config", "--strict", path)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"openarc: config error: {path}: models[1].device: expected a device present here "
                                   "(CPU); GPU.1 is not (model 'gpu')")


def test_serve_refuses_an_invalid_config_without_starting(tmp_path):
    done = run_cli("serve", "--config", write(tmp_path, {"server": {"port": 0}}))
    assert done.returncode == 2
    assert "server.port: expected a port number" in done.stderr


def test_memory_budget_keys_and_values_it_cannot_use_are_one_line_each(tmp_path, demo_model):
    """A float and a null are no sizes (they crashed check-config and serve with a traceback); bare GPU is GPU.0,
    as in models' devices, so a model over it is refused as one that could never load (it limited nothing)."""
    data = {"server": {"memory_budget": {"GPU": "4GiB", "CPU": 14.5, "GPU.1": None, "NPU": "0GiB"}},
            "models": [{"name": "big", "path": str(demo_model), "device": "GPU", "memory": "5GiB",
                        "load": "on_demand"}]}
    path = write(tmp_path, data)
    expected = [f"openarc: config error: {path}: {line}" for line in (
        "server.memory_budget.CPU: expected a size with its unit such as 14GiB or 32GB, got 14.5",
        "server.memory_budget.GPU.1: expected a size with its unit such as 14GiB or 32GB, got None",
        "server.memory_budget.NPU: expected a size with its unit such as 14GiB or 32GB, got '0GiB'",
        "models[0].memory: 5GiB exceeds server.memory_budget.GPU (4GiB); this model could never load")]
    for command in (["check-config", path], ["serve", "--config", path]):
        done = run_cli(*command)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        assert done.stderr.splitlines() == expected, command
    data["server"]["memory_budget"], data["models"][0]["memory"] = {"GPU": "4GiB", "GPU.0": "6GiB"}, "3GiB"
    done = run_cli("check-config", write(tmp_path, data))
    assert done.stderr.splitlines() == [f"openarc: config error: {path}: server.memory_budget.GPU.0: names the same "
                                        "device as server.memory_budget.GPU (GPU.0; bare GPU is GPU.0)"]


def test_sizes_past_a_float_are_one_line_each_not_a_traceback(tmp_path, demo_model):
    """`1e400`, `inf` and `nan` (and an int past any device) crashed check-config and serve with an OverflowError."""
    data = {"server": {"memory_budget": {"CPU": "1e400", "GPU": "inf", "GPU.1": 10 ** 400}},
            "models": [{"name": "big", "path": str(demo_model), "device": "CPU", "memory": "nan",
                        "load": "on_demand"}]}
    path = write(tmp_path, data)
    for command in (["check-config", path], ["serve", "--config", path]):
        done = run_cli(*command)
        assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
        lines = done.stderr.splitlines()
        for key in ("server.memory_budget.CPU", "server.memory_budget.GPU:", "server.memory_budget.GPU.1",
                    "models[0].memory"):
            assert any(f"{path}: {key}" in line for line in lines), (key, lines)


def test_a_bare_gpu_budget_counts_against_gpu_0():
    from appliance.config import parse_config
    config = parse_config({"server": {"memory_budget": {"GPU": "14GiB"}},
                           "models": [{"name": "a", "path": "/m", "device": "GPU", "load": "on_demand"}]}, "o.yaml")
    assert config.server.memory_budget_bytes == {"GPU.0": 14 << 30}


def test_serve_on_a_taken_port_is_one_line_and_starts_no_worker(tmp_path, demo_model):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = run_cli("serve", "--config", write(tmp_path, {"models": [{"name": "demo", "path": str(demo_model)}]}),
                       "--port", str(port))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == (f"openarc: config error: cannot listen on http://127.0.0.1:{port}: "
                                                    "Address already in use")
    assert "Traceback" not in done.stderr and "stopped -> loading" not in done.stderr


def test_serve_model_must_exist_in_the_config(tmp_path):
    done = run_cli("serve", "--config", write(tmp_path, FULL), "--model", "nope")
    assert done.returncode == 2
    assert "no model named 'nope' (have: qwen-14b, small)" in done.stderr


# --- several GPUs ------------------------------------------------------------------------------------------

@pytest.fixture
def two_models(demo_model):
    def config(first_device: str, second_device: str) -> dict:
        return {"models": [{"name": "a", "path": str(demo_model), "device": first_device, "port": 8001},
                           {"name": "b", "path": str(demo_model), "device": second_device, "port": 8002}]}
    return config


@pytest.mark.parametrize("first,second,gpu", [("GPU.0", "GPU.0", 0), ("GPU", "GPU.0", 0),
                                              ("HETERO:GPU.1,CPU", "GPU.1", 1)])
def test_check_config_warns_when_two_models_share_a_gpu(tmp_path, two_models, first, second, gpu):
    path = write(tmp_path, two_models(first, second))
    done = run_cli("check-config", path)
    assert done.returncode == 0, done.stderr
    assert f"OK: a ({first}), b ({second})" in done.stdout
    assert done.stderr.strip() == (f"openarc: warning: {path}: models[0].device, models[1].device: models 'a', 'b' "
                                   f"share GPU.{gpu} (bare GPU is GPU.0) and its memory; give each model its own "
                                   "card (GPU.0, GPU.1, ...) unless that is meant")


@pytest.mark.parametrize("first,second", [("GPU.0", "GPU.1"), ("GPU", "GPU"), ("GPU.1", "CPU"), ("AUTO", "GPU.0")])
def test_check_config_is_quiet_about_one_card_per_model(tmp_path, two_models, first, second):
    """Bare GPU everywhere is one card's box, or Kubernetes pods that each see only their own card."""
    done = run_cli("check-config", write(tmp_path, two_models(first, second)))
    assert done.returncode == 0 and done.stderr == ""


def test_multi_gpu_example_gives_each_card_its_model_and_port(tmp_path, demo_model):
    example = REPO / "units" / "openarc.multi-gpu.yaml"
    config = load_config(example)
    assert [(m.device, m.port) for m in config.models] == [("GPU.0", 8001), ("GPU.1", 8002)]
    # On a box with the model it names, check-config is quiet.
    data = with_paths(yaml.safe_load(example.read_text()), demo_model, demo_model)
    assert run_cli("check-config", write(tmp_path, data)).stderr == ""
    # The same file with both models on one card is what the warning is for.
    data["models"][1]["device"] = "GPU.0"
    assert "models 'qwen-gpu0', 'qwen-gpu1' share GPU.0" in run_cli("check-config", write(tmp_path, data)).stderr


# --- the server's start checks the model directories as check-config does -------------------------------------

def test_serve_names_every_bad_model_at_start_and_serves_the_good_ones(appliance_factory, demo_model,
                                                                      embedding_model, tmp_path):
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 1, "window_s": 60}
    missing = tmp_path / "no-such-model"
    app = appliance_factory({"models": [model_entry("lost", missing, restart=budget),
                                        model_entry("asr", embedding_model, kind="transcription", restart=budget),
                                        model_entry("chat", demo_model)]}, wait_ready=False)
    lost, asr = app.wait_model("lost", "failed"), app.wait_model("asr", "failed")
    app.wait_model("chat", "ready")
    logs = app.logs()
    assert (f"models[0].path: expected an OpenVINO model directory; {str(missing)!r} does not exist (model 'lost'); "
            "this model will not load") in logs
    assert "models[1].path: expected an OpenVINO IR directory for kind 'transcription'" in logs
    for status in (lost, asr):
        assert status["last_exit"] == "load_error" and status["pid"] is None
    assert "does not exist" in lost["last_error"] and "openvino_encoder_model.xml/.bin" in asr["last_error"]
    assert "worker[lost]" not in logs and "worker[asr]" not in logs  # no worker was started for either
    reply = app.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_model_aliases_are_globs_tried_in_order_after_exact_names(tmp_path):
    path = tmp_path / "openarc.yaml"
    path.write_text(yaml.safe_dump({"server": {"model_aliases": {"claude-haiku-*": "small", "claude-*": "big"}},
                                    "models": [{"name": "big", "path": "/a"}, {"name": "small", "path": "/b"}]},
                                   sort_keys=False))  # the order as written is the order tried
    server = load_config(path).server
    assert server.alias_target("claude-haiku-4-5") == "small" and server.alias_target("claude-opus-4-1") == "big"
    assert server.alias_target("gpt-5") is None and server.alias_target("Claude-x") is None  # case counts


def test_check_config_and_doctor_say_what_a_window_costs(tmp_path, demo_model):
    """Unset, a window is the model's own (the demo's 131072); an explicit max_context is priced in KV memory (the
    demo's 384 bytes a token at u8), and one past what the cache holds or the model was trained for is a warning."""
    from appliance.config import load_config
    from appliance.host.doctor import config_checks
    data = {"models": [{"name": "own", "path": str(demo_model)},
                       {"name": "priced", "path": str(demo_model), "max_context": 65536},
                       {"name": "untrained", "path": str(demo_model), "max_context": 300000},
                       {"name": "cramped", "path": str(demo_model), "max_context": 65536,
                        "scheduler_config": {"num_kv_blocks": 100}}]}  # of 32 tokens on the CPU
    path = write(tmp_path, data)
    done = run_cli("check-config", path)
    assert done.returncode == 0, done.stderr
    assert "model own: context window 131072 tokens (the model's own; its KV cache holds" in done.stdout
    assert "model priced: context window 65536 tokens (max_context" in done.stdout
    assert "max_context 65536 costs 24 MiB of KV cache for one full sequence" in done.stdout
    assert "model untrained: max_context 300000 is more than the model was trained for (131072" in done.stderr
    assert ("model cramped: max_context 65536 is more than its KV cache holds for one sequence (3200 tokens): "
            "set scheduler_config.cache_size to at least 1 (GB)") in done.stderr
    checks = {c.detail.split(":")[0]: c for c in config_checks.window_checks(load_config(path))}
    assert checks["model own"].status == "ok" and checks["model priced"].status == "ok"
    assert checks["model untrained"].status == checks["model cramped"].status == "warn"


def test_an_unquoted_off_is_the_word_off(tmp_path):
    """YAML 1.1 reads `off` as false: a choice that has the word off takes it as meant (server.canary,
    models[].gpu_mitigations)."""
    config = load_config(write(tmp_path, "server: {canary: off}\nmodels: [{name: a, path: /a, gpu_mitigations: off}]\n"))
    assert config.server.canary == "off" and config.models[0].gpu_mitigations == "off"
    assert load_config(write(tmp_path, "server: {}\n")).server.canary == "warn"
    assert "server.canary: expected one of 'off', 'warn', 'gate', got True" in error_of(tmp_path, "server: {canary: on}\n")


@pytest.mark.parametrize("text", ["", "\n  \n", "# being written\n"])
def test_an_empty_config_file_is_an_error_so_a_reload_of_a_half_written_file_keeps_the_models(tmp_path, text):
    """A SIGHUP that reads a config an editor is still writing (empty, or only its comments so far) was a config of
    no models, and the reload drained every model (found by the breaker's stress run); it is an error naming the
    file, and a reload of an invalid file changes nothing. `models: []` still says "no models" on purpose."""
    path = tmp_path / "openarc.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: top level: empty "):
        load_config(path)
    path.write_text("models: []\n")
    assert load_config(path).models == []
