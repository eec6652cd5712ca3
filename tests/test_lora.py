"""LoRA adapters (issue 40, docs/lora.md): the demo adapters built from nothing, what OpenVINO GenAI allows with them
(the facts openarc's scheduling rests on), the config, the rotation policy, and a live server whose interleaved
requests of two adapters and the base each get their own adapter's answer, equal to in-process genai's, with
adapters loaded and unloaded at runtime behind the API key."""

from __future__ import annotations

import collections
import contextlib
import concurrent.futures
import json
import os
import time
import shutil
import signal
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config import ConfigError, parse_config, path_check
from appliance.worker.adapter_rotation import BASE, may_join, next_group
from appliance.worker.engines.base import STEP_DELAY_ENV
from conftest import Appliance, http, model_entry, pid_alive, wait_until

KEY_ENV = "TEST_OPENARC_LORA_KEY"
KEY = "lora-test-key"


@pytest.fixture(scope="module")
def lora_dir(demo_model) -> Path:
    """The demo model's directory's parent, holding the two demo adapters (upper, title) beside it."""
    from appliance.demo.catalog import build_demo_adapter
    for family in ("upper", "title"):
        build_demo_adapter(demo_model.parent / family, family, demo_model)
    return demo_model.parent


@pytest.fixture(scope="module")
def genai_adapters(lora_dir):
    import openvino_genai
    return {family: openvino_genai.Adapter(str(lora_dir / family / "adapter_model.safetensors"))
            for family in ("upper", "title")}


@pytest.fixture(scope="module")
def in_process(demo_model, genai_adapters):
    """answer(prompt text, adapter name or BASE): greedy in-process genai (LLMPipeline) with that one adapter."""
    import openvino_genai
    config = openvino_genai.AdapterConfig(openvino_genai.AdapterConfig.Mode.MODE_DYNAMIC)
    for adapter in genai_adapters.values():
        config.add(adapter, 1.0)
    pipe = openvino_genai.LLMPipeline(str(demo_model), "CPU", adapters=config)

    def answer(text: str, adapter: str = BASE, max_new_tokens: int = 64, chat: bool = False) -> str:
        generation = openvino_genai.GenerationConfig()
        generation.max_new_tokens = max_new_tokens
        generation.apply_chat_template = chat
        # one adapter a config, as the worker does (an empty config mis-applies later switches: see below)
        generation.adapters = openvino_genai.AdapterConfig(genai_adapters[adapter or "upper"], 1.0 if adapter else 0.0)
        return str(pipe.generate(text, generation))
    return answer


# --- the demo adapters and what genai allows --------------------------------------------------------------------

def test_demo_adapters_restyle_every_word_and_the_base_is_unchanged(in_process):
    for prompt in ("hello", "what is the weather like?", "a longer prompt of several words"):
        base = in_process(prompt)
        assert base and base[1:] == base[1:].lower(), base  # the demo's plain walk
        assert in_process(prompt, "upper") == base.upper()
        assert in_process(prompt, "title") == " ".join(w[:1].upper() + w[1:] for w in base.split(" "))
        assert in_process(prompt) == base  # and back: the adapter left nothing behind


def test_demo_adapter_cli_builds_into_the_cache(tmp_path):
    import subprocess
    import sys
    env = {"OPENARC_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--adapter", "title", "--eos-after", "4"],
                          capture_output=True, text=True, env={**env, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert done.returncode == 0, done.stderr
    adapter = Path(done.stdout.strip())
    assert (adapter / "adapter_model.safetensors").is_file()
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["lm_head"]
    wrong = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--adapter", "shouty"], capture_output=True,
                           text=True, env={**env, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert wrong.returncode == 2 and "no demo adapter 'shouty' (have: upper, title)" in wrong.stderr


def test_continuous_batching_applies_adapters_in_generate_only(demo_model, genai_adapters, in_process):
    """The facts the worker's adapter groups rest on (genai 2026.4.1): add_request ignores
    GenerationConfig.adapters, generate() applies them but refuses while requests run, and what generate() applied
    stays for the requests added after it."""
    import openvino_genai
    up = genai_adapters["upper"]
    scheduler = openvino_genai.SchedulerConfig()
    scheduler.cache_size = 1
    pipe = openvino_genai.ContinuousBatchingPipeline(str(demo_model), scheduler, "CPU",
                                                     {"adapters": openvino_genai.AdapterConfig(up)})
    tokenizer = pipe.get_tokenizer()
    base, upper = in_process("hello", max_new_tokens=6), in_process("hello", "upper", max_new_tokens=6)

    def config(adapter_alpha: float, n: int = 6):
        generation = openvino_genai.GenerationConfig()
        generation.max_new_tokens = n
        generation.apply_chat_template = False  # generate() of a string would template it: add_request's ids do not
        generation.adapters = openvino_genai.AdapterConfig(up, adapter_alpha)
        return generation

    def added(adapter_alpha: float) -> str:
        handle = pipe.add_request(0, tokenizer.encode("hello").input_ids, config(adapter_alpha))
        ids = []
        while pipe.has_non_finished_requests():
            pipe.step()
            while handle.can_read():
                ids += [i for out in handle.read().values() for i in out.generated_ids]
        return tokenizer.decode(ids)

    assert added(1.0) == base  # ignored
    assert pipe.generate(["hello"], [config(1.0)])[0].m_generation_ids[0] == upper
    assert added(0.0) == upper  # what generate() applied stays
    running = pipe.add_request(1, tokenizer.encode("hello").input_ids, config(0.0, 30))
    pipe.step()
    with pytest.raises(RuntimeError, match="cannot be called while ContinuousBatchingPipeline is already in running"):
        pipe.generate(["hello"], [config(0.0)])
    running.cancel()
    while pipe.has_non_finished_requests():
        pipe.step()


def test_one_adapter_configs_switch_right_where_an_empty_config_does_not(demo_model, genai_adapters, in_process):
    """Why the worker never passes an empty AdapterConfig for the base (appliance.worker.engines.adapters): after
    base -> upper -> base with empty configs, genai 2026.4.1 applies upper wrongly. The one-adapter configs the
    worker uses (the base as an adapter at alpha 0) give every switch of the same sequence right. If the first
    assertion fails, genai fixed it and the worker could say base plainly."""
    import openvino_genai

    def pipeline():
        config = openvino_genai.AdapterConfig(openvino_genai.AdapterConfig.Mode.MODE_DYNAMIC)
        for adapter in genai_adapters.values():
            config.add(adapter, 1.0)
        return openvino_genai.LLMPipeline(str(demo_model), "CPU", adapters=config, ATTENTION_BACKEND="SDPA")
    expected = {name: in_process("hello", name, max_new_tokens=4) for name in (BASE, "upper", "title")}
    sequence = [BASE, "upper", BASE, "upper", "title", "upper", BASE, "title", "title", "upper", BASE, BASE]

    def answers(base_config) -> list[str]:
        pipe, out = pipeline(), []  # a pipeline each: a wrong switch leaves the pipeline wrong after it
        for name in sequence:
            generation = openvino_genai.GenerationConfig()
            generation.max_new_tokens = 4
            generation.apply_chat_template = False
            generation.adapters = base_config() if name == BASE else openvino_genai.AdapterConfig(
                genai_adapters[name], 1.0)
            out.append(str(pipe.generate("hello", generation)))
        return out

    assert answers(openvino_genai.AdapterConfig) != [expected[name] for name in sequence]
    assert answers(lambda: openvino_genai.AdapterConfig(genai_adapters["upper"], 0.0)) == [
        expected[name] for name in sequence]


# --- config -----------------------------------------------------------------------------------------------------

def _config(model: dict, checks=()):
    return parse_config({"models": [model]}, "lora.yaml", list(checks))


def test_config_takes_paths_or_path_and_alpha_and_checks_them(lora_dir, demo_model, tmp_path):
    model = _config(model_entry("demo", demo_model, adapters={
        "upper": str(lora_dir / "upper"), "title": {"path": str(lora_dir / "title" / "adapter_model.safetensors"),
                                                      "alpha": 0.5}}), [path_check]).models[0]
    assert {n: (a.path.endswith(("upper", ".safetensors")), a.alpha) for n, a in model.adapter_entries().items()} == {
        "upper": (True, 1.0), "title": (True, 0.5)}
    assert model.scheduler_settings()["enable_prefix_caching"] is False  # one adapter's KV must not serve another's

    torch_only = tmp_path / "torch-only"
    torch_only.mkdir()
    (torch_only / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")
    not_lora = tmp_path / "weights.safetensors"
    from safetensors.numpy import save_file
    import numpy as np
    save_file({"model.embed_tokens.weight": np.zeros((2, 2), np.float32)}, str(not_lora))
    (tmp_path / "garbage.safetensors").write_bytes(b"not a safetensors file")
    cases = {
        str(tmp_path / "missing"): "does not exist",
        str(torch_only): "holds a torch checkpoint (adapter_model.bin) and no adapter_model.safetensors; OpenVINO "
                         "GenAI reads safetensors only; convert it once",
        str(tmp_path / "x.bin"): "does not exist",
        str(not_lora): "expected LoRA tensors (lora_A / lora_B)",
        str(tmp_path / "garbage.safetensors"): "expected a safetensors file; cannot read",
        str(tmp_path): "has no adapter_model.safetensors",
    }
    for path, expected in cases.items():
        with pytest.raises(ConfigError) as error:
            _config(model_entry("demo", demo_model, adapters={"sql": path}), [path_check])
        assert error.value.lines[0].startswith("lora.yaml: models[0].adapters.sql: "), error.value.lines
        assert expected in str(error.value), str(error.value)


@pytest.mark.parametrize("entry, expected", [
    ({"adapters": {"a b": "/x"}}, "models[0].adapters.a b: expected a name of letters"),
    ({"adapters": {"a": "/x", "b": "/y"}, "max_adapters": 1}, "models[0].adapters: expected at most max_adapters (1)"),
    ({"adapters": {"a": {"path": "/x", "alpha": 0}}}, "models[0].adapters.a.alpha: expected a positive finite weight"),
    ({"adapters": {"a": {"path": "/x", "alpha": float("inf")}}}, "models[0].adapters.a.alpha: expected a positive finite"),
    ({"adapters": {"a": {"path": "/x", "weight": 2}}}, "models[0].adapters.a.weight: unknown key"),
    ({"adapters": {"a": "/x"}, "prompt_lookup": True}, "models[0].adapters: not with speculative decoding"),
    ({"adapters": {"a": "/x"}, "scheduler_config": {"enable_prefix_caching": True}},
     "models[0].scheduler_config.enable_prefix_caching: not with adapters"),
    ({"adapters": {"a": "/x"}, "kind": "embedding"}, "models[0].adapters: applies to kind 'llm' or 'image' models only"),
    ({"max_adapters": 0}, "models[0].max_adapters: expected at least 1"),
])
def test_config_names_each_adapter_mistake(entry, expected):
    with pytest.raises(ConfigError) as error:
        _config({"name": "demo", "path": "/m", **entry})
    assert any(line.startswith(f"lora.yaml: {expected}") for line in error.value.lines), error.value.lines


def test_a_keys_models_naming_an_adapter_is_a_config_error_naming_the_base():
    """A key's `models` are matched against model names, which hold no ':': `demo:sql` there never let the key in (a
    404 for every name); a key that may use `demo` may use its adapters (docs/lora.md), so the config says so."""
    with pytest.raises(ConfigError) as error:
        parse_config({"server": {"api_keys": [{"name": "sql-team", "key_env": "SQL_KEY",
                                               "models": ["other", "demo:sql"]}]},
                      "models": [{"name": "demo", "path": "/m", "adapters": {"sql": "/x"}}]}, "lora.yaml", [])
    assert error.value.lines == ["lora.yaml: server.api_keys[0].models[1]: expected a model's name or glob, not an "
                                 "adapter's ('demo:sql'): a key may use the adapters of the models it may use, so "
                                 "name the base model ('demo')"], error.value.lines


# --- the rotation policy -----------------------------------------------------------------------------------------

QUANTUM = 3


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([BASE, "a", "b", "c"]), st.integers(1, 4)), min_size=1, max_size=40),
       st.integers(1, 6))
def test_rotation_serves_every_group_within_one_pass(arrivals, steps_between):
    """A simulated worker (requests of a group arrive, run a few steps, finish) run by may_join and next_group:
    every request runs, and while a request waits, no other group starts two turns before its own group's next
    (a turn takes `QUANTUM` requests at most when others wait, so a request may need more than one of its own)."""
    held: dict[str, collections.deque] = collections.defaultdict(collections.deque)
    running: dict[int, int] = {}  # request -> steps left
    group, joined = None, 0
    turns_seen: dict[int, set[str]] = {}  # a waiting request -> other groups whose turn began since its group's
    done = set()
    pending = list(enumerate(arrivals))

    def join(request: int, steps: int) -> None:
        nonlocal joined
        joined += 1
        running[request] = steps
        turns_seen.pop(request, None)

    for tick in range(10_000):
        if tick % steps_between == 0 and pending:
            request, (g, steps) = pending.pop(0)
            others = any(q for h, q in held.items() if h != group)
            if may_join(g, group, joined, others, QUANTUM):
                join(request, steps)
            else:
                held[g].append((request, steps))
                turns_seen[request] = set()
        for request in list(running):
            running[request] -= 1
            if running[request] == 0:
                running.pop(request)
                done.add(request)
        if not running and any(held.values()):
            group, joined = next_group(group, [h for h, q in held.items() if q]), 0
            for request, waiting in turns_seen.items():
                if arrivals[request][0] == group:
                    waiting.clear()
                else:
                    assert group not in waiting, "a group had two turns while another waited"
                    waiting.add(group)
            while held[group] and may_join(group, group, joined, any(q for h, q in held.items() if h != group),
                                           QUANTUM):
                join(*held[group].popleft())
        if not pending and not running and not any(held.values()):
            break
    assert done == set(range(len(arrivals)))


def test_next_group_cycles_by_name_and_a_lone_group_keeps_its_turn():
    assert next_group(None, ["b", BASE]) == BASE
    assert next_group(BASE, ["b", "a"]) == "a"
    assert next_group("b", ["a", BASE]) == BASE
    assert next_group("a", []) is None
    assert may_join("a", "a", 100, others_waiting=False, quantum=1)
    assert not may_join("a", "a", 1, others_waiting=True, quantum=1)
    assert not may_join("b", "a", 0, others_waiting=False, quantum=8)


# --- a live server -----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_model, lora_dir):
    # an Ollama-style alias (a colon, as Open WebUI and Ollama clients name models) to the model with adapters
    config = {"server": {"api_key_env": KEY_ENV, "model_aliases": {"llama3:*": "demo"}}, "models": [
        model_entry("demo", demo_model, adapters={"upper": str(lora_dir / "upper"), "title": str(lora_dir / "title")},
                    max_adapters=3),
        model_entry("seq", demo_model, pipeline="stateful", adapters={"upper": str(lora_dir / "upper")}),
        model_entry("plain", demo_model),
    ]}
    # each engine step takes 10 ms at least: a 40-token answer runs long enough for the metrics test to see it run
    app = Appliance(config, tmp_path_factory.mktemp("lora"), env={KEY_ENV: KEY, STEP_DELAY_ENV: "0.01"}).start()
    yield app
    app.stop()


def chat(server, model: str, prompt: str, max_tokens: int = 12) -> tuple[int, object]:
    status, _, body = http("POST", server.base + "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens},
        headers=server.auth)
    return status, body["choices"][0]["message"]["content"] if status == 200 else body


def test_models_lists_each_adapter_with_its_parent(server, lora_dir):
    status, _, body = http("GET", server.base + "/v1/models", headers=server.auth)
    assert status == 200
    listed = {m["id"]: m for m in body["data"]}
    assert set(listed) == {"demo", "demo:upper", "demo:title", "seq", "seq:upper", "plain"}
    assert listed["demo:upper"]["parent"] == "demo" and "parent" not in listed["demo"]
    # `root` names the adapter, never its file on the server (a client has no business with the server's paths)
    assert (listed["demo:title"]["root"], listed["demo:upper"]["root"]) == ("title", "upper")
    assert str(lora_dir) not in json.dumps(body)


def test_interleaved_requests_of_two_adapters_and_the_base_each_get_their_own(server, in_process):
    prompts = ["hello", "hi there", "what now?", "tell me more about it"]
    jobs = [(model, prompt) for prompt in prompts for model in ("demo", "demo:upper", "demo:title", "seq", "seq:upper",
                                                                "demo:upper", "demo")]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda job: chat(server, *job), jobs))
    for (model, prompt), (status, text) in zip(jobs, answers):
        assert status == 200, text
        templated = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        expected = in_process(templated, model.partition(":")[2], max_new_tokens=12)
        assert text == expected, (model, prompt, text, expected)
    assert len({text for _, text in answers}) >= 3 * 2  # adapters and prompts both change the words


def test_an_alias_with_a_colon_reaches_the_base_model_never_an_adapter(server, in_process):
    """`llama3:8b` aliased to demo is demo's base: its tag is no adapter "8b" (a 400 "adapter not loaded" before),
    over chat completions and the Anthropic dialect alike."""
    status, text = chat(server, "llama3:8b", "hello")
    assert status == 200, text
    assert text == in_process("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", BASE, max_new_tokens=12)
    status, _, body = http("POST", server.base + "/v1/messages", {
        "model": "llama3:8b", "max_tokens": 12, "messages": [{"role": "user", "content": "hello"}]},
        headers=server.auth)
    assert status == 200 and body["content"][0]["text"] == text, body


def test_an_unknown_adapter_is_a_404_naming_the_models(server):
    status, body = chat(server, "demo:nope", "hello")
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert chat(server, "plain:upper", "hello")[0] == 404


def test_runtime_load_serves_the_adapter_and_unload_makes_its_name_a_404(server, lora_dir, in_process, tmp_path):
    url = server.base + "/openarc/models/demo/adapters"
    shout = lora_dir / "shout"
    shutil.copytree(lora_dir / "upper", shout, dirs_exist_ok=True)
    assert http("POST", url, {"name": "shout", "path": str(shout)})[0] == 401  # behind the key
    status, _, body = http("POST", url, {"name": "shout", "path": str(shout)}, headers=server.auth)
    assert status == 201, body
    assert (body["model"], body["parent"], body["root"]) == ("demo:shout", "demo", "shout")
    expected = in_process("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "upper", max_new_tokens=12)
    assert chat(server, "demo:shout", "hello") == (200, expected)
    models = http("GET", server.base + "/v1/models", headers=server.auth)[2]["data"]
    assert any(m["id"] == "demo:shout" and m["parent"] == "demo" for m in models)

    # a worker restarted after a crash loads the runtime adapter again (it is in the worker's spec)
    old_pid = server.worker_pid("demo")
    os.kill(old_pid, signal.SIGKILL)
    server.wait_model("demo", "ready", new_pid_not=old_pid)
    assert chat(server, "demo:shout", "hello") == (200, expected)

    status, _, body = http("POST", url, {"name": "more", "path": str(lora_dir / "upper")}, headers=server.auth)
    assert status == 409 and "max_adapters (3)" in body["error"]["message"]
    status, _, body = http("POST", url, {"name": "shout", "path": str(shout)}, headers=server.auth)
    assert status == 409 and body["error"]["code"] == "adapter_exists"

    status, _, body = http("DELETE", url + "/shout", headers=server.auth)
    assert status == 200, body
    assert chat(server, "demo:shout", "hello")[0] == 404
    assert http("DELETE", url + "/shout", headers=server.auth)[0] == 404
    assert chat(server, "demo:upper", "hello") == (200, expected)  # the others serve on

    # the stateful pipeline takes one at runtime too (each request applies its own)
    seq = server.base + "/openarc/models/seq/adapters"
    assert http("POST", seq, {"name": "t", "path": str(lora_dir / "title")}, headers=server.auth)[0] == 201
    title = in_process("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", "title", max_new_tokens=12)
    assert chat(server, "seq:t", "hello") == (200, title)
    assert chat(server, "seq", "hello") == (200, expected.lower().capitalize())
    assert http("DELETE", seq + "/t", headers=server.auth)[0] == 200


def test_runtime_load_refuses_bad_paths_with_a_400_naming_the_problem(server, lora_dir, tmp_path):
    url = server.base + "/openarc/models/demo/adapters"
    torch_only = lora_dir / "torch-only"
    torch_only.mkdir(exist_ok=True)
    (torch_only / "adapter_model.bin").write_bytes(b"\x80\x02}q\x00.")
    cases = [
        ({"name": "x", "path": str(lora_dir / "missing")}, "no LoRA adapter at"),
        ({"name": "x", "path": str(torch_only)}, "a torch checkpoint must be converted first"),
        ({"name": "x", "path": str(tmp_path)}, f"under {str(lora_dir)!r}"),
        ({"name": "x", "path": str(lora_dir / "upper" / ".." / ".." / "etc")}, "must be absolute and under"),
        ({"name": "x y", "path": str(lora_dir / "upper")}, "'name' must be letters"),
        ({"name": "x", "path": str(lora_dir / "upper"), "alpha": -1}, "'alpha' must be a positive finite number"),
        ({"name": "x", "path": str(lora_dir / "upper"), "alpha": 1e309}, "'alpha' must be a positive finite number"),
        ({"name": "x", "path": str(lora_dir / "upper") + "\x00"}, "must not contain a NUL"),
    ]
    for body, expected in cases:
        status, _, answer = http("POST", url, body, headers=server.auth)
        assert status == 400 and expected in answer["error"]["message"], (body, answer)
    status, _, answer = http("POST", server.base + "/openarc/models/plain/adapters",
                             {"name": "x", "path": str(lora_dir / "upper")}, headers=server.auth)
    assert status == 409 and answer["error"]["code"] == "no_adapters"
    assert http("POST", server.base + "/openarc/models/nope/adapters", {"name": "x", "path": "/x"},
                headers=server.auth)[0] == 404


def lora_info(metrics: str, model: str) -> list[str]:
    return [line for line in metrics.splitlines()
            if line.startswith("openarc_lora_requests_info{") and f'model="{model}"' in line]


def test_metrics_say_which_adapters_run_in_vllms_shape_and_count_by_adapter(server):
    import openai
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = client.chat.completions.create(model="demo:title", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=40, stream=True)
    try:
        next(iter(stream))  # running now, for 40 steps of 10 ms at least
        running = wait_until(lambda: [line for line in lora_info(server.metrics(), "demo")
                                      if 'running_lora_adapters="demo:title"' in line], 5, "demo:title running")
        assert 'max_lora="3"' in running[0], running
    finally:
        stream.close()
    assert chat(server, "demo:upper", "counted")[0] == 200
    assert chat(server, "demo", "counted")[0] == 200
    metrics = server.metrics()
    (idle,) = lora_info(metrics, "demo")
    assert 'running_lora_adapters=""' in idle and 'waiting_lora_adapters=""' in idle, idle
    assert float(idle.rsplit(" ", 1)[1]) > 1.7e9  # when it was set, as vLLM's is
    counted = {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith("openarc_adapter_requests_total{")}
    assert counted.get('adapter="upper",model="demo"', 0) >= 1 and counted.get('adapter="",model="demo"', 0) >= 1, \
        counted
    assert not lora_info(metrics, "plain") and 'model="plain"' not in "".join(counted)


# --- the runtime admin route under pressure (breaker b-40) --------------------------------------------------------

def _templated(prompt: str) -> str:
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"


def test_an_adapter_unloaded_and_loaded_again_under_its_name_answers_with_the_new_file(server, lora_dir, in_process):
    """The batching worker applies a group's adapter when the group's turn begins: a name unloaded and loaded again
    from another file must not keep the old file's weights applied (its group's turn has to begin again)."""
    url = server.base + "/openarc/models/demo/adapters"
    assert http("POST", url, {"name": "swap", "path": str(lora_dir / "upper")}, headers=server.auth)[0] == 201
    try:
        assert chat(server, "demo:swap", "hello") == (200, in_process(_templated("hello"), "upper", 12))
        assert http("DELETE", url + "/swap", headers=server.auth)[0] == 200
        assert http("POST", url, {"name": "swap", "path": str(lora_dir / "title")}, headers=server.auth)[0] == 201
        assert chat(server, "demo:swap", "hello") == (200, in_process(_templated("hello"), "title", 12))
    finally:
        http("DELETE", url + "/swap", headers=server.auth)


def test_concurrent_loads_hold_max_adapters_and_one_name_once(server, lora_dir):
    """The name and max_adapters checks and the load are one step: loads racing each other cannot both pass them."""
    url = server.base + "/openarc/models/demo/adapters"
    bodies = [{"name": name, "path": str(lora_dir / "upper")} for name in ("r1", "r1", "r2", "r3", "r4", "r5")]
    with concurrent.futures.ThreadPoolExecutor(len(bodies) + 1) as pool:
        # a request running: the worker takes each load between two steps (10 ms each), so the loads overlap
        running = pool.submit(chat, server, "demo:title", "keep the worker busy", 40)
        wait_until(lambda: 'running_lora_adapters="demo:title"' in "".join(lora_info(server.metrics(), "demo"))
                   or running.done(), 10, "a request running")
        answers = list(pool.map(lambda body: http("POST", url, body, headers=server.auth), bodies))
        assert running.result()[0] == 200
    try:
        statuses = sorted(status for status, _, _ in answers)
        assert statuses == [201] + [409] * 5, [(s, b) for s, _, b in answers]  # demo holds 2 of its 3 already
        # a conflict is the client's to resolve (OpenAI's type for a 4xx), not a server error
        assert {b["error"]["type"] for s, _, b in answers if s == 409} == {"invalid_request_error"}
        listed = [m["id"] for m in http("GET", server.base + "/v1/models", headers=server.auth)[2]["data"]
                  if m.get("parent") == "demo"]
        assert len(listed) == 3, listed
    finally:
        for name in ("r1", "r2", "r3", "r4", "r5"):
            http("DELETE", url + "/" + name, headers=server.auth)


def test_a_reload_that_leaves_the_model_alone_keeps_its_runtime_adapter_and_worker(server, lora_dir, in_process):
    """docs/lora.md: only a reload that replaces the model's worker (its config changed) drops runtime adapters; a
    reload of an unchanged config changes no model (the runtime adapter is not a config change)."""
    url = server.base + "/openarc/models/demo/adapters"
    assert http("POST", url, {"name": "kept", "path": str(lora_dir / "title")}, headers=server.auth)[0] == 201
    try:
        pid = server.worker_pid("demo")
        reloads = server.logs().count("reloaded ")
        server.proc.send_signal(signal.SIGHUP)
        wait_until(lambda: server.logs().count("reloaded ") > reloads, 30, "the reload")
        assert server.logs().splitlines()[-1].endswith("no model changed") or \
            "demo" not in [line for line in server.logs().splitlines() if "reloaded " in line][-1]
        assert server.worker_pid("demo") == pid
        assert chat(server, "demo:kept", "hello") == (200, in_process(_templated("hello"), "title", 12))
    finally:
        http("DELETE", url + "/kept", headers=server.auth)


def test_a_runtime_adapter_that_does_not_fit_the_models_layers_costs_no_other_request(server, lora_dir, in_process):
    """An adapter of the right names but the wrong shapes (another model's, a rank that does not match): a 4xx, and
    the worker, its other adapters and its base serve on."""
    import numpy as np
    from safetensors.numpy import load_file, save_file
    good = load_file(str(lora_dir / "upper" / "adapter_model.safetensors"))
    a, b = good["base_model.model.lm_head.lora_A.weight"], good["base_model.model.lm_head.lora_B.weight"]
    url = server.base + "/openarc/models/demo/adapters"
    pid = server.worker_pid("demo")
    expected = ["maps 196 inputs", "expected LoRA pairs of one rank"]
    for i, (shape_a, shape_b) in enumerate([((a.shape[0], a.shape[1] + 7), b.shape),
                                            (a.shape, (b.shape[0], b.shape[1] + 3))]):
        bad = lora_dir / f"misfit{i}"
        bad.mkdir(exist_ok=True)
        save_file({"base_model.model.lm_head.lora_A.weight": np.ones(shape_a, np.float32),
                   "base_model.model.lm_head.lora_B.weight": np.ones(shape_b, np.float32)},
                  str(bad / "adapter_model.safetensors"))
        status, _, body = http("POST", url, {"name": "misfit", "path": str(bad)}, headers=server.auth)
        if status == 201:  # (loaded, it answered each request a 500 naming an OpenVINO source file)
            http("DELETE", url + "/misfit", headers=server.auth)
        assert status == 400 and expected[i] in body["error"]["message"], body
        assert chat(server, "demo:upper", "hello") == (200, in_process(_templated("hello"), "upper", 12))
        assert chat(server, "demo", "hello") == (200, in_process(_templated("hello"), BASE, 12))
        assert server.worker_pid("demo") == pid


def test_adapters_loaded_and_unloaded_leave_no_series_behind(server, lora_dir):
    """Each name ever loaded at runtime must not stay a series of openarc_adapter_* for as long as the server runs."""
    url = server.base + "/openarc/models/demo/adapters"
    for i in range(4):
        name = f"churn{i}"
        assert http("POST", url, {"name": name, "path": str(lora_dir / "upper")}, headers=server.auth)[0] == 201
        assert chat(server, f"demo:{name}", "hello", 2)[0] == 200
        assert f'adapter="{name}"' in server.metrics()
        assert http("DELETE", url + "/" + name, headers=server.auth)[0] == 200
    # one unloaded while its request streams: the request finishes with it, and its series stay gone
    import openai
    assert http("POST", url, {"name": "churn9", "path": str(lora_dir / "upper")}, headers=server.auth)[0] == 201
    client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
    stream = iter(client.chat.completions.create(model="demo:churn9", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=30, stream=True))
    next(stream)
    assert http("DELETE", url + "/churn9", headers=server.auth)[0] == 200
    assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    leftover = [line for line in server.metrics().splitlines() if 'adapter="churn' in line or "demo:churn" in line]
    assert not leftover, leftover


def test_a_path_that_is_no_regular_file_is_a_400_and_blocks_no_one(server, lora_dir):
    """A FIFO (or a device) under the models directory: reading it would block whoever reads it for good; the
    front must answer 400 at once and keep serving."""
    fifo = lora_dir / "pipe.safetensors"
    if not fifo.exists():
        os.mkfifo(fifo)
    peft = lora_dir / "pipe-peft"
    peft.mkdir(exist_ok=True)
    if not (peft / "adapter_model.safetensors").exists():
        os.mkfifo(peft / "adapter_model.safetensors")
    url = server.base + "/openarc/models/demo/adapters"
    for path in (fifo, peft):
        status, _, body = http("POST", url, {"name": "pipe", "path": str(path)}, headers=server.auth, timeout=10)
        assert status == 400 and "no LoRA adapter at" in body["error"]["message"], body
    assert http("GET", server.base + "/ready", timeout=5)[0] == 200


def test_a_runtime_load_tells_no_one_which_directories_exist_beside_the_models(server, lora_dir, demo_model):
    """A key manages its own models' adapters: a path that does not exist and one that is another model's directory
    (or any directory without an adapter) get one answer, so the 400 is no way to list what lies beside them."""
    url = server.base + "/openarc/models/demo/adapters"
    answers = []
    for path in (lora_dir / "no-such-model", lora_dir / "upper" / "no-such-file", demo_model):
        status, _, body = http("POST", url, {"name": "probe", "path": str(path)}, headers=server.auth)
        assert status == 400, body
        answers.append(body["error"]["message"].replace(repr(str(path)), "PATH"))
    assert len(set(answers)) == 1 and answers[0].startswith("no LoRA adapter at PATH"), answers


def test_a_runtime_load_tells_no_one_which_files_exist_beside_the_models(server, lora_dir, demo_model, tmp_path):
    """Each pair: a path that exists beside the models and one that does not, which must get the same 400. Another
    model's weights (a .bin: it got the torch conversion hint), its config.json (readable: "cannot read it as
    safetensors"), a symlink out of the directory ("must be under", where a missing name got "no LoRA adapter"),
    a directory whose adapter file is a symlink out of the directory (it was loaded: the worker read a file from
    outside), and '..' after a directory that exists or not (the front checked the resolved path, the worker was handed the
    written one: a 400 "path does not exist" from the worker for the missing one, a 201 for the other)."""
    url = server.base + "/openarc/models/demo/adapters"
    escape = lora_dir / "escape-link"
    escape.unlink(missing_ok=True)
    escape.symlink_to(tmp_path)
    outside = tmp_path / "outside"  # a real adapter out of the directory, reached through a file's symlink in it
    shutil.copytree(lora_dir / "upper", outside)
    linked = lora_dir / "linked-file"
    linked.mkdir(exist_ok=True)
    (linked / "adapter_model.safetensors").unlink(missing_ok=True)
    (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    try:
        pairs = [(linked, lora_dir / "no-such-dir"),
                 (demo_model / "openvino_model.bin", lora_dir / "no-such-model" / "openvino_model.bin"),
                 (demo_model / "config.json", lora_dir / "no-such-model" / "config.json"),
                 (escape, lora_dir / "no-such-link"),
                 (escape / "x.safetensors", lora_dir / "no-such-link" / "x.safetensors")]
        for there, missing in pairs:
            answers = []
            for path in (there, missing):
                status, _, body = http("POST", url, {"name": "probe", "path": str(path)}, headers=server.auth)
                assert status == 400, (path, body)
                answers.append(body["error"]["message"].replace(repr(str(path)), "PATH"))
            assert answers[0] == answers[1] and answers[0].startswith("no LoRA adapter at PATH"), answers
        for i, path in enumerate((demo_model / ".." / "upper", lora_dir / "no-such-dir" / ".." / "upper")):
            status, _, body = http("POST", url, {"name": f"dots{i}", "path": str(path)}, headers=server.auth)
            assert status == 201, (path, body)
            assert chat(server, f"demo:dots{i}", "hello")[0] == 200
            assert http("DELETE", f"{url}/dots{i}", headers=server.auth)[0] == 200
    finally:
        escape.unlink()
        shutil.rmtree(linked)


def test_a_runtime_adapter_of_a_replicated_model_is_served_by_every_replica(tmp_path, demo_model, lora_dir, in_process):
    """A model on two devices (replicas, docs/operations.md): a load reaches each replica's worker, so whichever
    replica takes a request of the adapter answers it; an unload leaves none serving it."""
    config = {"server": {"api_key_env": KEY_ENV}, "models": [
        model_entry("twin", demo_model, device=["CPU", "CPU"], adapters={"upper": str(lora_dir / "upper")})]}
    app = Appliance(config, tmp_path, env={KEY_ENV: KEY}).start()
    try:
        url = app.base + "/openarc/models/twin/adapters"
        wait_until(lambda: all(replica["state"] == "ready" for replica in app.model_status("twin")["replicas"]),
                   60, "both replicas ready")
        # its configured adapter unloaded first: the model serves none, and what is loaded next is still served, also
        # by workers that started while it served none (their pipelines must still be built with LoRA)
        assert http("DELETE", url + "/upper", headers=app.auth)[0] == 200
        old_pids = {replica["pid"] for replica in app.model_status("twin")["replicas"]}
        for pid in old_pids:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: [(r["state"], r["pid"] in old_pids) for r in app.model_status("twin")["replicas"]]
                   == [("ready", False)] * 2, 60, "both replicas restarted")
        status, _, body = http("POST", url, {"name": "t", "path": str(lora_dir / "title")}, headers=app.auth)
        assert status == 201 and (body["model"], body["parent"]) == ("twin:t", "twin"), body
        prompts = ["hello", "what now?", "tell me more", "hi there", "and then?", "why not"]
        # (distinct prompts: no replica holds one's prefix; ties between idle replicas alternate)
        answers = [chat(app, "twin:t", prompt) for prompt in prompts]
        assert answers == [(200, in_process(_templated(prompt), "title", 12)) for prompt in prompts], answers
        assert http("DELETE", url + "/t", headers=app.auth)[0] == 200
        assert [chat(app, "twin:t", prompt)[0] for prompt in prompts] == [404] * len(prompts)
    finally:
        app.stop()


@pytest.mark.parametrize("device", ["CPU", ["CPU", "CPU"]], ids=["one worker", "replicas"])
def test_a_runtime_adapter_lasts_across_an_unload_and_is_served_by_every_replica(appliance_factory, demo_model,
                                                                                 lora_dir, device):
    """A runtime adapter lasts while the server runs (docs/lora.md): the model's unload (the API here; an idle
    unload or an eviction alike) and its next load on demand keep it, and a replicated model serves it from each
    replica, whichever a request is routed to."""
    app = appliance_factory({"server": {"parked_workers": 0}, "models": [model_entry(
        "lo", demo_model, adapters={"upper": str(lora_dir / "upper")}, device=device)]})
    if isinstance(device, list):
        wait_until(lambda: all(r["state"] == "ready" for r in app.model_status("lo")["replicas"]), 120, "replicas")
    url = app.base + "/openarc/models/lo/adapters"
    status, _, body = http("POST", url, {"name": "shout", "path": str(lora_dir / "upper")})
    assert status == 201 and (body["model"], body["parent"]) == ("lo:shout", "lo"), body
    ask = {"model": "lo:shout", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    first = http("POST", app.base + "/v1/chat/completions", ask)
    assert first[0] == 200, first[2]
    if isinstance(device, list):  # each replica in turn: a new conversation each time, so no prefix affinity
        answers = {http("POST", app.base + "/v1/chat/completions", {**ask, "messages": [
            {"role": "user", "content": f"hello {i}"}]})[0] for i in range(6)}
        assert answers == {200}, answers
        routed = [r["requests_routed"] for r in app.model_status("lo")["replicas"]]
        assert all(routed), routed
    assert http("POST", app.base + "/openarc/models/lo/unload")[0] == 200
    again = http("POST", app.base + "/v1/chat/completions", ask)
    assert again[0] == 200 and again[2]["choices"][0]["message"]["content"] == \
        first[2]["choices"][0]["message"]["content"], again[2]


def test_unloading_an_adapter_of_an_unloaded_model_loads_no_model(appliance_factory, demo_model, lora_dir):
    """An adapter's unload only changes what the model's workers are started with while none runs: it waited for the
    model's load (of seconds, evicting others under a budget) to unload an adapter from a worker that had none. The
    model's next load comes up without the adapter, whose name is a 404, and with LoRA built (another loads later)."""
    app = appliance_factory({"server": {"parked_workers": 0}, "models": [model_entry(
        "lo", demo_model, adapters={"upper": str(lora_dir / "upper")}, max_adapters=2)]})
    url = app.base + "/openarc/models/lo/adapters"
    assert http("POST", url, {"name": "shout", "path": str(lora_dir / "upper")})[0] == 201
    assert http("POST", app.base + "/openarc/models/lo/unload")[0] == 200
    app.wait_model("lo", "unloaded")
    status, _, body = http("DELETE", url + "/shout")
    assert status == 200 and body == {"model": "lo:shout", "unloaded": True}, body
    assert app.model_status("lo")["state"] == "unloaded"  # no worker started for it
    assert http("DELETE", url + "/upper")[0] == 200
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 6}
    assert [http("POST", app.base + "/v1/chat/completions", {**ask, "model": m})[0]
            for m in ("lo:shout", "lo:upper", "lo")] == [404, 404, 200]
    assert http("POST", url, {"name": "t", "path": str(lora_dir / "title")})[0] == 201
    assert http("POST", app.base + "/v1/chat/completions", {**ask, "model": "lo:t"})[0] == 200


def test_a_replica_started_while_an_adapter_loads_serves_it(appliance_factory, demo_model, lora_dir, in_process):
    """A load asks each running replica's worker in turn; a replica whose worker starts meanwhile (here: restarting
    after a crash, while the other replica's worker is held stopped mid-ask) must come up with the adapter. It read
    the model's adapters as they were before the load, which were only written once every ask had answered: it came
    up without it, and each request routed to it was a 400 "not loaded on this model"."""
    app = appliance_factory({"models": [model_entry("twin", demo_model, device=["CPU", "CPU"], restart={
        "backoff_initial_s": 4.0}, adapters={"upper": str(lora_dir / "upper")})]})
    replicas = lambda: app.model_status("twin")["replicas"]  # noqa: E731
    wait_until(lambda: all(r["state"] == "ready" for r in replicas()), 120, "both replicas ready")
    asked, restarting = (r["pid"] for r in replicas())
    os.kill(restarting, signal.SIGKILL)
    # (its backoff, 4 s, leaves the load time to see it restarting, not loading: that is a 503 to retry)
    wait_until(lambda: replicas()[1]["state"] == "restarting", 30, "the killed replica waiting out its backoff")
    os.kill(asked, signal.SIGSTOP)  # the load's ask to it waits until the other replica's worker has started
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(http, "POST", app.base + "/openarc/models/twin/adapters",
                               {"name": "t", "path": str(lora_dir / "title")}, timeout=120)
            wait_until(lambda: replicas()[1]["state"] in ("loading", "ready"), 30, "the other replica starting")
            os.kill(asked, signal.SIGCONT)
            status, _, body = load.result(120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (once continued, it may have ended)
            os.kill(asked, signal.SIGCONT)
    assert status == 201, body
    wait_until(lambda: all(r["state"] == "ready" for r in replicas()), 120, "both replicas ready again")
    prompts = ["hello", "what now?", "tell me more", "hi there", "and then?", "why not"]
    answers = [chat(app, "twin:t", prompt) for prompt in prompts]  # distinct prompts: both replicas take some
    assert all(r["requests_routed"] for r in replicas()), replicas()
    assert answers == [(200, in_process(_templated(prompt), "title", 12)) for prompt in prompts], answers


def test_an_adapter_change_that_a_reload_overtakes_is_refused_not_lost(appliance_factory, demo_model, lora_dir):
    """A reload that replaces the model (its config changed) while an adapter loads into it: the new workers serve
    the config's adapters (docs/lora.md), so the load must not answer 201 for an adapter no worker serves (it did:
    the change went to the replaced model, and its name was a 404 from then on)."""
    import yaml
    config = {"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")}, max_adapters=3)]}
    app = appliance_factory(config)
    old = app.worker_pid("lo")
    os.kill(old, signal.SIGSTOP)  # the load's ask waits in it while the reload replaces the model
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            load = pool.submit(http, "POST", app.base + "/openarc/models/lo/adapters",
                               {"name": "t", "path": str(lora_dir / "title")}, timeout=120)
            wait_until(lambda: app.model_status("lo")["requests_running"], 30, "the load asking the worker")
            config["models"][0]["max_adapters"] = 4
            config["server"]["port"] = app.port
            app.config_path.write_text(yaml.safe_dump(config))
            app.proc.send_signal(signal.SIGHUP)
            app.wait_model("lo", "ready", 120, new_pid_not=old)
            os.kill(old, signal.SIGCONT)
            status, _, body = load.result(120)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (once continued, it may have ended: a reload's drain)
            os.kill(old, signal.SIGCONT)
    assert status == 503 and "replaced by a reload" in body["error"]["message"], (status, body)
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert [http("POST", app.base + "/v1/chat/completions", {**ask, "model": m})[0]
            for m in ("lo:t", "lo:upper")] == [404, 200]
    assert http("POST", app.base + "/openarc/models/lo/adapters",
                {"name": "t", "path": str(lora_dir / "title")})[0] == 201  # asked again, it loads
    assert http("POST", app.base + "/v1/chat/completions", {**ask, "model": "lo:t"})[0] == 200


def test_an_adapter_load_that_a_model_unload_overtakes_is_served_at_the_next_load(appliance_factory, demo_model,
                                                                                   lora_dir):
    """A model unloaded while an adapter loads into it: the adapter is written to what its next workers start with
    (kept across unloads: docs/lora.md), so the load succeeded, and its answer must say so. It was a 503 'replaced by
    a reload ... change them again' (its check took any new supervisor for a reload's), and the retry a 409."""
    app = appliance_factory({"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")},
                                                    max_adapters=3)]})
    old = app.worker_pid("lo")
    os.kill(old, signal.SIGSTOP)  # the load's ask waits in it while the model is unloaded
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            load = pool.submit(http, "POST", app.base + "/openarc/models/lo/adapters",
                               {"name": "t", "path": str(lora_dir / "title")}, timeout=120)
            wait_until(lambda: app.model_status("lo")["requests_running"], 30, "the load asking the worker")
            unload = pool.submit(http, "POST", app.base + "/openarc/models/lo/unload", timeout=120)
            wait_until(lambda: app.model_status("lo")["state"] == "unloaded", 30, "the model unloaded")
            os.kill(old, signal.SIGCONT)
            status, _, body = load.result(120)
            assert unload.result(120)[0] == 200
    finally:
        with contextlib.suppress(ProcessLookupError):  # (once continued, it may have ended: the unload's drain)
            os.kill(old, signal.SIGCONT)
    assert status == 201, (status, body)
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert http("POST", app.base + "/v1/chat/completions", {**ask, "model": "lo:t"}, timeout=120)[0] == 200


def test_an_adapter_unload_whose_worker_dies_meanwhile_is_done(appliance_factory, demo_model, lora_dir):
    """A worker killed while it is asked to unload an adapter restarts without it (the adapters it starts with changed
    first): the unload is done, and its answer says so, not a 5xx whose retry is a 404."""
    app = appliance_factory({"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")},
                                                    max_adapters=3)]})
    url = app.base + "/openarc/models/lo/adapters"
    assert http("POST", url, {"name": "t", "path": str(lora_dir / "title")})[0] == 201
    old = app.worker_pid("lo")
    os.kill(old, signal.SIGSTOP)  # the unload's ask waits in it until it is killed
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        unload = pool.submit(http, "DELETE", url + "/t", timeout=120)
        wait_until(lambda: app.model_status("lo")["requests_running"], 30, "the unload asking the worker")
        os.kill(old, signal.SIGKILL)
        status, _, body = unload.result(120)
    assert (status, body) == (200, {"model": "lo:t", "unloaded": True}), (status, body)
    app.wait_model("lo", "ready", 60, new_pid_not=old)
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert [http("POST", app.base + "/v1/chat/completions", {**ask, "model": m}, timeout=120)[0]
            for m in ("lo:t", "lo:upper")] == [404, 200]


def test_an_adapter_unload_that_a_reload_overtakes_is_done_when_the_new_config_lacks_it_too(appliance_factory,
                                                                                             demo_model, lora_dir):
    """An unload of a runtime adapter while a reload replaces the model: the new workers serve the config's adapters,
    which lack it as well, so the unload holds and its answer says so (it was a 503 'change them again', whose retry
    is a 404); an unload of a configured adapter the reload brings back stays a 503."""
    import yaml
    config = {"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")}, max_adapters=3)]}
    app = appliance_factory(config)
    url = app.base + "/openarc/models/lo/adapters"
    assert http("POST", url, {"name": "t", "path": str(lora_dir / "title")})[0] == 201
    answers = []
    for adapter, max_adapters in (("t", 4), ("upper", 5)):
        old = app.worker_pid("lo")
        os.kill(old, signal.SIGSTOP)  # the unload's ask waits in it while the reload replaces the model
        try:
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                unload = pool.submit(http, "DELETE", f"{url}/{adapter}", timeout=120)
                wait_until(lambda: app.model_status("lo")["requests_running"], 30, "the unload asking the worker")
                config["models"][0]["max_adapters"] = max_adapters
                config["server"]["port"] = app.port
                app.config_path.write_text(yaml.safe_dump(config))
                app.proc.send_signal(signal.SIGHUP)
                app.wait_model("lo", "ready", 120, new_pid_not=old)
                os.kill(old, signal.SIGCONT)
                answers.append(unload.result(120)[0])
        finally:
            with contextlib.suppress(ProcessLookupError):  # (once continued, it may have ended: a reload's drain)
                os.kill(old, signal.SIGCONT)
    assert answers == [200, 503], answers
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert [http("POST", app.base + "/v1/chat/completions", {**ask, "model": m})[0]
            for m in ("lo:t", "lo:upper")] == [404, 200]


def test_adapter_changes_to_a_model_take_turns_across_its_unload_and_next_load(appliance_factory, demo_model,
                                                                                  lora_dir):
    """One change to a model's adapters at a time, whichever of its supervisors (a model's unload and next load
    make new ones) each change found: an unload still asking the worker being unloaded, and a load of the same name
    into the model's next worker, took a lock each (each supervisor's own) and ran at once: the load wrote the name
    back while the unload was in flight, and the unload answered 503 'replaced by a reload' where no reload was."""
    app = appliance_factory({"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")},
                                                    max_adapters=3)]})
    url = app.base + "/openarc/models/lo/adapters"
    assert http("POST", url, {"name": "t", "path": str(lora_dir / "title")})[0] == 201
    old = app.worker_pid("lo")
    os.kill(old, signal.SIGSTOP)  # the unload's ask waits in it
    try:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            unload = pool.submit(http, "DELETE", url + "/t", timeout=120)
            wait_until(lambda: app.model_status("lo")["requests_running"], 30, "the unload asking the worker")
            model_unload = pool.submit(http, "POST", app.base + "/openarc/models/lo/unload", timeout=120)
            wait_until(lambda: app.model_status("lo")["state"] == "unloaded", 30, "the model unloaded")
            load = pool.submit(http, "POST", url, {"name": "t", "path": str(lora_dir / "title")}, timeout=120)
            time.sleep(2)  # (the load's turn comes after the unload's: it may load the model meanwhile)
            os.kill(old, signal.SIGCONT)
            answers = [unload.result(120)[0], load.result(120)[0]]
            assert model_unload.result(120)[0] == 200
    finally:
        with contextlib.suppress(ProcessLookupError):  # (once continued, it may have ended: the unload's drain)
            os.kill(old, signal.SIGCONT)
    assert answers == [200, 201], answers
    ask = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}
    assert http("POST", app.base + "/v1/chat/completions", {**ask, "model": "lo:t"}, timeout=120)[0] == 200


def test_a_runtime_adapter_a_reload_drops_takes_its_series_with_it(appliance_factory, demo_model, lora_dir):
    """A reload that replaces the model serves its config's adapters: a runtime one it drops is unloaded, and its
    openarc_adapter_* series go as an unload's do (they stayed: each reload could leave max_adapters more names on
    the page for as long as the server ran). The config's adapters keep theirs."""
    import yaml
    config = {"models": [model_entry("lo", demo_model, adapters={"upper": str(lora_dir / "upper")}, max_adapters=3)]}
    app = appliance_factory(config)
    assert http("POST", app.base + "/openarc/models/lo/adapters", {"name": "zz", "path": str(lora_dir / "title")})[0] \
        == 201
    assert [chat(app, m, "hello")[0] for m in ("lo:zz", "lo:upper")] == [200, 200]
    assert 'adapter="zz"' in app.metrics() and 'adapter="upper"' in app.metrics()
    old = app.worker_pid("lo")
    config["models"][0]["max_adapters"] = 4
    config["server"]["port"] = app.port
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)
    app.wait_model("lo", "ready", 120, new_pid_not=old)
    wait_until(lambda: not pid_alive(old), 60, "the replaced worker gone")
    assert chat(app, "lo:zz", "hello")[0] == 404
    assert 'adapter="zz"' not in app.metrics() and 'adapter="upper"' in app.metrics()
