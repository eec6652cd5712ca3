"""A model's prompt: its chat template and tokenizer turning a request's messages (or text) into token ids.

One class, so that the LLM and VLM engines and the token counter (appliance.worker.token_counter, which counts for
a model whose worker is not loaded) render and count a conversation the same way: the template a model's config
names (models[].chat_template) or the one its tokenizer carries, its agent noise dropped first
(models[].canonicalize_agent_noise), the tool and reasoning formats detected from the template.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

from appliance import chat_formats
from appliance.config import window
from appliance.host import faults
from appliance.ipc import frame
from appliance.worker import agent_noise, system_turns
from appliance.worker.engines.constraints import genai_message

log = logging.getLogger("openarc.worker")

INVALID_REQUEST = faults.Fault("invalid_request", "invalid_request", None, False)


class Refused(Exception):
    """A request the worker will not run, and why (its fault): answered with an error frame, whose optional fields
    `details` adds (a prompt over the window: prompt_tokens, max_context, tool_tokens)."""

    def __init__(self, fault: faults.Fault, message: str, details: dict[str, int] | None = None):
        super().__init__(message)
        self.fault = fault
        self.details = details or {}

    def frame(self, request_id: int) -> dict[str, Any]:
        fault = self.fault
        return frame("error", id=request_id, kind=fault.kind, code=fault.code, hint=fault.hint, message=str(self),
                     retryable=fault.retryable, **self.details)


class Prompts:
    """The prompts of one model: `spec` is the worker's spec (appliance.config.worker_spec), `tokenizer` its
    openvino_genai.Tokenizer, `classify` names the fault of a tokenizer error (the engine's device-aware one)."""

    def __init__(self, spec: dict[str, Any], tokenizer, classify: Callable[[str], faults.Fault]):
        self.spec, self.tokenizer, self.classify = spec, tokenizer, classify
        if spec.get("chat_template"):
            tokenizer.set_chat_template(Path(spec["chat_template"]).read_text())
        template = self.template_text()
        self.formats = {
            "tool_parser": chat_formats.resolve(spec.get("tool_parser"), chat_formats.detect_tool_parser(template)),
            "reasoning_parser": chat_formats.resolve(spec.get("reasoning_parser"),
                                                     chat_formats.detect_reasoning_parser(template)),
        }
        self.noise_logged = False  # the first agent-noise drop is logged, the rest are not
        # how this template takes a system message in mid-conversation (appliance.worker.system_turns)
        self.system_form = system_turns.placement(lambda messages: self.apply(messages))
        log.info("model %s: a system message in mid-conversation is rendered as %s", spec.get("name"),
                 system_turns.DESCRIPTIONS[self.system_form])

    def template_text(self) -> str:
        try:
            return self.tokenizer.chat_template or ""
        except Exception:  # a tokenizer without a template
            return ""

    def prompt(self, message: dict[str, Any]) -> tuple[Any, str, bool, str]:
        """The prompt's token ids, the text the template already wrote for the answer (an opened <think>),
        whether the answer starts with reasoning (a reasoning model whose template did not close the block, as
        Qwen3's does for enable_thinking: false), and the prompt's text."""
        prefix, text, thinking = "", message.get("prompt", ""), False
        if message["kind"] == "chat":
            try:
                text = self.render(message)
            except Exception as exc:  # the template refused this conversation (raise_exception, a missing field)
                raise Refused(INVALID_REQUEST, "the model's chat template cannot render this conversation: "
                                               f"{genai_message(exc)}") from None
            if self.formats["reasoning_parser"]:
                tail = text.rstrip()
                if tail.endswith(chat_formats.THINK_OPEN):
                    prefix = chat_formats.THINK_OPEN  # the answer starts inside the block the template opened
                thinking = not tail.endswith(chat_formats.THINK_CLOSE)
        try:
            input_ids = self.tokenizer.encode(text, add_special_tokens=message["kind"] != "chat").input_ids
            return input_ids, prefix, thinking, text
        except Exception as exc:  # a tokenizer error belongs to this request only: its classified line to the client,
            fault = self.classify(str(exc))  # the runtime's whole text (source files, paths) to the log
            log.error("tokenizing a prompt failed (%s): %s", fault.kind, exc)
            raise Refused(fault, faults.client_message(fault)) from None

    def count(self, request_id: int, body: dict[str, Any]) -> dict[str, Any]:
        """The reply frame to a `request` op that counts a conversation (/v1/messages/count_tokens: a chat
        generate frame's messages, tools and template_kwargs) as the template renders it, or why it cannot be
        counted."""
        try:
            input_ids = self.prompt({**body, "kind": "chat"})[0]
        except Refused as refused:
            return refused.frame(request_id)
        return frame("result", id=request_id, result={"input_tokens": int(input_ids.get_shape()[1])}, counts={})

    def check(self, request_id: int, message: dict[str, Any]) -> dict[str, Any]:
        """The reply frame to a window check (the front's, for a stream about to open its headers while its request
        waits): the prompt's tokens and its fitted answer limit, or the refusal the worker itself would give."""
        try:
            prompt_tokens = self._tokens(message)
            limit = self.answer_limit(message, prompt_tokens)[0]
        except Refused as refused:
            return refused.frame(request_id)
        return frame("result", id=request_id, result={"input_tokens": prompt_tokens, "max_tokens": limit}, counts={})

    def answer_limit(self, message: dict[str, Any], prompt_tokens: int) -> tuple[int, str]:
        """The request's answer limit fitted to the model's window, and the bound that set it
        (appliance.config.window.answer_limit); a prompt that leaves no room is Refused, saying how much of it the
        tool definitions are (counted here, on the error path only)."""
        limit = self.spec["max_context"]
        try:
            return window.answer_limit(prompt_tokens, message["params"].get("max_tokens"), limit,
                                       self.spec.get("default_max_tokens"))
        except window.WindowExceeded:
            pass
        text = (f"This model's maximum context length is {limit} tokens; the prompt has {prompt_tokens} tokens, "
                "which leaves no room for an answer.")
        details = {"prompt_tokens": prompt_tokens, "max_context": limit}
        tools = message.get("tools") or []
        tool_tokens = self._tool_tokens(message, prompt_tokens) if tools and message["kind"] == "chat" else None
        if tool_tokens is not None:
            details["tool_tokens"] = tool_tokens
            text += (f" {tool_tokens} of them are the definitions of the request's {len(tools)} tools: the usual "
                     "cause is a UI's built-in tools (Open WebUI attaches 36 to every message); turn off the tools "
                     "this model does not need, or use a model with a larger window.")
        raise Refused(faults.CONTEXT_LENGTH_EXCEEDED, text, details)

    def _tool_tokens(self, message: dict[str, Any], prompt_tokens: int) -> int | None:
        """How many of a prompt's tokens its tool definitions are: the prompt less the prompt without them (None if
        the template will not render the conversation without its tools)."""
        try:
            return prompt_tokens - self._tokens({**message, "tools": None})
        except Refused:
            return None

    def _tokens(self, message: dict[str, Any]) -> int:
        return int(self.prompt(message)[0].get_shape()[1])

    def render(self, message: dict[str, Any]) -> str:
        """The chat prompt: messages (tool calls and results included), the tools, chat_template_kwargs."""
        messages = system_turns.placed(self.canonical(message["messages"]), self.system_form)
        return self.apply(messages, message.get("tools"), message.get("template_kwargs"))

    def apply(self, messages: list[dict[str, Any]], tools: list | None = None, kwargs: dict | None = None) -> str:
        """The template's text for these messages, as they are."""
        import openvino_genai
        return self.tokenizer.apply_chat_template(openvino_genai.ChatHistory(messages), add_generation_prompt=True,
                                                  tools=tools or None, extra_context=kwargs or None)

    def canonical(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages without known agent noise (models[].canonicalize_agent_noise), so prefixes stay stable."""
        if not self.spec.get("canonicalize_agent_noise", True):
            return messages
        messages, dropped = agent_noise.canonical_messages(messages)
        if dropped and not self.noise_logged:
            self.noise_logged = True
            log.info("model %s: dropped %s before templating (it changes every request and would defeat the prefix "
                     "cache; logged once; canonicalize_agent_noise: false keeps it)", self.spec["name"], dropped[0])
        return messages
