"""A transcription result in each `response_format` OpenAI's audio routes offer: json, text, srt, vtt, verbose_json.

The worker's result (appliance.worker.engines.transcription) holds the text, the language code, segments as
[start, end, text] and words as [word, start, end]; the front adds the duration it decoded.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

from aiohttp import web

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
# Whisper's languages: ISO code and the name verbose_json reports (underscores stand for spaces).
LANGUAGE_NAMES = dict(pair.split("=") for pair in """
en=english zh=chinese de=german es=spanish ru=russian ko=korean fr=french ja=japanese pt=portuguese tr=turkish
pl=polish ca=catalan nl=dutch ar=arabic sv=swedish it=italian id=indonesian hi=hindi fi=finnish vi=vietnamese
he=hebrew uk=ukrainian el=greek ms=malay cs=czech ro=romanian da=danish hu=hungarian ta=tamil no=norwegian
th=thai ur=urdu hr=croatian bg=bulgarian lt=lithuanian la=latin mi=maori ml=malayalam cy=welsh sk=slovak
te=telugu fa=persian lv=latvian bn=bengali sr=serbian az=azerbaijani sl=slovenian kn=kannada et=estonian
mk=macedonian br=breton eu=basque is=icelandic hy=armenian ne=nepali mn=mongolian bs=bosnian kk=kazakh
sq=albanian sw=swahili gl=galician mr=marathi pa=punjabi si=sinhala km=khmer sn=shona yo=yoruba so=somali
af=afrikaans oc=occitan ka=georgian be=belarusian tg=tajik sd=sindhi gu=gujarati am=amharic yi=yiddish lo=lao
uz=uzbek fo=faroese ht=haitian_creole ps=pashto tk=turkmen nn=nynorsk mt=maltese sa=sanskrit lb=luxembourgish
my=myanmar bo=tibetan tl=tagalog mg=malagasy as=assamese tt=tatar haw=hawaiian ln=lingala ha=hausa ba=bashkir
jw=javanese su=sundanese yue=cantonese""".split())
LANGUAGE_CODES = {name.replace("_", " "): code for code, name in LANGUAGE_NAMES.items()}


@dataclass
class Transcript:
    task: str          # transcribe | translate
    text: str
    language: str      # ISO code
    duration: float    # seconds of audio
    segments: list[dict[str, Any]]
    words: list[dict[str, Any]]
    temperature: float = 0.0

    @classmethod
    def from_result(cls, result: dict[str, Any], task: str, duration: float, temperature: float) -> Transcript:
        segments = []
        for i, (start, end, text) in enumerate(result["segments"]):
            if end < start:  # genai's mark of a segment the window ended before it closed
                following = result["segments"][i + 1][0] if i + 1 < len(result["segments"]) else duration
                end = max(start, min(following, duration))
            if text.strip():
                segments.append(_segment(len(segments), start, end, text, temperature))
        words = [{"word": word, "start": start, "end": end} for word, start, end in result["words"]]
        return cls(task, result["text"], result["language"], duration, segments, words, temperature)

    def usage(self) -> dict[str, Any]:
        return {"type": "duration", "seconds": math.ceil(self.duration)}

    def response(self, response_format: str, words: bool) -> web.Response:
        if response_format == "text":
            return web.Response(text=self.text.strip() + "\n", content_type="text/plain")
        if response_format == "srt":
            return web.Response(text=self.subtitles(","), content_type="application/x-subrip")
        if response_format == "vtt":
            return web.Response(text="WEBVTT\n\n" + self.subtitles("."), content_type="text/vtt")
        if response_format == "verbose_json":
            return web.json_response(self.verbose(words))
        return web.json_response({"text": self.text.strip(), "usage": self.usage()})

    def verbose(self, words: bool) -> dict[str, Any]:
        body = {"task": self.task, "language": LANGUAGE_NAMES.get(self.language, self.language).replace("_", " "),
                "duration": round(self.duration, 3), "text": self.text.strip(), "segments": self.segments}
        if words:
            body["words"] = self.words
        body["usage"] = self.usage()
        return body

    def subtitles(self, decimal_mark: str) -> str:
        """SRT cues (numbered, with a comma before the milliseconds) or VTT cues (a dot)."""
        cues = []
        for i, segment in enumerate(self.segments, 1):
            number = f"{i}\n" if decimal_mark == "," else ""
            times = f"{_clock(segment['start'], decimal_mark)} --> {_clock(segment['end'], decimal_mark)}"
            cues.append(f"{number}{times}\n{segment['text'].strip()}\n")
        return "\n".join(cues)


def _segment(index: int, start: float, end: float, text: str, temperature: float) -> dict[str, Any]:
    """One verbose_json segment.  genai reports no token ids or log-probabilities: those fields are zeros."""
    data = text.encode()
    return {"id": index, "seek": int(round(start * 100)), "start": round(start, 3), "end": round(end, 3),
            "text": text, "tokens": [], "temperature": temperature, "avg_logprob": 0.0,
            "compression_ratio": round(len(data) / len(zlib.compress(data)), 3), "no_speech_prob": 0.0}


def _clock(seconds: float, decimal_mark: str) -> str:
    millis = int(round(max(seconds, 0.0) * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_mark}{millis:03d}"
