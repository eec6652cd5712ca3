"""Tool-call and reasoning formats of model families, and their detection from a chat template's text.

Shared by the front (which parses answers) and the worker (which builds constrained-decoding tags and detects the
formats of the template it loaded); neither side needs OpenVINO for this.
"""

from __future__ import annotations

# tool_parser values: how a model writes tool calls.
TOOL_PARSERS = {
    "hermes": "Hermes, Qwen2.5, Qwen3: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>",
    "qwen3_coder": "Qwen3-Coder: <tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>",
    "llama3_json": "Llama 3.1-3.3: {\"name\": ..., \"parameters\": {...}}",
    "mistral": "Mistral: [TOOL_CALLS][{\"name\": ..., \"arguments\": {...}}]",
}
# reasoning_parser values: how a model marks its reasoning. Both put it in <think>...</think>; deepseek_r1
# templates often open the block in the prompt (the worker then sends the opening tag first), and the original
# DeepSeek-R1 distill template never writes <think> at all: the model opens the block itself.
REASONING_PARSERS = {
    "qwen3": "Qwen3, QwQ: <think>...</think>, opened by the model",
    "deepseek_r1": "DeepSeek-R1 and its distills: <think>...</think>, often opened by the template",
}
NONE = "none"  # configured explicitly: no tool calls / no reasoning split for this model
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def detect_tool_parser(template: str) -> str | None:
    """The tool-call format a chat template teaches, or None if it renders no tools we know."""
    if "<function=" in template and "<parameter=" in template:
        return "qwen3_coder"
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|start_header_id|>" in template and "parameters" in template and "tools" in template:
        return "llama3_json"
    return None


# DeepSeek's role markers (fullwidth bars): a template with them and a think tag is DeepSeek-R1's or a distill's.
DEEPSEEK_MARKERS = ("<｜Assistant｜>", "<｜User｜>")


def detect_reasoning_parser(template: str) -> str | None:
    """The reasoning format a chat template shows, or None. A template shows it in one of three ways, and real ones
    show only one of them: Qwen3's re-renders reasoning as `<think>...</think>`; DeepSeek-R1's updated template and
    QwQ's open `<think>` in the generation prompt; DeepSeek-R1's original template (still in many distills, e.g.
    DeepSeek-R1-Distill-Llama-8B) has no `<think>` at all, only `</think>`, where it strips reasoning from history.
    So either tag counts: looking for `<think>` alone missed that last one and put its reasoning in `content`."""
    if THINK_OPEN not in template and THINK_CLOSE not in template:
        return None
    return "deepseek_r1" if any(marker in template for marker in DEEPSEEK_MARKERS) else "qwen3"


def resolve(configured: str | None, detected: str | None) -> str | None:
    """The configured value wins; `none` switches a detected format off."""
    if configured == NONE:
        return None
    return configured or detected
