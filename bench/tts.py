"""`python -m bench.tts [--quick]`: speech synthesis through the server against the in-process
Text2SpeechPipeline, same model, same text, same run: the real-time factor (seconds of audio per second of
synthesis) and the time to first audio.

The baseline (bench.inprocess) is the demo SpeechT5-shaped model's Text2SpeechPipeline, warm, in a bare process of
its own, speaking the text sentence by sentence as the server's worker does (appliance.front.api.sentences cuts
both); the server gets the same text on /v1/audio/speech, so its figures include what a client's request costs on
top: the hops between client, front and worker, one worker request per sentence, the spool files and encoding in
the speech encoder's process. Baseline and server take turns block by block; each figure is the median over its
blocks. Figures:

- real-time factor: the whole text as one WAV (16-bit, the cheapest encoding: the figure weighs the path, not
  a codec), against the pipeline speaking every sentence;
- time to first audio: the same text streamed (`stream_format: "audio"`) until its first chunk, as pcm (the path
  alone) and as mp3 (the default format: the first sentence's MP3 encoding on top), against the pipeline speaking
  the first sentence.

The demo model speaks 64 ms of audio per character in well under a millisecond a step, far faster than a real
SpeechT5 or Kokoro: the ratios here are the path's cost at its most visible; on a real model the worker's share
grows and the path's shrinks.
"""

from __future__ import annotations

import io
import time
import wave

import aiohttp

from bench import inprocess, report

MODEL = "speech"
VOICE = "alloy"  # one of the demo model's voice files, voices/alloy.bin
# The sentences the server cuts the text into (appliance.front.api.sentences), spoken one by one in process too.
SENTENCES = ["The quick brown fox jumps over the lazy dog.",
             "Speech comes out one sentence at a time, so a long text starts playing early.",
             "Every piece is spoken by the same worker, in order.", "This is the last sentence."]
TEXT = " ".join(SENTENCES)


# --- the baseline, in its own process ----------------------------------------------------------------------

def baseline(model_path: str) -> None:
    """The in-process side: a warm Text2SpeechPipeline built as the server's worker builds it, speaking with the
    voice the server is asked for."""
    import numpy as np
    import openvino as ov
    import openvino_genai

    pipe = openvino_genai.Text2SpeechPipeline(model_path, "CPU")
    speaker = ov.Tensor(np.fromfile(f"{model_path}/voices/{VOICE}.bin", np.float32).reshape(1, -1))
    pipe.generate("warm up.", speaker)

    def speak(text: str) -> int:
        return sum(s.get_size() for s in pipe.generate(text, speaker).speeches)

    def run_phase(phase: str, rounds: int) -> float:
        if phase == "first":  # seconds until the first sentence's audio, averaged
            started = time.perf_counter()
            for _ in range(rounds):
                speak(SENTENCES[0])
            return (time.perf_counter() - started) / rounds
        started = time.perf_counter()
        samples = sum(speak(sentence) for _ in range(rounds) for sentence in SENTENCES)
        return samples / 16000 / (time.perf_counter() - started)

    inprocess.serve(run_phase)


# --- the server ----------------------------------------------------------------------------------------------

async def speech(session: aiohttp.ClientSession, base: str, **extra) -> aiohttp.ClientResponse:
    return await session.post(base + "/v1/audio/speech", json={"model": MODEL, "input": TEXT, "voice": VOICE,
                                                               **extra})


async def server_rates(session: aiohttp.ClientSession, base: str, rounds: int) -> dict[str, float]:
    started = time.perf_counter()
    audio_s = 0.0
    for _ in range(rounds):
        async with await speech(session, base, response_format="wav") as response:
            body = await response.read()
        if response.status != 200:
            raise RuntimeError(f"{response.status}: {body[:300]!r}")
        with wave.open(io.BytesIO(body)) as w:
            audio_s += w.getnframes() / w.getframerate()
    rtf = audio_s / (time.perf_counter() - started)
    return {"rtf": rtf, "first": await first_audio(session, base, rounds, "pcm"),
            "first_mp3": await first_audio(session, base, rounds, "mp3")}


async def first_audio(session: aiohttp.ClientSession, base: str, rounds: int, fmt: str) -> float:
    """Seconds from a streamed request to its first chunk, averaged over `rounds`."""
    total = 0.0
    for _ in range(rounds):
        started = time.perf_counter()
        async with await speech(session, base, response_format=fmt, stream_format="audio") as response:
            if response.status != 200:
                raise RuntimeError(f"{response.status}: {(await response.read())[:300]!r}")
            await response.content.readany()
            total += time.perf_counter() - started
            await response.read()
    return total / rounds


def figures(m: dict[str, float]) -> list[report.Figure]:
    def factor(name: str, value: float) -> report.Figure:
        return report.Figure(name, f"{value:,.1f} x real time", value, "x")

    def ms(name: str, seconds: float) -> report.Figure:
        return report.Figure(name, f"{seconds * 1000:,.1f} ms", seconds * 1000, "ms")

    share = m["server_rtf"] / m["inprocess_rtf"] * 100
    added = m["server_first"] - m["inprocess_first"]
    return [
        factor("In process, real-time factor", m["inprocess_rtf"]),
        factor("Server, real-time factor (WAV)", m["server_rtf"]),
        report.Figure("Server / in process, real-time factor", f"{share:.0f} %", share, "%"),
        ms("In process, first sentence spoken", m["inprocess_first"]),
        ms("Server, time to first audio (streamed pcm)", m["server_first"]),
        report.Figure("Server, time to first audio added", f"{added * 1000:+,.1f} ms", added * 1000, "ms"),
        ms("Server, time to first audio (streamed mp3)", m["server_first_mp3"]),
    ]


BENCH = inprocess.SideBench("tts", "tts", {"name": MODEL}, ("rtf", "first"), ((2, 2), (10, 9)), server_rates,
                            figures)


def main(argv: list[str] | None = None) -> None:
    BENCH.main(argv, __doc__, baseline)


if __name__ == "__main__":
    main()
