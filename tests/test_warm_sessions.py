"""Warm sessions through `openarc serve`: prefix caching on by default, cached tokens in every dialect's usage (read
by the openai and anthropic SDKs), the same greedy answers with the cache on and off, Claude Code's billing line
kept from breaking the cache, and the metrics counting both sources.

The demo model's phrase tokens never come back from text (appliance.demo.llm), so a conversation's next turn
matches its previous prompt, not the answer: "at least 80 % of the previous prompt" is what a turn must show.
"""

from __future__ import annotations

import statistics
import time
import uuid

import anthropic
import pytest

from conftest import Appliance, model_entry, wait_until
from test_metrics import samples, value

SYSTEM = "You are a careful assistant. " + " ".join(f"Rule {i}: answer in plain words." for i in range(60))
BILLING = "x-anthropic-billing-header: cc_version=2.1.3.abc; cc_entrypoint=cli; cch={};"


@pytest.fixture(scope="module")
def app(demo_model, tmp_path_factory):
    models = [model_entry("warm", demo_model),
              model_entry("cold", demo_model, scheduler_config={"enable_prefix_caching": False}),
              model_entry("raw", demo_model, canonicalize_agent_noise=False)]
    appliance = Appliance({"models": models}, tmp_path_factory.mktemp("warm")).start()
    yield appliance
    appliance.stop()


def conversation(app, model: str, turns: int, nonce: str, **extra) -> list:
    """A chat of `turns` turns (each answer goes back into the history): each turn's (usage, text, logprobs)."""
    client = app.client()
    messages = [{"role": "system", "content": f"{nonce} {SYSTEM}"}]
    out = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: what comes next in the story?"})
        reply = client.chat.completions.create(model=model, messages=messages, max_tokens=12, **extra)
        choice = reply.choices[0]
        logprobs = [t.logprob for t in choice.logprobs.content] if choice.logprobs else None
        out.append((reply.usage, choice.message.content, logprobs))
        messages.append({"role": "assistant", "content": choice.message.content})
    return out


def test_later_turns_are_served_from_the_cache_and_a_fresh_conversation_is_not(app):
    turns = conversation(app, "warm", 4, uuid.uuid4().hex)
    first = turns[0][0]
    assert first.prompt_tokens > 300 and first.prompt_tokens_details.cached_tokens == 0
    for (previous, _, _), (usage, _, _) in zip(turns, turns[1:]):
        cached = usage.prompt_tokens_details.cached_tokens
        assert 0.8 * previous.prompt_tokens <= cached < usage.prompt_tokens
    cold = conversation(app, "cold", 3, uuid.uuid4().hex)
    assert [u.prompt_tokens_details.cached_tokens for u, _, _ in cold] == [0, 0, 0]
    scrape = samples(app.metrics())
    assert value(scrape, "openarc_prompt_tokens_total", model="warm", source="cache") >= \
        sum(u.prompt_tokens_details.cached_tokens for u, _, _ in turns)
    assert value(scrape, "openarc_prompt_tokens_total", model="cold", source="cache") == 0
    assert value(scrape, "openarc_prompt_tokens_total", model="cold", source="computed") >= \
        sum(u.prompt_tokens for u, _, _ in cold)


def test_greedy_answers_are_the_same_with_the_cache_on_and_off(app):
    """Token for token, and the log-probabilities too (the demo's transformer layers move them: a KV block served
    wrong would show), over a multi-turn conversation whose later turns the warm model serves from the cache."""
    nonce = uuid.uuid4().hex
    warm = conversation(app, "warm", 4, nonce, logprobs=True)
    cold = conversation(app, "cold", 4, nonce, logprobs=True)
    assert warm[-1][0].prompt_tokens_details.cached_tokens > 0
    for (_, warm_text, warm_lp), (_, cold_text, cold_lp) in zip(warm, cold):
        assert warm_text == cold_text
        assert warm_lp == pytest.approx(cold_lp, abs=1e-3)


def test_every_dialect_reports_cached_tokens_through_the_sdks(app):
    client, nonce = app.client(), uuid.uuid4().hex
    messages = [{"role": "system", "content": f"{nonce} {SYSTEM}"}, {"role": "user", "content": "Hello"}]
    client.chat.completions.create(model="warm", messages=messages, max_tokens=2)
    # chat completions, whole and the final streamed usage
    whole = client.chat.completions.create(model="warm", messages=messages, max_tokens=2).usage
    assert 0.8 * whole.prompt_tokens <= whole.prompt_tokens_details.cached_tokens < whole.prompt_tokens
    chunks = list(client.chat.completions.create(model="warm", messages=messages, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == whole.prompt_tokens_details.cached_tokens
    # text completions
    prompt = f"{nonce} {SYSTEM}"
    client.completions.create(model="warm", prompt=prompt, max_tokens=2)
    usage = client.completions.create(model="warm", prompt=prompt, max_tokens=2).usage
    assert usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens
    streamed = list(client.completions.create(model="warm", prompt=prompt, max_tokens=2, stream=True,
                                              stream_options={"include_usage": True}))[-1].usage
    assert streamed.prompt_tokens_details.cached_tokens >= 0.8 * streamed.prompt_tokens
    # responses
    client.responses.create(model="warm", instructions=f"{nonce} {SYSTEM}", input="Hi", max_output_tokens=2)
    response = client.responses.create(model="warm", instructions=f"{nonce} {SYSTEM}", input="Hi",
                                       max_output_tokens=2).usage
    assert response.input_tokens_details.cached_tokens >= 0.8 * response.input_tokens
    # messages: computed + read = the whole prompt, on message_start and at the end
    anthropic_client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=60)
    body = {"model": "warm", "max_tokens": 2, "system": f"{nonce} {SYSTEM}",
            "messages": [{"role": "user", "content": "Hi"}]}
    anthropic_client.messages.create(**body)
    message = anthropic_client.messages.create(**body).usage
    counted = anthropic_client.messages.count_tokens(**{k: v for k, v in body.items() if k != "max_tokens"})
    assert message.cache_creation_input_tokens == 0
    assert message.input_tokens + message.cache_read_input_tokens == counted.input_tokens
    assert message.cache_read_input_tokens >= 0.8 * counted.input_tokens
    with anthropic_client.messages.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_message().usage
    start = events[0].message.usage
    assert start.cache_read_input_tokens == final.cache_read_input_tokens == message.cache_read_input_tokens
    assert start.input_tokens == final.input_tokens == message.input_tokens


def claude_code_body(cch: str, nonce: str) -> dict:
    """A Claude Code request as it arrives: the billing line as the first system block, cache_control marks."""
    return {"model": "{}", "max_tokens": 4,
            "system": [{"type": "text", "text": BILLING.format(cch)},
                       {"type": "text", "text": f"{nonce} {SYSTEM}", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Fix the bug.",
                                                      "cache_control": {"type": "ephemeral"}}]}]}


@pytest.mark.parametrize("model, served", [("warm", True), ("raw", False)])
def test_two_claude_code_requests_differing_in_cch_share_the_cache(app, model, served):
    anthropic_client = anthropic.Anthropic(base_url=app.base, api_key="unused", max_retries=0, timeout=60)
    nonce = uuid.uuid4().hex
    first = anthropic_client.messages.create(**{**claude_code_body("1f2e3", nonce), "model": model}).usage
    second = anthropic_client.messages.create(**{**claude_code_body("9a8b7", nonce), "model": model}).usage
    whole = second.input_tokens + second.cache_read_input_tokens
    assert first.cache_read_input_tokens == 0
    if served:  # all but the last block of the prompt
        assert second.cache_read_input_tokens >= 0.8 * whole and second.input_tokens < 40
    else:  # canonicalize_agent_noise: false: the line is in the prompt, and the changed checksum breaks it early
        assert second.cache_read_input_tokens < 0.2 * whole
    if served:
        assert "x-anthropic-billing-header" in app.logs() and app.logs().count("logged once") == 1


@pytest.fixture(scope="module")
def heavy_app(tmp_path_factory):
    """A demo model heavy enough that prefill dominates a request (12 layers), with the cache on."""
    from appliance.demo.catalog import build_demo_model
    path = build_demo_model(tmp_path_factory.mktemp("models") / "heavy", eos_after=0, max_new_tokens=64, layers=12)
    appliance = Appliance({"models": [model_entry("heavy", path, max_context=2048)]},
                          tmp_path_factory.mktemp("heavy")).start()
    yield appliance
    appliance.stop()


def first_token(client, messages) -> tuple[float, int, int]:
    """(seconds to the first streamed token, prompt tokens, cached tokens) of one chat."""
    start, ttft = time.perf_counter(), None
    for chunk in client.chat.completions.create(model="heavy", messages=messages, max_tokens=2, stream=True,
                                                stream_options={"include_usage": True}):
        if ttft is None and chunk.choices and chunk.choices[0].delta.content:
            ttft = time.perf_counter() - start
        if chunk.usage:
            usage = chunk.usage
    return ttft, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_the_reported_cached_tokens_match_the_latency_they_imply(heavy_app):
    """A prompt reported as served from the cache is answered several times faster than the same prompt length
    computed; one reported as computed is not (medians of alternated repeats: a shared machine is noisy)."""
    client = heavy_app.client(timeout=120)
    long_system = " ".join(f"Clause {i} of the house rules applies." for i in range(45))
    served, computed = [], []
    for _ in range(3):
        messages = [{"role": "system", "content": f"{uuid.uuid4().hex} {long_system}"},
                    {"role": "user", "content": "Go on."}]
        fresh, prompt, cached = first_token(client, messages)
        assert prompt > 1000 and cached == 0
        again, prompt, cached = first_token(client, messages)
        assert cached >= prompt - 32
        computed.append(fresh)
        served.append(again)
    assert statistics.median(served) < statistics.median(computed) / 2, (served, computed)


def test_the_sessions_bench_runs_quick(tmp_path):
    """`python -m bench.sessions --quick` (shapes only, never a timing): every side's turn 1 and later turns, the
    speed-up and the warm model's hit ratio, which a replay of growing conversations must show above zero."""
    from conftest import quick_side_bench
    figures = quick_side_bench("sessions", tmp_path)
    for side in ("warm", "cold", "in-process genai"):
        for what in ("turn 1", "later turns"):
            assert figures[f"TTFT {what}, {side} (median; lowest-highest)"]["value"] > 0
    headline = figures["Warm sessions, later turns: time to first token, prefix cache on (default) / off"]
    assert headline["value"] > 0 and "off / on" in headline["measured"], headline  # the main bench's row
    assert 0 < figures["Prompt tokens the warm model's cache served (all turns)"]["value"] < 100


# Turn N+1's prompt begins with turn N's prompt and answer for these templates (template, whether the model thinks,
# whether it is byte-stable). A reasoning model's answer starts with a think block that the templates drop from
# history (the client sends back the answer without it), and Qwen3 with enable_thinking: false opens an empty
# block that history does not repeat: there the prefix ends where the previous answer began, and everything
# before it (system prompt, tools, earlier turns) stays cached.
TEMPLATE_CASES = [("meta-llama-Llama-3.3-70B-Instruct.jinja", None, True),
                  ("mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja", None, True),
                  ("tool_chat_template_qwen3coder.jinja", None, True),
                  ("Qwen-Qwen3-0.6B.jinja", None, True),  # thinking on, an answer without a think block
                  ("Qwen-Qwen3-0.6B.jinja", True, False),
                  ("Qwen-Qwen3-0.6B.jinja", False, False),
                  ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", True, False),
                  ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", True, False)]


@pytest.mark.parametrize("template, thinking, stable", TEMPLATE_CASES)
def test_the_next_turns_prompt_begins_with_this_turns_prompt_and_answer(demo_model, template, thinking, stable):
    import openvino_genai
    from conftest import FIXTURES
    tokenizer = openvino_genai.Tokenizer(str(demo_model))
    tokenizer.set_chat_template((FIXTURES / "chat-templates" / template).read_text())
    kwargs = {"enable_thinking": thinking} if thinking is not None else None

    def render(messages, generation_prompt=True):
        return tokenizer.apply_chat_template(openvino_genai.ChatHistory(messages),
                                             add_generation_prompt=generation_prompt, extra_context=kwargs)

    history = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi there"}]
    prompt, answer = render(history), "Hello! How can I help?"
    generated = "<think>\nLet me see.\n</think>\n\n" + answer if thinking else answer
    if prompt.endswith("<think>\n"):  # the template opened the block: the model writes the rest
        generated = generated.removeprefix("<think>\n")
    following = render(history + [{"role": "assistant", "content": answer}, {"role": "user", "content": "More"}])
    assert following.startswith(prompt + generated) == stable
    # wherever it breaks, it breaks at the previous answer: the history before it is served from the cache
    assert following.startswith(render(history, generation_prompt=False))


def test_a_full_cache_evicts_the_oldest_conversation_and_never_fails_a_request(appliance_factory, demo_model):
    """A cache of 64 blocks (2,048 tokens on the CPU) and conversations of about 600 tokens: each new one pushes the
    least recently used out. Every request succeeds, the last conversation comes back warm, the first cold, and
    the timing agrees with the figure where the demo model is this light only loosely, so only the figures are
    checked here (the heavy test above checks figures against time)."""
    app = appliance_factory({"models": [model_entry("small", demo_model, max_context=1024,
                                                    scheduler_config={"num_kv_blocks": 64})]})
    client = app.client()
    systems = [f"{uuid.uuid4().hex} " + " ".join(f"Note {i} of {n}." for i in range(60)) for n in range(6)]

    def ask(system):
        reply = client.chat.completions.create(model="small", max_tokens=4, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Next?"}])
        return reply.usage

    first = [ask(system) for system in systems]
    assert all(u.prompt_tokens > 400 and u.prompt_tokens_details.cached_tokens == 0 for u in first)
    latest = ask(systems[-1])
    assert latest.prompt_tokens_details.cached_tokens >= latest.prompt_tokens - 32
    assert ask(systems[0]).prompt_tokens_details.cached_tokens == 0  # evicted: recomputed, and answered


def test_running_generations_count_against_the_cache_so_cached_tokens_never_overstate(appliance_factory,
                                                                                      long_demo_model):
    """A cache of 64 blocks (2,048 tokens on the CPU) holds a 900-token conversation (28 blocks) while two long
    generations grow past 800 tokens (25 blocks each): genai evicts the conversation's blocks to make room for them,
    so asked again it is recomputed. The worker's model must say so: it counted the whole cache as room for finished
    prefixes and reported the conversation as served from the cache. (The figure only: the heavy test above checks
    figures against time.)"""
    app = appliance_factory({"models": [model_entry("small", long_demo_model, max_context=1024,
                                                    scheduler_config={"num_kv_blocks": 64})]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.01"})  # the generations still run when asked
    client = app.client()
    system = f"{uuid.uuid4().hex} " + " ".join(f"Note {i} of the plan." for i in range(60))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Next?"}]

    def ask():
        return client.chat.completions.create(model="small", max_tokens=4, messages=messages).usage

    def generated() -> float:
        return value(samples(app.metrics()), "openarc_generation_tokens_total", model="small")

    stored = ask()
    assert stored.prompt_tokens > 500 and ask().prompt_tokens_details.cached_tokens >= stored.prompt_tokens - 32
    before = generated()
    streams = [client.chat.completions.create(model="small", max_tokens=1000, stream=True,
                                              messages=[{"role": "user", "content": f"Story {n}."}]) for n in range(2)]
    try:
        wait_until(lambda: generated() >= before + 1600, 120, "two generations of 800 tokens")
        assert app.model_status("small")["requests_running"] == 2  # they still hold their blocks
        again = ask()  # its figure is the worker's at admission, while they run
    finally:
        for stream in streams:
            stream.close()
    assert again.prompt_tokens_details.cached_tokens < again.prompt_tokens - 32, again
