"""Streamed text must equal what the tokenizer's own decode() gives for the whole answer, token by token."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import openvino_genai
import pytest

from appliance.worker.detokenize import SAMPLE_TEXTS, ByteTableDetokenizer, WindowDetokenizer, make_detokenizer


@dataclass
class Stream:
    generated: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    decoder: Any = None


@pytest.fixture(scope="module")
def tokenizer(demo_model):
    return openvino_genai.Tokenizer(str(demo_model))


def streamed_text(detok, ids: list[int], step: int) -> str:
    stream, text = Stream(), ""
    for start in range(0, len(ids), step):
        stream.generated.extend(ids[start:start + step])
        text += detok.deltas([stream])[0]
    return text


@pytest.mark.parametrize("step", [1, 3])
@pytest.mark.parametrize("sample", SAMPLE_TEXTS)
def test_both_detokenizers_stream_exactly_what_decode_gives(tokenizer, sample, step):
    ids = list(tokenizer.encode(sample, add_special_tokens=False).input_ids.data[0])
    whole = tokenizer.decode(ids)
    assert "\ufffd" not in whole
    for detok in (WindowDetokenizer(tokenizer), make_detokenizer(tokenizer)):
        assert streamed_text(detok, ids, step) == whole


def test_requests_of_one_step_keep_their_own_state(tokenizer):
    detok = make_detokenizer(tokenizer)
    texts = SAMPLE_TEXTS[3], SAMPLE_TEXTS[0]
    ids = [list(tokenizer.encode(t, add_special_tokens=False).input_ids.data[0]) for t in texts]
    streams, out = [Stream(), Stream()], ["", ""]
    for i in range(max(map(len, ids))):
        live = [(s, seq) for s, seq in zip(streams, ids) if i < len(seq)]
        for s, seq in live:
            s.generated.append(seq[i])
        for (s, _), delta in zip(live, detok.deltas([s for s, _ in live])):
            out[streams.index(s)] += delta
    assert out == [tokenizer.decode(seq) for seq in ids]


def test_the_byte_table_is_used_for_a_byte_level_bpe_tokenizer(tokenizer):
    assert isinstance(make_detokenizer(tokenizer), ByteTableDetokenizer)


class CleansUpSpaces:
    """A tokenizer whose decode() removes spaces before punctuation, as HF's clean_up_tokenization_spaces does."""

    def __init__(self, real):
        self._real = real

    def get_vocab(self):
        return self._real.get_vocab()

    def encode(self, *args, **kwargs):
        return self._real.encode(*args, **kwargs)

    def decode(self, ids):
        def clean(text: str) -> str:
            for p in (" .", " ,", " !", " ?", " 's"):
                text = text.replace(p, p[1:])
            return text
        decoded = self._real.decode(ids)
        return [clean(t) for t in decoded] if isinstance(decoded, list) else clean(decoded)


def test_a_tokenizer_whose_decode_is_not_byte_concatenation_falls_back(tokenizer):
    assert isinstance(make_detokenizer(CleansUpSpaces(tokenizer)), WindowDetokenizer)


@pytest.mark.parametrize("sample", SAMPLE_TEXTS)
def test_whole_answers_decode_the_same_either_way(tokenizer, sample):
    ids = list(tokenizer.encode(sample, add_special_tokens=False).input_ids.data[0])
    assert make_detokenizer(tokenizer).decode(ids) == WindowDetokenizer(tokenizer).decode(ids) == sample
