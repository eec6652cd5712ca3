"""Audio uploads under load and faults of the front's own: many large uploads to a busy model are refused early
without piling up in the front's memory, and a fault of the decoder process (a full disk, a hung decoder) is a 5xx
that says so, not a 400 telling the client its file is bad."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from audio_samples import multipart, tone, wav_bytes
from conftest import http, model_entry

UPLOAD_MB = 20
CLIENTS = 50
# What the front may add to its peak RSS for 50 concurrent 20 MB uploads to a model that admits 2 requests (one
# running, one queued): the uploads it holds at once (appliance.front.api.audio.MAX_UPLOADS_IN_FLIGHT = 4, read
# into one buffer each) and the slack of the allocator. Holding all fifty would be 1,000 MB.
RSS_BOUND_MB = 250


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 1024


def test_many_large_uploads_to_a_busy_model_get_429_early_and_the_front_stays_small(appliance_factory, demo_whisper):
    app = appliance_factory({"models": [model_entry("whisper", demo_whisper, kind="transcription",
                                                    max_running=1, max_queue=1)]},
                            env={"OPENARC_DEBUG_STEP_DELAY_S": "1"})  # 1 s per 30 s window: 20 s per upload
    # 20 MB of 16 kHz mono WAV is about 10 minutes of audio; the model field first, as the OpenAI SDK sends it
    content_type, body = multipart({"model": "whisper", "file": wav_bytes(tone(UPLOAD_MB * 1e6 / 32000))})
    before = peak_rss_mb(app.proc.pid)

    def upload(_) -> tuple[int, float, dict]:
        started = time.monotonic()
        status, headers, reply = http("POST", app.base + "/v1/audio/transcriptions", raw=body,
                                      headers={"Content-Type": content_type}, timeout=300)
        return status, time.monotonic() - started, headers

    with ThreadPoolExecutor(CLIENTS) as pool:
        results = list(pool.map(upload, range(CLIENTS)))
    growth = peak_rss_mb(app.proc.pid) - before
    statuses = sorted(status for status, _, _ in results)
    refused = [(waited, headers) for status, waited, headers in results if status == 429]
    print(f"{statuses.count(200)} transcribed, {len(refused)} refused with 429; front peak RSS +{growth:.0f} MB; "
          f"slowest 429 after {max(w for w, _ in refused):.1f} s")
    assert set(statuses) <= {200, 429} and statuses.count(200) >= 2
    assert len(refused) >= CLIENTS - 10
    assert all(headers.get("Retry-After") for _, headers in refused)
    # Early: a refused upload is not read, decoded and queued first. One transcription takes 20 s here, so a median
    # refusal well before that cannot have waited for one; the bound leaves room for 50 clients pushing 1 GB through
    # loopback on two shared cores (3-5 s seen under the parallel suite).
    assert sorted(w for w, _ in refused)[len(refused) // 2] < 10
    assert growth < RSS_BOUND_MB, f"the front's peak RSS grew by {growth:.0f} MB"


# --- faults of the decoder process ------------------------------------------------------------------------------

def decode(data: bytes, out_path: str):
    from appliance.front.audio_decoder import AudioDecoder

    async def run():
        decoder = AudioDecoder()
        try:
            return await decoder.decode(data, 60, out_path)
        finally:
            await decoder.close()
    return asyncio.run(run())


def test_a_full_disk_under_the_decoded_audio_is_a_503_not_the_clients_fault():
    """/dev/full: every write fails with ENOSPC, as on a full spool file system."""
    from appliance.front.audio_decoder import HelperFault
    with pytest.raises(HelperFault) as info:
        decode(wav_bytes(tone(1.0)), "/dev/full")
    assert "cannot write the decoded audio to /dev/full" in str(info.value)
    failure = info.value.failure()
    assert (failure.status, failure.code) == (503, "audio_decoder_unavailable") and failure.retry_after


def test_a_hung_decoder_is_a_503_and_is_replaced(monkeypatch, tmp_path):
    from appliance.front import audio_decoder
    monkeypatch.setattr(audio_decoder, "DECODE_TIMEOUT_S", 2.0)

    async def run():
        decoder = audio_decoder.AudioDecoder()
        try:
            proc = await decoder.start()
            os.kill(proc.pid, signal.SIGSTOP)  # hung, as a decoder stuck in a C library is
            with pytest.raises(audio_decoder.HelperFault) as info:
                await decoder.decode(wav_bytes(tone(1.0)), 60, str(tmp_path / "a.f32"))
            assert proc.returncode is not None  # killed
            again = await decoder.decode(wav_bytes(tone(1.0)), 60, str(tmp_path / "b.f32"))  # a new process
            return info.value, again
        finally:
            await decoder.close()
    fault, again = asyncio.run(run())
    assert "did not answer" in str(fault) and fault.failure().status == 503
    assert again.seconds == 1.0
