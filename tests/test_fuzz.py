"""Bad input, generated: no request body makes a 5xx or shows a traceback, and no config raises anything but a
ConfigError with a line per problem, each naming the file and where in it.

Request bodies go to a live appliance (random JSON, mutated valid bodies, raw bytes and headers); configs go
through parse_config and, as files, load_config. Example counts are bounded so the module runs in well under a
minute; shrinking is off for the HTTP properties (every shrink step is another request to a live server).
"""

from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from appliance.config import Config, ConfigError, load_config, parse_config
from conftest import Appliance, http, model_entry

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/rerank", "/v1/responses",
             "/v1/messages", "/v1/messages/count_tokens")
ANTHROPIC_ERROR_TYPES = {"invalid_request_error", "authentication_error", "not_found_error", "request_too_large",
                         "rate_limit_error", "api_error", "overloaded_error", "timeout_error"}
HTTP_FUZZ = settings(max_examples=120, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                     suppress_health_check=[HealthCheck.too_slow])
CONFIG_FUZZ = settings(max_examples=300, deadline=None, database=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ERROR_TYPES = {"invalid_request_error", "rate_limit_error", "server_error"}
REQUEST_TIMEOUT_S = 30  # only catches a hang: the demo model answers in milliseconds


@pytest.fixture(scope="module")
def app(demo_model, embedding_model, rerank_model, tmp_path_factory):
    config = {"server": {"max_body_bytes": 65536}, "models": [
        model_entry("demo", demo_model, max_context=512),
        model_entry("embed", embedding_model, kind="embedding", max_context=64, max_inputs=16),
        model_entry("rank", rerank_model, kind="rerank", max_context=64, max_inputs=16)]}
    appliance = Appliance(config, tmp_path_factory.mktemp("fuzz")).start()
    yield appliance
    appliance.stop()


# --- strategies -------------------------------------------------------------------------------------------

# Any character, lone surrogates and controls included: JSON can carry them all (as \\u escapes).
texts = st.text(st.characters(), max_size=12)
numbers = st.integers() | st.integers(min_value=-(10 ** 30), max_value=10 ** 30) | st.floats()
json_values = st.recursive(st.none() | st.booleans() | numbers | texts,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner, max_size=3),
                           max_leaves=8)
REQUEST_KEYS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
                "stop", "stream", "stream_options", "n", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "logprobs", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
                "response_format", "structured_outputs", "guided_regex", "guided_choice", "chat_template_kwargs",
                "logit_bias", "echo", "suffix", "best_of",
                "input", "encoding_format", "dimensions", "truncate", "query", "documents", "top_n",
                "return_documents", "instructions", "max_output_tokens", "previous_response_id", "store", "text",
                "reasoning", "system", "stop_sequences", "thinking", "metadata")
MODELS = ("demo", "embed", "rank")
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(("system", "developer", "user", "assistant", "tool"))
                                           | texts, "content": texts | json_values}), max_size=3)


def valid_body(endpoint: str) -> dict:
    if endpoint.endswith("responses"):
        return {"model": "demo", "input": "Hi", "max_output_tokens": 4}
    if "/messages" in endpoint:
        return {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
    if endpoint.endswith("embeddings"):
        return {"model": "embed", "input": ["Hi", "a cat"], "dimensions": 32}
    if endpoint.endswith("rerank"):
        return {"model": "rank", "query": "Hi", "documents": ["Hi there", {"text": "a cat"}], "top_n": 1}
    body = {"model": "demo", "max_tokens": 4}
    if endpoint.endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": "Hi"}]
    else:
        body["prompt"] = "Hi"
    return body


@st.composite
def mutated_bodies(draw) -> dict:
    """A valid body with a few keys replaced by anything, deleted, or added."""
    body = valid_body(draw(st.sampled_from(ENDPOINTS)))
    for _ in range(draw(st.integers(1, 4))):
        key = draw(st.sampled_from(REQUEST_KEYS) | texts)
        if draw(st.booleans()):
            body.pop(key, None)
        else:
            body[key] = draw(messages if key == "messages" else st.sampled_from(MODELS) if key == "model" else json_values)
    return body


# The new fields in their own shape, with anything inside: schemas, regexes and grammars that may or may not
# compile, tool definitions and calls, so the worker's constraint probe and the answer parsers see odd input.
schemas = json_values | st.fixed_dictionaries({"type": st.sampled_from(("object", "string", "array", "integer", 5))},
                                              optional={"properties": st.dictionaries(texts, json_values, max_size=2),
                                                        "maxLength": numbers, "pattern": texts,
                                                        "required": st.lists(texts, max_size=2)})
functions = st.fixed_dictionaries({"name": st.sampled_from(("f", "get_weather")) | texts},
                                  optional={"parameters": schemas, "strict": st.booleans() | json_values,
                                            "description": texts | json_values})
tools = st.lists(st.fixed_dictionaries({"type": st.just("function") | texts, "function": functions}), max_size=2)
tool_choices = (st.sampled_from(("none", "auto", "required")) | json_values
                | st.fixed_dictionaries({"type": st.just("function"),
                                         "function": st.fixed_dictionaries({"name": st.just("f") | texts})}))
response_formats = st.fixed_dictionaries(
    {"type": st.sampled_from(("json_object", "json_schema", "text")) | texts},
    optional={"json_schema": st.fixed_dictionaries({"name": texts, "schema": schemas},
                                                   optional={"strict": json_values})})
regexes = texts | st.sampled_from(("[a-z]{3}", "a(b", "(?=x)y", "\\", "[", "a{2,1}", "x*", ".{5}", "(a|b)+"))
structured = (st.fixed_dictionaries({}, optional={"regex": regexes, "choice": st.lists(texts, max_size=3) | json_values,
                                                  "grammar": texts | st.just('root ::= "a" | b'), "json": schemas,
                                                  "json_object": json_values}))
tool_turns = st.fixed_dictionaries({
    "role": st.just("assistant"), "content": st.none() | texts,
    "tool_calls": st.lists(st.fixed_dictionaries({"id": texts | json_values, "type": st.just("function"),
                                                  "function": st.fixed_dictionaries({"name": texts | json_values,
                                                                                     "arguments": texts | json_values})}),
                           max_size=2) | json_values})
tool_results = st.fixed_dictionaries({"role": st.just("tool"), "content": texts | json_values,
                                      "tool_call_id": texts | json_values})


# The Responses and Messages dialects' own shapes: input items, content blocks, their tools and choices.
parts = st.lists(st.fixed_dictionaries({"type": st.sampled_from(("input_text", "output_text", "input_image",
                                                                 "reasoning_text")) | texts,
                                        "text": texts | json_values}), max_size=2)
input_items = st.fixed_dictionaries(
    {"type": st.sampled_from(("message", "function_call", "function_call_output", "reasoning", "item_reference"))
     | texts},
    optional={"role": st.sampled_from(("user", "assistant", "system", "developer")) | texts,
              "content": texts | parts | json_values, "call_id": texts | json_values,
              "name": st.just("f") | texts, "arguments": texts | json_values, "output": texts | parts | json_values,
              "summary": json_values})
response_fields = {
    "input": texts | st.lists(input_items, max_size=3) | json_values, "instructions": texts | json_values,
    "tools": st.lists(st.fixed_dictionaries({"type": st.just("function") | texts, "name": st.just("f") | texts},
                                            optional={"parameters": schemas, "strict": st.booleans() | json_values,
                                                      "description": texts | json_values}), max_size=2),
    "tool_choice": st.sampled_from(("none", "auto", "required")) | json_values
    | st.fixed_dictionaries({"type": st.just("function"), "name": st.just("f") | texts}),
    "text": st.fixed_dictionaries({"format": st.fixed_dictionaries(
        {"type": st.sampled_from(("text", "json_object", "json_schema")) | texts},
        optional={"name": texts, "schema": schemas, "strict": json_values})}) | json_values,
    "previous_response_id": texts | json_values, "store": st.booleans() | json_values,
    "reasoning": st.fixed_dictionaries({}, optional={"effort": texts, "summary": json_values}) | json_values,
    "parallel_tool_calls": json_values, "max_output_tokens": numbers, "temperature": numbers, "top_p": numbers}
blocks = st.fixed_dictionaries(
    {"type": st.sampled_from(("text", "tool_use", "tool_result", "thinking", "redacted_thinking", "image")) | texts},
    optional={"text": texts | json_values, "id": texts | json_values, "name": st.just("f") | texts,
              "input": st.dictionaries(texts, json_values, max_size=2) | json_values, "tool_use_id": texts,
              "content": texts | st.lists(blocks_text := st.fixed_dictionaries({"type": st.just("text") | texts,
                                                                                "text": texts}), max_size=2),
              "is_error": json_values, "thinking": texts | json_values, "signature": texts})
message_fields = {
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(("user", "assistant")) | texts,
                                                "content": texts | st.lists(blocks, max_size=3) | json_values}),
                         max_size=3),
    "system": texts | st.lists(blocks_text, max_size=2) | json_values,
    "tools": st.lists(st.fixed_dictionaries({"name": st.just("f") | texts},
                                            optional={"input_schema": schemas, "description": texts | json_values,
                                                      "type": st.just("custom") | texts}), max_size=2) | json_values,
    "tool_choice": st.fixed_dictionaries({"type": st.sampled_from(("auto", "any", "tool", "none")) | texts},
                                         optional={"name": st.just("f") | texts,
                                                   "disable_parallel_tool_use": json_values}) | json_values,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(("enabled", "disabled", "adaptive")) | texts},
                                      optional={"budget_tokens": numbers}) | json_values,
    "stop_sequences": st.lists(texts, max_size=3) | json_values, "metadata": json_values, "top_k": numbers,
    "max_tokens": numbers, "temperature": numbers}


@st.composite
def dialect_requests(draw) -> tuple[str, dict]:
    endpoint = draw(st.sampled_from(ENDPOINTS[4:]))
    body = valid_body(endpoint)
    fields = response_fields if endpoint.endswith("responses") else message_fields
    for key in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=4, unique=True)):
        body[key] = draw(fields[key])
    if draw(st.booleans()):
        body["stream"] = True
    return endpoint, body


DEEP_SCHEMA: dict = {"type": "string"}
for _ in range(400):  # deep enough to take genai's schema compiler many seconds, and Python's json.dumps to its limit
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}


@st.composite
def bodies_with_new_fields(draw) -> dict:
    body = valid_body(draw(st.sampled_from(ENDPOINTS[:2])))
    options = {"tools": tools, "tool_choice": tool_choices, "parallel_tool_calls": json_values,
               "response_format": response_formats, "structured_outputs": structured,
               "top_k": numbers, "min_p": numbers, "logprobs": json_values, "top_logprobs": numbers,
               "presence_penalty": numbers, "frequency_penalty": numbers, "repetition_penalty": numbers,
               "chat_template_kwargs": json_values, "stream": st.booleans()}
    for key in draw(st.lists(st.sampled_from(sorted(options)), min_size=1, max_size=4, unique=True)):
        body[key] = draw(options[key])
    if "messages" in body and draw(st.booleans()):
        body["messages"] = body["messages"] + draw(st.lists(tool_turns | tool_results, min_size=1, max_size=3))
    return body


# Bodies that break a JSON parser in ways other than a syntax error.
NASTY_RAW = [b"[" * 5000 + b"]" * 5000, b'{"max_tokens": ' + b"9" * 5000 + b"}", b'{"model": "\\ud800"}',
             b"\xff\xfe{}", b'{"model": "demo", "prompt": "x", "max_tokens": 1e999}', b"NaN", b""]
CONTENT_TYPES = ("application/json", "text/plain", "application/json; charset=latin-1",
                 "application/json; charset=no-such-codec", "application/json; charset=utf-16", "")


# --- checks -------------------------------------------------------------------------------------------------

def assert_clean(status: int, body, endpoint: str = "") -> None:
    """What any OpenAI (or, on /v1/messages, Anthropic) client may rely on, whatever it sent."""
    text = body if isinstance(body, str) else json.dumps(body)
    assert status < 500, f"{status}: {text[:500]}"
    assert "Traceback" not in text and 'File "' not in text, text[:500]
    if endpoint.startswith("/v1/messages"):
        assert_anthropic(status, body, text)
    elif endpoint == "/v1/responses" and status < 400:
        if isinstance(body, str):  # a stream ends with the response's last state (or an error)
            last = body.strip().rsplit("event: ", 1)[-1].split("\n", 1)[0]
            assert last in ("response.completed", "response.incomplete", "response.failed"), body[-300:]
        else:
            assert body["object"] == "response" and body["output"] and "usage" in body, body
    elif status >= 400:
        assert isinstance(body, dict) and set(body) == {"error"}, text[:500]
        error = body["error"]
        assert isinstance(error["message"], str) and error["message"], error
        assert error["type"] in ERROR_TYPES and {"param", "code"} <= set(error), error
    elif isinstance(body, str):  # a stream
        assert body.endswith("data: [DONE]\n\n"), body[-200:]
    else:  # completions have choices, embeddings data, rerank results
        assert (body.get("choices") or body.get("data") or body.get("results")) and "usage" in body, body


def assert_anthropic(status: int, body, text: str) -> None:
    if status >= 400:
        assert isinstance(body, dict) and set(body) == {"type", "error"} and body["type"] == "error", text[:500]
        assert body["error"]["type"] in ANTHROPIC_ERROR_TYPES and body["error"]["message"], body
    elif isinstance(body, str):
        assert body.rstrip().endswith(('"message_stop"}', "}}")) and "event: message_start" in body, body[-300:]
    else:
        assert body.get("input_tokens") or (body["type"] == "message" and body["content"] and body["usage"]), body


def post(app, endpoint: str, body=None, raw: bytes | None = None, content_type: str = "application/json"):
    status, _, reply = http("POST", app.base + endpoint, body, raw=raw, headers={"Content-Type": content_type},
                            timeout=REQUEST_TIMEOUT_S)
    return status, reply


# --- request bodies -----------------------------------------------------------------------------------------

@HTTP_FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), body=json_values)
def test_random_json_bodies_get_a_4xx_error_body_never_a_5xx(app, endpoint, body):
    assert_clean(*post(app, endpoint, body), endpoint)


@HTTP_FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), body=mutated_bodies())
@example(endpoint="/v1/completions", body={"model": "demo", "prompt": "\ud800", "max_tokens": 4})
@example(endpoint="/v1/chat/completions", body={"model": "demo", "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 4, "stop": ["\udfff"]})
@example(endpoint="/v1/embeddings", body={"model": "embed", "input": ["\ud800"]})
@example(endpoint="/v1/embeddings", body={"model": "embed", "input": [[0, 1, 2, 3, 4]], "truncate": True})
@example(endpoint="/v1/embeddings", body={"model": "embed", "input": "\x00 \u200b \U0001f600" * 30, "truncate": True})
@example(endpoint="/v1/rerank", body={"model": "rank", "query": "\x00", "documents": ["", "\U0001f600" * 200],
                                      "truncate": True})
def test_mutated_valid_bodies_are_served_or_refused_cleanly(app, endpoint, body):
    assert_clean(*post(app, endpoint, body), endpoint)


@HTTP_FUZZ
@given(body=bodies_with_new_fields())
@example(body={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
               "structured_outputs": {"regex": "a(b"}, "stream": True})
@example(body={"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
               "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                                     "properties": 5}}}],
               "tool_choice": "required"})
def test_tools_constraints_and_sampling_fields_are_served_or_refused_cleanly(app, body):
    endpoint = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    assert_clean(*post(app, endpoint, body), endpoint)


@HTTP_FUZZ
@given(request=dialect_requests())
@example(request=("/v1/responses", {"model": "demo", "input": [{"type": "function_call", "call_id": "c", "name": "f",
                                                                 "arguments": '{"a":' * 900 + "1" + "}" * 900}]}))
@example(request=("/v1/messages", {"model": "demo", "max_tokens": 4, "messages": [
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text"}]}]}]}))
@example(request=("/v1/messages/count_tokens", {"model": "demo", "messages": [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {"\ud800": 1}}]}]}))
@example(request=("/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": 4, "stream": True,
                                    "tools": [{"type": "function", "name": "f", "parameters": {"type": "object",
                                                                                              "properties": 5}}],
                                    "tool_choice": "required"}))
@example(request=("/v1/messages", {"model": "demo", "max_tokens": 40, "stream": True, "tool_choice": {"type": "any"},
                                   "messages": [{"role": "user", "content": "Hi"}],
                                   "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
                                       "a": {"type": "string", "pattern": "[a-z]{200}"}}}}]}))
@example(request=("/v1/messages", {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}],
                                   "thinking": {"type": "disabled", "budget_tokens": "x"}}))
def test_responses_and_messages_fields_are_served_or_refused_cleanly(app, request):
    endpoint, body = request
    assert_clean(*post(app, endpoint, body), endpoint)


@pytest.mark.parametrize("body", [
    {"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP_SCHEMA}}},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"a":' * 900 + "1" + "}" * 900}}]}]},
], ids=["deep schema", "deep tool-call arguments"])
def test_deeply_nested_json_is_refused_before_it_costs_anything(app, body):
    """Not generated (hypothesis cannot print a value this deep): a schema nested 400 levels takes genai's
    compiler many seconds, and Python's own JSON encoder stops near 500."""
    status, reply = post(app, "/v1/chat/completions", {**valid_body("/v1/chat/completions"), **body})
    assert_clean(status, reply)
    assert status == 400 and "deeper than" in reply["error"]["message"], reply


@HTTP_FUZZ
@given(endpoint=st.sampled_from(ENDPOINTS), raw=st.sampled_from(NASTY_RAW) | st.binary(max_size=200),
       content_type=st.sampled_from(CONTENT_TYPES))
def test_raw_bytes_and_odd_content_types_are_refused_cleanly(app, endpoint, raw, content_type):
    assert_clean(*post(app, endpoint, raw=raw, content_type=content_type), endpoint)


def test_the_appliance_still_serves_after_the_fuzzing(app):
    """Runs last in this module: nothing above left the model stuck (a request stranded in a worker slot) or
    killed its worker."""
    status, reply = post(app, "/v1/completions", valid_body("/v1/completions"))
    assert status == 200 and reply["usage"]["completion_tokens"] == 4
    assert post(app, "/v1/embeddings", valid_body("/v1/embeddings"))[0] == 200
    assert post(app, "/v1/rerank", valid_body("/v1/rerank"))[0] == 200
    for endpoint in ENDPOINTS[4:]:
        assert post(app, endpoint, valid_body(endpoint))[0] == 200
    for model in MODELS:
        status = app.model_status(model)
        assert (status["requests_running"], status["crashes"], status["restarts"]) == (0, 0, 0), status


# --- configs ------------------------------------------------------------------------------------------------

CONFIG_KEYS = ("server", "models", "name", "path", "device", "port", "host", "pipeline", "restart", "scheduler_config",
               "runtime_config", "max_context", "max_running", "max_queue", "stall_timeout_s", "backoff_initial_s",
               "num_kv_blocks", "log_level", "api_key_env", "kind", "max_inputs", "pooling", "normalize",
               "matryoshka_dimensions", "api_keys", "key_env", "priority", "max_concurrent", "task_model",
               "memory_budget", "memory", "GPU", "CPU")
# Sizes at and past the edge of a float (they crashed check-config, serve and reload with an OverflowError).
sizes = (st.sampled_from(["inf", "-inf", "nan", "1e400", "1e400GiB", "Infinity", "1e18TiB", "0.5B", "4.5GiB"])
         | st.builds("{}{}".format, st.floats(allow_nan=True, allow_infinity=True) | st.integers(-1, 10 ** 30),
                     st.sampled_from(["", "B", "GiB", "gb", " MiB", "TiB"])))
yaml_scalars = (st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10 ** 400), max_value=10 ** 400)
                | st.floats() | texts | st.dates() | sizes)
config_values = st.recursive(yaml_scalars, lambda inner: st.lists(inner, max_size=3)
                             | st.dictionaries(st.sampled_from(CONFIG_KEYS) | texts, inner, max_size=4), max_leaves=10)
VALID_CONFIG = {
    "server": {"host": "127.0.0.1", "port": 8000, "api_key_env": "OPENARC_KEY", "max_body_bytes": 4096,
               "memory_budget": {"GPU": "14GiB", "CPU": "32GB"},
               "drain_timeout_s": 5, "load_concurrency": 1, "log_level": "info",
               "api_keys": [{"name": "agent", "key_env": "OPENARC_AGENT_KEY", "priority": "background",
                             "max_concurrent": 2, "tokens_per_minute": 1000, "models": ["demo*"]}]},
    "models": [{"name": "demo", "path": "/models/demo", "device": "GPU.0", "pipeline": "stateful", "max_context": 2048,
                "memory": "4.5GiB", "load": "on_demand",
                "scheduler_config": {"num_kv_blocks": 4}, "runtime_config": {"KV_CACHE_PRECISION": "u8"},
                "restart": {"backoff_initial_s": 1, "backoff_max_s": 2, "max_failures": 3, "window_s": 60}},
               {"name": "embed", "path": "/models/embed", "kind": "embedding", "max_context": 512, "max_inputs": 64,
                "pooling": "mean", "normalize": True, "matryoshka_dimensions": [256, 512]}],
}


def config_paths(node, prefix=()) -> list[tuple]:
    """Every place in VALID_CONFIG a mutation can hit, plus an unknown key in every mapping."""
    paths = []
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, child in children:
        paths.append(prefix + (key,))
        paths += config_paths(child, prefix + (key,))
    if isinstance(node, dict):
        paths.append(prefix + ("no_such_key",))
    return paths


def child(node, key):
    if isinstance(node, dict):
        return node.get(key)
    if isinstance(node, list) and isinstance(key, int) and key < len(node):
        return node[key]
    return None


@st.composite
def mutated_configs(draw) -> dict:
    config = copy.deepcopy(VALID_CONFIG)
    for path in draw(st.lists(st.sampled_from(config_paths(VALID_CONFIG)), min_size=1, max_size=3)):
        parent = config
        for key in path[:-1]:  # an earlier mutation may have replaced a mapping on this path
            parent = child(parent, key)
            if not isinstance(parent, (dict, list)):
                break
        else:
            if isinstance(parent, dict) and draw(st.booleans()):
                parent.pop(path[-1], None)
            elif isinstance(parent, dict) or child(parent, path[-1]) is not None:
                parent[path[-1]] = draw(config_values)
    return config


def utf8(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")  # a lone surrogate becomes bytes no UTF-8 decoder accepts


KEY_PATH = re.compile(r"(top level|server|models)\b")
UNREADABLE = object()  # a file that is no YAML at all: its error can name no key


def assert_each_line_naming(message: str, source: str, data) -> None:
    """Every problem is reported, each on a line of its own that names the file and the key."""
    assert "\r" not in message, message
    lines = message.split("\n")
    assert len(lines) == len(set(lines)), message  # no problem twice
    for line in lines:
        assert line.startswith(f"{source}: "), message
        if data is UNREADABLE:
            assert len(lines) == 1, message
            continue
        where = line[len(source) + 2:]
        # an unknown top-level key is named as it is, or quoted
        top_keys = tuple(f"{name}: " for k in data for name in (k, repr(k))) if isinstance(data, dict) else ()
        assert KEY_PATH.match(where) or where.startswith(top_keys), message


def parses_or_explains(data, source: str = "fuzz.yaml") -> None:
    try:
        config = parse_config(data, source)
    except ConfigError as exc:
        assert_each_line_naming(str(exc), source, data)
    else:
        assert isinstance(config, Config)


def test_the_valid_config_the_mutations_start_from_is_valid():
    assert parse_config(copy.deepcopy(VALID_CONFIG), "fuzz.yaml").models[0].name == "demo"


@CONFIG_FUZZ
@given(data=config_values)
@example(data={"server": {"drain_timeout_s": 10 ** 400}})
@example(data={"models": [{"name": "a", "path": "p", "restart": {"window_s": -(10 ** 400)}}]})
@example(data={"server": {"a\nb": 1}})
@example(data={"server": {"memory_budget": {"CPU": "1e400"}}})
@example(data={"models": [{"name": "a", "path": "p", "memory": "inf"}], "server": {"memory_budget": {"GPU": 10 ** 400}}})
def test_random_configs_parse_or_fail_with_a_config_error_line_per_problem(data):
    parses_or_explains(data)


@CONFIG_FUZZ
@given(data=mutated_configs())
def test_mutated_valid_configs_parse_or_fail_with_a_config_error_line_per_problem(data):
    parses_or_explains(data)


@CONFIG_FUZZ
@given(content=st.binary(max_size=300) | texts.map(utf8) | mutated_configs().map(
    lambda c: utf8(yaml.safe_dump(c, allow_unicode=True))))
@example(content=b"\xff\xfe: 1")
@example(content=b"server: \x07")
def test_config_files_load_or_fail_with_a_config_error_line_per_problem(tmp_path, content):
    path = tmp_path / "openarc.yaml"
    path.write_bytes(content)
    try:
        config = load_config(path)
    except ConfigError as exc:
        assert_each_line_naming(str(exc), str(path), yaml_data(content))
    else:
        assert isinstance(config, Config) and config.source == str(path)


def yaml_data(content: bytes):
    """What a config file holds as YAML, or UNREADABLE."""
    try:
        return yaml.safe_load(content.decode("utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError):
        return UNREADABLE

