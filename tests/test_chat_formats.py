"""Detection of a model's tool-call and reasoning formats from its chat template: a pure function, run on every
real template in tests/fixtures/chat-templates/ (tests/test_tools.py serves some of them on real genai)."""

from __future__ import annotations

import pytest

from appliance.chat_formats import detect_reasoning_parser, detect_tool_parser, resolve
from conftest import FIXTURES

TEMPLATES = FIXTURES / "chat-templates"

# Every real template and what a model that carries it is: (tool_parser, reasoning_parser).
EXPECTED = {
    "Qwen-Qwen3-0.6B.jinja": ("hermes", "qwen3"),
    "tool_chat_template_qwen3coder.jinja": ("qwen3_coder", None),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja": (None, "deepseek_r1"),
    # The original template of the distills: `</think>` (history is stripped of reasoning) but no `<think>`.
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": (None, "deepseek_r1"),
    "meta-llama-Llama-3.3-70B-Instruct.jinja": ("llama3_json", None),
    "mistralai-Mistral-Small-3.1-24B-Instruct-2503.jinja": ("mistral", None),
}


def test_every_fixture_template_has_an_expectation():
    assert sorted(path.name for path in TEMPLATES.glob("*.jinja")) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_real_template_is_detected_as_its_family(name):
    template = (TEMPLATES / name).read_text()
    assert (detect_tool_parser(template), detect_reasoning_parser(template)) == EXPECTED[name]


def test_the_distill_template_that_only_strips_reasoning_lacks_the_opening_tag():
    """What made it a hidden case: the substring every earlier check looked for is not in it."""
    template = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text()
    assert "<think>" not in template and "</think>" in template


@pytest.mark.parametrize("template, expected", [
    # QwQ-style: the generation prompt opens the block, nothing else mentions it.
    ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
     "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}", "qwen3"),
    # DeepSeek markers with the block opened by the prompt.
    ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}{{ '<｜Assistant｜><think>\\n' }}", "deepseek_r1"),
    # Only strips reasoning from history, ChatML family.
    ("{% for m in messages %}{{ m.content.split('</think>')[-1] }}{% endfor %}", "qwen3"),
    # DeepSeek-V3: the markers, but no reasoning.
    ("{% for m in messages %}<｜User｜>{{ m.content }}{% endfor %}<｜Assistant｜>", None),
    ("{% for m in messages %}{{ m.content }}{% endfor %}", None),
])
def test_reasoning_is_detected_from_either_tag(template, expected):
    assert detect_reasoning_parser(template) == expected


def test_configured_wins_and_none_switches_detection_off():
    assert resolve(None, "deepseek_r1") == "deepseek_r1"
    assert resolve("qwen3", "deepseek_r1") == "qwen3"
    assert resolve("none", "deepseek_r1") is None
