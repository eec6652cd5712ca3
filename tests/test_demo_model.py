"""The built-in demo model, driven through real OpenVINO GenAI pipelines on CPU (no mocks)."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import openvino_genai as genai
import pytest

from appliance.demo import llm as demo
from appliance.demo.catalog import MARKER_FILE, build_demo_model, default_cache_dir, ensure_demo_model
from conftest import REPO

EOS_AFTER = 48
WORDS = set(demo.ADJECTIVES) | set(demo.NOUNS)
MAX_STEPS = 2000  # a step loop that runs longer than this is hung, not slow


@pytest.fixture(scope="module")
def model_dir(demo_model):
    """The session's demo model (conftest): stops after EOS_AFTER tokens, 64 at most."""
    return demo_model


@pytest.fixture(scope="module")
def pipe(model_dir):
    return genai.LLMPipeline(str(model_dir), "CPU")


def chat(text):
    return genai.ChatHistory([{"role": "user", "content": text}])


def phrase_words(text):
    """The words of a demo answer, checking that it is made only of the demo's phrase words."""
    words = text.replace(".", " ").lower().split()
    assert words and set(words) <= WORDS, text
    return words


def run_requests(pipe, prompts, config):
    """Feed `prompts` to a ContinuousBatchingPipeline together and step until all finish.
    Returns (handles, generated ids per handle as streamed by read(), last finish reason per handle, steps)."""
    handles = [pipe.add_request(i, prompt, config) for i, prompt in enumerate(prompts)]
    ids = [[] for _ in handles]
    reasons = [None for _ in handles]
    steps = 0
    while pipe.has_non_finished_requests():
        pipe.step()
        steps += 1
        assert steps < MAX_STEPS
        for i, handle in enumerate(handles):
            while handle.can_read():  # read() blocks (holding the GIL) when nothing is ready: ask first
                for output in handle.read().values():
                    ids[i] += output.generated_ids
                    reasons[i] = output.finish_reason
    return handles, ids, reasons, steps


def test_build_is_quick_small_and_complete(tmp_path):
    started = time.monotonic()
    dest = build_demo_model(tmp_path / "m", eos_after=7, max_new_tokens=20, seed=3)
    assert time.monotonic() - started < 10

    assert dest == tmp_path / "m"
    names = {p.name for p in dest.iterdir()}
    assert {"openvino_model.xml", "openvino_model.bin", "openvino_tokenizer.xml", "openvino_tokenizer.bin",
            "openvino_detokenizer.xml", "openvino_detokenizer.bin", "config.json", "generation_config.json",
            "tokenizer.json", "tokenizer_config.json", MARKER_FILE} <= names
    assert sum(p.stat().st_size for p in dest.iterdir()) < 4_000_000
    assert json.loads((dest / "config.json").read_text())["max_position_embeddings"] == 131072
    generation = json.loads((dest / "generation_config.json").read_text())
    assert generation["max_new_tokens"] == 20 and generation["eos_token_id"] == demo.EOS_ID
    marker = json.loads((dest / MARKER_FILE).read_text())
    assert marker["params"] == {"eos_after": 7, "max_new_tokens": 20, "seed": 3}
    assert not [p for p in tmp_path.iterdir() if p.name != "m"], "temporary build directory left behind"


def test_same_params_rebuild_the_same_model_and_seed_changes_it(tmp_path, model_dir):
    again = build_demo_model(tmp_path / "again", eos_after=EOS_AFTER, max_new_tokens=64)
    for name in ("openvino_model.bin", "openvino_tokenizer.bin", "openvino_detokenizer.bin", "tokenizer.json"):
        assert (again / name).read_bytes() == (model_dir / name).read_bytes(), name
    other = build_demo_model(tmp_path / "other", eos_after=EOS_AFTER, max_new_tokens=64, seed=1)
    assert (other / "openvino_model.bin").read_bytes() != (model_dir / "openvino_model.bin").read_bytes()
    prompt = chat("Hello")
    assert (genai.LLMPipeline(str(other), "CPU").generate(prompt).texts
            != genai.LLMPipeline(str(model_dir), "CPU").generate(prompt).texts)


def test_chat_answer_is_readable_deterministic_and_stops_by_itself(pipe):
    first = pipe.generate(chat("Hi there"))
    second = pipe.generate(chat("Hi there"))
    assert first.texts == second.texts
    text = first.texts[0]
    assert text.isprintable() and text[0].isupper() and text.endswith(".")
    assert len(phrase_words(text)) == 2 * EOS_AFTER
    assert first.finish_reasons == [genai.GenerationFinishReason.STOP]
    assert first.perf_metrics.get_num_generated_tokens() == EOS_AFTER + 1  # GenAI counts the EOS token


@pytest.mark.parametrize("prompt_words", [1, 300])
def test_eos_comes_after_eos_after_tokens_whatever_the_prompt_length(pipe, prompt_words):
    tokenizer = pipe.get_tokenizer()
    prompt = tokenizer.encode(" ".join(["word"] * prompt_words), add_special_tokens=False)
    result = pipe.generate(prompt, max_new_tokens=200)
    ids = list(result.tokens[0])
    assert len(ids) == EOS_AFTER + 1 and ids[-1] == demo.EOS_ID
    assert tokenizer.decode(ids[:-1]).startswith(" ")  # a completion goes on after the prompt's last word
    assert result.finish_reasons == [genai.GenerationFinishReason.STOP]


def test_plain_completion_prompt(pipe):
    result = pipe.generate(["Once upon a time"], apply_chat_template=False, max_new_tokens=5)
    text = result.texts[0]
    assert text.startswith(" ") and len(phrase_words(text)) == 10
    assert result.finish_reasons == [genai.GenerationFinishReason.LENGTH]


def test_different_prompts_give_different_answers_and_sampling_changes_nothing(pipe):
    answers = {pipe.generate(chat("Hi" + "!" * n)).texts[0] for n in range(4)}
    assert len(answers) > 1
    sampled = pipe.generate(chat("Hi"), do_sample=True, temperature=2.0, top_p=1.0, rng_seed=7)
    assert sampled.texts == pipe.generate(chat("Hi")).texts


def test_max_new_tokens_from_generation_config_is_the_default(tmp_path):
    model = build_demo_model(tmp_path / "endless", eos_after=0, max_new_tokens=12)
    result = genai.LLMPipeline(str(model), "CPU").generate(chat("Hi"))
    assert result.finish_reasons == [genai.GenerationFinishReason.LENGTH]
    assert result.perf_metrics.get_num_generated_tokens() == 12
    assert len(phrase_words(result.texts[0])) == 24


def test_streamer_callback_receives_the_answer_in_pieces(pipe):
    pieces = []

    def on_text(text):
        pieces.append(text)
        return genai.StreamingStatus.RUNNING

    result = pipe.generate(chat("Hi"), streamer=on_text)
    assert len(pieces) > 1 and "".join(pieces) == result.texts[0]


def test_sdpa_backend_gives_the_same_answers(model_dir, pipe):
    sdpa = genai.LLMPipeline(str(model_dir), "CPU", ATTENTION_BACKEND="SDPA")
    for prompt in ("Hi", "What is the weather like?"):
        result = sdpa.generate(chat(prompt))
        assert result.texts == pipe.generate(chat(prompt)).texts
        assert result.finish_reasons == [genai.GenerationFinishReason.STOP]


def test_continuous_batching_serves_two_requests_at_once(model_dir, pipe):
    batching = genai.ContinuousBatchingPipeline(str(model_dir), genai.SchedulerConfig(), "CPU")
    prompts = ["Once upon a time", "Once upon a time there"]
    config = genai.GenerationConfig()
    config.max_new_tokens = 100
    handles, ids, reasons, steps = run_requests(batching, prompts, config)

    assert [h.get_status() for h in handles] == [genai.GenerationStatus.FINISHED] * 2
    assert reasons == [genai.GenerationFinishReason.STOP] * 2
    assert all(len(x) == EOS_AFTER + 1 and x[-1] == demo.EOS_ID for x in ids)
    assert steps < 2 * (EOS_AFTER + 1)  # the two requests advanced in the same steps
    tokenizer = batching.get_tokenizer()
    expected = pipe.generate(prompts, apply_chat_template=False, max_new_tokens=100).texts
    assert [tokenizer.decode(x) for x in ids] == expected
    assert expected[0] != expected[1]


def test_scheduler_out_of_memory(model_dir):
    """4 KV blocks of 32 tokens: a prompt of more than 128 tokens cannot be scheduled."""
    scheduler = genai.SchedulerConfig()
    scheduler.num_kv_blocks = 4
    long_prompt = " ".join(["hello"] * 100)  # 200 tokens
    config = genai.GenerationConfig()
    config.max_new_tokens = 10

    batching = genai.ContinuousBatchingPipeline(str(model_dir), scheduler, "CPU")
    handles, ids, reasons, _ = run_requests(batching, [long_prompt], config)
    assert handles[0].get_status() == genai.GenerationStatus.IGNORED and ids == [[]]
    handles, ids, reasons, _ = run_requests(batching, ["Hi"], config)  # the pipeline still serves
    assert handles[0].get_status() == genai.GenerationStatus.FINISHED and len(ids[0]) == 10

    pipe = genai.LLMPipeline(str(model_dir), "CPU", scheduler_config=scheduler)
    with pytest.raises(RuntimeError, match=r"dropped by the scheduler .*\(out of memory\)"):
        pipe.generate(long_prompt, max_new_tokens=10)


def test_ensure_reuses_the_cache_and_rebuilds_when_params_change(tmp_path):
    first = ensure_demo_model(tmp_path, eos_after=5, max_new_tokens=9)
    assert first.parent == tmp_path / "models" and first.name.startswith("demo-")
    built_at = (first / "openvino_model.bin").stat().st_mtime_ns
    assert ensure_demo_model(tmp_path, eos_after=5, max_new_tokens=9) == first
    assert (first / "openvino_model.bin").stat().st_mtime_ns == built_at

    other = ensure_demo_model(tmp_path, eos_after=6, max_new_tokens=9)
    assert other != first
    assert json.loads((other / MARKER_FILE).read_text())["params"]["eos_after"] == 6
    result = genai.LLMPipeline(str(other), "CPU").generate(chat("Hi"))
    assert len(phrase_words(result.texts[0])) == 12

    (first / MARKER_FILE).unlink()  # an unfinished or damaged build is rebuilt
    assert ensure_demo_model(tmp_path, eos_after=5, max_new_tokens=9) == first
    assert (first / MARKER_FILE).exists()


def test_build_refuses_to_replace_a_directory_that_is_not_a_demo_build(tmp_path):
    (tmp_path / "precious.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_demo_model(tmp_path)
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    with pytest.raises(ValueError):
        build_demo_model(tmp_path / "m", eos_after=-1)


def test_a_build_killed_midway_leaves_no_model(tmp_path):
    """SIGKILL the builder while its temporary directory is being filled: `dest` is either absent or complete."""
    dest = tmp_path / "m"
    code = f"from appliance.demo.catalog import build_demo_model; build_demo_model({str(dest)!r})"
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(demo.__file__).parents[1]))
    for _attempt in range(5):
        builder = subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.DEVNULL)
        try:
            while builder.poll() is None:
                if any(any(p.iterdir()) for p in tmp_path.glob(".m.*")):
                    builder.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.001)
            builder.wait(timeout=60)
        finally:
            if builder.poll() is None:
                builder.kill()
                builder.wait()
        if not dest.exists():
            assert builder.returncode == -signal.SIGKILL
            assert ensure_demo_model(tmp_path / "cache").exists()  # and a later build works
            return
        assert demo._read_marker(dest), "a half-written model was left at dest"
        shutil.rmtree(dest)  # it got to the rename before the kill: try again
    pytest.fail("the build always finished before it could be killed")


@pytest.mark.parametrize("env, expected", [
    ({"OPENARC_CACHE_DIR": "/o", "CACHE_DIRECTORY": "/s", "XDG_CACHE_HOME": "/x"}, "/o"),
    ({"CACHE_DIRECTORY": "/var/cache/openarc:/var/cache/other", "XDG_CACHE_HOME": "/x"}, "/var/cache/openarc"),
    ({"XDG_CACHE_HOME": "/x"}, "/x/openarc"),
    ({"HOME": "/home/u"}, "/home/u/.cache/openarc"),
])
def test_default_cache_dir(monkeypatch, env, expected):
    for name in ("OPENARC_CACHE_DIR", "CACHE_DIRECTORY", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert default_cache_dir() == pathlib.Path(expected)


def test_cli_builds_a_model_that_never_stops_into_the_cache(tmp_path):
    """`openarc demo-model --eos-after 0` (no DIR): the cached build has the parameters asked for, not the default
    ones; the bench's throughput figures rely on such a model."""
    env = {**os.environ, "OPENARC_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--eos-after", "0", "--max-new-tokens", "80"],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    path = pathlib.Path(done.stdout.strip())
    assert path.parent == tmp_path / "models"
    assert json.loads((path / MARKER_FILE).read_text())["params"] == {"eos_after": 0, "max_new_tokens": 80, "seed": 0}
    result = genai.LLMPipeline(str(path), "CPU").generate(chat("Hi"), max_new_tokens=70)
    assert len(phrase_words(result.texts[0])) == 2 * 70  # two words a token, and no EOS: it ran to max_new_tokens


@pytest.mark.parametrize("kind", ["llm", "embedding"])
def test_building_a_demo_model_prints_only_what_openarc_says(tmp_path, kind):
    """What `make serve` runs first: transformers' "PyTorch was not found" advisory (it imports without torch) was
    the first line a new user saw; the build now says only the model's path."""
    env = {**{k: v for k, v in os.environ.items() if k != "TRANSFORMERS_NO_ADVISORY_WARNINGS"},
           "OPENARC_CACHE_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--kind", kind], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert done.returncode == 0, done.stdout
    assert "PyTorch" not in done.stdout and "transformers" not in done.stdout, done.stdout
    assert done.stdout.strip() == str(tmp_path / "models" / pathlib.Path(done.stdout.strip()).name)
