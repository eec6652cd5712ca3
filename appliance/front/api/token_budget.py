"""What a request may cost its key's `tokens_per_minute`, known at admission before anything is tokenized: a pure
estimate from the JSON body (docs/sharing.md#limits says how far it lets a window be overshot).

The reservation is the completion's bound (`max_tokens`, `max_completion_tokens` or `max_output_tokens`, times `n`
choices) plus the prompt's estimate (the body's text at CHARS_PER_TOKEN characters a token). A body with no bound
reserves DEFAULT_COMPLETION_TOKENS per choice: it may then generate more than it reserved, and the docs say so.
The prompt's estimate is also what a request is charged when it was handed to its worker but its prompt count
never came back (its client hung up during prefill, or it failed after it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from appliance.config.kinds import GENERATIVE_KINDS

CHARS_PER_TOKEN = 4  # a BPE tokenizer's English average; prompts of code or other scripts run denser
DEFAULT_COMPLETION_TOKENS = 1024  # a generation with no max_tokens, per choice
COMPLETION_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
TOKEN_KINDS = GENERATIVE_KINDS + ("embedding", "rerank")  # the kinds whose workers count a prompt's tokens
MAX_CHOICES = 128  # an absurd `n` is the route's 400 to give; the estimate only must not run away with it


@dataclass(frozen=True)
class TokenBudget:
    prompt: int  # the prompt's estimate
    completion: int  # the completion's bound, all choices together (0: a kind that generates nothing)

    @property
    def total(self) -> int:
        return self.prompt + self.completion


NO_TOKENS = TokenBudget(0, 0)  # a call that generates and charges no tokens (a load, an unload, a count)


def budget_of(body: Any, kind: str, window: int | None = None) -> TokenBudget:
    """The reservation of a request with this body for a model of this kind: its prompt and completion for the
    generative kinds, its input for embedding and rerank, nothing for the kinds that count no tokens (speech,
    transcription: their workers report seconds and characters). `window`: the model's context (None: unknown),
    which neither a prompt nor a choice's completion can exceed, whatever the body asks (opencode asks 32,000 of
    any model): a reservation past it only holds the key's other requests back."""
    if kind not in TOKEN_KINDS:
        return NO_TOKENS
    fit = (lambda tokens: tokens) if not window else (lambda tokens: min(tokens, window))
    prompt = fit(math.ceil(_text_chars(body) / CHARS_PER_TOKEN))
    if kind not in GENERATIVE_KINDS or not isinstance(body, dict):
        return TokenBudget(prompt, 0)
    bound = next((body[name] for name in COMPLETION_FIELDS if _count(body.get(name))), DEFAULT_COMPLETION_TOKENS)
    choices = min(body["n"], MAX_CHOICES) if _count(body.get("n")) else 1
    return TokenBudget(prompt, fit(bound) * choices)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _text_chars(value: Any) -> int:
    """Characters of the body's text (messages, prompt, input, tools, ...); data URLs (images, audio) and the
    field names are left out: their cost is not the text's. Iterative: admission reads a body before any route has
    refused its depth."""
    pending, total = [value], 0
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            total += 0 if item.startswith("data:") else len(item)
        elif isinstance(item, dict):
            pending.extend(v for k, v in item.items() if k != "model")
        elif isinstance(item, list):
            pending.extend(item)
    return total
