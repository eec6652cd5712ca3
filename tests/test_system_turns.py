"""System messages in mid-conversation (appliance.worker.system_turns): the form each real chat template takes, found
by probing it with genai's own template engine (as the worker renders), and the rewrite as a pure function over
generated conversations. docs/responses-and-messages.md lists the same table."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.worker.system_turns import INSTRUCTIONS, MERGED, SYSTEM, USER, placed, placement
from conftest import FIXTURES

TEMPLATES = FIXTURES / "chat-templates"

# Every real template and the form a mid-conversation system message takes with it.
EXPECTED = {
    "Qwen-Qwen3-0.6B.jinja": SYSTEM,                      # renders a system turn anywhere
    "tool_chat_template_qwen3coder.jinja": SYSTEM,
    "meta-llama-Llama-3.3-70B-Instruct.jinja": SYSTEM,
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": USER,  # gathers system messages into the top prompt
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": USER,
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja": USER,  # drops a system message after the first
}


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    import openvino_genai
    return openvino_genai.Tokenizer(str(demo_model))


def renderer(tokenizer, name):
    import openvino_genai
    tokenizer.set_chat_template((TEMPLATES / name).read_text())
    return lambda messages: tokenizer.apply_chat_template(openvino_genai.ChatHistory(messages),
                                                          add_generation_prompt=True)


def test_every_fixture_template_has_an_expectation():
    assert sorted(path.name for path in TEMPLATES.glob("*.jinja")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_real_template_gets_the_form_it_renders_at_the_place(tokenizer, name):
    render = renderer(tokenizer, name)
    form = placement(render)
    assert form == EXPECTED[name]
    conversation = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List the files."},
                    {"role": "system", "content": "Mind the tests."}]
    text = render(placed(conversation, form))
    # the reminder comes after the user's turn, never moved up into the system prompt
    assert text.index("You are terse.") < text.index("List the files.") < text.index("Mind the tests.")
    # the next turn's prompt begins with this one's (the prefix cache keeps serving it)
    following = conversation + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "More"}]
    start = render(placed(conversation, form))
    assert render(placed(following, form)).startswith(start[:start.index("Mind the tests.")])


def strict(messages):  # a template that refuses two user turns in a row and drops system turns after the first
    roles = [m["role"] for m in messages if m["role"] != "system"]
    if any(a == b for a, b in zip(roles, roles[1:])):
        raise ValueError("roles must alternate")
    return "".join(m["content"] for i, m in enumerate(messages) if m["role"] != "system" or i == 0)


def test_a_template_that_takes_no_mid_conversation_turn_at_all_gets_the_merged_form():
    assert placement(strict) == MERGED
    assert placement(lambda messages: 1 / 0) == MERGED  # a template that renders nothing


ROLES = st.sampled_from(["system", "user", "assistant", "tool"])


@settings(max_examples=200, deadline=None)
@given(st.lists(ROLES, max_size=12), st.sampled_from([SYSTEM, USER, MERGED]))
def test_the_rewrite_keeps_the_system_prompt_and_every_text_in_order(roles, form):
    messages = [{"role": role, "content": f"<{i}>"} for i, role in enumerate(roles)]
    out = placed(messages, form)
    leading = next((i for i, role in enumerate(roles) if role != "system"), len(roles))
    assert out[:leading] == messages[:leading]  # the system prompt as it was
    rendered = "\n".join(m["content"] for m in out)
    at = [rendered.index(f"<{i}>") for i in range(len(roles))]  # every text is there, each once, in order
    assert at == sorted(at) and all(rendered.count(f"<{i}>") == 1 for i in range(len(roles)))
    if form == SYSTEM:
        assert out == messages
    else:
        assert all(m["role"] != "system" for m in out[leading:])
        assert [m for m in out if m["role"] not in ("system", "user")] == \
               [m for m in messages if m["role"] not in ("system", "user")]
        moved = [m for m in messages[leading:] if m["role"] == "system"]
        assert sum(INSTRUCTIONS.format(m["content"]) in rendered for m in moved) == len(moved)


@pytest.mark.parametrize("roles", [["user", "assistant", "system", "user"],  # a reminder after the answer
                                   ["user", "assistant", "system"],
                                   ["user", "assistant", "tool", "system", "system", "assistant", "user"]])
def test_the_merged_form_never_makes_two_user_turns_of_a_system_turn_after_an_answer(roles):
    """A template that needs roles to alternate still renders a conversation whose system message came after an
    assistant turn (a Codex developer message, a Claude Code reminder replayed on the next turn)."""
    messages = [{"role": "system", "content": "top"}] + [{"role": role, "content": f"<{i}>"}
                                                         for i, role in enumerate(roles)]
    text = strict(placed(messages, MERGED))
    at = [text.index(f"<{i}>") for i in range(len(roles))]
    assert at == sorted(at)


@settings(max_examples=200, deadline=None)
@given(st.lists(ROLES, max_size=12))
def test_the_merged_form_adds_no_user_turn_next_to_another(roles):
    messages = [{"role": role, "content": f"<{i}>"} for i, role in enumerate(roles)]
    leading = next((i for i, role in enumerate(roles) if role != "system"), len(roles))
    turns = [m["role"] for m in placed(messages, MERGED)[leading:]]
    given_turns = [role for role in roles[leading:] if role != "system"]
    pairs = lambda seq: sum(a == b == "user" for a, b in zip(seq, seq[1:]))  # noqa: E731
    assert pairs(turns) == pairs(given_turns)
