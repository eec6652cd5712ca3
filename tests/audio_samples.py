"""Test audio made here: numpy signals written as WAV by the standard library's `wave`, and as compressed files
(flac, mp3, ogg/opus, webm/opus, m4a/aac) by FFmpeg's encoders through PyAV; and multipart forms to upload them."""

from __future__ import annotations

import io
import wave

import numpy as np

# name -> (PyAV container format, codec, sample rate): what each compressed test file is
COMPRESSED = {
    "flac": ("flac", "flac", 44100),
    "mp3": ("mp3", "libmp3lame", 44100),
    "ogg": ("ogg", "libopus", 48000),
    "webm": ("webm", "libopus", 48000),
    "m4a": ("ipod", "aac", 44100),
}
TRANSCRIPT = "hello world from a tiny model."  # what the demo Whisper hears in any sound (appliance.demo.whisper)


def tone(seconds: float, rate: int = 16000) -> np.ndarray:
    """A warbling 440 Hz tone at a third of full scale: sound, as far as the demo Whisper can tell."""
    t = np.arange(int(seconds * rate)) / rate
    return (0.3 * np.sin(2 * np.pi * 440 * t) * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t))).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int = 16000, channels: int = 1) -> bytes:
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(np.repeat(pcm, channels).tobytes())
    return buffer.getvalue()


def encoded(name: str, seconds: float = 2.0, silent: bool = False) -> bytes:
    """`seconds` of tone (or silence) as a stereo file of format `name` (a COMPRESSED key)."""
    import av

    container_format, codec, rate = COMPRESSED[name]
    samples = np.zeros(int(seconds * rate), np.float32) if silent else tone(seconds, rate)
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate, layout="stereo")
        step = 4096
        for start in range(0, samples.size, step):
            chunk = samples[start:start + step]
            frame = av.AudioFrame.from_ndarray(np.stack([chunk, chunk]), format="fltp", layout="stereo")
            frame.rate, frame.pts = rate, start
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return buffer.getvalue()


def multipart(fields: dict) -> tuple[str, bytes]:
    """(content type, body) of a multipart/form-data form; bytes values are sent as files."""
    boundary = "openarc-test-boundary"
    parts = []
    for name, value in fields.items():
        filename = f'; filename="{name}.bin"' if isinstance(value, bytes) else ""
        data = value if isinstance(value, bytes) else str(value).encode()
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"{filename}\r\n\r\n'.encode()
                     + data + b"\r\n")
    return f"multipart/form-data; boundary={boundary}", b"".join(parts) + f"--{boundary}--\r\n".encode()
