"""POST /v1/messages/count_tokens never loads a model to count: a model without a ready worker is counted by the token
counter process from its tokenizer files and template, and the count is the one its message's usage reports."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import threading
import time

import anthropic

from conftest import FIXTURES, http, model_entry, pid_alive, wait_until
from test_messages import QUESTION, TOOLS, prompt_of
from test_on_demand import HANG_BOUND_S, chat, on_demand, samples, worker_pids

QWEN3 = FIXTURES / "chat-templates" / "Qwen-Qwen3-0.6B.jinja"


def test_an_unloaded_model_is_counted_without_a_load_and_the_count_is_its_messages_usage(
        appliance_factory, demo_model, demo_vlm):
    """One slot, held by an idle model: counting three others (one with its own chat template, one a VLM) loads
    none of them and evicts nothing; each count equals the usage of the same message once the model has loaded
    for it, and equals the count its own worker gives once loaded."""
    app = appliance_factory({"server": {"max_loaded": 1},
                             "models": [on_demand("a", demo_model), on_demand("plain", demo_model),
                                        on_demand("qwen3", demo_model, chat_template=str(QWEN3)),
                                        on_demand("vlm", demo_vlm, kind="vlm")]})
    client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=HANG_BOUND_S)
    assert chat(app, "a", stream=False) == "length"  # a holds the one slot, idle
    holder = worker_pids(app)
    conversations = {"plain": dict(messages=QUESTION, system="Be brief.", tools=TOOLS),
                     "qwen3": dict(messages=QUESTION, tools=TOOLS), "vlm": dict(messages=QUESTION)}
    counted = {}
    for name, conversation in conversations.items():
        started = time.monotonic()
        counted[name] = client.messages.count_tokens(model=name, **conversation).input_tokens
        assert counted[name] > 0 and time.monotonic() - started < HANG_BOUND_S
        assert app.model_status(name)["state"] == "unloaded"
    assert counted["plain"] != counted["qwen3"]  # each with its own template
    assert worker_pids(app) == holder and app.model_status("a")["state"] == "ready"
    loads = samples(app, "openarc_model_loads_total")
    assert {name for name, reasons in loads.items() if sum(reasons.values())} == {"a"}, loads  # nothing loaded to count
    assert not sum(samples(app, "openarc_model_unloads_total").get("a", {}).values())

    for name, conversation in conversations.items():  # each message loads its model (evicting the last one)
        message = client.messages.create(model=name, max_tokens=2, **conversation)
        assert prompt_of(message.usage) == counted[name], name
        assert client.messages.count_tokens(model=name, **conversation).input_tokens == counted[name]  # its worker


def test_a_count_whose_tokenizer_cannot_load_is_a_503_and_the_next_one_counts(appliance_factory, demo_model, tmp_path):
    """The model's directory lost its tokenizer under a running server: the count is Anthropic's 503 error with
    Retry-After, not a 500 or a hang, and counting works again once the files are back."""
    model = tmp_path / "model"
    shutil.copytree(demo_model, model)
    app = appliance_factory({"models": [on_demand("m", model)]})
    count = {"model": "m", "messages": QUESTION}
    tokenizer = model / "openvino_tokenizer.xml"
    tokenizer.rename(tmp_path / "aside.xml")
    code, headers, body = http("POST", app.base + "/v1/messages/count_tokens", count, timeout=HANG_BOUND_S)
    assert code == 503 and body["type"] == "error" and int(headers["Retry-After"]) >= 1, body
    assert "cannot be loaded" in body["error"]["message"] and str(model) not in body["error"]["message"], body
    assert f"cannot be loaded from {model}" in app.logs()  # the server path is the operator's: the log
    (tmp_path / "aside.xml").rename(tokenizer)
    code, _, body = http("POST", app.base + "/v1/messages/count_tokens", count, timeout=HANG_BOUND_S)
    assert code == 200 and body["input_tokens"] > 0, body
    assert app.model_status("m")["state"] == "unloaded"


def test_a_count_for_a_model_of_another_kind_or_none_is_anthropics_error(appliance_factory, demo_model,
                                                                          embedding_model):
    app = appliance_factory({"models": [on_demand("m", demo_model),
                                        model_entry("embed", embedding_model, kind="embedding")]})
    code, _, body = http("POST", app.base + "/v1/messages/count_tokens", {"model": "embed", "messages": QUESTION},
                         timeout=HANG_BOUND_S)
    assert code == 400 and body["type"] == "error" and "kind embedding" in body["error"]["message"], body
    code, _, body = http("POST", app.base + "/v1/messages/count_tokens", {"model": "nope", "messages": QUESTION},
                         timeout=HANG_BOUND_S)
    assert code == 404 and body["type"] == "error" and "does not exist" in body["error"]["message"], body


def counter_pids(app) -> list[int]:
    """The front's token counter processes (zombies have no command line)."""
    children = open(f"/proc/{app.proc.pid}/task/{app.proc.pid}/children").read().split()
    return [int(pid) for pid in children if b"appliance.worker.token_counter" in open(f"/proc/{pid}/cmdline", "rb").read()]


def test_a_client_hanging_up_mid_count_leaves_the_counter_to_the_others_and_bursts_are_bounded(appliance_factory,
                                                                                                demo_model):
    """The counter's exchange is shielded: a count whose client hangs up (Claude Code cancels them routinely) no
    longer kills the process for every other count. Counts beyond MAX_PENDING_COUNTS waiting on it are a 429
    with Retry-After, not an unbounded queue."""
    from appliance.front.api.count_tokens import MAX_PENDING_COUNTS
    app = appliance_factory({"models": [on_demand("m", demo_model)]})
    count = {"model": "m", "messages": QUESTION}
    answers: list[tuple] = []
    burst = [threading.Thread(target=lambda: answers.append(http("POST", app.base + "/v1/messages/count_tokens",
                                                                 count, timeout=HANG_BOUND_S)))
             for _ in range(MAX_PENDING_COUNTS + 4)]
    for thread in burst:  # all while the counter starts (OpenVINO's import: seconds)
        thread.start()
    for thread in burst:
        thread.join(HANG_BOUND_S)
    codes = sorted(code for code, _, _ in answers)
    assert codes.count(200) >= MAX_PENDING_COUNTS and set(codes) <= {200, 429}, codes
    assert 429 in codes, codes
    refused = next(a for a in answers if a[0] == 429)
    assert refused[2]["type"] == "error" and int(refused[1]["Retry-After"]) >= 1, refused

    for pid in counter_pids(app):  # a fresh counter again: its start is the exchange the client leaves
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not pid_alive(pid), 10, "the counter gone")
    raw = json.dumps(count).encode()
    with socket.create_connection(("127.0.0.1", app.port), timeout=30) as conn:
        conn.sendall(b"POST /v1/messages/count_tokens HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
        started = wait_until(lambda: counter_pids(app), 30, "a counter started for the count")
    # the client has hung up mid-exchange; the counter goes on and answers the next count
    code, _, body = http("POST", app.base + "/v1/messages/count_tokens", count, timeout=HANG_BOUND_S)
    assert code == 200 and body["input_tokens"] > 0, body
    assert counter_pids(app) == started  # the same process: it was not killed

