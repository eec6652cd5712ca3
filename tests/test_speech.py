"""/v1/audio/speech through the official openai SDK against a real `openarc serve` with the tiny SpeechT5-shaped
model (tests/test_demo_tts.py says how it speaks: 64 ms a byte, a chord per letter) next to the chat demo: every
response format decoded, voices and OpenAI's aliases, speed, chunked and SSE streaming piece by piece, bad input,
metrics, a worker SIGABRTed mid-synthesis, and the encoder process replaced after a crash.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request
import wave
from http.client import HTTPConnection, IncompleteRead

import numpy as np
import openai
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from conftest import http, model_entry, pid_alive, wait_until

MS_PER_BYTE = 64  # the demo model: 1024 samples at 16 kHz per byte of text, and one more for </s> per piece
RATE = 16000
TEXT = "Hello world. How are you?"  # two sentences: two pieces


@pytest.fixture(scope="module")
def app(demo_tts, demo_model, tmp_path_factory):
    from conftest import Appliance
    voices = {"deep": str(demo_tts / "voices" / "onyx.bin"), "bright": str(demo_tts / "voices" / "shimmer.bin")}
    config = {"models": [
        model_entry("speech", demo_tts, kind="tts"),
        model_entry("custom", demo_tts, kind="tts", voices=voices, default_voice="bright"),
        model_entry("chat", demo_model)]}
    appliance = Appliance(config, tmp_path_factory.mktemp("speech")).start()
    yield appliance
    appliance.stop()


def speak(app, text: str = TEXT, model: str = "speech", **kwargs) -> bytes:
    return app.client().audio.speech.create(model=model, input=text, voice=kwargs.pop("voice", "alloy"),
                                            **kwargs).content


def expected_seconds(*pieces: str) -> float:
    return sum(len(p.encode()) + 1 for p in pieces) * MS_PER_BYTE / 1000


def decode(data: bytes) -> tuple[np.ndarray, int]:
    """Samples (mono float) and rate of any container PyAV reads."""
    import av
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [f.to_ndarray().reshape(-1) for f in container.decode(stream)]  # mono: one plane
        return np.concatenate(frames).astype(np.float32), stream.rate


def pcm_samples(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<i2")


# --- formats ----------------------------------------------------------------------------------------------------

def test_wav_parses_and_its_length_follows_the_text(app):
    with wave.open(io.BytesIO(speak(app, response_format="wav"))) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        assert w.getnframes() / RATE == pytest.approx(expected_seconds("Hello world.", "How are you?"))
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert np.abs(samples).max() > 0.05 * 32767  # audible, not silence


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac"])
def test_compressed_formats_decode_to_about_the_same_length(app, fmt):
    samples, rate = decode(speak(app, response_format=fmt))
    # encoders pad a frame or two at either end
    assert samples.size / rate == pytest.approx(expected_seconds("Hello world.", "How are you?"), abs=0.15)
    assert np.abs(samples).max() > 0.05


def test_pcm_is_raw_16_bit_at_the_rate_the_header_gives(app):
    raw = app.client().audio.speech.with_raw_response.create(model="speech", input="Hi there", voice="alloy",
                                                             response_format="pcm")
    assert raw.headers["x-sample-rate"] == "16000" and raw.headers["content-type"] == "audio/pcm"
    assert pcm_samples(raw.content).size == (len("Hi there") + 1) * 1024


def test_same_text_same_audio_other_text_other_audio(app):
    first = speak(app, "hello world", response_format="pcm")
    assert speak(app, "hello world", response_format="pcm") == first
    assert speak(app, "hello wordl", response_format="pcm") != first  # the same length, other letters
    assert speak(app, "hello world", response_format="pcm", voice="onyx") != first


def test_voices_aliases_and_unknown_voices(app):
    custom = speak(app, "hi", model="custom", response_format="pcm", voice="deep")
    assert custom == speak(app, "hi", model="speech", response_format="pcm", voice="onyx")  # the same file
    # OpenAI's names the model lacks speak in its default voice, as does no voice at all
    bright = speak(app, "hi", model="speech", response_format="pcm", voice="shimmer")
    assert speak(app, "hi", model="custom", response_format="pcm", voice="alloy") == bright
    status, _, audio = post_speech(app, {"model": "custom", "input": "hi", "response_format": "pcm"})
    assert status == 200 and audio == bright
    with pytest.raises(openai.BadRequestError) as refused:
        speak(app, "hi", model="custom", voice="nobody")
    error = refused.value.body
    assert error["code"] == "unknown_voice" and error["param"] == "voice"
    assert "bright, deep" in error["message"]


def test_speed_stretches_without_changing_the_format(app):
    normal = pcm_samples(speak(app, "Hello there", response_format="pcm")).size
    assert pcm_samples(speak(app, "Hello there", response_format="pcm", speed=2.0)).size == pytest.approx(
        normal / 2, rel=0.05)
    assert pcm_samples(speak(app, "Hello there", response_format="pcm", speed=0.25)).size == pytest.approx(
        normal * 4, rel=0.05)
    samples, rate = decode(speak(app, "Hello there", response_format="mp3", speed=4.0))
    assert samples.size / rate == pytest.approx(normal / RATE / 4, abs=0.1)


def test_instructions_are_accepted_and_change_nothing(app):
    assert speak(app, "hi", response_format="pcm", instructions="Speak like a pirate.") == \
        speak(app, "hi", response_format="pcm")


# --- streaming -------------------------------------------------------------------------------------------------------

SENTENCES = ["First sentence here.", "Second one.", "And a third.", "Fourth and last."]


def test_streamed_audio_is_the_whole_file_in_pieces(app):
    whole = speak(app, " ".join(SENTENCES), response_format="pcm")
    with app.client().audio.speech.with_streaming_response.create(
            model="speech", input=" ".join(SENTENCES), voice="alloy", response_format="pcm",
            extra_body={"stream_format": "audio"}) as response:
        assert response.headers["transfer-encoding"] == "chunked"
        streamed = b"".join(response.iter_bytes())
    assert streamed == whole
    with app.client().audio.speech.with_streaming_response.create(
            model="speech", input=" ".join(SENTENCES), voice="alloy", response_format="wav",
            extra_body={"stream_format": "audio"}) as response:
        data = response.read()
    assert data[44:] == whole  # a streamed WAV: a header with unknown sizes, then the samples
    with wave.open(io.BytesIO(data)) as w:
        assert w.getframerate() == RATE


def test_sse_events_carry_the_audio_then_done(app):
    events = sse_events(app, {"model": "speech", "input": " ".join(SENTENCES), "voice": "alloy",
                              "response_format": "pcm", "stream_format": "sse"})
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= len(SENTENCES) and events[-1]["type"] == "speech.audio.done"
    assert events[-1]["usage"]["input_tokens"] == len(" ".join(SENTENCES))
    audio = b"".join(base64.b64decode(e["audio"]) for e in deltas)
    assert audio == speak(app, " ".join(SENTENCES), response_format="pcm")


def test_the_first_piece_arrives_before_the_rest_is_spoken(appliance_factory, demo_tts):
    """Each piece waits STEP s in the worker: the first chunk comes after about one STEP, the whole after four."""
    step = 0.5
    app = appliance_factory({"models": [model_entry("speech", demo_tts, kind="tts")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": str(step)})
    started = time.monotonic()
    arrivals = []
    with app.client().audio.speech.with_streaming_response.create(
            model="speech", input=" ".join(SENTENCES), voice="alloy", response_format="mp3",
            extra_body={"stream_format": "audio"}) as response:
        for chunk in response.iter_bytes():
            arrivals.append(time.monotonic() - started)
    assert arrivals[-1] >= len(SENTENCES) * step
    assert arrivals[0] < arrivals[-1] - 2 * step  # the first audio came at least two pieces before the end
    assert "openarc_time_to_first_audio_seconds_count{model=\"speech\"} 1.0" in app.metrics()


# --- bad input ---------------------------------------------------------------------------------------------------------

BAD = [
    ({"input": ""}, "input"),
    ({"input": "   "}, "input"),
    ({"input": "x" * 4097}, "input"),
    ({"input": 42}, "input"),
    ({"response_format": "ogg"}, "response_format"),
    ({"speed": 0.1}, "speed"),
    ({"speed": 4.5}, "speed"),
    ({"speed": "fast"}, "speed"),
    ({"voice": 7}, "voice"),
    ({"voice": "nobody"}, "voice"),
    ({"stream_format": "chunks"}, "stream_format"),
    ({"instructions": 3}, "instructions"),
]


def test_bad_input_is_a_400_naming_the_parameter_and_the_worker_lives_on(app):
    pid = app.worker_pid("speech")
    for change, param in BAD:
        body = {"model": "speech", "input": "hello", "voice": "alloy", **change}
        status, _, reply = http("POST", app.base + "/v1/audio/speech", body)
        assert status == 400 and reply["error"]["param"] == param, (change, reply)
    status, _, reply = http("POST", app.base + "/v1/audio/speech", {"model": "chat", "input": "hello"})
    assert status == 400 and reply["error"]["code"] == "wrong_model_kind"
    status, _, reply = http("POST", app.base + "/v1/audio/speech", {"model": "nope", "input": "hello"})
    assert status == 404
    status, _, reply = http("POST", app.base + "/v1/audio/speech", raw=b"{not json")
    assert status == 400
    assert app.worker_pid("speech") == pid and app.model_status("speech")["crashes"] == 0
    assert speak(app, "x" * 4096, response_format="pcm")  # the limit itself is fine


SPEECH_FIELDS = {
    "model": st.sampled_from(["speech", "custom", "chat", "nope", ""]) | st.integers(),
    "input": st.text(st.characters(), max_size=40) | st.integers() | st.none() | st.lists(st.text(max_size=3)),
    "voice": st.sampled_from(["alloy", "deep", "cedar", "nobody", ""]) | st.none() | st.integers()
             | st.fixed_dictionaries({"id": st.text(max_size=8)}),
    "response_format": st.sampled_from([*("mp3", "opus", "aac", "flac", "wav", "pcm"), "ogg", ""]) | st.integers(),
    "speed": st.floats(allow_nan=True) | st.integers(-5, 10) | st.text(max_size=3) | st.booleans(),
    "stream_format": st.sampled_from(["audio", "sse", "chunks"]) | st.none() | st.integers(),
    "instructions": st.text(max_size=10) | st.integers() | st.none(),
}


@settings(max_examples=60, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(body=st.fixed_dictionaries({}, optional=SPEECH_FIELDS))
def test_generated_bodies_never_get_a_5xx_or_hurt_the_worker(app, body):
    pid = app.worker_pid("speech")
    status, headers, reply = post_speech(app, body)
    assert status < 500, (body, reply)
    if status >= 400:
        assert set(reply) == {"error"} and reply["error"]["message"], reply
    assert app.worker_pid("speech") == pid


def test_metrics_count_audio_seconds_characters_and_first_audio(app):
    def value(name: str, **labels) -> float:
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        match = re.search(rf"^{name}\{{{selector}\}} (\S+)$", app.metrics(), re.M)
        return float(match.group(1)) if match else 0.0

    seconds = value("openarc_speech_audio_seconds_total", model="speech")
    characters = value("openarc_speech_characters_total", model="speech")
    first_audio = value("openarc_time_to_first_audio_seconds_count", model="speech")
    speak(app, TEXT, response_format="wav")
    assert value("openarc_speech_audio_seconds_total", model="speech") - seconds == pytest.approx(
        expected_seconds("Hello world.", "How are you?"))
    # the pieces' characters: the space between the sentences is not spoken
    assert value("openarc_speech_characters_total", model="speech") - characters == len(TEXT) - 1
    assert value("openarc_time_to_first_audio_seconds_count", model="speech") == first_audio + 1
    assert value("openarc_requests_total", model="speech", endpoint="audio/speech", status="200", key="none",
                 priority="interactive") >= 1


# --- failures ------------------------------------------------------------------------------------------------------

def test_worker_abort_mid_synthesis_is_a_fast_5xx_and_the_queued_request_is_served(appliance_factory, demo_tts,
                                                                                      demo_model):
    """The request being synthesised gets its 503 within a second; the one queued behind it gets a 503 with
    Retry-After too (docs/failures.md), which the SDK retries: its client gets the audio from the new worker."""
    app = appliance_factory({"models": [model_entry("speech", demo_tts, kind="tts"),
                                        model_entry("chat", demo_model)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "1.0"})
    pid = app.worker_pid("speech")
    results: dict[str, object] = {}

    def post() -> None:
        results["aborted"] = post_speech(app, {"model": "speech", "input": " ".join(SENTENCES), "voice": "alloy",
                                               "response_format": "wav"})

    def queued() -> None:
        client = app.client()
        results["queued"] = client.with_options(max_retries=2).audio.speech.create(  # the SDK's default retries
            model="speech", input="Queued behind it.", voice="alloy", response_format="wav").content

    first = threading.Thread(target=post)
    first.start()
    wait_until(lambda: app.model_status("speech")["requests_running"], 30, "synthesising")
    second = threading.Thread(target=queued)
    second.start()
    # both are with the worker now (the front dispatched them): a crash fails both, whatever the worker had read
    wait_until(lambda: app.model_status("speech")["requests_running"] == 2, 30, "the second request dispatched")
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    first.join(30)
    assert time.monotonic() - aborted < 1.0
    status, headers, body = results["aborted"]
    assert status == 503 and body["error"]["code"] == "worker_crash" and "Retry-After" in headers
    second.join(60)
    with wave.open(io.BytesIO(results["queued"])) as w:  # served by the restarted worker
        assert w.getnframes() / RATE == pytest.approx(expected_seconds("Queued behind it."))
    new = app.wait_model("speech", "ready", new_pid_not=pid)
    assert new["crashes"] == 1 and "SIGABRT" in new["last_error"] and not pid_alive(pid)
    reply = app.client().chat.completions.create(model="chat", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2)
    assert reply.choices[0].finish_reason == "length"


def test_worker_abort_mid_stream_ends_it_with_an_error(appliance_factory, demo_tts):
    app = appliance_factory({"models": [model_entry("speech", demo_tts, kind="tts")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "1.0"})
    pid = app.worker_pid("speech")
    connection = HTTPConnection("127.0.0.1", app.port, timeout=30)
    connection.request("POST", "/v1/audio/speech", json.dumps(
        {"model": "speech", "input": " ".join(SENTENCES), "voice": "alloy", "stream_format": "sse",
         "response_format": "pcm"}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # the first piece
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    rest = response.read().decode()
    assert time.monotonic() - aborted < 1.0
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "worker_crash"
    pid = app.wait_model("speech", "ready", new_pid_not=pid)["pid"]
    # chunked audio: the status went out with the first piece, so the body is cut short, never complete-looking
    connection = HTTPConnection("127.0.0.1", app.port, timeout=30)
    connection.request("POST", "/v1/audio/speech", json.dumps(
        {"model": "speech", "input": " ".join(SENTENCES), "voice": "alloy", "stream_format": "audio",
         "response_format": "pcm"}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.read1(1 << 16)  # the first piece
    os.kill(pid, signal.SIGABRT)
    aborted = time.monotonic()
    with pytest.raises(IncompleteRead):
        response.read()
    assert time.monotonic() - aborted < 1.0
    app.wait_model("speech", "ready", new_pid_not=pid)
    assert speak(app, "again", response_format="pcm")


def test_a_full_queue_never_cuts_an_admitted_speech_short(appliance_factory, demo_tts):
    """One place on the model (max_running 1, max_queue 0) and a client asking for it again and again: a streamed
    speech, once admitted, holds the place of its next sentence while each one is spoken, so every sentence is
    spoken and the stream ends done; the other client is told 429 meanwhile and is served once the speech ends."""
    app = appliance_factory({"models": [model_entry("speech", demo_tts, kind="tts", max_running=1, max_queue=0)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.3"})
    body = {"model": "speech", "input": " ".join(SENTENCES), "voice": "alloy", "response_format": "pcm"}
    done = threading.Event()
    statuses: list[int] = []

    def other_client() -> None:
        while not done.is_set():
            statuses.append(post_speech(app, {**body, "input": "Hi."})[0])

    hammer = threading.Thread(target=other_client)
    connection = HTTPConnection("127.0.0.1", app.port, timeout=60)
    connection.request("POST", "/v1/audio/speech", json.dumps({**body, "stream_format": "sse"}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.readline().startswith(b"data: ")  # admitted, first sentence spoken
    hammer.start()
    try:
        rest = response.read().decode()
    finally:
        done.set()
        hammer.join(60)
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]  # no 429 (or any error) halfway
    assert 429 in statuses and set(statuses) <= {200, 429}, statuses
    assert post_speech(app, {**body, "input": "Hi."})[0] == 200  # the held places were all given back
    assert app.model_status("speech")["requests_waiting"] == 0


def open_sse_speech(app, sentences: list[str]):
    """A streamed (SSE) speech of `sentences`, once its first audio delta has arrived: (response, first line)."""
    connection = HTTPConnection("127.0.0.1", app.port, timeout=60)
    connection.request("POST", "/v1/audio/speech", json.dumps(
        {"model": "speech", "input": " ".join(sentences), "voice": "alloy", "stream_format": "sse",
         "response_format": "pcm"}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    return response


def unload_in_background(app, model: str) -> tuple[threading.Thread, dict]:
    """POST the model's unload from a thread; the result dict gets its status and how long the drain took."""
    result: dict = {}

    def unload() -> None:
        started = time.monotonic()
        result["status"] = http("POST", f"{app.base}/openarc/models/{model}/unload", timeout=60)[0]
        result["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=unload)
    thread.start()
    return thread, result


def spool_files(root) -> list[str]:
    return [str(p) for p in root.glob("openarc-speech-*/*")]


def test_a_speech_playing_while_its_model_unloads_is_finished_and_the_drain_ends_with_it(appliance_factory, demo_tts,
                                                                                           tmp_path):
    """The drain exists to let admitted work end: a streamed speech admitted before the unload keeps the place of
    each next sentence while the model drains, every sentence is spoken, and the drain ends as the speech ends
    (not after drain_timeout_s), leaving no spool file and no place held."""
    spool = tmp_path / "tmp"
    spool.mkdir()
    app = appliance_factory({"server": {"drain_timeout_s": 30},
                             "models": [model_entry("speech", demo_tts, kind="tts")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.05", "TMPDIR": str(spool)})
    sentences = [f"Sentence number {i}." for i in range(12)]
    response = open_sse_speech(app, sentences)
    for _ in range(3):  # three sentences spoken
        assert response.readline().startswith(b"data: ")
        assert response.readline() == b"\n"
    unloading, unloaded = unload_in_background(app, "speech")
    rest = response.read().decode()
    ended = time.monotonic()
    unloading.join(60)
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: ")]
    assert events[-1]["type"] == "speech.audio.done", events[-1]  # every sentence, no error halfway
    assert unloaded["status"] == 200 and time.monotonic() - ended < 10, unloaded  # not the 30 s drain timeout
    assert app.model_status("speech")["state"] == "unloaded"
    assert spool_files(spool) == []
    assert "not held" not in app.logs()
    # the gauges say what status says: nothing running or waiting (they kept the speech's figures from before the
    # unload, its sentence running and its next place held: tests/test_residency_model.py found it)
    scrape = app.metrics()
    for gauge in ("openarc_requests_running", "openarc_requests_waiting"):
        assert f'{gauge}{{model="speech"}} 0.0' in scrape.splitlines(), gauge


def test_a_speech_longer_than_the_drain_is_told_its_model_unloads(appliance_factory, demo_tts, tmp_path):
    """A drain that times out ends the speech with an error naming the model's unload (the server is not shutting
    down), on time, with its spool files removed; the model then loads again for the next speech."""
    spool = tmp_path / "tmp"
    spool.mkdir()
    app = appliance_factory({"server": {"drain_timeout_s": 1.0},
                             "models": [model_entry("speech", demo_tts, kind="tts", load="on_demand")]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.3", "TMPDIR": str(spool)})
    response = open_sse_speech(app, [f"Sentence number {i}." for i in range(60)])
    assert response.readline().startswith(b"data: ")
    unloading, unloaded = unload_in_background(app, "speech")
    rest = response.read().decode()
    unloading.join(60)
    events = [json.loads(line[6:]) for line in rest.splitlines() if line.startswith("data: ")]
    error = events[-1]
    assert error["type"] == "error" and "speech is unloading" in error["error"]["message"], error
    assert unloaded["status"] == 200 and unloaded["seconds"] < 10, unloaded
    wait_until(lambda: spool_files(spool) == [], 10, "the spool emptied")
    assert "not held" not in app.logs()
    assert speak(app, "again", response_format="pcm")  # loads again on demand


def test_a_stalled_worker_mid_synthesis_is_a_504_within_the_stall_bound(appliance_factory, demo_tts):
    stall = 1.0
    app = appliance_factory({"models": [model_entry("speech", demo_tts, kind="tts", stall_timeout_s=stall)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "0.3"})
    pid = app.worker_pid("speech")
    result: list = []
    thread = threading.Thread(target=lambda: result.append(post_speech(app, {
        "model": "speech", "input": " ".join(SENTENCES), "voice": "alloy", "response_format": "wav"})))
    thread.start()
    wait_until(lambda: app.model_status("speech")["requests_running"], 30, "synthesising")
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    thread.join(30)
    assert time.monotonic() - stopped < stall + 1.0
    status, _, body = result[0]
    assert status == 504 and body["error"]["code"] == "stall"
    app.wait_model("speech", "ready", new_pid_not=pid)
    assert not pid_alive(pid)
    assert speak(app, "again", response_format="pcm")


def test_a_dead_encoder_is_replaced(app):
    encoder = encoder_pid(app)
    os.kill(encoder, signal.SIGKILL)
    samples, _ = decode(speak(app, response_format="flac"))
    assert samples.size > 0 and encoder_pid(app) != encoder


# --- helpers -------------------------------------------------------------------------------------------------------

def post_speech(app, body: dict) -> tuple[int, dict, bytes | dict]:
    """(status, headers, the audio bytes, or the JSON error) of one POST by hand."""
    request = urllib.request.Request(app.base + "/v1/audio/speech", data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), json.loads(exc.read())


def sse_events(app, body: dict) -> list[dict]:
    status, headers, text = http("POST", app.base + "/v1/audio/speech", body)
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: ")]


def encoder_pid(app) -> int:
    speak(app, "hi", response_format="mp3")  # make sure the encoder has started
    return app.helper_pid("appliance.front.speech_encoder")


def test_quick_tts_bench_reports_every_figure(tmp_path):
    """`python -m bench.tts --quick`: server against in-process, every figure there (never a timing)."""
    from conftest import quick_side_bench
    figures = quick_side_bench("tts", tmp_path)
    assert len(figures) == 7
    assert all(f["value"] > 0 for name, f in figures.items() if not name.endswith("added"))
    assert all(f["verdict"] == "info" for f in figures.values())


def test_check_config_names_a_voice_file_it_cannot_read(demo_tts, tmp_path):
    import subprocess
    import sys
    config = tmp_path / "openarc.yaml"
    config.write_text(json.dumps({"models": [model_entry("speech", demo_tts, kind="tts",
                                                         voices={"a": "voices/alloy.bin", "gone": "voices/gone.bin"})]}))
    done = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(config)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"models[0].voices.gone: expected a voice file this user can read; cannot read " \
           f"'{demo_tts}/voices/gone.bin' (model 'speech')" in done.stderr + done.stdout


def test_a_client_hanging_up_mid_encode_leaves_the_encoder_to_the_others(app):
    """The whole of a long text is encoded at the end; a client that hangs up then must not take the encoder process
    (and every other response's session in it) down with its request."""
    encoder = encoder_pid(app)

    def busy_ticks() -> int:
        fields = open(f"/proc/{encoder}/stat").read().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime

    connection = HTTPConnection("127.0.0.1", app.port, timeout=60)
    text = " ".join(["The quick brown fox jumps over the lazy dog again and again."] * 60)[:4096]
    connection.request("POST", "/v1/audio/speech", json.dumps(
        {"model": "speech", "input": text, "voice": "alloy", "response_format": "mp3"}),
        {"Content-Type": "application/json"})
    idle = busy_ticks()
    wait_until(lambda: busy_ticks() > idle + 5, 60, "the encoder at work on the long text")
    connection.close()  # the client hangs up while its audio is being encoded
    assert speak(app, "Still here.", response_format="mp3") and encoder_pid(app) == encoder
