"""/v1/audio/transcriptions and /v1/audio/translations through the official openai SDK against a real
`openarc serve` with the tiny Whisper-shaped model (tests/test_demo_whisper.py says what it hears) next to the
chat demo: every container format and response format, streaming, long audio, limits, bad uploads, wrong kinds,
metrics, and a worker SIGABRTed mid-request while the chat model keeps answering.
"""

from __future__ import annotations

import os
import random
import re
import signal
import threading
import time
from http.client import HTTPConnection

import numpy as np
import openai
import pytest

from audio_samples import COMPRESSED, TRANSCRIPT, encoded, multipart, tone, wav_bytes
from conftest import Appliance, http, model_entry, pid_alive, quick_side_bench, wait_until

# the labels of a request with no API key configured (docs/sharing.md), which the exact-match helper below needs
NO_KEY = {"key": "none", "priority": "interactive"}
HANG_BOUND_S = 3.0  # a client waiting longer than this after a fault is a hang, not a slow error
LIMITED = {"max_upload_bytes": 200_000, "max_audio_seconds": 10}


@pytest.fixture(scope="module")
def app(demo_whisper, demo_model, tmp_path_factory):
    config = {"models": [
        model_entry("whisper", demo_whisper, kind="transcription", word_timestamps=True),
        model_entry("whisper-limited", demo_whisper, kind="transcription", **LIMITED),
        model_entry("chat", demo_model)]}
    appliance = Appliance(config, tmp_path_factory.mktemp("audio")).start()
    yield appliance
    appliance.stop()


@pytest.fixture(scope="module")
def files() -> dict[str, bytes]:
    """Two seconds of sound in every format the route takes."""
    return {"wav": wav_bytes(tone(2.0)), **{name: encoded(name) for name in COMPRESSED}}


def transcribe(app, data: bytes, name: str = "audio.wav", model: str = "whisper", **kwargs):
    return app.client().audio.transcriptions.create(model=model, file=(name, data), **kwargs)


# --- formats -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("container", ["wav", *COMPRESSED])
def test_every_container_format_transcribes(app, files, container):
    assert transcribe(app, files[container], f"audio.{container}").text == TRANSCRIPT


@pytest.mark.parametrize("container", ["wav", "mp3"])
def test_every_response_format(app, files, container):
    data, name = files[container], f"speech.{container}"
    assert transcribe(app, data, name, response_format="json").text == TRANSCRIPT
    assert transcribe(app, data, name, response_format="text").strip() == TRANSCRIPT
    srt = transcribe(app, data, name, response_format="srt")
    assert srt.strip() == f"1\n00:00:00,000 --> 00:00:01,000\n{TRANSCRIPT}"
    vtt = transcribe(app, data, name, response_format="vtt")
    assert vtt.strip() == f"WEBVTT\n\n00:00:00.000 --> 00:00:01.000\n{TRANSCRIPT}"
    verbose = transcribe(app, data, name, response_format="verbose_json")
    assert (verbose.text, verbose.language, verbose.task) == (TRANSCRIPT, "english", "transcribe")
    assert verbose.duration == pytest.approx(2.0, abs=0.05)
    assert [(s.id, s.start, s.end, s.text) for s in verbose.segments] == [(0, 0.0, 1.0, " " + TRANSCRIPT)]
    assert verbose.usage.seconds == 2


def test_silence_is_an_empty_transcript(app):
    """The model transcribes any sound as its sentence and silence as nothing: the decoded samples reached it."""
    assert transcribe(app, wav_bytes(np.zeros(32000, np.float32))).text == ""
    assert transcribe(app, encoded("mp3", silent=True), "silence.mp3").text == ""
    assert transcribe(app, wav_bytes(np.zeros(32000, np.float32)), response_format="srt").strip() == ""


def test_word_timestamps_and_long_audio(app, files):
    verbose = transcribe(app, files["flac"], "a.flac", response_format="verbose_json",
                         timestamp_granularities=["word", "segment"])
    assert "".join(w.word for w in verbose.words) == " " + TRANSCRIPT
    assert all(a.start <= a.end <= b.start + 1e-3 for a, b in zip(verbose.words, verbose.words[1:]))
    long = transcribe(app, encoded("ogg", seconds=45.0), "long.ogg", response_format="verbose_json")
    assert [(s.start, s.end) for s in long.segments] == [(0.0, 1.0), (30.0, 31.0)]
    assert long.text == f"{TRANSCRIPT} {TRANSCRIPT}" and long.duration == pytest.approx(45.0, abs=0.05)


def test_word_timestamps_need_the_model_configured_for_them(app, files):
    with pytest.raises(openai.BadRequestError) as info:
        transcribe(app, files["wav"], model="whisper-limited", response_format="verbose_json",
                   timestamp_granularities=["word"])
    assert "word_timestamps: true" in info.value.body["message"]


def test_streaming_deltas_then_done(app, files):
    """(Deltas that queue up behind the client arrive merged; the slow-steps test below sees them one by one.)"""
    events = list(transcribe(app, files["webm"], "a.webm", stream=True))
    deltas = [e.delta for e in events if e.type == "transcript.text.delta"]
    assert deltas and "".join(deltas).strip() == TRANSCRIPT
    assert events[-1].type == "transcript.text.done" and events[-1].text == TRANSCRIPT
    assert events[-1].usage.seconds == 2


def test_translation_language_and_prompt(app, files):
    translation = app.client().audio.translations.create(model="whisper", file=("a.m4a", files["m4a"]))
    assert translation.text == TRANSCRIPT
    verbose = transcribe(app, files["wav"], language="de", prompt="hello", temperature=0.2,
                         response_format="verbose_json")
    assert verbose.language == "german" and verbose.segments[0].temperature == 0.2
    with pytest.raises(openai.BadRequestError) as info:
        transcribe(app, files["wav"], language="klingon")
    assert info.value.body["param"] == "language"


# --- limits and bad input ------------------------------------------------------------------------------------------

def test_oversize_uploads_and_audio_are_413(app, files):
    big = wav_bytes(tone(8.0))  # 256 kB: over whisper-limited's max_upload_bytes
    with pytest.raises(openai.APIStatusError) as info:
        transcribe(app, big, model="whisper-limited")
    assert info.value.status_code == 413 and info.value.body["code"] == "upload_too_large"
    long = encoded("mp3", seconds=12.0)  # small file, but 12 s > max_audio_seconds=10
    assert len(long) < LIMITED["max_upload_bytes"]
    with pytest.raises(openai.APIStatusError) as info:
        transcribe(app, long, "long.mp3", model="whisper-limited")
    assert info.value.status_code == 413 and info.value.body["code"] == "audio_too_long"
    assert transcribe(app, files["mp3"], "ok.mp3", model="whisper-limited").text == TRANSCRIPT


@pytest.mark.parametrize("data, code", [
    (b"", "audio_empty"),
    (b"this is not audio at all", "audio_undecodable"),
    (b"RIFF\x24\x00\x00\x00WAVEfmt " + bytes(40), "audio_undecodable"),
    # seeded noise: every xdist worker must collect the same test ids
    (b"ID3\x04\x00\x00\x00\x00\x00\x00" + random.Random(1).randbytes(5000), "audio_undecodable"),
    (b"OggS" + random.Random(2).randbytes(3000), "audio_undecodable"),
], ids=["empty", "text", "wav_header_only", "id3_then_noise", "ogg_then_noise"])
def test_undecodable_and_empty_uploads_are_400(app, data, code):
    with pytest.raises(openai.BadRequestError) as info:
        transcribe(app, data)
    assert info.value.body["code"] == code and info.value.body["type"] == "invalid_request_error"


def test_malformed_forms_are_400(app, files):
    status, _, body = http("POST", app.base + "/v1/audio/transcriptions", {"model": "whisper"})
    assert status == 400 and "multipart/form-data" in body["error"]["message"]
    for fields in ({"file": files["wav"]}, {"model": "whisper"},
                   {"model": "whisper", "file": files["wav"], "response_format": "docx"},
                   {"model": "whisper", "file": files["wav"], "temperature": "hot"},
                   # digits int() and float() read that no JSON number holds: 0.5 was taken from each
                   {"model": "whisper", "file": files["wav"], "temperature": "\u0660.\u0665"},
                   {"model": "whisper", "file": files["wav"], "temperature": "\uff10.\uff15"},
                   {"model": "whisper", "file": files["wav"], "temperature": "0_5"}):
        status, body = post_form(app, fields)
        assert status == 400, (fields.keys(), body)


def test_wrong_kind_is_400_naming_both(app, files):
    with pytest.raises(openai.BadRequestError) as info:
        transcribe(app, files["wav"], model="chat")
    assert info.value.body["code"] == "wrong_model_kind"
    assert "'chat' is of kind llm" in info.value.body["message"] and "transcription" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        app.client().chat.completions.create(model="whisper", messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["code"] == "wrong_model_kind"
    kinds = {m.id: m.kind for m in app.client().models.list().data}
    assert kinds == {"whisper": "transcription", "whisper-limited": "transcription", "chat": "llm"}


def test_without_a_transcription_model_the_route_names_the_kinds(appliance_factory, demo_model, files):
    app = appliance_factory({"models": [model_entry("chat", demo_model)]})
    with pytest.raises(openai.BadRequestError) as info:
        transcribe(app, files["mp3"], "a.mp3", model="chat")
    assert info.value.body["code"] == "wrong_model_kind"
    with pytest.raises(openai.NotFoundError):
        transcribe(app, files["mp3"], "a.mp3", model="whisper")


def test_metrics_count_audio_seconds_and_requests(app, files):
    def value(name: str, **labels) -> float:
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as the exposition orders them
        match = re.search(rf"^{name}\{{{selector}\}} (\S+)$", app.metrics(), re.M)
        return float(match.group(1)) if match else 0.0

    before = value("openarc_audio_seconds_total", model="whisper")
    ok = value("openarc_requests_total", model="whisper", endpoint="audio/transcriptions", status="200", **NO_KEY)
    transcribe(app, files["wav"])
    app.client().audio.translations.create(model="whisper", file=("a.wav", files["wav"]))
    with pytest.raises(openai.BadRequestError):
        transcribe(app, b"garbage")
    assert value("openarc_audio_seconds_total", model="whisper") - before == pytest.approx(4.0)
    assert value("openarc_requests_total", model="whisper", endpoint="audio/transcriptions", status="200",
                 **NO_KEY) == ok + 1
    assert value("openarc_requests_total", model="whisper", endpoint="audio/translations", status="200", **NO_KEY) >= 1
    assert value("openarc_request_errors_total", model="whisper", kind="invalid_request",
                 endpoint="audio/transcriptions") >= 1


# --- failures ------------------------------------------------------------------------------------------------------

def test_worker_abort_mid_transcription_is_fast_and_chat_keeps_answering(appliance_factory, demo_whisper, demo_model,
                                                                          files):
    # Each streamed token of the transcript waits 0.4 s: the abort lands while the request is generating.
    app = appliance_factory({"models": [model_entry("whisper", demo_whisper, kind="transcription"),
                                        model_entry("chat", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.4"})
    pid = app.worker_pid("whisper")
    arrivals = [time.monotonic() for e in transcribe(app, files["wav"], stream=True) if e.type.endswith("delta")]
    assert len(arrivals) == 7 and arrivals[-1] - arrivals[0] > 2.0  # streamed as generated, token by token
    result: list = []
    thread = threading.Thread(target=lambda: result.append(post_form(app, {"model": "whisper", "file": files["wav"]})))
    thread.start()
    wait_until(lambda: app.model_status("whisper")["requests_running"], 30, "transcribing")
    time.sleep(0.5)
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    thread.join(30)
    assert time.monotonic() - aborted < HANG_BOUND_S
    status, body = result[0]
    assert status == 503 and body["error"]["code"] == "worker_crash"
    reply = app.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    assert reply.choices[0].finish_reason == "length"
    new = app.wait_model("whisper", "ready", new_pid_not=pid)
    assert new["crashes"] == 1 and "SIGABRT" in new["last_error"] and not pid_alive(pid)
    assert transcribe(app, files["wav"]).text == TRANSCRIPT


def test_a_client_hanging_up_stops_its_transcription(appliance_factory, demo_whisper, files):
    """Each of the 7 transcript tokens waits STEP s: a caller who hangs up after the first delta must free the worker
    at the next token, so the request after it finishes in about its own time, not after the abandoned one's rest."""
    step = 1.0
    app = appliance_factory({"models": [model_entry("whisper", demo_whisper, kind="transcription")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": str(step)})
    content_type, body = multipart({"model": "whisper", "file": files["wav"], "stream": "true"})
    connection = HTTPConnection("127.0.0.1", app.port, timeout=30)
    connection.request("POST", "/v1/audio/transcriptions", body, {"Content-Type": content_type})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the first delta: generating
    connection.close()
    hung_up = time.monotonic()
    assert transcribe(app, files["wav"]).text == TRANSCRIPT
    # Cancelled: at most one step of the old request, then the 7 of this one. Not cancelled: 6 more steps first.
    assert time.monotonic() - hung_up < (1 + 7 + 3) * step


def test_a_dead_decoder_is_replaced(app, files):
    """The decoder process is the front's child; killed between uploads, the next upload gets a new one."""
    decoder = decoder_pid(app)
    os.kill(decoder, signal.SIGKILL)
    assert transcribe(app, files["ogg"], "a.ogg").text == TRANSCRIPT
    assert decoder_pid(app) != decoder


# --- helpers -------------------------------------------------------------------------------------------------------

def post_form(app, fields: dict, path: str = "/v1/audio/transcriptions") -> tuple[int, dict]:
    """A multipart POST by hand (the SDK would refuse some of these forms before sending)."""
    status, _, body = http("POST", app.base + path, raw=multipart(fields)[1],
                           headers={"Content-Type": multipart(fields)[0]})
    return status, body


def decoder_pid(app) -> int:
    transcribe(app, wav_bytes(tone(0.5)))  # make sure the decoder has started
    return app.helper_pid("appliance.front.audio_decoder")


def test_quick_transcription_bench_reports_every_figure(tmp_path):
    """`python -m bench.transcription --quick`: server against in-process, every figure there (never a timing)."""
    figures = quick_side_bench("transcription", tmp_path)
    assert len(figures) == 8 and all(f["value"] > 0 for f in figures.values())
    judged = [f for f in figures.values() if f["target"]]
    assert len(judged) == 1 and judged[0]["target"] == ">= 95 %" and judged[0]["verdict"] in ("PASS", "MISS")
