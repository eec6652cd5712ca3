"""The tiny SpeechT5-shaped model under a real openvino_genai.Text2SpeechPipeline on CPU: it loads, its audio
follows the text (64 ms a byte, a chord per letter, silence for spaces), each voice has its own timbre, the same
input gives the same samples, and `openarc demo-model --kind tts` builds it; and the sentence splitter the
speech route cuts long input with (a pure function)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from appliance.demo.tts import HOP, REDUCTION, SAMPLE_RATE, STEPS_PER_TOKEN
from appliance.front.api.sentences import split_sentences
from appliance.model_files import OPENAI_VOICES, detect, read_dir

SAMPLES_PER_BYTE = STEPS_PER_TOKEN * REDUCTION * HOP  # 1024: 64 ms at 16 kHz


@pytest.fixture(scope="module")
def pipe(demo_tts):
    import openvino_genai
    return openvino_genai.Text2SpeechPipeline(str(demo_tts), "CPU")


def voice(demo_tts, name: str):
    import openvino as ov
    return ov.Tensor(np.fromfile(demo_tts / "voices" / f"{name}.bin", np.float32).reshape(1, 512))


def speak(pipe, text: str, speaker=None) -> np.ndarray:
    result = pipe.generate(text, speaker) if speaker is not None else pipe.generate(text)
    assert result.output_sample_rate == SAMPLE_RATE and len(result.speeches) == 1
    return np.array(result.speeches[0].data, np.float32).reshape(-1)  # a copy: the next call reuses the buffer


def test_length_follows_the_text_and_it_is_audible(pipe, demo_tts):
    for text in ("hello", "Hello world, this is openarc.", "héllo"):  # é: two bytes, two tokens
        audio = speak(pipe, text, voice(demo_tts, "alloy"))
        assert audio.size == (len(text.encode()) + 1) * SAMPLES_PER_BYTE  # +1: </s>
        assert 0.05 < np.abs(audio).max() <= 1.0
    spaced = speak(pipe, "a b", voice(demo_tts, "alloy"))
    assert np.abs(spaced[SAMPLES_PER_BYTE:2 * SAMPLES_PER_BYTE]).max() < 0.01  # the space is silence
    assert np.abs(spaced[:SAMPLES_PER_BYTE]).max() > 0.05


def test_same_text_same_audio_other_text_or_voice_other_audio(pipe, demo_tts):
    alloy, onyx = voice(demo_tts, "alloy"), voice(demo_tts, "onyx")
    first = speak(pipe, "hello world", alloy)
    assert np.array_equal(first, speak(pipe, "hello world", alloy))
    assert not np.array_equal(first, speak(pipe, "hello wordl", alloy))  # same length, other letters
    assert not np.array_equal(first, speak(pipe, "hello world", onyx))
    assert speak(pipe, "hello world").size == first.size  # genai's built-in speaker works too


def test_the_directory_is_a_tts_model_with_openai_voices(demo_tts):
    files, config = read_dir(demo_tts)
    assert detect(files, config).kind == "tts"
    assert {f"voices/{name}.bin" for name in OPENAI_VOICES} <= files


def test_cli_builds_it(tmp_path):
    out = tmp_path / "tts"
    done = subprocess.run([sys.executable, "-m", "appliance", "demo-model", "--kind", "tts", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (out / "openvino_vocoder.xml").is_file() and (out / "voices" / "nova.bin").stat().st_size == 512 * 4


# --- the sentence splitter ---------------------------------------------------------------------------------------

def test_split_at_sentence_ends_keeping_every_word():
    text = 'Hello there. How are you?  I am fine!\nA new line "Quoted." (Aside.) Last one'
    assert split_sentences(text) == ["Hello there.", "How are you?", "I am fine!", 'A new line "Quoted."',
                                     "(Aside.)", "Last one"]
    assert split_sentences("   \n ") == []
    assert split_sentences("No end") == ["No end"]
    assert split_sentences("3.14 is pi. Yes") == ["3.14 is pi.", "Yes"]  # a point inside a number is no end


def test_long_sentences_cut_at_clauses_then_spaces_then_anywhere():
    assert split_sentences("one two, three four; five", max_chars=10) == ["one two,", "three", "four; five"]
    assert split_sentences("a" * 25, max_chars=10) == ["a" * 10, "a" * 10, "a" * 5]
    words = " ".join(f"w{i}" for i in range(500))
    pieces = split_sentences(words + ".")
    assert all(len(p) <= 300 for p in pieces) and " ".join(pieces) == words + "."
