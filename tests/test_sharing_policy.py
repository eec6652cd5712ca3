"""Sharing one GPU, the policies alone (no processes): a key's limits with an injected clock, the priority class
of a request (Open WebUI's recorded task prompts included), the admission order, and the key ring."""

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.config import ConfigError, parse_config
from appliance.front.admission import AdmissionQueue
from appliance.front.keys import KeyRing
from appliance.front.limits import KeyLimits, Limited, SlidingWindow
from appliance.front.priority import BACKGROUND, INTERACTIVE, BadPriority, housekeeping_task, request_class

FIXTURES = Path(__file__).parent / "fixtures"
OPEN_WEBUI = json.loads((FIXTURES / "open-webui-task-prompts.json").read_text())


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


# --- limits -----------------------------------------------------------------------------------------------------

def test_concurrency_limit_frees_a_slot_on_release():
    limits = KeyLimits("agent", max_concurrent=1, clock=Clock())
    limits.admit()
    with pytest.raises(Limited) as refused:
        limits.admit()
    assert refused.value.reason == "concurrency" and refused.value.retry_after == 1
    assert "agent" in str(refused.value) and "max_concurrent=1" in str(refused.value)
    limits.release()
    limits.admit()


def test_a_key_without_limits_is_never_refused_and_its_use_is_counted():
    clock = Clock()
    limits = KeyLimits("household", clock=clock)
    for _ in range(50):
        limits.admit()
        limits.add_tokens(1000)
    assert limits.usage() == {"running": 50, "requests_last_minute": 50, "tokens_last_minute": 50_000,
                              "tokens_reserved": 0}
    clock.now += 61
    for _ in range(50):
        limits.release()
    assert limits.usage() == {"running": 0, "requests_last_minute": 0, "tokens_last_minute": 0, "tokens_reserved": 0}
    limits.configure(None, 1, None)  # a reload that adds a limit keeps the minute's count
    limits.admit()
    with pytest.raises(Limited):
        limits.admit()


def test_requests_per_minute_is_a_sliding_window_and_says_when_it_frees():
    clock = Clock()
    limits = KeyLimits("indexer", requests_per_minute=3, clock=clock)
    for step in range(3):
        limits.admit()
        limits.release()
        clock.now += 10  # at 1000, 1010, 1020
    with pytest.raises(Limited) as refused:  # at 1030: the first leaves the window at 1060
        limits.admit()
    assert refused.value.reason == "requests" and refused.value.retry_after == 30
    clock.now = 1059.5
    with pytest.raises(Limited):
        limits.admit()
    clock.now = 1060.0
    limits.admit()  # the first request left the window


def test_refused_requests_take_nothing():
    clock = Clock()
    limits = KeyLimits("k", max_concurrent=5, requests_per_minute=1, clock=clock)
    limits.admit()
    for _ in range(5):
        with pytest.raises(Limited):
            limits.admit()
    assert limits.running == 1 and limits.requests.used(clock.now) == 1


def test_tokens_per_minute_counts_tokens_as_produced():
    clock = Clock()
    limits = KeyLimits("agent", tokens_per_minute=100, clock=clock)
    limits.admit()
    limits.add_tokens(60)  # a prompt
    clock.now += 5
    limits.add_tokens(39)  # completion tokens, while running
    limits.release()
    limits.admit()  # 99 < 100: still admitted
    limits.add_tokens(1)
    limits.release()
    with pytest.raises(Limited) as refused:
        limits.admit()
    assert refused.value.reason == "tokens"
    assert refused.value.retry_after == 55  # the 60 prompt tokens of t=1000 leave the window at 1060; now is 1005


def test_concurrent_requests_cannot_all_pass_under_an_empty_window():
    """Four requests at once under tokens_per_minute 50: the first reserves its budget, so the others are refused
    until it ends (checked at admission alone, all four passed and the key used 1,884 tokens)."""
    clock = Clock()
    limits = KeyLimits("sipper", tokens_per_minute=50, clock=clock)
    first = limits.admit(470)
    for _ in range(3):
        with pytest.raises(Limited) as refused:
            limits.admit(470)
        assert refused.value.reason == "tokens" and refused.value.retry_after == 1  # a running request's end
        assert "holds 470" in str(refused.value)
    limits.add_tokens(30, first)
    limits.release(first)  # settled: it used 30 of its 470; the rest is given back
    assert limits.usage()["tokens_reserved"] == 0
    limits.release(limits.admit(10))  # 30 < 50: admitted


def test_a_reservation_is_drawn_down_as_tokens_come():
    clock = Clock()
    limits = KeyLimits("k", tokens_per_minute=100, clock=clock)
    running = limits.admit(80)
    limits.add_tokens(50, running)
    assert limits.reserved() == 30 and limits.tokens.used(clock.now) == 50
    limits.add_tokens(40, running)  # past its reservation (an estimate of its prompt fell short)
    assert limits.reserved() == 0


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["admit", "use", "release", "wait"]), st.integers(0, 400)), max_size=60),
       st.integers(1, 300))
def test_a_window_is_overshot_by_at_most_one_reservation(steps, limit):
    """docs/sharing.md: requests that use no more than they reserve never take a key's window past its limit plus
    one reservation, whatever their order, sizes and timing."""
    clock = Clock()
    limits = KeyLimits("k", tokens_per_minute=limit, clock=clock)
    running = []
    largest = 0
    for op, amount in steps:
        if op == "admit":
            try:
                running.append(limits.admit(amount))
                largest = max(largest, amount)
            except Limited:
                pass
        elif op == "use" and running:
            reservation = running[amount % len(running)]
            limits.add_tokens(min(amount, reservation.pending), reservation)
        elif op == "release" and running:
            limits.release(running.pop(amount % len(running)))
        elif op == "wait":
            clock.now += amount / 10
        assert limits.tokens.used(clock.now) < limit + max(largest, 1)


def test_a_requests_token_budget_is_its_completion_bound_and_its_prompts_estimate():
    from appliance.front.api.token_budget import DEFAULT_COMPLETION_TOKENS, budget_of
    chat = {"model": "a-long-model-name", "messages": [{"role": "user", "content": "x" * 40}]}
    assert budget_of({**chat, "max_tokens": 100}, "llm").prompt == 40 // 4 + 1  # 40 characters and "user"
    assert budget_of({**chat, "max_tokens": 100, "n": 3}, "llm").completion == 300
    assert budget_of({**chat, "max_completion_tokens": 7, "max_tokens": 100}, "vlm").completion == 7
    assert budget_of({"model": "m", "input": "hi", "max_output_tokens": 9}, "llm").completion == 9  # Responses
    assert budget_of(chat, "llm").completion == DEFAULT_COMPLETION_TOKENS  # no bound: the documented estimate
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 10000}}
    assert budget_of({"messages": [{"role": "user", "content": [image]}]}, "vlm").prompt < 10  # pixels aren't text
    assert budget_of({"input": ["abcd"] * 10}, "embedding") == budget_of({"input": ["abcd"] * 10}, "rerank")
    assert budget_of({"input": "a" * 400}, "embedding").completion == 0
    assert budget_of({"input": "a" * 400, "max_tokens": 5}, "tts").total == 0  # a kind that counts no tokens
    assert budget_of({**chat, "max_tokens": True, "n": "3"}, "llm").completion == DEFAULT_COMPLETION_TOKENS


def test_sliding_window_frees_in():
    window = SlidingWindow(limit=10, window_s=60)
    window.add(0, 4)
    window.add(20, 4)
    window.add(40, 4)  # 12 >= 10
    assert window.full(45)
    assert window.frees_in(45) == pytest.approx(15)  # at 60 the first 4 leave: 8 < 10
    assert window.frees_in(60) == 0 and not window.full(60)


# --- priority classes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("task", sorted(OPEN_WEBUI["requests"]))
def test_open_webui_task_prompts_are_background(task):
    body = OPEN_WEBUI["requests"][task]
    assert housekeeping_task(body) == task.partition("@")[0]  # follow_ups@0.12: the same task, newer wording
    assert request_class(INTERACTIVE, None, body) == BACKGROUND


@pytest.mark.parametrize("name", sorted(OPEN_WEBUI["interactive_requests"]))
def test_open_webui_rag_prompt_is_a_persons_question(name):
    """Open WebUI's RAG template starts `### Task:` too, but is the person's own question with their documents."""
    body = OPEN_WEBUI["interactive_requests"][name]
    assert body["messages"][-1]["content"].startswith("### Task:")
    assert housekeeping_task(body) is None
    assert request_class(INTERACTIVE, None, body) == INTERACTIVE


@pytest.mark.parametrize("content", [
    "Why is the sky blue?",
    "### Task:\nwrite me a poem about tasks",  # a person's own heading, quoting no chat history
    "Summarise this: <chat_history>hello</chat_history>",  # no task heading
    [{"type": "text", "text": "What is in this image?"}, {"type": "image_url", "image_url": {"url": "x"}}],
])
def test_a_persons_messages_are_interactive(content):
    body = {"model": "m", "messages": [{"role": "system", "content": "### Task: be nice"},
                                       {"role": "user", "content": content}]}
    assert housekeeping_task(body) is None
    assert request_class(INTERACTIVE, None, body) == INTERACTIVE


def test_task_prompt_in_content_parts_and_custom_templates():
    title = OPEN_WEBUI["requests"]["title"]["messages"][0]["content"]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": title}]}]}
    assert housekeeping_task(parts) == "title"
    custom = {"messages": [{"role": "user", "content": "### Task:\nSay something.\n<chat_history>\nUSER: hi\n"
                                                       "</chat_history>"}]}
    assert housekeeping_task(custom) == "task"
    earlier = {"messages": [{"role": "user", "content": title}, {"role": "assistant", "content": "{}"},
                            {"role": "user", "content": "thanks"}]}
    assert housekeeping_task(earlier) is None  # only the last message counts


def test_the_header_lowers_a_class_and_never_raises_it():
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    assert request_class(INTERACTIVE, "background", chat) == BACKGROUND
    assert request_class(INTERACTIVE, " Interactive ", chat) == INTERACTIVE
    assert request_class(BACKGROUND, "interactive", chat) == BACKGROUND
    assert request_class(BACKGROUND, None, None) == BACKGROUND
    with pytest.raises(BadPriority, match="X-OpenArc-Priority"):
        request_class(INTERACTIVE, "urgent", chat)


# --- admission order --------------------------------------------------------------------------------------------

def drain(queue, now, background_running=0, slots=1):
    order = []
    while (entry := queue.pop_next(now, background_running, slots)) is not None:
        order.append(entry.item)
    return order


def test_interactive_first_fifo_within_a_class():
    queue = AdmissionQueue(max_wait_s=30)
    for i, cls in enumerate([BACKGROUND, BACKGROUND, INTERACTIVE, BACKGROUND, INTERACTIVE]):
        queue.push(f"{cls[0]}{i}", cls, now=i)
    assert drain(queue, now=5, slots=10) == ["i2", "i4", "b0", "b1", "b3"]


def test_ages_at_is_the_earliest_moment_a_waiting_background_request_changes_class():
    queue = AdmissionQueue(max_wait_s=30)
    assert queue.ages_at(0) is None
    queue.push("i0", INTERACTIVE, 0)
    assert queue.ages_at(0) is None  # interactive requests never change class
    queue.push("b1", BACKGROUND, 5)
    queue.push("b2", BACKGROUND, 7)
    assert queue.ages_at(10) == 35
    assert queue.ages_at(35) == 37  # b1 has aged: the next is b2's
    assert queue.ages_at(37) is None


def test_background_slots_keep_room_for_people():
    queue = AdmissionQueue(max_wait_s=30)
    queue.push("b0", BACKGROUND, 0)
    queue.push("b1", BACKGROUND, 1)
    assert queue.next(2, background_running=1, background_slots=1) is None  # its one slot is taken
    assert queue.next(2, background_running=0, background_slots=1).item == "b0"
    assert queue.next(2, background_running=0, background_slots=0) is None


def test_a_background_request_ages_into_the_interactive_class():
    queue = AdmissionQueue(max_wait_s=30)
    queue.push("b0", BACKGROUND, 0)
    queue.push("i1", INTERACTIVE, 10)
    queue.push("i2", INTERACTIVE, 31)
    assert queue.next(29, 0, 1).item == "i1"  # not yet aged
    assert queue.next(30, 0, 1).item == "b0"  # aged: ordered by its arrival among the interactive ones
    assert queue.next(30, background_running=5, background_slots=0).item == "b0"  # and no longer held to slots


@settings(max_examples=300, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["push interactive", "push background", "admit", "end"]),
                                st.floats(0, 3)), max_size=60),
       max_wait_s=st.sampled_from([0.5, 2.0]), slots=st.integers(0, 2))
def test_background_is_admitted_before_its_bound_only_when_no_person_waits(steps, max_wait_s, slots):
    """The policy's promise, over any arrivals, admissions and ends in time: a background request younger than
    max_wait_s is admitted only when no interactive request waits and a background slot is free; an aged one waits
    only behind requests that arrived before it; and nothing waits while a slot could take it."""
    queue, now, serial = AdmissionQueue(max_wait_s=max_wait_s), 0.0, 0
    running: list[str] = []  # the classes of running requests, as queued
    for what, later in steps:
        now += later
        if what.startswith("push"):
            serial += 1
            queue.push(serial, what.split()[1], now)
        elif what == "end" and running:
            running.pop(0)
        elif what == "admit":
            waiting = list(queue.entries)
            entry = queue.pop_next(now, running.count(BACKGROUND), slots)
            if entry is None:  # only young background requests wait, and their slots are taken
                assert all(e.effective(now, max_wait_s) == BACKGROUND for e in waiting)
                assert not waiting or running.count(BACKGROUND) >= slots
                continue
            if entry.effective(now, max_wait_s) == BACKGROUND:
                assert not any(e.effective(now, max_wait_s) == INTERACTIVE for e in waiting), (entry, waiting)
                assert running.count(BACKGROUND) < slots
            else:
                assert all(e.order > entry.order for e in waiting if e is not entry
                           and e.effective(now, max_wait_s) == INTERACTIVE)
            running.append(entry.priority)


def test_remove_and_membership():
    queue = AdmissionQueue(max_wait_s=30)
    a, b = object(), object()
    queue.push(a, INTERACTIVE, 0)
    queue.push(b, BACKGROUND, 0)
    assert a in queue and len(queue) == 2 and list(queue) == [a, b]
    assert queue.remove(a) and not queue.remove(a)
    assert a not in queue and queue.priority_of(b) == BACKGROUND


# --- keys -------------------------------------------------------------------------------------------------------

def config(**server):
    return parse_config({"server": server, "models": [{"name": "chat-7b", "path": "/x"},
                                                       {"name": "embed", "path": "/x", "kind": "embedding"}]}, "t.yaml")


def test_keys_are_identified_by_either_header_and_models_by_glob():
    cfg = config(api_key_env="K0", api_keys=[{"name": "indexer", "key_env": "K1", "models": ["embed*"]}])
    ring = KeyRing(cfg, cfg.key_secrets({"K0": "s3cret-a", "K1": "s3cret-b"}))
    assert ring.identify("Bearer s3cret-a", "").name == "default"
    assert ring.identify("", "s3cret-b").name == "indexer"
    assert ring.identify("Bearer s3cret-c", "s3cret") is None
    assert ring.identify("s3cret-a", "") is None  # not a Bearer
    indexer = ring.named("indexer")
    assert indexer.may_use("embed") and not indexer.may_use("chat-7b")
    assert ring.named("default").may_use("chat-7b")


def test_the_bearer_scheme_is_read_in_any_case_and_undecodable_headers_present_no_key():
    cfg = config(api_key_env="K0")
    ring = KeyRing(cfg, cfg.key_secrets({"K0": "s3cret-a"}))
    for header in ("bearer s3cret-a", "BEARER s3cret-a", "  Bearer   s3cret-a "):  # RFC 7235: case-insensitive
        assert ring.identify(header, "").name == "default", header
    undecodable = b"Bearer \xff\xfe".decode("utf-8", "surrogateescape")  # how aiohttp keeps non-UTF-8 bytes
    assert ring.identify(undecodable, undecodable) is None  # it raised UnicodeEncodeError: a 500 per request
    assert ring.identify("Basic s3cret-a", "") is None and ring.identify("\ud800", "") is None


@pytest.mark.parametrize("environ, said", [({}, "K1 is not set"), ({"K1": ""}, "K1 is empty"),
                                           ({"K1": "  "}, "K1 is empty")])
def test_an_unset_or_empty_variable_refuses_naming_it(environ, said):
    cfg = config(api_keys=[{"name": "agent", "key_env": "K1"}])
    with pytest.raises(ConfigError) as refused:
        cfg.key_secrets(environ)
    assert "t.yaml: server.api_keys[0].key_env:" in str(refused.value) and said in str(refused.value)


def test_a_systemd_credential_of_the_variables_name_is_read(tmp_path):
    (tmp_path / "K1").write_text("from-a-credential\n")
    cfg = config(api_keys=[{"name": "agent", "key_env": "K1"}])
    assert cfg.key_secrets({"CREDENTIALS_DIRECTORY": str(tmp_path)}) == {"agent": "from-a-credential"}
    assert cfg.key_secrets({"CREDENTIALS_DIRECTORY": str(tmp_path), "K1": "env-wins"}) == {"agent": "env-wins"}
    with pytest.raises(ConfigError, match="K1 is not set"):
        cfg.key_secrets({"CREDENTIALS_DIRECTORY": str(tmp_path / "none")})


def test_two_keys_with_one_value_are_refused_without_showing_it():
    cfg = config(api_key_env="K0", api_keys=[{"name": "agent", "key_env": "K1"}])
    with pytest.raises(ConfigError) as refused:
        cfg.key_secrets({"K0": "same-secret", "K1": "same-secret"})
    assert "'agent' has the same value as key 'default'" in str(refused.value)
    assert "same-secret" not in str(refused.value)


def test_key_config_mistakes_are_named():
    with pytest.raises(ConfigError) as refused:
        config(api_key_env="K0", api_keys=[{"name": "default", "key_env": "K1"}, {"name": "a", "key_env": "K0"},
                                           {"name": "b c", "key_env": "K2", "max_concurrent": 0, "models": []},
                                           {"name": "d", "key_env": "K3", "priority": "urgent"}])
    lines = str(refused.value).splitlines()
    assert any("server.api_keys[0].name" in line and "server.api_key_env is the key named 'default'" in line
               for line in lines)
    assert any("server.api_keys[1].key_env: K0 is another key's variable" in line for line in lines)
    assert any("server.api_keys[2].name" in line for line in lines)
    assert any("server.api_keys[2].max_concurrent: expected at least 1" in line for line in lines)
    assert any("server.api_keys[2].models" in line for line in lines)
    assert any("server.api_keys[3].priority" in line for line in lines)


@pytest.mark.parametrize("name", ["", "MY KEY", "sk-abc123"])
def test_api_key_env_must_name_a_variable(name):
    with pytest.raises(ConfigError, match="server.api_key_env: expected the name of an environment variable"):
        config(api_key_env=name)


def test_task_model_must_be_another_chat_model():
    def models(**chat):
        return {"models": [{"name": "big", "path": "/x", **chat}, {"name": "small", "path": "/x"},
                           {"name": "embed", "path": "/x", "kind": "embedding"}]}
    assert parse_config(models(task_model="small"), "t.yaml").model("big").task_model == "small"
    for wrong in ("big", "embed", "nope"):
        with pytest.raises(ConfigError, match=r"models\[0\]\.task_model: expected the name of another configured "
                                              "chat model"):
            parse_config(models(task_model=wrong), "t.yaml")
    with pytest.raises(ConfigError, match=r"models\[0\]\.max_running_background: expected 0 to max_running"):
        parse_config(models(max_running=2, max_running_background=3), "t.yaml")
    big = parse_config(models(max_running=8), "t.yaml").model("big")
    assert big.background_slots == 4
    assert parse_config(models(max_running=1), "t.yaml").model("big").background_slots == 1


def test_a_reload_keeps_what_a_key_used():
    cfg = config(api_keys=[{"name": "agent", "key_env": "K1", "max_concurrent": 1, "requests_per_minute": 5}])
    ring = KeyRing(cfg, {"agent": "a"})
    ring.named("agent").limits.admit()
    cfg2 = config(api_keys=[{"name": "agent", "key_env": "K1", "max_concurrent": 2, "requests_per_minute": 1}])
    ring2 = KeyRing(cfg2, {"agent": "b"}, previous=ring)
    limits = ring2.named("agent").limits
    assert limits.running == 1 and limits.max_concurrent == 2
    with pytest.raises(Limited) as refused:  # the request of before the reload counts against the new rate
        limits.admit()
    assert refused.value.reason == "requests"
    ring.named("agent").limits.release()  # the request admitted before the reload ends: its slot is free again
    assert limits.running == 0
    assert ring2.identify("Bearer b", "").name == "agent" and ring2.identify("Bearer a", "") is None


@given(st.integers(1, 10**6), st.integers(1, 200), st.integers(0, 20_000), st.integers(16, 200_000))
def test_a_token_budget_never_exceeds_what_the_models_window_allows(max_tokens, n, chars, window):
    """No choice can use more than the window, nor a prompt be longer: a budget past (n + 1) windows only holds the
    key's other requests back (opencode's max_tokens 32000 reserved 32,000 of a 256-token model)."""
    from appliance.front.api.token_budget import budget_of
    body = {"messages": [{"role": "user", "content": "x" * chars}], "max_tokens": max_tokens, "n": n}
    budget, unbounded = budget_of(body, "llm", window), budget_of(body, "llm")
    assert budget.prompt == min(unbounded.prompt, window)
    assert budget.completion == min(max_tokens, window) * min(n, 128)
