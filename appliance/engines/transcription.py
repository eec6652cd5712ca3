"""The transcription worker kind: openvino_genai.WhisperPipeline turns 16 kHz mono audio into text.

Request frame: {"audio_path": float32 samples the front's decoder wrote (appliance.audio_decoder), "task":
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

from appliance.engines.base import InvalidInput, ResultEngine

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
        self.current: int | None = None
        self.cancelled = False
        self.pipe.generate(np.zeros(SAMPLE_RATE, np.float32))  # the first call's one-off costs, paid before `ready`

    def on_cancel(self, request_id: int) -> None:
        super().on_cancel(request_id)
        self.cancelled = self.cancelled or request_id == self.current

    def answer(self, message: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        import numpy as np
        audio = np.fromfile(message["audio_path"], dtype=np.float32)
        config = self._generation_config(message)
        self.current, self.cancelled = message["id"], False
        try:
            result = self.pipe.generate(audio, config, self._streamer(message))
        finally:
            self.current = None
        words = (result.words or []) if message["words"] else []
        return {
            "text": result.texts[0] if result.texts else "",
            "language": (result.language or "").strip("<|>") or message["language"],
            "segments": [[round(c.start_ts, 3), round(c.end_ts, 3), c.text] for c in (result.chunks or [])],
            "words": [[w.word, round(w.start_ts, 3), round(w.end_ts, 3)] for w in words],
        }, {"audio_seconds": audio.size / SAMPLE_RATE}

    def _generation_config(self, message: dict[str, Any]):
        config = self.pipe.get_generation_config()
        if message["task"] == "translate":
            if not self.multilingual:
                raise InvalidInput(f"the model '{self.spec['name']}' is English-only and cannot translate",
                                   "unsupported_task")
            config.task = "translate"
        if message["language"]:
            token = f"<|{message['language']}|>"
            if token not in self.languages:
                raise InvalidInput(f"language '{message['language']}' is not one this model knows",
                                   "unsupported_language")
            config.language = token
        if message["prompt"]:
            config.initial_prompt = message["prompt"]
        if message["temperature"]:
            config.do_sample = True
            config.temperature = message["temperature"]
        config.return_timestamps = message["timestamps"]
        config.word_timestamps = message["words"]
        return config

    def _streamer(self, message: dict[str, Any]):
        """Called by genai with each piece of new text: forward it to a streaming caller, keep the stall timer
        fed, and stop a request whose caller went away."""
        import openvino_genai

        def write(text: str):
            # An exception here would be printed and swallowed by genai while generation goes on.
            try:
                if message["stream"] and text:
                    self.post({"op": "tokens", "id": message["id"], "text": text, "n": 1})
                self.flush()
                self.drain_inbox(block=False)
                self.pause()
            except Exception:
                log.exception("streamer failed")
                return openvino_genai.StreamingStatus.STOP
            return openvino_genai.StreamingStatus.CANCEL if self.cancelled else openvino_genai.StreamingStatus.RUNNING

        return write
