"""The transcription worker kind: openvino_genai.WhisperPipeline turns 16 kHz mono audio into text.

Request body (ipc op `request`): {"audio_path": float32 samples the front's decoder wrote (appliance.front.audio_decoder), "task":
"transcribe" | "translate", "language": an ISO code or None (detect), "prompt": str or None (Whisper's
initial prompt), "temperature": float, "timestamps": bool (segments), "words": bool (word timestamps),
"stream": bool}.
Result: {"text", "language" (code), "segments": [[start, end, text], ...], "words": [[word, start, end], ...]}.
While it runs, "tokens" frames carry text deltas to a streaming caller (genai streams token by token up to 30 s
without timestamps, one 30 s window at a time otherwise); for any caller the streamer keeps progress frames
going (the stall timer) and ends a cancelled request early.
"""

from __future__ import annotations

import logging
from typing import Any

from appliance.worker.engines.base import InvalidInput, ResultEngine
from appliance.ipc import frame

log = logging.getLogger("openarc.worker")

SAMPLE_RATE = 16000


class TranscriptionEngine(ResultEngine):
    def __init__(self, spec: dict[str, Any], channel):
        import numpy as np
        import openvino_genai
        super().__init__(spec, channel)
        self.pipe = openvino_genai.WhisperPipeline(spec["path"], spec["device"],
                                                   word_timestamps=spec["word_timestamps"], **spec["properties"])
        defaults = self.pipe.get_generation_config()
        self.multilingual = defaults.is_multilingual
        self.languages = set(defaults.lang_to_id)
        self.cancelled = False  # the request in the pipeline lost its caller
        self.pipe.generate(np.zeros(SAMPLE_RATE, np.float32))  # the first call's one-off costs, paid before `ready`

    def on_cancel(self, request_id: int) -> None:
        super().on_cancel(request_id)
        self.cancelled = self.cancelled or (self.current is not None and request_id == self.current["id"])

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        import numpy as np
        audio = np.fromfile(body["audio_path"], dtype=np.float32)
        config = self._generation_config(body)
        self.cancelled = False
        streamer = Streamer(self, self.current["id"], body["stream"])
        result = self.pipe.generate(audio, config, streamer)
        if streamer.error is not None:  # our own code failed, not the pipeline: raised now that genai returned
            raise streamer.error
        words = (result.words or []) if body["words"] else []
        return {
            "text": result.texts[0] if result.texts else "",
            "language": (result.language or "").strip("<|>") or body["language"],
            "segments": [[round(c.start_ts, 3), round(c.end_ts, 3), c.text] for c in (result.chunks or [])],
            "words": [[w.word, round(w.start_ts, 3), round(w.end_ts, 3)] for w in words],
        }, {"audio_seconds": audio.size / SAMPLE_RATE}

    def _generation_config(self, body: dict[str, Any]):
        config = self.pipe.get_generation_config()
        if body["task"] == "translate":
            if not self.multilingual:
                raise InvalidInput(f"the model '{self.spec['name']}' is English-only and cannot translate",
                                   "unsupported_task")
            config.task = "translate"
        if body["language"]:
            token = f"<|{body['language']}|>"
            if token not in self.languages:
                raise InvalidInput(f"language '{body['language']}' is not one this model knows",
                                   "unsupported_language")
            config.language = token
        if body["prompt"]:
            config.initial_prompt = body["prompt"]
        if body["temperature"]:
            config.do_sample = True
            config.temperature = body["temperature"]
        config.return_timestamps = body["timestamps"]
        config.word_timestamps = body["words"]
        return config


class Streamer:
    """Called by genai with each piece of new text: forwards it to a streaming caller, keeps the stall timer fed,
    and stops a request whose caller went away.  genai would print and swallow an exception raised here while
    generation went on: it is kept, generation stops, and answer() raises it."""

    def __init__(self, engine: TranscriptionEngine, request_id: int, stream: bool):
        self.engine, self.request_id, self.stream = engine, request_id, stream
        self.error: BaseException | None = None

    def __call__(self, text: str):
        import openvino_genai
        engine = self.engine
        try:
            if self.stream and text:
                engine.post(frame("tokens", id=self.request_id, text=text, n=1))
            engine.flush()
            engine.drain_inbox(block=False)
            engine.after_step()
        except BaseException as exc:
            self.error = exc
            return openvino_genai.StreamingStatus.CANCEL
        return openvino_genai.StreamingStatus.CANCEL if engine.cancelled else openvino_genai.StreamingStatus.RUNNING
