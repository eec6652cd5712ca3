"""The hostile-request suite (issue 36): a real server on the demo models, every route, bodies mutated from valid
ones by hypothesis (deep nesting, huge numbers, NaN and Infinity, wrong types, invalid UTF-8, giant strings, many
items, grammar, schema and regex bombs) and a fixed corpus of known bombs. Invariants over the whole run, not
single cases: every answer is a documented status with a JSON error body in the route's own shape, within
ANSWER_BOUND_S; no traceback in the log; no worker's pid changes; the front's RSS grows by less than
RSS_GROWTH_BOUND_MB; a good request after the storm answers as it did before.

About two minutes in CI; OPENARC_HOSTILE_EXAMPLES (examples per route, default 12) runs it longer. The corpus is
bench.hostile's (its bench replays it beside an honest client). On the code before issue 36 (74ff599) it found:
the nested-repeat Lark grammar on chat and Responses (503 worker_crash: the worker exited on the front's 101 MB
frame, twice, with a traceback in the log), the 16-optional grammar (answered after 25 s: lark in the front's
default executor), a nested-repeat regex constraint and a schema `pattern` with nested repeats (20 s: genai's
compile in the worker, near its stall timeout). The terminal DAG was left out of that run: lark's own reference
resolution of it would have run for hours in the front. The 100 MB-expanding schema and the nested-repeat EBNF
grammar were answered 200 (genai compiles $refs as rules), and are refused now by their bounds.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from audio_samples import multipart, tone, wav_bytes
from bench.hostile import (EBNF_BOMB, NAMED_GROUP_REGEX_BOMB, NESTED_REPEATS, OPTIONALS_16, REGEX_BOMB,
                           TEMPLATE_FANOUT, TERMINAL_DAG, custom_tool, deep, schema_bomb)
from conftest import Appliance, http, model_entry, pid_alive, wait_until

EXAMPLES = int(os.environ.get("OPENARC_HOSTILE_EXAMPLES") or 12)
ANSWER_BOUND_S = 20.0  # only catches a hang (or a conversion that ran): a refusal takes milliseconds
BOMB_BOUND_S = 2.0  # the issue's bombs: "a 400 in milliseconds", with room for two loaded cores
RSS_GROWTH_BOUND_MB = 48  # the front over the whole storm (the old code: +100 MB from one grammar)
DOCUMENTED = {200, 400, 404, 405, 413, 415, 429}  # docs/api.md: what a client's request may get; never a 5xx
MAX_BODY = 256 << 10
IMAGE_BYTES, IMAGE_PIXELS = 64 << 10, 10_000  # the vision model's limits in the storm's config
HOSTILE_SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                            phases=(Phase.explicit, Phase.generate),
                            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

CHAT = [{"role": "user", "content": "Hi"}]


# --- the routes ---------------------------------------------------------------------------------------------

def request(method: str, url: str, raw: bytes | None, headers: dict) -> tuple[int, Any]:
    """(status, the body as JSON, or its bytes when it is none: speech answers audio)."""
    req = urllib.request.Request(url, data=raw, method=method,
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=ANSWER_BOUND_S + 30) as response:
            status, data = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, data = exc.code, exc.read()
    try:
        return status, json.loads(data)
    except ValueError:
        return status, data


class Route:
    """One route: how a request is sent, a valid body, and the shape of its errors."""

    def __init__(self, name: str, method: str, path: str, body: Any, anthropic: bool = False,
                 form: bool = False):
        self.name, self.method, self.path, self.body = name, method, path, body
        self.anthropic, self.form = anthropic, form

    def send(self, app: Appliance, raw: bytes | None = None, path: str | None = None) -> tuple[int, Any, float]:
        started = time.monotonic()
        headers = {}
        if self.form:
            content_type, raw = multipart(self.body) if raw is None else raw
            headers["Content-Type"] = content_type
        elif raw is None and self.body is not None:
            raw = json.dumps(self.body).encode()
        status, reply = request(self.method, app.base + (path or self.path), raw, headers)
        return status, reply, time.monotonic() - started

    def assert_error_shape(self, status: int, reply: Any) -> None:
        assert isinstance(reply, dict), f"{self.name}: a {status} whose body is no JSON object: {str(reply)[:300]}"
        if self.anthropic:
            assert reply.get("type") == "error" and isinstance(reply["error"]["message"], str), reply
        else:
            error = reply.get("error")
            assert isinstance(error, dict) and isinstance(error.get("message"), str) and error.get("type"), reply
        assert "Traceback" not in json.dumps(reply)


ROUTES = {r.name: r for r in [
    Route("chat", "POST", "/v1/chat/completions", {"model": "demo", "messages": CHAT, "max_tokens": 8,
                                                   "temperature": 0}),
    Route("completions", "POST", "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 8,
                                                     "temperature": 0}),
    Route("responses", "POST", "/v1/responses", {"model": "demo", "input": "Hi", "max_output_tokens": 8,
                                                 "temperature": 0}),
    Route("messages", "POST", "/v1/messages", {"model": "demo", "messages": CHAT, "max_tokens": 8,
                                               "temperature": 0}, anthropic=True),
    Route("count_tokens", "POST", "/v1/messages/count_tokens", {"model": "demo", "messages": CHAT},
          anthropic=True),
    Route("embeddings", "POST", "/v1/embeddings", {"model": "embed", "input": ["Hi", "a cat"]}),
    Route("rerank", "POST", "/v1/rerank", {"model": "rank", "query": "Hi", "documents": ["Hi there", "a cat"]}),
    Route("transcription", "POST", "/v1/audio/transcriptions", {"model": "whisper", "file": b"placeholder"},
          form=True),
    Route("speech", "POST", "/v1/audio/speech", {"model": "tts", "input": "hello", "voice": "alloy"}),
    Route("load", "POST", "/openarc/models/demo/load", None),
    Route("unload", "POST", "/openarc/models/nonesuch/unload", None),
    Route("status", "GET", "/openarc/status", None),
]}
JSON_ROUTES = [name for name, r in ROUTES.items() if isinstance(r.body, dict) and not r.form]
PATH_ROUTES = ["load", "unload", "status"]


def good_answer(route: Route, reply: Any) -> Any:
    """What a good request's answer must keep across the storm (a deterministic part of it)."""
    if route.name == "chat":
        return reply["choices"][0]["message"]["content"]
    if route.name == "completions":
        return reply["choices"][0]["text"]
    if route.name == "responses":
        return reply["output"][-1]["content"][0]["text"]
    if route.name == "messages":
        return reply["content"][0]["text"]
    if route.name == "count_tokens":
        return reply["input_tokens"]
    if route.name == "embeddings":
        return [round(x, 4) for x in reply["data"][0]["embedding"][:8]]
    if route.name == "rerank":
        return [r["index"] for r in reply["results"]]
    if route.name == "transcription":
        return reply["text"]
    if route.name == "speech":
        return len(reply) > 0
    if route.name == "load":
        return reply["state"]
    return None


def front_rss_mb(app: Appliance) -> float:
    for line in Path(f"/proc/{app.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class Storm:
    """The invariants the whole module keeps, checked by its last test."""

    def __init__(self, app: Appliance):
        self.app = app
        self.pids = {m["name"]: m["pid"] for m in app.status()["models"]}
        self.rss_before = front_rss_mb(app)
        self.good = {name: good_answer(route, self.good_reply(route)) for name, route in ROUTES.items()
                     if route.name not in ("unload", "status")}
        self.answers: list[tuple[str, int, float]] = []

    def good_reply(self, route: Route) -> Any:
        if route.form:
            route.body["file"] = wav_bytes(tone(1.0))
        status, reply, _ = route.send(self.app)
        assert status == 200, (route.name, reply)
        return reply

    def check(self, route: Route, status: int, reply: Any, waited: float, bound: float = ANSWER_BOUND_S) -> None:
        self.answers.append((route.name, status, waited))
        assert status in DOCUMENTED, f"{route.name}: {status} {str(reply)[:500]}"
        if status != 200:
            route.assert_error_shape(status, reply)
        assert waited < bound, f"{route.name}: answered after {waited:.2f} s"


@pytest.fixture(scope="module")
def storm(demo_model, embedding_model, rerank_model, demo_whisper, demo_tts, demo_vlm, tmp_path_factory):
    config = {"server": {"max_body_bytes": MAX_BODY}, "models": [
        model_entry("demo", demo_model, max_context=512),
        model_entry("embed", embedding_model, kind="embedding", max_context=64, max_inputs=16),
        model_entry("rank", rerank_model, kind="rerank", max_context=64, max_inputs=16),
        model_entry("whisper", demo_whisper, kind="transcription", max_upload_bytes=1 << 20, max_audio_seconds=5),
        model_entry("tts", demo_tts, kind="tts"),
        model_entry("vlm", demo_vlm, kind="vlm", max_image_bytes=IMAGE_BYTES, max_image_pixels=IMAGE_PIXELS)]}
    app = Appliance(config, tmp_path_factory.mktemp("hostile")).start()
    try:
        yield Storm(app)
    finally:
        app.stop()


# --- the fixed corpus of known bombs ------------------------------------------------------------------------

def with_raw(body: dict, **raw: bytes) -> bytes:
    """`body` as JSON with some keys' values as raw bytes (JSON Python cannot write: NaN, bad UTF-8)."""
    text = json.dumps({**body, **{key: f"__RAW_{key}__" for key in raw}}).encode()
    for key, value in raw.items():
        text = text.replace(f'"__RAW_{key}__"'.encode(), value)
    return text


CHAT_BODY = ROUTES["chat"].body
RESPONSES_BODY = ROUTES["responses"].body
# (name, route, body (dict or raw bytes), statuses it may get, the error code it must carry if any)
CORPUS: list[tuple[str, str, Any, set[int], str | None]] = [
    ("nested-repeat grammar (chat)", "chat", {**CHAT_BODY, "tools": [custom_tool(NESTED_REPEATS)]}, {400},
     "grammar_too_large"),
    ("nested-repeat grammar (responses)", "responses", {**RESPONSES_BODY, "tools": [custom_tool(NESTED_REPEATS, True)]},
     {400}, "grammar_too_large"),
    ("16-optional grammar", "responses", {**RESPONSES_BODY, "tools": [custom_tool(OPTIONALS_16, True)]}, {400},
     "grammar_too_large"),
    ("terminal DAG grammar", "chat", {**CHAT_BODY, "tools": [custom_tool(TERMINAL_DAG)]}, {400}, "grammar_too_large"),
    ("template fan-out grammar", "responses", {**RESPONSES_BODY, "tools": [custom_tool(TEMPLATE_FANOUT, True)]},
     {400}, "grammar_too_large"),
    ("100 MB-expanding schema", "chat", {**CHAT_BODY, "response_format": {"type": "json_schema", "json_schema": {
        "name": "bomb", "schema": schema_bomb()}}}, {400}, "grammar_too_large"),
    ("schema bomb in a strict tool", "chat", {**CHAT_BODY, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True, "parameters": schema_bomb()}}]}, {400}, "grammar_too_large"),
    ("schema bomb in a Messages tool", "messages", {**ROUTES["messages"].body, "tools": [{
        "name": "f", "input_schema": schema_bomb()}]}, {400}, None),
    ("nested-repeat regex", "chat", {**CHAT_BODY, "structured_outputs": {"regex": REGEX_BOMB}}, {400},
     "grammar_too_large"),
    ("nested-repeat regex in genai's dialect", "chat", {**CHAT_BODY, "structured_outputs": {
        "regex": NAMED_GROUP_REGEX_BOMB}}, {400}, "grammar_too_large"),
    ("nested-repeat EBNF", "completions", {**ROUTES["completions"].body, "structured_outputs": {"grammar": EBNF_BOMB}},
     {400}, "grammar_too_large"),
    ("nested-repeat schema pattern", "chat", {**CHAT_BODY, "response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "string", "pattern": REGEX_BOMB}}}}, {400}, "grammar_too_large"),
    # "²" passed str.isdigit() as an array index, and int() raised on it: a 500
    ("a $ref to a superscript index", "chat", {**CHAT_BODY, "response_format": {"type": "json_schema", "json_schema": {
        "name": "r", "schema": {"type": "array", "prefixItems": [{"type": "string"}],
                                "items": {"$ref": "#/prefixItems/\u00b2"}}}}}, {200, 400}, None),
    ("catastrophic-backtracking regex", "chat", {**CHAT_BODY, "structured_outputs": {"regex": "(a+)+$"}},
     {200, 400}, None),
    ("long grammar definition", "chat", {**CHAT_BODY, "tools": [custom_tool('start: "' + "a" * 40000 + '"')]},
     {400}, "grammar_too_large"),
    ("deep grammar brackets", "chat", {**CHAT_BODY, "tools": [custom_tool("start: " + "(" * 3000 + '"a"' + ")" * 3000)]},
     {400}, "grammar_too_large"),
    ("a 2 MB string", "chat", {**CHAT_BODY, "messages": [{"role": "user", "content": "a" * (2 << 20)}]}, {413}, None),
    ("many stop strings", "chat", {**CHAT_BODY, "stop": ["x"] * 10000}, {400}, None),
    ("n past the limit", "chat", {**CHAT_BODY, "n": 10 ** 9}, {400}, None),
    ("logit_bias of 10,000 entries", "chat", {**CHAT_BODY, "logit_bias": {str(i): 1 for i in range(10000)}},
     {200, 400}, None),
    ("max_tokens of 10**30", "chat", {**CHAT_BODY, "max_tokens": 10 ** 30}, {400}, None),
    ("a 200 KB prompt to count", "count_tokens", {"model": "demo", "messages": [{"role": "user", "content":
                                                   "a" * 200_000}]}, {400}, None),
    ("speech input past 4096 characters", "speech", {**ROUTES["speech"].body, "input": "a" * 5000}, {400}, None),
    ("10,000 embedding inputs", "embeddings", {"model": "embed", "input": ["x"] * 10000}, {400}, None),
    ("10,000 rerank documents", "rerank", {"model": "rank", "query": "q", "documents": ["x"] * 10000}, {400}, None),
    ("a giant model name to load", "load", None, {404}, None),
]
for name in JSON_ROUTES:  # what every JSON route must refuse the same way
    CORPUS += [
        (f"100,000 levels of nesting ({name})", name, deep(100000), {400}, None),
        (f"NaN and Infinity ({name})", name, with_raw(ROUTES[name].body, temperature=b"NaN", top_p=b"Infinity",
                                                       seed=b"-Infinity"), {200, 400}, None),
        (f"invalid UTF-8 ({name})", name, with_raw(ROUTES[name].body, model=b'"\xff\xfe\xc3("'), {400}, None),
        (f"a 5,000-digit number ({name})", name, with_raw(ROUTES[name].body, max_tokens=b"9" * 5000), {200, 400},
         None),
        (f"not JSON ({name})", name, b"\x00\x01{", {400}, None),
    ]


@pytest.mark.parametrize("case", CORPUS, ids=[case[0] for case in CORPUS])
def test_each_known_bomb_gets_its_documented_answer_in_milliseconds(storm, case):
    name, route_name, body, statuses, code = case
    route = ROUTES[route_name]
    # 4,000 characters: past 8,190 aiohttp's HTTP parser answers a plain-text 400 before any route (docs/api.md)
    path = "/openarc/models/" + "m" * 4000 + "/load" if name.startswith("a giant model name") else None
    raw = body if isinstance(body, bytes) else json.dumps(body).encode() if body is not None else None
    status, reply, waited = route.send(storm.app, raw, path)
    bound = BOMB_BOUND_S if code == "grammar_too_large" else ANSWER_BOUND_S
    storm.check(route, status, reply, waited, bound)
    assert status in statuses, f"{name}: {status} {str(reply)[:400]}"
    if code is not None:
        assert reply["error"]["code"] == code, reply


ISSUE_BOMBS = ["nested-repeat grammar (responses)", "16-optional grammar", "100 MB-expanding schema"]
FEW_MB = 8  # the issue's "within a few MB": one request of the old code took the front from 53 to 119 MB


def test_the_issues_three_bombs_get_400s_in_milliseconds_and_cost_the_front_a_few_mb(storm):
    cases = [case for case in CORPUS if case[0] in ISSUE_BOMBS]
    pids = {m["name"]: m["pid"] for m in storm.app.status()["models"]}

    def send_all() -> float:
        slowest = 0.0
        for name, route_name, body, _, _ in cases:
            route = ROUTES[route_name]
            status, reply, waited = route.send(storm.app, json.dumps(body).encode())
            storm.check(route, status, reply, waited, BOMB_BOUND_S)
            assert status == 400 and reply["error"]["code"] == "grammar_too_large", (name, reply)
            slowest = max(slowest, waited)
        return slowest

    send_all()  # the first time: the grammar helper starts, the refusals are remembered
    before = front_rss_mb(storm.app)
    slowest = max(send_all() for _ in range(20))
    grown = front_rss_mb(storm.app) - before
    print(f"the issue's bombs, 20 rounds: slowest answer {slowest * 1000:.0f} ms, front RSS {grown:+.1f} MB")
    assert slowest < 0.5, f"a refusal took {slowest * 1000:.0f} ms"  # milliseconds, with room for loaded cores
    assert grown < FEW_MB
    assert {m["name"]: m["pid"] for m in storm.app.status()["models"]} == pids


# --- bodies mutated from valid ones --------------------------------------------------------------------------

HOSTILE_RAW = st.sampled_from([
    deep(5000), b"NaN", b"Infinity", b"-Infinity", b"1e400", b"9" * 4400, b"-0", b"null", b"true", b"{}", b"[]",
    b'"\xff\xfe"', b'"\\ud800"', b'"' + b"a" * 300000 + b'"', b"[" + b",".join([b'"x"'] * 50000) + b"]",
    json.dumps(custom_tool(NESTED_REPEATS)).encode(), json.dumps(schema_bomb()).encode(),
    json.dumps({"regex": REGEX_BOMB}).encode(), json.dumps({"grammar": EBNF_BOMB}).encode(),
    json.dumps([custom_tool(OPTIONALS_16, True)]).encode(),
    json.dumps({"type": "json_schema", "json_schema": {"name": "b", "schema": schema_bomb()}}).encode(),
]) | st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                  lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                  max_leaves=10).map(lambda v: json.dumps(v).encode())
FIELDS = ["model", "messages", "prompt", "input", "max_tokens", "max_output_tokens", "temperature", "stop", "n",
          "tools", "tool_choice", "response_format", "structured_outputs", "logit_bias", "stream", "seed",
          "documents", "query", "voice", "dimensions", "system", "instructions", "text", "top_n", "speed"]


def mutated(route: Route, data) -> bytes:
    body = dict(route.body)
    raw_fields = {}
    for _ in range(data.draw(st.integers(1, 3))):
        field = data.draw(st.sampled_from(FIELDS + list(body)))
        if data.draw(st.integers(0, 4)) == 0:
            body.pop(field, None)
        else:
            raw_fields[field] = data.draw(HOSTILE_RAW)
            body[field] = f"__RAW_{field}__"
    text = json.dumps(body).encode()
    for field, raw in raw_fields.items():
        text = text.replace(f'"__RAW_{field}__"'.encode(), raw)
    return text


@pytest.mark.parametrize("route_name", JSON_ROUTES)
def test_mutated_bodies_get_documented_answers(storm, route_name):
    route = ROUTES[route_name]

    @HOSTILE_SETTINGS
    @given(data=st.data())
    def one(data):
        status, reply, waited = route.send(storm.app, mutated(route, data))
        storm.check(route, status, reply, waited)

    one()


@HOSTILE_SETTINGS
@given(fields=st.dictionaries(st.sampled_from(["model", "language", "prompt", "response_format", "temperature",
                                               "timestamp_granularities[]", "stream", "x" * 70000]),
                              st.text(st.characters(blacklist_categories=("Cs",)), max_size=30)
                              | st.sampled_from(["\x00\xff", "9" * 5000, "NaN", "whisper", "a" * 100000]),
                              max_size=4),
       audio=st.sampled_from([b"", b"\xff" * 1000, b"RIFF" + b"\x00" * 40, None]))
def test_mutated_uploads_get_documented_answers(storm, fields, audio):
    route = ROUTES["transcription"]
    form = {"model": "whisper", **fields}
    if audio is not None:
        form["file"] = audio
    status, reply, waited = route.send(storm.app, multipart(form))
    storm.check(route, status, reply, waited)


@HOSTILE_SETTINGS
@given(name=st.text(min_size=1, max_size=300).filter(lambda s: "/" not in s and s not in ("demo",)),
       route_name=st.sampled_from(["load", "unload"]))
def test_hostile_model_names_to_load_and_unload_get_404(storm, name, route_name):
    from urllib.parse import quote
    route = ROUTES[route_name]
    action = route.path.rsplit("/", 1)[1]
    status, reply, waited = route.send(storm.app, path=f"/openarc/models/{quote(name, safe='')}/{action}")
    storm.check(route, status, reply, waited)
    assert status in (400, 404), reply


def test_status_under_hostile_queries(storm):
    route = ROUTES["status"]
    for query in ("?" + "a=" * 4000, "?x=%ff%fe", "?" + "&".join(f"k{i}=v" for i in range(1000))):
        status, reply, waited = route.send(storm.app, path=route.path + query)
        storm.check(route, status, reply, waited)


def test_a_request_line_past_aiohttps_limit_is_refused_before_any_route(storm):
    # aiohttp's HTTP parser refuses a request line (or a header) past 8,190 bytes with a plain-text 400 of its
    # own, before the middlewares: the one refusal not in a route's JSON shape (docs/api.md, the limits table)
    for path in ("/openarc/status?" + "a=" * 10000, "/openarc/models/" + "m" * 10000 + "/load"):
        status, reply, waited = ROUTES["status"].send(storm.app, path=path)
        assert status == 400 and b"8190" in reply and waited < ANSWER_BOUND_S


# --- the limits table of docs/api.md: one request past each row -------------------------------------------

DOCS = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def limit_rows() -> list[str]:
    """The first column of each row of the limits table in docs/api.md."""
    section = DOCS.read_text().split("\n## Limits\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    return [row.split(" | ")[0].lstrip("| ").strip() for row in rows[1:]]


def png(side: int, noise: bool = False) -> str:
    import base64
    import io
    import random

    from PIL import Image
    image = Image.new("RGB", (side, side), "red")
    if noise:  # incompressible: the file is as large as its pixels
        image = Image.frombytes("RGB", (side, side), random.Random(side).randbytes(side * side * 3))
    out = io.BytesIO()
    image.save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def vlm_chat(*urls: str) -> dict:
    return {"model": "vlm", "max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What colour?"}, *({"type": "image_url", "image_url": {"url": u}} for u in urls)]}]}


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


# row -> (route, body or raw, status, code (None: the route's shape has none, or any)), or the test that covers it
LIMIT_CASES: dict[str, Any] = {
    "request body": ("embeddings", {"model": "embed", "input": "a" * (MAX_BODY + 1)}, 413, "request_entity_too_large"),
    "request line, each header": "test_a_request_line_past_aiohttps_limit_is_refused_before_any_route",
    "JSON nesting of a schema or tool parameters": ("chat", {**CHAT_BODY, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": nested_schema(40)}}}, 400, "invalid_request"),
    "prompt (messages, tools and template rendered)": ("chat", {**CHAT_BODY, "messages": [
        {"role": "user", "content": "word " * 2000}]}, 400, "context_length_exceeded"),
    "prompt characters, counted in the front before the worker renders and tokenizes it (a token count's too)": (
        "chat", {**CHAT_BODY, "messages": [{"role": "user", "content": "a" * (512 * 64 + 1)}]}, 400,
        "context_length_exceeded"),
    "one request as passed to its worker":
        "test_an_oversized_frame_fails_its_own_request_and_the_worker_and_its_other_requests_live",
    "`stop` (chat, completions)": ("chat", {**CHAT_BODY, "stop": ["a"] * 5}, 400, "invalid_request"),
    "`stop_sequences` (messages)": ("messages", {**ROUTES["messages"].body, "stop_sequences": ["a"] * 9}, 400, None),
    "`n`": ("chat", {**CHAT_BODY, "n": 9}, 400, "invalid_request"),
    "`logit_bias`": ("chat", {**CHAT_BODY, "logit_bias": {"1": 1}}, 400, "invalid_request"),
    "Lark grammar definition": ("chat", {**CHAT_BODY, "tools": [custom_tool('start: "' + "a" * 40000 + '"')]}, 400,
                                "grammar_too_large"),
    "Lark grammar nesting of `( [ {`": ("chat", {**CHAT_BODY, "tools": [custom_tool(
        "start: " + "(" * 40 + '"a"' + ")" * 40)]}, 400, "grammar_too_large"),
    "Lark grammar rules written out (each `x?`, `[x]`, group and `~` repeat multiplies their alternatives)": (
        "responses", {**RESPONSES_BODY, "tools": [custom_tool(OPTIONALS_16, True)]}, 400, "grammar_too_large"),
    "regex written out (nested `{m,n}` multiply): regex constraints, custom tools' regexes, Lark terminals, schema "
    "`pattern`s, EBNF grammars across their rules": (
        "chat", {**CHAT_BODY, "structured_outputs": {"regex": REGEX_BOMB}}, 400, "grammar_too_large"),
    "JSON schema with every `$ref` written out in place (response formats, strict tools' parameters)": (
        "chat", {**CHAT_BODY, "response_format": {"type": "json_schema", "json_schema": {
            "name": "bomb", "schema": schema_bomb()}}}, 400, "grammar_too_large"),
    "Lark grammar conversion": "test_grammar_bounds.py::test_a_conversion_past_its_time_bound_is_stopped_and_refused",
    "what a constraint costs the model's engine thread (every grammar, schema, regex and tool input above, timed by "
    "the worker's probe off that thread)": "test_grammar_probe.py::"
    "test_a_grammar_that_costs_the_engine_seconds_is_refused_while_another_client_streams",
    "images per request": ("chat", vlm_chat(*[png(4)] * 9), 400, "too_many_images"),
    "image size": ("chat", vlm_chat(png(160, noise=True)), 400, "invalid_image"),
    "image pixels": ("chat", vlm_chat(png(200)), 400, "invalid_image"),
    "embedding inputs, rerank documents": ("embeddings", {"model": "embed", "input": ["x"] * 17}, 400,
                                           "too_many_inputs"),
    "audio upload": ("transcription", {"model": "whisper", "file": b"\0" * ((1 << 20) + 1)}, 413, None),
    "audio length": ("transcription", {"model": "whisper", "file": wav_bytes(tone(6.0))}, 413, "audio_too_long"),
    # the server's one spool budget, shared by the routes: shown on a front whose budget is set small
    "decoded media of all requests in flight, in the front's spool files (chat images' pixels, image edits' pictures "
    "and masks, audio samples), together":
        "test_spool_budget.py::test_edits_and_uploads_are_refused_while_chat_images_hold_the_shared_spool",
    # image models' limits: 400s decided before the model is asked, each shown by its pure check
    "picture width or height": "test_images.py::test_the_models_limits_are_400s",
    "pictures per image request": "test_images.py::test_the_models_limits_are_400s",
    "denoising steps": "test_images.py::test_the_models_limits_are_400s",
    "pixels of one image request's pictures together (`n` x width x height)":
        "test_images.py::test_more_pixels_than_one_request_may_make_are_a_400_before_any_picture_is_painted",
    "form fields of an upload": ("transcription", {"model": "whisper", **{f"f{i}": "x" for i in range(33)},
                                                   "file": wav_bytes(tone(0.5))}, 400, "invalid_request"),
    "files of an upload (each up to its size above)":
        "test_image_generation.py::test_an_edit_form_of_more_files_than_it_uses_is_a_400_before_the_next_is_read",
    "speech `input`": ("speech", {**ROUTES["speech"].body, "input": "a" * 4097}, 400, "string_above_max_length"),
    "a key's requests, tokens, concurrent requests": "test_a_key_that_may_not_make_a_request_costs_no_conversion",
}


def test_the_limits_table_and_its_cases_name_the_same_rows():
    assert limit_rows() == list(LIMIT_CASES)
    for row, case in LIMIT_CASES.items():
        if isinstance(case, str):  # covered by a test of its own (another server, or no server): it exists
            module, _, name = case.rpartition("::")
            source = (Path(__file__).parent / (module or "test_hostile.py")).read_text()
            assert f"def {name}(" in source, (row, case)


@pytest.mark.parametrize("row", [row for row, case in LIMIT_CASES.items() if not isinstance(case, str)])
def test_each_row_of_the_limits_table_is_enforced(storm, row):
    route_name, body, status, code = LIMIT_CASES[row]
    route = ROUTES[route_name]
    raw = multipart(body) if route.form else json.dumps(body).encode()
    got, reply, waited = route.send(storm.app, raw)
    storm.check(route, got, reply, waited)
    assert got == status, f"{row}: {got} {str(reply)[:400]}"
    if code is not None:
        assert reply["error"]["code"] == code, reply


# --- the invariants over the whole storm: the module's last test --------------------------------------------

def test_zz_after_the_storm_nothing_was_lost(storm):
    app = storm.app
    assert storm.answers, "no hostile request was sent"
    log = app.logs()
    assert "Traceback" not in log, log[log.index("Traceback") - 2000:][:6000]
    assert {m["name"]: m["pid"] for m in app.status()["models"]} == storm.pids, "a worker was replaced"
    for model in app.status()["models"]:
        assert model["crashes"] == 0 and model["restarts"] == 0, model
    for name, answer in storm.good.items():
        route = ROUTES[name]
        assert good_answer(route, storm.good_reply(route)) == answer, f"{name} answers differently after the storm"
    grown = front_rss_mb(app) - storm.rss_before
    statuses = sorted({status for _, status, _ in storm.answers})
    slowest = max(storm.answers, key=lambda a: a[2])
    print(f"{len(storm.answers)} hostile requests, statuses {statuses}, slowest {slowest}, front RSS +{grown:.1f} MB")
    assert grown < RSS_GROWTH_BOUND_MB, f"the front's RSS grew by {grown:.1f} MB"


# --- the wire refuses: an oversized frame fails its own request, never the worker ----------------------------

FRAME_LIMIT = 64 << 10  # OPENARC_DEBUG_MAX_FRAME for this test: a 100 KB prompt is past it


def test_an_oversized_frame_fails_its_own_request_and_the_worker_and_its_other_requests_live(
        appliance_factory, long_demo_model, embedding_model):
    app = appliance_factory({"server": {"max_body_bytes": 1 << 20},
                             "models": [model_entry("demo", long_demo_model, max_context=4096),
                                        model_entry("embed", embedding_model, kind="embedding", max_inputs=256)]},
                            env={"OPENARC_DEBUG_MAX_FRAME": str(FRAME_LIMIT)})
    pid = app.worker_pid("demo")
    generating, finished = threading.Event(), {}

    def long_request():  # streamed, so the oversized request lands while this one generates
        req = urllib.request.Request(app.base + "/v1/completions", method="POST", headers={
            "Content-Type": "application/json"}, data=json.dumps({
                "model": "demo", "prompt": "Hi", "max_tokens": 3000, "temperature": 0, "stream": True}).encode())
        with urllib.request.urlopen(req, timeout=300) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    generating.set()
                    chunk = json.loads(line[6:])
                    finished["reason"] = chunk["choices"][0].get("finish_reason") or finished.get("reason")
                    finished["tokens"] = finished.get("tokens", 0) + 1

    thread = threading.Thread(target=long_request)
    thread.start()
    assert generating.wait(60), "the long request never started"
    started = time.monotonic()
    status, _, reply = http("POST", app.base + "/v1/chat/completions",
                            {"model": "demo", "max_tokens": 4, "messages": [{"role": "user", "content": "a" * 100000}]})
    assert status == 413 and reply["error"]["code"] == "request_too_large", reply
    assert "frame limit" in reply["error"]["message"]
    assert time.monotonic() - started < ANSWER_BOUND_S
    assert thread.is_alive(), "the long request ended before the oversized one was refused: make it longer"
    thread.join(300)
    assert finished.get("reason") == "length", finished  # the other request went on to its end
    assert app.worker_pid("demo") == pid and pid_alive(pid)
    assert app.model_status("demo")["crashes"] == 0
    status, _, _ = http("POST", app.base + "/v1/completions", {"model": "demo", "prompt": "Hi", "max_tokens": 4})
    assert status == 200
    # the other way: an answer past the limit (256 embeddings of 128 floats) fails its request, not the worker
    embed_pid = app.worker_pid("embed")
    status, _, reply = http("POST", app.base + "/v1/embeddings", {"model": "embed", "input": ["a cat"] * 256})
    assert status == 500 and reply["error"]["code"] == "response_too_large", reply
    status, _, reply = http("POST", app.base + "/v1/embeddings", {"model": "embed", "input": ["a cat"] * 4})
    assert status == 200 and len(reply["data"]) == 4
    assert app.worker_pid("embed") == embed_pid and app.model_status("embed")["crashes"] == 0


# --- admission before work ------------------------------------------------------------------------------------

def helper_cpu_s(app: Appliance) -> float:
    """The CPU time of the front's grammar helper (started with the server, lark loaded before it reads requests)."""
    pid = app.helper_pid("appliance.front.api.grammar_helper")
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


LARGE_GRAMMAR = "start: " + " | ".join(f"r{i}" for i in range(1500)) + "\n" + \
    "".join(f'r{i}: "w{i}"\n' for i in range(1500))  # a valid grammar of a few hundred ms of lark


def test_a_key_that_may_not_make_a_request_costs_no_conversion(appliance_factory, demo_model):
    env = {"KEY_B": "b" * 32}
    app = appliance_factory({"server": {"api_keys": [
        {"name": "b", "key_env": "KEY_B", "models": ["other"], "requests_per_minute": 1}]},
        "models": [model_entry("demo", demo_model), model_entry("other", demo_model)]}, env=env)
    auth = {"Authorization": "Bearer " + "b" * 32}
    children = Path(f"/proc/{app.proc.pid}/task/{app.proc.pid}/children")
    wait_until(lambda: any("grammar_helper" in Path(f"/proc/{pid}/cmdline").read_text()
                           for pid in children.read_text().split()), 30, "the grammar helper started")

    def settled() -> bool:  # its start (lark's import) over
        before = helper_cpu_s(app)
        time.sleep(0.5)
        return helper_cpu_s(app) == before

    wait_until(settled, 60, "the grammar helper idle")
    idle = helper_cpu_s(app)

    def ask(model: str, headers: dict, tag: str) -> tuple[int, Any]:
        body = {**CHAT_BODY, "model": model, "tools": [custom_tool(LARGE_GRAMMAR + f"// {tag}\n")]}
        status, _, reply = http("POST", app.base + "/v1/chat/completions", body, headers=headers)
        return status, reply

    assert ask("demo", auth, "a")[0] == 404  # b may not use demo
    assert ask("demo", {}, "b")[0] == 401
    assert helper_cpu_s(app) - idle < 0.1, "a refused request's grammar was converted"
    assert ask("other", auth, "c")[0] in (200, 400)  # b's one request this minute (the demo has no tool format)
    converted = helper_cpu_s(app)
    assert converted - idle >= 0.1, "the admitted request's grammar was not converted"
    status, reply = ask("other", auth, "d")
    assert status == 429, reply  # over its limit: refused before its (new) grammar was converted
    assert helper_cpu_s(app) - converted < 0.1
    front = process_cpu_s(app.proc.pid)
    for model, tag in (("demo", "e"), ("other", "f")):  # a WebSocket warm-up (generate: false) is admitted first too
        event = ws_warm_up(app, auth, {**RESPONSES_BODY, "model": model, "generate": False,
                                       "tools": [custom_tool(LARGE_GRAMMAR + f"// {tag}\n", True)]})
        assert event["type"] == "error", event
    assert process_cpu_s(app.proc.pid) - front < 0.1, "a refused warm-up's grammar was converted in the front"
    assert helper_cpu_s(app) - converted < 0.1, "a refused warm-up's grammar was converted"


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ws_warm_up(app: Appliance, headers: dict, body: dict) -> dict:
    """The first event a response.create over /v1/responses' WebSocket answers."""
    import asyncio

    import aiohttp

    async def send() -> dict:
        async with aiohttp.ClientSession() as session:
            async with session.ws_connect(app.base.replace("http", "ws") + "/v1/responses", headers=headers) as ws:
                await ws.send_str(json.dumps({"type": "response.create", **body}))
                return json.loads((await ws.receive(timeout=ANSWER_BOUND_S)).data)

    return asyncio.run(send())


@HOSTILE_SETTINGS
@given(name=st.sampled_from(["file", "model", "language", None]), before=st.booleans())
def test_a_nested_multipart_part_is_a_400_in_the_routes_shape(storm, name, before):
    """A part that is itself a multipart (multipart/mixed, as RFC 7578's ancestors sent several files in one field):
    no field or file of a form route is one; aiohttp hands it over as a reader of its own parts, which the form reader
    took for a field: a 500 "internal server error" and a traceback in the log, where any other bad form is a 400."""
    route = ROUTES["transcription"]
    boundary, inner = "outer-boundary", "inner-boundary"
    named = f'Content-Disposition: form-data; name="{name}"\r\n' if name else ""
    nested = (f"--{boundary}\r\n{named}Content-Type: multipart/mixed; boundary={inner}\r\n\r\n--{inner}\r\n"
              f"Content-Type: text/plain\r\n\r\nhello\r\n--{inner}--\r\n").encode()
    model = f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nwhisper\r\n'.encode()
    body = (model + nested if before else nested + model) + f"--{boundary}--\r\n".encode()
    status, reply, waited = route.send(storm.app, (f"multipart/form-data; boundary={boundary}", body))
    storm.check(route, status, reply, waited)
    assert status == 400 and "nested multipart" in reply["error"]["message"], (status, reply)
