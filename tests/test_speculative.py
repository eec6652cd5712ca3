"""Speculative decoding (a draft model, prompt lookup) through `openarc serve` on the demo pair: real genai on CPU.

The demo's main model and its drafts share one tokenizer; `draft` predicts the main model exactly, `draft_miss`
guesses every fourth token wrong, and the main model's answer pasted into a prompt encodes to the tokens it will
generate (so prompt lookup finds them). Whatever the drafts propose, greedy answers must be the main model's own.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, Appliance, http, model_entry

MODELS = ("plain", "draft", "miss", "lookup")
PROMPTS = ["Describe the weather.", "Tell me about rivers, please", "x"]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "sunny": {"type": "boolean"}},
          "required": ["city", "sunny"], "additionalProperties": False}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from appliance.demo.catalog import ensure_speculative_demo
    return ensure_speculative_demo(tmp_path_factory.mktemp("spec-cache"), eos_after=40, max_new_tokens=64)


@pytest.fixture(scope="module")
def app(pair, tmp_path_factory):
    main = pair["main"]
    config = {"models": [
        model_entry("plain", main),
        model_entry("draft", main, draft_model={"path": str(pair["draft"])}, num_assistant_tokens=4),
        model_entry("miss", main, draft_model={"path": str(pair["draft_miss"]), "device": "CPU"}),
        model_entry("lookup", main, prompt_lookup=True, max_ngram_size=2),
    ]}
    appliance = Appliance(config, tmp_path_factory.mktemp("speculative")).start()
    yield appliance
    appliance.stop()


def answer(app, model, prompt, stream=False, **kwargs):
    client = app.client()
    messages = [{"role": "user", "content": prompt}]
    if not stream:
        reply = client.chat.completions.create(model=model, messages=messages, **kwargs)
        return reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage.completion_tokens
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        if chunk.usage:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def draft_counts(app, model):
    metrics = app.metrics()
    found = {}
    for outcome in ("accepted", "rejected"):
        match = re.search(rf'openarc_draft_tokens_total{{model="{model}",outcome="{outcome}"}} (\S+)', metrics)
        found[outcome] = float(match.group(1)) if match else 0.0
    return found


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_greedy_answers_are_identical_with_a_draft_and_with_prompt_lookup(app, stream):
    for prompt in PROMPTS:
        for kwargs in ({}, {"max_tokens": 7}, {"stop": [" river"]}, {"max_tokens": 30, "stop": ["zzz"]}):
            answers = {model: answer(app, model, prompt, stream, **kwargs) for model in MODELS}
            assert answers["plain"][0], answers
            assert len(set(answers.values())) == 1, (prompt, kwargs, answers)


def test_structured_output_is_unchanged_by_the_draft(app):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    answers = {model: answer(app, model, "Weather?", max_tokens=60, response_format=fmt) for model in MODELS}
    assert answers["plain"][1] == "stop", answers
    assert len(set(answers.values())) == 1, answers


def test_acceptance_is_counted_and_a_worse_draft_accepts_less(app):
    before = {model: draft_counts(app, model) for model in MODELS}
    for prompt in PROMPTS:
        for model in ("draft", "miss"):
            answer(app, model, prompt)
    after = {model: draft_counts(app, model) for model in MODELS}
    gained = {m: {k: after[m][k] - before[m][k] for k in ("accepted", "rejected")} for m in MODELS}
    assert gained["plain"] == {"accepted": 0, "rejected": 0}
    assert gained["draft"]["accepted"] >= 3 * 30, gained  # ~40 tokens an answer, nearly all proposed and accepted
    assert gained["miss"]["rejected"] > 0 and gained["miss"]["accepted"] > 0, gained
    ratio = {m: gained[m]["accepted"] / (gained[m]["accepted"] + gained[m]["rejected"]) for m in ("draft", "miss")}
    assert ratio["draft"] > 0.9 and ratio["miss"] < ratio["draft"], ratio
    status = app.model_status("miss")
    assert status["speculative"] == "draft"
    assert status["draft_tokens_accepted"] == after["miss"]["accepted"]
    assert 0 < status["draft_acceptance_ratio"] < 1
    assert app.model_status("plain")["draft_acceptance_ratio"] is None
    assert app.model_status("lookup")["speculative"] == "prompt_lookup"


def copy_prompt(app) -> str:
    """A prompt holding the demo's answers of all four variants (the answer's variant follows the prompt's length):
    whichever the next answer is, the prompt holds it, token for token."""
    answers: dict[str, str] = {}
    for n in range(16):
        said = answer(app, "plain", "Say something" + " more" * n)[0]
        answers.setdefault(said.split()[0], said)
        if len(answers) == 4:
            return "Repeat one of these:\n" + "\n".join(answers.values())
    raise AssertionError(f"the demo gave {len(answers)} variants of answer, not 4")


def test_prompt_lookup_accepts_an_answer_copied_from_the_prompt(app):
    prompt = copy_prompt(app)
    before = draft_counts(app, "lookup")["accepted"]
    repeated = answer(app, "lookup", prompt)
    assert repeated == answer(app, "plain", prompt)
    assert repeated[0] in prompt  # the answer repeats (a line of) the prompt
    copied = draft_counts(app, "lookup")["accepted"] - before
    assert copied >= 30, (copied, repeated)  # 40 tokens; the first two find no n-gram to match


def test_the_load_log_says_which_mode_runs(app):
    logs = app.logs()
    assert re.search(r"model draft decodes speculatively with draft model \S+ on CPU \(num_assistant_tokens=4\)", logs)
    assert "model lookup decodes speculatively with prompt lookup (num_assistant_tokens=5, max_ngram_size=2)" in logs
    assert "model plain decodes without speculative decoding" in logs


@pytest.mark.parametrize("body, field", [
    ({"num_assistant_tokens": 0}, "num_assistant_tokens"),
    ({"num_assistant_tokens": 33}, "num_assistant_tokens"),
    ({"max_ngram_size": "3"}, "max_ngram_size"),
    ({"assistant_confidence_threshold": 1}, "assistant_confidence_threshold"),
    ({"num_assistant_tokens": 3, "assistant_confidence_threshold": 0.4}, "assistant_confidence_threshold"),
])
def test_request_knobs_out_of_range_are_400(app, body, field):
    status, _, reply = http("POST", app.base + "/v1/chat/completions",
                            {"model": "draft", "messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400, reply
    assert reply["error"]["param"] == field


def test_request_knobs_change_speed_not_answers(app):
    plain = answer(app, "plain", "knobs")
    assert answer(app, "draft", "knobs", extra_body={"num_assistant_tokens": 1}) == plain
    assert answer(app, "draft", "knobs", extra_body={"assistant_confidence_threshold": 0.5}) == plain
    assert answer(app, "lookup", "knobs", extra_body={"max_ngram_size": 1, "num_assistant_tokens": 2}) == plain
    assert answer(app, "plain", "knobs", extra_body={"num_assistant_tokens": 3}) == plain  # ignored: no draft


def check_config(tmp_path, model: dict) -> subprocess.CompletedProcess:
    path = tmp_path / "openarc.yaml"
    path.write_text(yaml.safe_dump({"models": [model]}))
    return subprocess.run([sys.executable, "-m", "appliance", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_check_config_refuses_a_draft_with_another_tokenizer(pair, demo_model, tmp_path):
    # The plain demo model encodes phrase text by BPE; the pair's models hold the phrases as added tokens.
    result = check_config(tmp_path, {"name": "m", "path": str(pair["main"]), "draft_model": {"path": str(demo_model)}})
    assert result.returncode == 2, result
    assert "models[0].draft_model.path" in result.stderr and "a draft must share" in result.stderr
    assert str(pair["main"]) in result.stderr and str(demo_model) in result.stderr
    good = check_config(tmp_path, {"name": "m", "path": str(pair["main"]), "draft_model": {"path": str(pair["draft"])}})
    assert good.returncode == 0, good.stderr


def test_check_config_says_draft_and_prompt_lookup_exclude_each_other(pair, tmp_path):
    result = check_config(tmp_path, {"name": "m", "path": str(pair["main"]), "prompt_lookup": True,
                                     "draft_model": {"path": str(pair["draft"])}})
    assert result.returncode == 2
    assert "models[0].prompt_lookup: a model decodes with a draft_model or with prompt_lookup, not both" in result.stderr
    stateful = check_config(tmp_path, {"name": "m", "path": str(pair["main"]), "prompt_lookup": True,
                                       "pipeline": "stateful"})
    assert stateful.returncode == 2 and "pipeline: continuous_batching" in stateful.stderr


def test_a_draft_that_fails_to_load_fails_the_model_with_the_reason(pair, appliance_factory, tmp_path):
    broken = tmp_path / "broken-draft"
    shutil.copytree(pair["draft"], broken)
    (broken / "openvino_model.xml").write_text("<net>not a model</net>")
    app = appliance_factory({"models": [model_entry("plain", pair["main"]),
                                        model_entry("m", pair["main"], draft_model={"path": str(broken)},
                                                    restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.1,
                                                             "max_failures": 2, "window_s": 60})]},
                            wait_ready=False)
    status = app.wait_model("m", "failed", timeout=120)
    assert f"draft_model '{broken}' failed to load" in status["last_error"], status
    assert status["pid"] is None  # no half-loaded worker serves without its draft
    code, _, body = http("POST", app.base + "/v1/chat/completions",
                         {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert code == 503, body


def test_draft_tally_counts_acceptances_from_each_steps_output():
    """genai's step API gives no per-request counts: each read is one step's output, 1 + accepted tokens."""
    from appliance.worker.engines.speculative import DraftTally
    tally = DraftTally(proposal=4, max_tokens=12)
    for produced in (1, 5, 3, 3):  # prompt step; all 4 accepted; 2 of 4; then 2 of the 2 still allowed
        tally.read(produced)
    assert (tally.accepted, tally.rejected, tally.generated) == (8, 2, 12)
    threshold = DraftTally(proposal=0, max_tokens=10)  # a confidence threshold: proposals of unknown size
    for produced in (1, 3, 1):
        threshold.read(produced)
    assert (threshold.accepted, threshold.rejected) == (2, 0)


@pytest.mark.parametrize("keys, error", [
    ({"prompt_lookup": True, "num_assistant_tokens": 0}, "models[0].num_assistant_tokens: expected 1 to 32"),
    ({"prompt_lookup": True, "max_ngram_size": 17}, "models[0].max_ngram_size: expected 1 to 16"),
    ({"max_ngram_size": 3}, "models[0].max_ngram_size: applies with prompt_lookup: true only"),
    ({"prompt_lookup": True, "assistant_confidence_threshold": 0.5},
     "models[0].assistant_confidence_threshold: applies to a draft_model"),
    ({"draft_model": {"path": "/nowhere"}, "num_assistant_tokens": 3, "assistant_confidence_threshold": 0.5},
     "models[0].assistant_confidence_threshold: set it or num_assistant_tokens, not both"),
    ({"draft_model": {"path": "/nowhere", "device": "gpu"}}, "models[0].draft_model.device: expected an OpenVINO"),
    ({"draft_model": {"path": "/nowhere", "size": 1}}, "models[0].draft_model.size: unknown key"),
    ({"kind": "embedding", "prompt_lookup": True}, "models[0].prompt_lookup: applies to kind 'llm' models only"),
])
def test_speculative_config_errors_name_the_key(keys, error):
    from appliance.config import ConfigError, parse_config
    with pytest.raises(ConfigError) as caught:
        parse_config({"models": [{"name": "m", "path": "/m", **keys}]}, "openarc.yaml")
    assert str(caught.value).startswith(f"openarc.yaml: {error}"), caught.value


def test_speculative_defaults_reach_the_worker_spec():
    from appliance.config import parse_config, worker_spec
    config = parse_config({"models": [
        {"name": "d", "path": "/m", "device": "GPU.1", "draft_model": {"path": "/d", "runtime_config": {"A": 1}}},
        {"name": "t", "path": "/m", "draft_model": {"path": "/d", "device": "CPU"}, "assistant_confidence_threshold": 0.4},
        {"name": "l", "path": "/m", "prompt_lookup": True, "max_ngram_size": 2},
        {"name": "p", "path": "/m"}]}, "x.yaml")
    d, t, l, p = (worker_spec(m, config) for m in config.models)
    assert d["draft_model"]["device"] == "GPU.1" and d["draft_model"]["properties"]["A"] == 1
    assert d["speculative"] == {"num_assistant_tokens": 5}
    assert t["speculative"] == {"assistant_confidence_threshold": 0.4} and t["draft_model"]["device"] == "CPU"
    assert l["speculative"] == {"num_assistant_tokens": 5, "max_ngram_size": 2} and l["prompt_lookup"] is True
    assert p["speculative"] == {} and p["draft_model"] is None
