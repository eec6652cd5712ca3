"""Long speech input cut into pieces at sentence boundaries, synthesised one after another (the first piece's
audio can be sent while the rest is still being spoken), each piece short enough for a TTS model's text
positions (SpeechT5 reads at most 600 tokens; its voice degrades well before).  A pure function."""

from __future__ import annotations

import re

MAX_PIECE_CHARS = 300
# A sentence ends at . ! ? (or their CJK forms, or an ellipsis) followed by closing quotes or brackets, then
# whitespace; or at a line break.  "e.g. this" splits too: a pause there costs nothing audible.
SENTENCE_END = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])[\"')\]\u201d\u2019]*\s+|\n+")
CLAUSE_END = re.compile(r"(?<=[,;:\u3001\uff0c\uff1b])\s+")


def split_sentences(text: str, max_chars: int = MAX_PIECE_CHARS) -> list[str]:
    """`text` as pieces of at most `max_chars` characters: one per sentence (so the first audio waits for the
    first sentence only), a sentence over the limit cut at clause ends, then at spaces, then anywhere.
    The pieces joined with single spaces hold every word of `text` in order; whitespace-only text gives []."""
    return [part for sentence in _cut(text.strip(), SENTENCE_END) for part in _fit(sentence, max_chars)]


def _cut(text: str, pattern: re.Pattern) -> list[str]:
    """`text` split after each match of `pattern`, the punctuation kept, the whitespace dropped."""
    parts, start = [], 0
    for match in pattern.finditer(text):
        parts.append(text[start:match.start()] + match.group().rstrip().lstrip("\n"))
        start = match.end()
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _fit(sentence: str, max_chars: int) -> list[str]:
    """A sentence in parts of at most max_chars: at clause ends, then spaces, then hard cuts."""
    if len(sentence) <= max_chars:
        return [sentence]
    parts: list[str] = []
    for clause in _cut(sentence, CLAUSE_END):
        for word in clause.split(" ") if len(clause) > max_chars else [clause]:
            while len(word) > max_chars:
                parts.append(word[:max_chars])
                word = word[max_chars:]
            if not word:
                continue
            if parts and len(parts[-1]) + 1 + len(word) <= max_chars:
                parts[-1] += " " + word
            else:
                parts.append(word)
    return parts

