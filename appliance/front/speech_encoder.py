"""Synthesised speech (float32 mono samples a tts worker wrote) encoded to what `/v1/audio/speech` returns: mp3,
opus (in Ogg), aac (ADTS), flac, wav or pcm (16-bit little-endian), in a process of its own
(`python -m appliance.front.speech_encoder`) through PyAV, stretched to the request's `speed` without changing the
pitch (FFmpeg's atempo) where the model did not speak at that speed itself.

FFmpeg is a large C library: as with uploads (appliance.front.audio_decoder), a crash in it must cost one
request, never the front or a model's worker.  The process is the shared helper of appliance.front.helper_process.

A stream is encoded piece by piece as its sentences are synthesised: a *session* (one per response) keeps its
encoder between requests, so each piece's bytes continue the one file (one MP3/Ogg/FLAC stream, one WAV header).
Protocol, one request at a time: {"session": id, "in": [sample files], "rate": Hz, "format": name, "speed": x,
"final": bool, "out": path} -> the bytes encoded so far (all of them once final) written to `out`, and
{"bytes": n}; {"session": id, "drop": true} forgets a session whose client left; errors are
{"error": "unknown_session" | "encode_failed" | "write_failed", "message": ...}.
"""

from __future__ import annotations

import logging
import os
import struct
import sys
from typing import Any

from appliance.front.helper_process import HelperFailed, HelperProcess
from appliance.ipc import serve_requests

log = logging.getLogger("openarc.audio")

ENCODE_TIMEOUT_S = 60.0  # one piece (a sentence, at most MAX_PIECE_CHARS) encodes in well under a second
# response_format -> (FFmpeg muxer, encoder, Content-Type); wav and pcm are written here, without FFmpeg.
CODECS = {
    "mp3": ("mp3", "libmp3lame", "audio/mpeg"),
    "opus": ("ogg", "libopus", "audio/ogg"),
    "aac": ("adts", "aac", "audio/aac"),
    "flac": ("flac", "flac", "audio/flac"),
}
CONTENT_TYPES = {**{name: c[2] for name, c in CODECS.items()}, "wav": "audio/wav", "pcm": "audio/pcm"}
RESPONSE_FORMATS = tuple(CONTENT_TYPES)
STREAMED_WAV_SIZE = 0xFFFFFFFF  # a WAV header's sizes when the length is not known yet (streamed), as OpenAI sends


class Sink:
    """A write-only file for FFmpeg's muxer: no seek, so it writes a stream that needs no header fix-up."""

    def __init__(self):
        self.data = bytearray()

    def write(self, chunk) -> int:
        self.data += chunk
        return len(chunk)

    def take(self) -> bytes:
        data, self.data = bytes(self.data), bytearray()
        return data


class Session:
    """One response's encoder: pieces in, the encoded bytes so far out."""

    def __init__(self, fmt: str, rate: int, speed: float, streamed: bool):
        self.fmt, self.rate, self.streamed = fmt, rate, streamed
        self.tempo = _Tempo(rate, speed) if speed != 1.0 else None
        self.pcm_written = 0
        self.held: list = []  # wav, not streamed: the samples until the header can carry their count
        self.container = self.stream = self.resampler = None
        if fmt in CODECS:
            import av
            muxer, codec, _ = CODECS[fmt]
            self.sink = Sink()
            self.container = av.open(self.sink, mode="w", format=muxer)
            self.stream = self.container.add_stream(codec, rate=rate)
            self.stream.layout = "mono"
            ctx = self.stream.codec_context
            self.resampler = av.AudioResampler(format=ctx.format.name, layout="mono", rate=rate,
                                               frame_size=ctx.frame_size or None)

    def feed(self, pcm, final: bool) -> bytes:
        """Encode `pcm` (float32 samples); with `final`, flush and end the file."""
        import numpy as np
        if self.tempo is not None:
            pcm = self.tempo.stretch(pcm, final)
        if self.container is None:
            return self._linear(np.asarray(pcm, np.float32), final)
        import av
        frames = []
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.float32).reshape(1, -1), format="flt",
                                               layout="mono")
            frame.sample_rate = self.rate
            frames.append(frame)
        if final:
            frames.append(None)  # flushes the resampler's partial frame
        for frame in frames:
            for out in self.resampler.resample(frame):
                out.pts = None
                for packet in self.stream.encode(out):
                    self.container.mux(packet)
        if final:
            for packet in self.stream.encode(None):
                self.container.mux(packet)
            self.container.close()
        return self.sink.take()

    def _linear(self, pcm, final: bool) -> bytes:
        """pcm and wav: 16-bit little-endian samples, behind a WAV header for wav (sizes unknown when streamed)."""
        import numpy as np
        data = (np.clip(pcm, -1.0, 1.0) * 32767).astype("<i2").tobytes()
        if self.fmt == "pcm":
            return data
        if not self.streamed:
            self.held.append(data)
            if not final:
                return b""
            data = b"".join(self.held)
            return _wav_header(self.rate, len(data)) + data
        header = _wav_header(self.rate, None) if self.pcm_written == 0 else b""
        self.pcm_written += len(data) or 1
        return header + data


def _wav_header(rate: int, data_bytes: int | None) -> bytes:
    """A 44-byte RIFF/WAVE header for 16-bit mono PCM; None: a streamed file's unknown length."""
    riff = STREAMED_WAV_SIZE if data_bytes is None else 36 + data_bytes
    data = STREAMED_WAV_SIZE if data_bytes is None else data_bytes
    return (b"RIFF" + struct.pack("<I", riff) + b"WAVEfmt " + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
            + b"data" + struct.pack("<I", data))


class _Tempo:
    """FFmpeg's atempo filter (tempo without pitch), chained for speeds under 0.5, with its state across pieces.
    atempo holds back up to a window of samples at the end of its input: the end is padded with silence and the
    output cut to exactly the input's length over the speed."""

    def __init__(self, rate: int, speed: float):
        import av
        self.rate, self.speed = rate, speed
        self.graph = av.filter.Graph()
        chain = [self.graph.add_abuffer(format="flt", sample_rate=rate, layout="mono")]
        while speed < 0.5:
            chain.append(self.graph.add("atempo", "0.5"))
            speed /= 0.5
        chain.append(self.graph.add("atempo", f"{speed:.6f}"))
        chain.append(self.graph.add("abuffersink"))
        for a, b in zip(chain, chain[1:]):
            a.link_to(b)
        self.graph.configure()
        self.consumed = self.produced = self.padded = 0

    def stretch(self, pcm, final: bool):
        import numpy as np
        self._push(pcm)
        if final:
            self._push(np.zeros(self.rate // 2, np.float32), padding=True)  # flushes atempo's window
            self.graph.push(None)
        out = self._pull()
        if final:
            out = out[:max(0, round(self.consumed / self.speed) - self.produced)]
        self.produced += len(out)
        return out

    def _push(self, pcm, padding: bool = False) -> None:
        import av
        import numpy as np
        if len(pcm):
            frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(pcm, np.float32).reshape(1, -1), format="flt",
                                               layout="mono")
            frame.sample_rate, frame.pts = self.rate, self.consumed + self.padded
            if padding:
                self.padded += len(pcm)
            else:
                self.consumed += len(pcm)
            self.graph.push(frame)

    def _pull(self):
        import av
        import numpy as np
        out = []
        while True:
            try:
                out.append(self.graph.pull().to_ndarray().reshape(-1))
            except (av.BlockingIOError, av.EOFError):
                break
        return np.concatenate(out) if out else np.zeros(0, np.float32)


SESSIONS: dict[str, Session] = {}


def _handle(request: dict[str, Any], _data: bytes) -> dict[str, Any]:
    import numpy as np
    sid = request["session"]
    if request.get("drop"):
        SESSIONS.pop(sid, None)
        return {"bytes": 0}
    try:
        session = SESSIONS.get(sid)
        if session is None:
            if request.get("continued"):
                return {"error": "unknown_session", "message": "the speech encoder restarted mid-stream"}
            session = SESSIONS[sid] = Session(request["format"], request["rate"], request["speed"],
                                              not request["final"])
        pcm = np.concatenate([np.fromfile(path, np.float32) for path in request["in"]] or [np.zeros(0, np.float32)])
        encoded = session.feed(pcm, request["final"])
    except Exception as exc:  # an FFmpeg or filter error: this session is unusable, the process is fine
        SESSIONS.pop(sid, None)
        return {"error": "encode_failed", "message": f"{type(exc).__name__}: {exc}"}
    if request["final"]:
        SESSIONS.pop(sid, None)
    try:
        with open(request["out"], "wb") as f:
            f.write(encoded)
    except OSError as exc:
        SESSIONS.pop(sid, None)
        return {"error": "write_failed", "message": f"cannot write the encoded audio to {request['out']}: {exc}"}
    return {"bytes": len(encoded)}


class EncoderFault(Exception):
    """The encoder crashed, hung, or could not write: a server fault (a 503 before the response began)."""


class SpeechEncoder(HelperProcess):
    """The front's handle on the encoder process, restarted after a crash (a stream that was using it ends)."""

    def __init__(self):
        super().__init__("appliance.front.speech_encoder", ENCODE_TIMEOUT_S, "speech encoder")

    async def encode(self, session: str, inputs: list[str], out: str, *, fmt: str, rate: int, speed: float,
                     final: bool, continued: bool) -> bytes:
        """The bytes this piece adds to the session's file (all that remain once final); EncoderFault if not."""
        try:
            reply = await self.ask({"session": session, "in": inputs, "out": out, "format": fmt, "rate": rate,
                                    "speed": speed, "final": final, "continued": continued}, b"")
        except HelperFailed as exc:
            raise EncoderFault(f"the speech encoder {exc.how} on this audio") from None
        if "error" in reply:
            raise EncoderFault(reply["message"])
        try:
            with open(out, "rb") as f:
                return f.read()
        finally:
            os.unlink(out)

    async def drop(self, session: str) -> None:
        """Forget a session that will not be finished (its client left, or synthesis failed)."""
        if self._proc is not None and self._proc.returncode is None:
            try:
                await self.ask({"session": session, "drop": True}, b"")
            except HelperFailed:
                pass


def main() -> None:
    # Not niced, unlike the audio decoder: the encoding of the first sentence is on the path of the time to first
    # audio, and a niced encoder on a busy box added about 200 ms to it.
    serve_requests(sys.stdin.buffer, sys.stdout.buffer, _handle)


if __name__ == "__main__":
    main()
