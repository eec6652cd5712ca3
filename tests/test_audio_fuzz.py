"""Bad uploads, generated: random bytes behind each format's magic, mutated real files in every container, and
random multipart forms. None gets a 5xx, none crashes the Whisper worker or the decoder process, and the server
still transcribes.

Goes to a live appliance; example counts are bounded so the module runs in about a minute; shrinking is off
(every shrink step is another request).
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from appliance.front.audio_decoder import FORMATS
from audio_samples import COMPRESSED, TRANSCRIPT, encoded, multipart, tone, wav_bytes
from conftest import Appliance, http, model_entry

FUZZ = settings(max_examples=60, deadline=None, database=None, phases=(Phase.explicit, Phase.generate),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
ERROR_TYPES = {"invalid_request_error", "rate_limit_error", "server_error"}
MAGICS = [b"\x00" * offset + magic for magic, offset, _ in FORMATS] + [b"\xff\xfb", b""]


@pytest.fixture(scope="module")
def app(demo_whisper, tmp_path_factory):
    config = {"models": [model_entry("whisper", demo_whisper, kind="transcription", max_upload_bytes=1 << 20,
                                     max_audio_seconds=60)]}
    appliance = Appliance(config, tmp_path_factory.mktemp("audio-fuzz")).start()
    yield appliance
    assert transcribes(appliance), "the server no longer transcribes after the fuzzing"
    status = appliance.model_status("whisper")
    assert status["crashes"] == 0 and status["restarts"] == 0, status
    assert "audio decoder process" not in appliance.logs(), "the decoder process died on an upload"
    appliance.stop()


@pytest.fixture(scope="module")
def real_files() -> list[bytes]:
    return [wav_bytes(tone(1.0)), *(encoded(name, seconds=1.0) for name in COMPRESSED)]


def transcribes(app) -> bool:
    status, body = post(app, {"model": "whisper", "file": wav_bytes(tone(1.0))})
    return status == 200 and body["text"] == TRANSCRIPT


def post(app, fields: dict) -> tuple[int, dict | str]:
    content_type, body = multipart(fields)
    status, _, reply = http("POST", app.base + "/v1/audio/transcriptions", raw=body,
                            headers={"Content-Type": content_type}, timeout=60)
    return status, reply


def assert_clean(status: int, body) -> None:
    assert status < 500, body
    if status != 200:
        assert isinstance(body, dict) and body["error"]["type"] in ERROR_TYPES and "Traceback" not in str(body)


@FUZZ
@given(magic=st.sampled_from(MAGICS), tail=st.binary(max_size=4096))
def test_random_bytes_behind_a_format_magic(app, magic, tail):
    status, body = post(app, {"model": "whisper", "file": magic + tail})
    assert_clean(status, body)
    assert status in (400, 413) or body["text"] in ("", TRANSCRIPT)


@FUZZ
@given(data=st.data())
def test_mutated_real_files(app, real_files, data):
    original = data.draw(st.sampled_from(real_files))
    mutated = bytearray(original)
    for _ in range(data.draw(st.integers(1, 8))):
        at = data.draw(st.integers(0, len(mutated) - 1))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip":
            mutated[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del mutated[at:at + data.draw(st.integers(1, 2000))]
        else:
            mutated[at:at] = data.draw(st.binary(min_size=1, max_size=64))
        if not mutated:
            mutated = bytearray(b"\x00")
    status, body = post(app, {"model": "whisper", "file": bytes(mutated),
                              "response_format": data.draw(st.sampled_from(["json", "verbose_json", "srt"]))})
    assert_clean(status, body)


FIELD_NAMES = st.sampled_from(["model", "file", "language", "prompt", "response_format", "temperature", "stream",
                               "timestamp_granularities[]", "timestamp_granularities"]) | st.text(max_size=8)
FIELD_VALUES = st.text(max_size=16) | st.binary(max_size=64) | st.sampled_from(
    ["whisper", "json", "text", "srt", "vtt", "verbose_json", "word", "segment", "true", "en", "-1", "nan", "2"])


@FUZZ
@given(fields=st.dictionaries(FIELD_NAMES, FIELD_VALUES, max_size=6), with_file=st.booleans())
def test_random_forms(app, fields, with_file):
    if with_file:
        fields["file"] = wav_bytes(tone(0.5))
    status, body = post(app, fields)
    assert_clean(status, body)


@FUZZ
@given(raw=st.binary(max_size=2048), content_type=st.sampled_from([
    "multipart/form-data; boundary=openarc-test-boundary", "multipart/form-data", "multipart/form-data; boundary=",
    "application/octet-stream", "audio/wav"]))
def test_raw_bodies(app, raw, content_type):
    status, _, body = http("POST", app.base + "/v1/audio/transcriptions", raw=raw,
                           headers={"Content-Type": content_type}, timeout=60)
    assert_clean(status, body)
    assert status >= 400
