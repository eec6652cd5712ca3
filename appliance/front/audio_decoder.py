"""Decoding uploaded audio (wav, flac, mp3, ogg, webm, mp4/m4a) to 16 kHz mono float32, in a process of its own.

Uploads are untrusted media and the decoder is FFmpeg (through PyAV), a large C library: a malformed file can
crash it.  So it never runs in the front (which would take every model down) nor in a Whisper worker (which would
fail the other requests it is serving and restart the model).  The front keeps one long-lived decoder process
(`python -m appliance.front.audio_decoder`, started on first use) and talks to it over pipes: a crash costs only the
upload being decoded (a 400) and the process is started again for the next one. A fault of ours (the decoded
samples cannot be written, the decoder hangs) is a HelperFault: a 503 the client may retry.

Only the container formats listed in FORMATS are opened, recognised by their first bytes and named explicitly
to FFmpeg: FFmpeg's own probing would also accept playlists (HLS, concat) that make it open other files.

Protocol (appliance.front.helper_process), one request at a time: the front writes a JSON line {"bytes": n,
"max_seconds": s, "out": path} and n bytes of upload; the decoder writes the samples (float32, native order) to `out` and answers with a
JSON line {"seconds": d} or {"error": "undecodable" | "too_long" | "empty" | "write_failed", "message": ...}.
"""

from __future__ import annotations

import io
import os
import sys
import wave
from dataclasses import dataclass
from typing import Callable

from appliance.front.helper_process import HelperFailed, HelperFault, HelperProcess, write_failed
from appliance.ipc import serve_requests

SAMPLE_RATE = 16000
SAMPLE_BYTES = 4  # float32: a second of audio is 64,000 bytes in its spool file
DECODE_TIMEOUT_S = 120.0  # a decoder stuck on one file is killed: generous, decoding runs at 100x real time or more


# (magic bytes at offset, offset, FFmpeg demuxer)
FORMATS = (
    (b"RIFF", 0, "wav"),
    (b"fLaC", 0, "flac"),
    (b"OggS", 0, "ogg"),
    (b"\x1a\x45\xdf\xa3", 0, "matroska"),  # webm and mka
    (b"ID3", 0, "mp3"),
    (b"ftyp", 4, "mov"),  # mp4, m4a
)


class AudioError(Exception):
    """An upload that cannot be transcribed: `kind` is undecodable, too_long or empty."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def sniff_format(data: bytes) -> str | None:
    for magic, offset, name in FORMATS:
        if data[offset:offset + len(magic)] == magic:
            return name
    if len(data) >= 2 and data[0] == 0xFF and data[1] & 0xE0 == 0xE0:  # an MPEG audio frame header, no ID3 tag
        return "mp3"
    return None


def decode(data: bytes, max_seconds: float):
    """The upload's first audio stream as a float32 array of 16 kHz mono samples, or AudioError."""
    import av
    import numpy as np

    name = sniff_format(data)
    if name is None:
        raise AudioError("undecodable", "Unsupported audio format: expected wav, flac, mp3, ogg, webm or mp4/m4a.")
    max_samples = int(max_seconds * SAMPLE_RATE)
    if name == "wav" and (pcm := _speech_wav(data, max_samples, max_seconds)) is not None:
        return pcm
    chunks, total = [], 0
    try:
        with av.open(io.BytesIO(data), mode="r", format=name) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None:
                raise AudioError("undecodable", "The file has no audio stream.")
            resampler = av.AudioResampler(format="flt", layout="mono", rate=SAMPLE_RATE)
            for frame in [*container.decode(stream), None]:  # None flushes the resampler
                for out in resampler.resample(frame):
                    samples = out.to_ndarray().reshape(-1)
                    chunks.append(samples)
                    total += samples.size
                    if total > max_samples:
                        raise AudioError("too_long", f"The audio is longer than the {max_seconds:g} s limit.")
    except (av.FFmpegError, ValueError, EOFError, IndexError, OverflowError) as exc:
        raise AudioError("undecodable", f"The audio could not be decoded ({name}): {exc}") from None
    if total == 0:
        raise AudioError("empty", "The file holds no audio samples.")
    pcm = np.concatenate(chunks).astype(np.float32, copy=False)
    if not np.isfinite(pcm).all():
        raise AudioError("undecodable", "The audio decoded to non-finite samples.")
    return pcm


def _speech_wav(data: bytes, max_samples: int, max_seconds: float):
    """The samples of a 16-bit PCM WAV that is already 16 kHz mono, what speech clients mostly send, read by the
    standard library's `wave` (FFmpeg takes 4x longer: a Python call per 1,024-sample frame); None for any other
    WAV, which FFmpeg decodes and resamples."""
    import numpy as np

    try:
        with wave.open(io.BytesIO(data)) as w:
            if (w.getframerate(), w.getnchannels(), w.getsampwidth(), w.getcomptype()) != (SAMPLE_RATE, 1, 2, "NONE"):
                return None
            raw = w.readframes(min(w.getnframes(), max_samples + 1))
    except Exception:  # (wave.Error, EOFError, a RuntimeError from a chunk past the end, ...) FFmpeg decides
        return None
    if len(raw) // 2 > max_samples:
        raise AudioError("too_long", f"The audio is longer than the {max_seconds:g} s limit.")
    if len(raw) < 2:
        return None  # a header without a length (a streamed WAV): FFmpeg reads to the end
    return np.frombuffer(raw[:len(raw) // 2 * 2], "<i2").astype(np.float32) / 32768.0


def _handle(request: dict, data: bytes) -> dict:
    try:
        pcm = decode(data, request["max_seconds"])
        pcm.tofile(request["out"])
        return {"seconds": pcm.size / SAMPLE_RATE}
    except AudioError as exc:
        return {"error": exc.kind, "message": str(exc)}
    except OSError as exc:  # ENOSPC, EDQUOT, EIO writing the samples: the server's trouble, not the file's
        return write_failed(request["out"], "audio", exc)


@dataclass
class DecodedAudio:
    path: str
    seconds: float

    @property
    def spool_bytes(self) -> int:
        """The bytes of its spool file: its samples (seconds is their count over SAMPLE_RATE)."""
        return spool_bytes_of(self.seconds)


def spool_bytes_of(seconds: float) -> int:
    """The spool bytes of that many seconds of decoded audio."""
    return round(seconds * SAMPLE_RATE) * SAMPLE_BYTES


def seconds_in(spool_bytes: int) -> float:
    """The seconds of decoded audio that many spool bytes hold."""
    return spool_bytes / (SAMPLE_RATE * SAMPLE_BYTES)


class AudioDecoder(HelperProcess):
    """The front's handle on the decoder process: one upload at a time, restarted after a crash."""

    def __init__(self):
        super().__init__("appliance.front.audio_decoder", DECODE_TIMEOUT_S, "audio decoder")

    async def decode(self, data: bytes, max_seconds: float | Callable[[], float], out_path: str) -> DecodedAudio:
        """Decode `data` into `out_path`; AudioError for anything that is not usable audio (too_long past
        `max_seconds`: a function is called when the decoder takes the file, so that its caller reserves the spool
        bytes then), HelperFault for a fault of ours."""
        try:
            reply = await self.answer({"out": out_path}, data, lambda: {
                "max_seconds": max_seconds() if callable(max_seconds) else max_seconds})
        except HelperFailed:
            raise AudioError("undecodable", "The audio could not be decoded (the decoder crashed on this file).") from None
        if "error" in reply:
            raise AudioError(reply["error"], reply["message"])
        return DecodedAudio(out_path, reply["seconds"])


def main() -> None:
    os.nice(5)  # decoding yields to the model workers on a busy box
    serve_requests(sys.stdin.buffer, sys.stdout.buffer, _handle)


if __name__ == "__main__":
    main()
