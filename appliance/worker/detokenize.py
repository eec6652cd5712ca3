"""Incremental detokenization for streamed tokens.

Two ways to turn a request's new token ids into new text, behind one interface (`deltas(reqs)`):
- ByteTableDetokenizer: when the tokenizer's vocabulary maps every token to fixed bytes (byte-level BPE, as
  OpenVINO's `get_vocab()` gives them), text is those bytes through an incremental UTF-8 decoder: about a
  microsecond per token instead of a detokenizer inference. It is used only after it reproduces the tokenizer's
  own `decode()` on every single token and on sample texts; any difference (SentencePiece space handling,
  clean-up of spaces before punctuation, ...) falls back to
- WindowDetokenizer: the tokenizer's `decode()` over a short window of ids, all requests of a step in one
  batched call.
"""

from __future__ import annotations

import codecs
import logging
from typing import Any, Protocol

log = logging.getLogger("openarc.worker")

# Text whose round trip must be exact for the byte table to be trusted: spaces before punctuation, digits,
# newlines and tabs, code, and multi-byte characters that split across tokens.
SAMPLE_TEXTS = (
    "Hello , world . It 's a test : yes ? No ! (maybe) [x] {y} \"quoted\" 'single'",
    "Numbers 1234567890, 3.14159 and -42; dates 2026-11-29.\n\nNew paragraph\twith a tab.",
    "def f(x):\n    return x ** 2  # code\n",
    "Grüße, naïve café — 日本語のテキスト, 中文, Ελληνικά, русский, emoji 🙂🚀 and ½ ≠ ∞.",
)


class Tracked(Protocol):
    generated: list[int]
    prefix_offset: int
    read_offset: int
    decoder: Any


class WindowDetokenizer:
    """decode() a short window per request, so each step costs O(1), not O(length); one batched call per step.

    A multi-byte character split across tokens decodes to U+FFFD until its last byte arrives: hold it back.
    """

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def deltas(self, reqs: list[Tracked]) -> list[str]:
        windows = []
        for req in reqs:
            windows += [req.generated[req.prefix_offset:req.read_offset], req.generated[req.prefix_offset:]]
        texts = self._tokenizer.decode(windows)
        out = []
        for req, before, after in zip(reqs, texts[0::2], texts[1::2]):
            if len(after) <= len(before) or after.endswith("\ufffd"):
                out.append("")
                continue
            req.prefix_offset, req.read_offset = req.read_offset, len(req.generated)
            out.append(after[len(before):])
        return out


class ByteTableDetokenizer:
    """Token ids to bytes by table, bytes to text by an incremental UTF-8 decoder kept per request."""

    def __init__(self, table: list[bytes]):
        self._table = table

    def deltas(self, reqs: list[Tracked]) -> list[str]:
        out = []
        for req in reqs:
            if req.decoder is None:
                req.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
            new = req.generated[req.read_offset:]
            req.read_offset = len(req.generated)
            out.append(req.decoder.decode(b"".join(self._table[i] for i in new)))
        return out

    def decode(self, ids: list[int]) -> str:
        return b"".join(self._table[i] for i in ids).decode("utf-8", errors="replace")


def byte_table(tokenizer) -> list[bytes] | None:
    """The id -> bytes table, or None unless it decodes every token and the sample texts exactly as decode() does."""
    vocab = tokenizer.get_vocab()
    size = max(vocab.values(), default=-1) + 1
    if not vocab or not all(isinstance(token, bytes) for token in vocab):
        return None
    table = [b""] * size
    for token, token_id in vocab.items():
        table[token_id] = token
    singles = tokenizer.decode([[i] for i in range(size)])
    for token_id, text in enumerate(singles):
        if text == "":
            table[token_id] = b""  # a special token that decode() skips
            continue
        try:
            if table[token_id].decode("utf-8") != text:
                return None
        except UnicodeDecodeError:
            pass  # a partial UTF-8 sequence: decode() shows it as replacement characters, the table keeps the bytes
    checker = ByteTableDetokenizer(table)
    for sample in SAMPLE_TEXTS:
        ids = list(tokenizer.encode(sample, add_special_tokens=False).input_ids.data[0])
        if checker.decode(ids) != tokenizer.decode(ids):
            return None
    return table


def make_detokenizer(tokenizer) -> WindowDetokenizer | ByteTableDetokenizer:
    try:
        table = byte_table(tokenizer)
    except Exception as exc:  # an unusual tokenizer must never stop a model from loading
        log.info("byte-table detokenizer unavailable (%s); using decode()", exc)
        table = None
    if table is None:
        log.info("streaming detokenization: tokenizer decode() over a window")
        return WindowDetokenizer(tokenizer)
    log.info("streaming detokenization: byte table (%d tokens), checked against decode()", len(table))
    return ByteTableDetokenizer(table)
