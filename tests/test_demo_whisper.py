"""The tiny Whisper-shaped model under a real openvino_genai.WhisperPipeline on CPU: what it transcribes, with
and without timestamps, long form, word timestamps, streaming; and that its build is deterministic."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from audio_samples import TRANSCRIPT, tone

RATE = 16000


@pytest.fixture(scope="module")
def pipe(demo_whisper):
    import openvino_genai
    return openvino_genai.WhisperPipeline(str(demo_whisper), "CPU", word_timestamps=True)


def test_sound_is_the_transcript_and_silence_is_empty(pipe):
    assert pipe.generate(tone(2.0)).texts == [" " + TRANSCRIPT]
    noise = np.random.default_rng(0).normal(0, 0.05, 3 * RATE).astype(np.float32)
    assert pipe.generate(noise).texts == [" " + TRANSCRIPT]
    assert pipe.generate(np.zeros(2 * RATE, np.float32)).texts == [""]


def test_timestamps_and_long_form(pipe):
    result = pipe.generate(tone(2.0), return_timestamps=True)
    assert [(c.start_ts, c.end_ts, c.text) for c in result.chunks] == [(0.0, 1.0, " " + TRANSCRIPT)]
    result = pipe.generate(tone(45.0), return_timestamps=True)  # genai cuts it into 30 s windows
    assert [(c.start_ts, c.end_ts) for c in result.chunks] == [(0.0, 1.0), (30.0, 31.0)]
    assert result.texts == [" " + TRANSCRIPT + " " + TRANSCRIPT]


def test_language_task_words_and_streaming(pipe):
    detected = pipe.generate(tone(1.0))
    assert detected.language.strip("<|>") == "en"
    assert pipe.generate(tone(1.0), language="<|de|>", task="translate").texts == [" " + TRANSCRIPT]
    words = pipe.generate(tone(2.0), word_timestamps=True).words
    assert "".join(w.word for w in words) == " " + TRANSCRIPT
    assert all(a.start_ts <= a.end_ts <= b.start_ts + 1e-6 for a, b in zip(words, words[1:]))
    pieces = []
    pipe.generate(tone(1.0), streamer=lambda text: pieces.append(text) or False)
    assert len(pieces) == 7 and "".join(pieces) == " " + TRANSCRIPT


def test_build_is_deterministic(demo_whisper, tmp_path):
    from appliance.demo.catalog import build_demo_model
    again = build_demo_model(tmp_path / "again", "transcription")

    def digests(path):
        return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.glob("*.bin"))}

    assert digests(again) == digests(demo_whisper) and len(digests(again)) == 4
    generation = json.loads((again / "generation_config.json").read_text())
    assert generation["no_timestamps_token_id"] + 1 + 1500 == json.loads((again / "config.json").read_text())["vocab_size"] - 1
