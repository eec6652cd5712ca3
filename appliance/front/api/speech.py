"""POST /v1/audio/speech, as the OpenAI SDK sends it (`client.audio.speech.create`): text in, audio out.

Fields: `model` (a tts model), `input` (1 to 4096 characters), `voice` (a voice of the model, one of OpenAI's
names, which the model's default voice answers when it has no voice of that name, or {"id": name}),
`response_format` (mp3 default, opus, aac, flac, wav, pcm: 16-bit little-endian mono at the rate the
X-Sample-Rate header gives), `speed` (0.25 to 4.0), `instructions` (accepted, unused: SpeechT5 and Kokoro take
no style prompt), `stream_format` ("audio": the file sent in chunks as each sentence is spoken; "sse":
`speech.audio.delta` events carrying base64 chunks, then `speech.audio.done`; absent: one response).

A request goes: validated here (every error a 400 in OpenAI's shape) -> the input split at sentence boundaries
(appliance.front.api.sentences) -> each piece a `request` frame to the model's worker, in turn, which writes its
samples to a spool file (appliance.worker.engines.tts) -> the pieces encoded in the speech encoder's process
(appliance.front.speech_encoder; one session per response) -> the bytes to the client, piece by piece when
streamed.  A worker that dies or stalls on a piece fails the request with its 5xx (before any audio went out), an
SSE error event, or a chunked response cut short (the status was already sent).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import os
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import fields, lookup, sse
from appliance.front.api.audio import TRANSCRIPT_ERRORS
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.results import result_of
from appliance.front.api.route import Call, route
from appliance.front.api.sentences import split_sentences
from appliance.front.helper_process import HelperUser
from appliance.front.request import Request, RequestFailed
from appliance.front.request_ledger import LEDGER
from appliance.front.speech_encoder import CONTENT_TYPES, RESPONSE_FORMATS, EncoderFault, SpeechEncoder
from appliance.model_files import OPENAI_VOICES, voice_files

KIND = "tts"
MAX_INPUT_CHARS = 4096  # OpenAI's limit
MIN_SPEED, MAX_SPEED = 0.25, 4.0
STREAM_FORMATS = ("audio", "sse")
SAMPLE_RATE_HEADER = "X-Sample-Rate"


def add_routes(app: web.Application, appliance: ServerView) -> None:
    speech = SpeechRoutes(appliance)
    # TRANSCRIPT_ERRORS: OpenAI's bodies, and in a stream an event of type "error" like the audio events' types.
    app.router.add_post("/v1/audio/speech", route(appliance, "audio/speech", speech.handle, TRANSCRIPT_ERRORS))
    speech.mount(app)


@dataclass
class SpeechRequest:
    model: str
    input: str
    voice: str | None
    response_format: str
    speed: float
    stream_format: str | None


def parse(body: Any) -> SpeechRequest:
    model = fields.model_name(body)
    text = fields.required_text(body, "input", MAX_INPUT_CHARS, "the text to speak")
    response_format = body.get("response_format") or "mp3"
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}", "response_format")
    speed = fields.number(body, "speed", MIN_SPEED, MAX_SPEED)
    stream_format = body.get("stream_format")
    if stream_format is not None and stream_format not in STREAM_FORMATS:
        raise InvalidRequest("'stream_format' must be 'audio' or 'sse'", "stream_format")
    if body.get("instructions") is not None:
        fields.text(body["instructions"], "instructions", empty=True)  # accepted; these models take no style prompt
    return SpeechRequest(model=model, input=text, voice=_voice_name(body.get("voice")),
                         response_format=response_format, speed=float(speed or 1.0), stream_format=stream_format)


def _voice_name(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):  # OpenAI's custom voices: {"id": "voice_..."}
        value = value.get("id")
    if not isinstance(value, str) or not value:
        raise InvalidRequest("'voice' must be a voice name (or an object with its 'id')", "voice")
    return value


def choose_voice(requested: str | None, voices: dict[str, str], default_voice: str | None, model: str) -> str | None:
    """The voice file a request is spoken with (None: the pipeline's own default voice): the named voice; for
    none, or for one of OpenAI's names the model lacks, the model's default_voice, else its first voice by name."""
    default = voices.get(default_voice) if default_voice else (voices[min(voices)] if voices else None)
    if requested is None:
        return default
    if requested in voices:
        return voices[requested]
    if requested in OPENAI_VOICES:
        return default
    have = ", ".join(sorted(voices)) or "none of its own"
    raise InvalidRequest(f"the model '{model}' has no voice '{requested}' (its voices: {have}; OpenAI's names "
                         f"{', '.join(OPENAI_VOICES)} speak in its default voice)", "voice", "unknown_voice")


class SpeechRoutes(HelperUser):
    def __init__(self, appliance: ServerView):
        self.encoder = SpeechEncoder()
        super().__init__(appliance, KIND, self.encoder, "openarc-speech-")
        self.serial = itertools.count(1)

    async def handle(self, request: web.Request, call: Call) -> web.StreamResponse:
        body = await fields.json_body(request)
        call.label(body)
        req = parse(body)
        sup = await lookup.model_for(self.appliance, req.model, call, (KIND,))
        voice = choose_voice(req.voice, voice_files(sup.model.path, sup.model.voices), sup.model.default_voice,
                             req.model)
        speech = Speech(self, sup, req, voice, f"{os.getpid()}-{next(self.serial)}")
        try:
            if req.stream_format is None:
                return await self._whole(speech)
            if req.stream_format == "audio":
                return await self._chunked(request, call, speech)
            return await self._events(request, call, speech)
        finally:
            await speech.close()

    async def _whole(self, speech: Speech) -> web.Response:
        data = b"".join([chunk async for chunk in speech.chunks()])
        return web.Response(body=data, content_type=CONTENT_TYPES[speech.req.response_format],
                            headers={SAMPLE_RATE_HEADER: str(speech.rate)})

    async def _chunked(self, request: web.Request, call: Call, speech: Speech) -> web.StreamResponse:
        """The file as chunked transfer, a piece as each sentence is spoken; a failure after the first piece cuts
        the response short (its status went out with the first piece)."""
        chunks = speech.chunks()
        first = await anext(chunks)  # a failure here is still a status of its own
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPES[speech.req.response_format],
                                               SAMPLE_RATE_HEADER: str(speech.rate)})
        response.enable_chunked_encoding()
        await response.prepare(request)
        await response.write(first)
        try:
            async for chunk in chunks:
                await response.write(chunk)
        except RequestFailed as failure:
            call.count_error(failure.kind)
            response.force_close()
            request.transport.close()  # the client sees an incomplete chunked body, never a complete-looking file
            return response
        await response.write_eof()
        return response

    async def _events(self, request: web.Request, call: Call, speech: Speech) -> web.StreamResponse:
        chunks = speech.chunks()
        first = await anext(chunks)
        stream = await sse.EventStream(request).open()
        await stream.send({"type": "speech.audio.delta", "audio": base64.b64encode(first).decode()})
        try:
            async for chunk in chunks:
                if chunk:
                    await stream.send({"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode()})
        except RequestFailed as failure:
            await stream.send(call.stream_failed(failure))
            return await stream.close()
        characters = len(speech.req.input)  # SpeechT5 and Kokoro read characters (or their phonemes), not tokens
        await stream.send({"type": "speech.audio.done",
                           "usage": {"input_tokens": characters, "output_tokens": 0, "total_tokens": characters}})
        return await stream.close()


class Speech:
    """One request's audio: its pieces spoken by the model's worker one after another, encoded in one session of
    the speech encoder, the bytes yielded as each piece is done (streamed) or all at the end."""

    def __init__(self, routes: SpeechRoutes, sup, req: SpeechRequest, voice: str | None, session: str):
        self.routes, self.sup, self.req, self.voice, self.session = routes, sup, req, voice, session
        self.pieces = split_sentences(req.input)
        self.streamed = req.stream_format is not None
        self.rate = 0
        self.started = time.monotonic()
        self.first_audio = False
        self.finished = False
        self.files: list[str] = []
        self.next_place = False  # a queue place held for the next sentence (ModelSupervisor.reserve(continuing))

    async def chunks(self) -> AsyncIterator[bytes]:
        """The encoded audio: a chunk per piece and a last one when streamed, one chunk otherwise."""
        speed = self.req.speed
        for i, text in enumerate(self.pieces):
            path = self._spool(f"{i}.f32")
            self.files.append(path)
            LEDGER.spooled(path)
            event = await result_of(self.sup, self._open(i, {"kind": KIND, "body": {
                "text": text, "voice_path": self.voice, "speed": self.req.speed, "out": path}}))
            self.rate = event.result["sample_rate"]
            speed = 1.0 if event.result["speed_applied"] else self.req.speed
            if self.streamed:
                yield self._first(await self._encode([path], speed, final=False, continued=i > 0))
                self._unlink(path)
        chunk = await self._encode([] if self.streamed else self.files, speed, final=True, continued=self.streamed)
        self.finished = True
        yield self._first(chunk)

    def _open(self, i: int, frame: dict) -> Request:
        """Sentence i's request on the model: the first one is admitted as any request is (or refused with 429
        before any audio); each later one takes the place the one before it held for it, so a full queue never
        cuts an admitted speech short."""
        held, self.next_place = self.next_place, False  # open() takes the place, admitted or not
        handle = self.sup.open(frame, op="request", reserved=held)
        if i + 1 < len(self.pieces):
            try:  # in the step that opened sentence i, so a draining model still takes it (until drained)
                self.sup.reserve(continuing=True)
            except RequestFailed:
                self.sup.close(handle)  # nobody would read its result, nor remove its spool file
                raise
            self.next_place = True  # only once held: close() gives back what was reserved, never more
        return handle

    def _first(self, chunk: bytes) -> bytes:
        if chunk and not self.first_audio:
            self.first_audio = True
            self.sup.router.series.time_to_first_audio.observe(time.monotonic() - self.started)
        return chunk

    async def _encode(self, inputs: list[str], speed: float, final: bool, continued: bool) -> bytes:
        """This response's next bytes from the encoder process.  Shielded: a client that hangs up mid-encode must
        not cancel the exchange, whose cancellation kills the process (so no stale reply reaches the next request)
        and with it every other response's encoder session."""
        try:
            return await asyncio.shield(self.routes.encoder.encode(
                self.session, inputs, self._spool("out"), fmt=self.req.response_format, rate=self.rate, speed=speed,
                final=final, continued=continued))
        except EncoderFault as exc:
            raise RequestFailed(503, "speech_encoder", f"the audio could not be encoded because of a server fault: "
                                f"{exc}", "speech_encoder_unavailable", retry_after=1) from None

    def _spool(self, name: str) -> str:
        return os.path.join(self.routes.spool, f"{self.session}.{name}")

    @staticmethod
    def _unlink(path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)

    async def close(self) -> None:
        if self.next_place:  # the speech ended before its next sentence (a failure, a client gone)
            self.next_place = False
            self.sup.router.unreserve()
        for path in self.files:
            self._unlink(path)
        if self.streamed and not self.finished:
            await self.routes.encoder.drop(self.session)
