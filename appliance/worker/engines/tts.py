"""The tts worker kind: openvino_genai.Text2SpeechPipeline turns one piece of text into audio (SpeechT5 with its
vocoder, or Kokoro: genai picks the backend from the model directory).

Request body (ipc op `request`): {"text": one piece of the input (the front splits long input at sentence
boundaries, appliance.front.api.sentences), "voice_path": a speaker-embedding / voice file (float32, the shape
the pipeline asks for) or None (the pipeline's own default voice), "speed": float, "out": where to write the
samples (float32, native order, mono)}.
Result: {"samples": count written, "sample_rate": Hz, "speed_applied": whether the pipeline itself spoke at
`speed` (Kokoro) so the front's encoder must not stretch the audio again}.
Counts: speech_audio_seconds and speech_characters (the model's counters).
"""

from __future__ import annotations

from typing import Any

from appliance.worker.engines.base import InvalidInput, ResultEngine


class SpeechEngine(ResultEngine):
    def __init__(self, spec: dict[str, Any], channel):
        import openvino_genai
        super().__init__(spec, channel)
        self.pipe = openvino_genai.Text2SpeechPipeline(spec["path"], spec["device"], **spec["properties"])
        self.embedding_shape = list(self.pipe.get_speaker_embedding_shape())
        self.voices: dict[str, Any] = {}  # voice file -> its tensor, read once
        self.native_speed = self._speaks_at_speed()
        self.pipe.generate("warm up.")  # the first call's one-off costs, paid before `ready`

    def _speaks_at_speed(self) -> bool:
        """Kokoro takes `speed` itself; SpeechT5 ignores it (the front's encoder stretches its audio instead)."""
        from appliance.model_files import read_json
        import pathlib
        config = read_json(pathlib.Path(self.spec["path"]) / "config.json") or {}
        return "SpeechT5ForTextToSpeech" not in (config.get("architectures") or ())

    def answer(self, body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float]]:
        import numpy as np
        speaker = self._voice(body["voice_path"])
        properties = {"speed": float(body["speed"])} if self.native_speed else {}
        self.after_step()
        result = self.pipe.generate(body["text"], speaker, **properties) if speaker is not None else \
            self.pipe.generate(body["text"], **properties)
        samples = np.concatenate([np.asarray(s.data, dtype=np.float32).reshape(-1) for s in result.speeches])
        samples.tofile(body["out"])
        rate = int(result.output_sample_rate)
        return ({"samples": int(samples.size), "sample_rate": rate, "speed_applied": self.native_speed},
                {"speech_audio_seconds": samples.size / rate, "speech_characters": len(body["text"])})

    def _voice(self, path: str | None):
        """The voice file's tensor (cached), or None for the pipeline's default voice."""
        import numpy as np
        import openvino as ov
        if path is None:
            return None
        if path not in self.voices:
            try:
                data = np.fromfile(path, dtype=np.float32)
            except OSError as exc:
                raise InvalidInput(f"the voice file {path} cannot be read: {exc}", "voice_unreadable") from None
            shape = [d if d > 0 else -1 for d in self.embedding_shape]
            try:
                self.voices[path] = ov.Tensor(data.reshape(shape))
            except ValueError:
                raise InvalidInput(f"the voice file {path} holds {data.size} floats, not the shape "
                                   f"{self.embedding_shape} this model takes", "voice_unreadable") from None
        return self.voices[path]
