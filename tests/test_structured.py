"""Structured outputs through `openarc serve` on the demo model (random weights: only constrained decoding makes
its answers match a schema, so a valid answer shows the constraint reached genai)."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest
from pydantic import BaseModel, Field

from conftest import Appliance, http, model_entry
from test_metrics import samples, value

CHAT = [{"role": "user", "content": "Describe the weather."}]
THINK = r"<think>[a-z ]{5,40}</think>\nHello [a-z]{3,10}"
DEEP = {"type": "string"}
for _ in range(300):  # 300 levels took genai 8 s to compile: refused up front
    DEEP = {"type": "object", "properties": {"a": DEEP}}


class Weather(BaseModel):
    city: str = Field(max_length=12)
    celsius: int = Field(ge=-50, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    config = {"models": [model_entry("demo", demo_model),
                         model_entry("think", demo_model, reasoning_parser="qwen3"),
                         model_entry("sdpa", demo_model, pipeline="stateful")]}
    appliance = Appliance(config, tmp_path_factory.mktemp("structured"),
                          env={"OPENARC_DEBUG_STEP_DELAY_S": "0.005"}).start()
    yield appliance
    appliance.stop()


@pytest.mark.parametrize("model", ["demo", "sdpa"])
def test_parse_returns_a_pydantic_object(app, model):
    reply = app.client().chat.completions.parse(model=model, messages=CHAT, response_format=Weather, max_tokens=200)
    message = reply.choices[0].message
    assert isinstance(message.parsed, Weather)
    assert Weather.model_validate_json(message.content) == message.parsed


def test_json_schema_streamed_is_valid_too(app):
    schema = Weather.model_json_schema()
    stream = app.client().chat.completions.create(
        model="demo", messages=CHAT, max_tokens=200, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}})
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    Weather.model_validate_json(text)


def test_json_object_gives_a_json_object(app):
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=300,
                                                 response_format={"type": "json_object"})
    assert reply.choices[0].finish_reason == "stop", reply
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@pytest.mark.parametrize("spec, check", [
    ({"regex": "[0-9]{3}-[a-z]{4}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{4}", t)),
    ({"choice": ["sunny", "rain (light)", "a.b*c"]}, lambda t: t in ("sunny", "rain (light)", "a.b*c")),
    ({"grammar": 'root ::= "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
    ({"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
     lambda t: len(json.loads(t)) == 2 and all(isinstance(v, bool) for v in json.loads(t))),
])
def test_structured_outputs_kinds(app, spec, check):
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=100,
                                                 extra_body={"structured_outputs": spec})
    assert check(reply.choices[0].message.content), reply.choices[0].message.content


def test_older_guided_fields_and_completions(app):
    reply = app.client().completions.create(model="demo", prompt="Code:", max_tokens=20,
                                            extra_body={"guided_regex": "[A-Z]{5}"})
    assert re.fullmatch("[A-Z]{5}", reply.choices[0].text)


def test_regex_think_block_comes_back_as_reasoning_content(app):
    client = app.client()
    reply = client.chat.completions.create(model="think", messages=CHAT, max_tokens=100,
                                           extra_body={"structured_outputs": {"regex": THINK}})
    message = reply.choices[0].message
    assert re.fullmatch("[a-z ]{5,40}", message.reasoning_content), message
    assert re.fullmatch("Hello [a-z]{3,10}", message.content), message
    assert 0 < reply.usage.completion_tokens_details.reasoning_tokens < reply.usage.completion_tokens
    # streamed: the same split, deltas never mixing the two
    stream = client.chat.completions.create(model="think", messages=CHAT, max_tokens=100, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"structured_outputs": {"regex": THINK}})
    reasoning, content, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            reasoning.append(getattr(choice.delta, "reasoning_content", None) or "")
            content.append(choice.delta.content or "")
    assert "".join(reasoning) == message.reasoning_content
    assert "".join(content) == message.content
    assert usage.completion_tokens_details.reasoning_tokens == reply.usage.completion_tokens_details.reasoning_tokens


def test_text_completions_are_never_split_into_reasoning(app):
    reply = app.client().completions.create(model="think", prompt="Hi", max_tokens=40,
                                            extra_body={"structured_outputs": {"regex": THINK}})
    assert reply.choices[0].text.startswith("<think>") and reply.usage.completion_tokens_details is None


def test_a_plain_model_gets_no_reasoning_fields(app):
    reply = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=100,
                                                 extra_body={"structured_outputs": {"regex": THINK}})
    assert reply.choices[0].message.content.startswith("<think>")
    assert "reasoning_content" not in reply.choices[0].message.model_extra
    assert reply.usage.completion_tokens_details is None


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object",
                                                                                      "properties": 5}}}},
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
])
def test_an_uncompilable_constraint_is_a_400_while_a_concurrent_request_completes(app, body, param):
    pid = app.worker_pid("demo")
    errors_before = grammar_errors(app)
    done = {}

    def long_request():
        done["reply"] = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=60,
                                                             stream=False)
    thread = threading.Thread(target=long_request)
    thread.start()
    status, _, reply = http("POST", app.base + "/v1/chat/completions",
                            {"model": "demo", "messages": CHAT, "max_tokens": 20, **body})
    thread.join(60)
    assert status == 400, reply
    assert reply["error"]["code"] == "invalid_grammar" and "cannot be compiled" in reply["error"]["message"]
    assert reply["error"]["param"] == param
    assert done["reply"].usage.completion_tokens == 49  # 48 phrases and EOS: undisturbed
    assert app.worker_pid("demo") == pid
    ok = app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=20,
                                              extra_body={"structured_outputs": {"regex": "[a-z]{4}"}})
    assert re.fullmatch("[a-z]{4}", ok.choices[0].message.content)
    assert grammar_errors(app) == errors_before + 1  # this request's, counted once


def grammar_errors(app) -> float:
    return value(samples(app.metrics()), "openarc_request_errors_total", endpoint="chat/completions",
                 kind="invalid_grammar", model="demo")


def test_many_new_constraints_at_once_are_each_answered(app):
    """New constraints go by the worker's probe thread while others generate: every one is answered (valid ones
    matched, broken ones refused), clients that leave early are dropped, and the worker carries on."""
    import concurrent.futures
    import urllib.error
    import urllib.request
    pid = app.worker_pid("demo")

    def ask(i: int):
        regex = f"[a-z]{{{i + 1}}}" if i % 4 else f"[a-z]{{{i}}}("  # every fourth does not compile
        return http("POST", app.base + "/v1/chat/completions",
                    {"model": "demo", "messages": CHAT, "max_tokens": 30, "structured_outputs": {"regex": regex}})

    def leave_early(i: int) -> None:
        body = json.dumps({"model": "demo", "messages": CHAT, "max_tokens": 30,
                           "structured_outputs": {"regex": f"[0-9]{{{i + 2}}}x"}}).encode()
        request = urllib.request.Request(app.base + "/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        try:
            urllib.request.urlopen(request, timeout=0.001).read()
        except (urllib.error.URLError, TimeoutError, OSError):
            pass

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        left = [pool.submit(leave_early, i) for i in range(8)]
        answers = list(pool.map(ask, range(24)))
        for future in left:
            future.result()
    for i, (status, _, reply) in enumerate(answers):
        if i % 4:
            assert status == 200 and re.fullmatch(f"[a-z]{{{i + 1}}}", reply["choices"][0]["message"]["content"])
        else:
            assert status == 400 and reply["error"]["code"] == "invalid_grammar", reply
    assert app.worker_pid("demo") == pid
    deadline = time.monotonic() + 30
    while app.model_status("demo")["requests_running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert app.model_status("demo")["requests_running"] == 0


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ({"structured_outputs": {"json": DEEP}}, "structured_outputs.json"),
])
def test_malformed_constraints_are_refused_by_name(app, body, param):
    status, _, reply = http("POST", app.base + "/v1/chat/completions", {"model": "demo", "messages": CHAT, **body})
    assert status == 400 and reply["error"]["param"] == param, reply


def test_constrained_requests_are_counted_by_kind(app):
    def counted(kind: str) -> float:
        return value(samples(app.metrics()), "openarc_structured_requests_total", kind=kind, model="demo")
    before = {kind: counted(kind) for kind in ("choice", "regex")}
    app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=20,
                                         extra_body={"structured_outputs": {"choice": ["a", "b"]}})
    assert counted("choice") == before["choice"] + 1
    assert counted("regex") == before["regex"]  # by its own kind only
