"""POST /v1/audio/transcriptions and /v1/audio/translations, multipart/form-data as the OpenAI SDK sends it.

Fields: `file` (wav, flac, mp3, ogg, webm, mp4/m4a), `model`, `language` (ISO code, or a name), `prompt`,
`response_format` (json, text, srt, vtt, verbose_json), `temperature`, `timestamp_granularities[]` (segment,
word; verbose_json only), `stream` (transcriptions, json and text: SSE transcript.text.delta / .done events).

A request goes: the form's fields before the file read (the OpenAI SDK sends `model` first) -> the model looked
up and a place in its queue reserved (429 at once when it is full, the file never read) -> the file read (at most
the model's max_upload_bytes, else 413; at most MAX_UPLOADS_IN_FLIGHT files held by the front at once, the others
wait unread) -> decoded to 16 kHz mono in the decoder process (appliance.front.audio_decoder; at most
max_audio_seconds, else 413; undecodable or empty: 400; a fault of the decoder's own: 503) -> samples handed to the
model's worker in a spool file, its bytes claimed on the server's one spool budget until the request ends
(appliance.front.spool_budget: no room now is a 503 spool_full with Retry-After) -> the worker's result shaped by
appliance.front.api.transcripts. A form that names its model after the file is read first (within the largest
max_upload_bytes), then admitted.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from aiohttp import BodyPartReader, http_exceptions, web

from appliance.front.api.server_view import ServerView
from appliance.front.api import fields, lookup, sse
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.results import QueuePlace, one_result
from appliance.front.api.route import Call, ErrorShape, route
from appliance.front.api.transcripts import LANGUAGE_CODES, LANGUAGE_NAMES, RESPONSE_FORMATS, Transcript
from appliance.front.audio_decoder import (AudioDecoder, AudioError, DecodedAudio, HelperFault, seconds_in,
                                          spool_bytes_of)
from appliance.front.helper_process import HelperUser
from appliance.front.request import Event, RequestFailed
from appliance.front.spool_budget import SpoolBudget, spool_full

KIND = "transcription"
# Upload files the front holds in memory at once (read, or waiting for the one decoder process): the front's
# memory for uploads stays under this many times max_upload_bytes however many clients upload.
MAX_UPLOADS_IN_FLIGHT = 4
MAX_FIELD_BYTES = 64 << 10  # any form field but the file (a prompt is 224 tokens at most for Whisper)
MAX_FIELDS = 32
GRANULARITIES = ("segment", "word")
BOOLEANS = {"true": True, "1": True, "false": False, "0": False}


def add_routes(app: web.Application, appliance: ServerView) -> None:
    audio = AudioRoutes(appliance)
    app.router.add_post("/v1/audio/transcriptions",
                        route(appliance, "audio/transcriptions", audio.transcriptions, TRANSCRIPT_ERRORS))
    app.router.add_post("/v1/audio/translations",
                        route(appliance, "audio/translations", audio.translations, TRANSCRIPT_ERRORS))
    audio.mount(app)


@dataclass
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    granularities: list[str] = field(default_factory=list)
    file: bytes | bytearray | None = None
    files: dict[str, list[bytearray]] = field(default_factory=dict)  # every file part by its name, in order


@dataclass
class AudioRequest:
    model: str
    task: str
    file: bytes | bytearray
    response_format: str
    language: str | None
    prompt: str | None
    temperature: float
    words: bool
    stream: bool

    def body(self, audio_path: str) -> dict[str, Any]:
        """The body of the worker's `request` frame (appliance.worker.engines.transcription)."""
        return {"audio_path": audio_path, "task": self.task, "language": self.language, "prompt": self.prompt,
                "temperature": self.temperature, "timestamps": self.response_format in ("srt", "vtt", "verbose_json"),
                "words": self.words, "stream": self.stream}


class UploadRoutes(HelperUser):
    """A route family whose requests upload files in a multipart form (Upload admits them): the uploads in flight
    bounded, and the bytes a file may have."""

    def __init__(self, appliance: ServerView, kind: str, helper, spool_prefix: str):
        super().__init__(appliance, kind, helper, spool_prefix)
        self.uploads = asyncio.Semaphore(MAX_UPLOADS_IN_FLIGHT)

    @staticmethod
    def upload_limit(model) -> int:
        """The bytes one uploaded file may have for this model."""
        return model.max_upload_bytes

    @property
    def budget(self) -> SpoolBudget:
        """The server's one spool budget, which every file a request of the family decodes is claimed on."""
        return self.appliance.spool_budget

    def _upload_cap(self) -> int:
        """The largest upload any model of the family's kind takes (without one, the server's max_body_bytes, so a
        request still learns that its model is of another kind): a bigger body is refused while it is read."""
        return max((self.upload_limit(sup.model) for sup in self.appliance.supervisor.models.values()
                    if sup.model.kind == self.kind), default=self.appliance.config.server.max_body_bytes)


class AudioRoutes(UploadRoutes):
    def __init__(self, appliance: ServerView):
        self.decoder = AudioDecoder()
        super().__init__(appliance, KIND, self.decoder, "openarc-audio-")
        self.serial = 0

    async def transcriptions(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._handle(request, call, "transcribe")

    async def translations(self, request: web.Request, call: Call) -> web.StreamResponse:
        return await self._handle(request, call, "translate")

    async def _handle(self, request: web.Request, call: Call, task: str) -> web.StreamResponse:
        self.serial += 1
        audio_path = self.spool_file(f"{self.serial}.f32")
        upload = Upload(self, call)
        try:
            form = await read_form(request, upload.before_file)
            call.label(form.fields)
            req = parse(form, task)
            sup = await upload.admit(req.model)
            check_model_limits(req, sup.model)
            decoded = await self._decode(req, sup.model, audio_path)
            form.file = req.file = b""  # decoded into the spool file: the upload's memory is free for the next
            upload.release_slot()
            frame = {"kind": KIND, "body": req.body(audio_path)}
            sup = await upload.follow(req.model)
            if req.stream:
                return await self._stream(request, call, sup, req, frame, decoded.seconds, upload.hand_over())
            event = await one_result(sup, frame, upload.hand_over())
            transcript = Transcript.from_result(event.result, req.task, decoded.seconds, req.temperature)
            return transcript.response(req.response_format, req.words)
        finally:
            upload.close()
            self.budget.remove(audio_path)

    async def _decode(self, req: AudioRequest, model, audio_path: str) -> DecodedAudio:
        """The upload's samples into the spool file `audio_path`, its bytes reserved on the spool budget as the
        decoder takes it: at most the model's max_audio_seconds and the whole budget's (413 past either:
        max_audio_seconds has no upper bound, and audio the whole spool cannot hold is never served), and the
        budget's room then (the decoder stops there: a 503 spool_full, worth a retry once requests in flight end)."""
        capacity, room = self.budget.capacity, 0

        def reserve() -> float:  # (as the decoder takes the file)
            nonlocal room
            room = self.budget.reserve(audio_path, spool_bytes_of(model.max_audio_seconds))
            return min(model.max_audio_seconds, seconds_in(room))
        try:
            decoded = await self.decoder.decode(req.file, reserve, audio_path)
        except AudioError as exc:
            if exc.kind == "too_long" and room < spool_bytes_of(model.max_audio_seconds):
                if room < capacity:
                    raise spool_full(f"the audio is longer than {seconds_in(room):g} s ({room} bytes of samples)",
                                     capacity) from None
                exc = AudioError("too_long", f"The audio is longer than {seconds_in(room):g} s: its samples would "
                                 f"not fit the server's spool ({capacity} bytes in all).")
            status = 413 if exc.kind == "too_long" else 400
            raise RequestFailed(status, "invalid_request", str(exc), f"audio_{exc.kind}") from None
        except HelperFault as exc:
            raise exc.failure() from None
        self.budget.settle(audio_path, decoded.spool_bytes)
        return decoded

    async def _stream(self, request: web.Request, call: Call, sup, req: AudioRequest, frame: dict[str, Any],
                      seconds: float, reserved: bool) -> web.StreamResponse:
        handle = sup.open(frame, op="request", reserved=reserved)
        events = sup.events(handle)
        try:
            event = await sse.next_event(events)
            sse.refused_before_start(event)
            stream = await sse.EventStream(request).open()
            while isinstance(event, Event) and event.op == "tokens":
                await stream.send({"type": "transcript.text.delta", "delta": event.text, "logprobs": None})
                event = await sse.next_event(events)
            if isinstance(event, RequestFailed):
                return await call.end_stream(stream, event)
            transcript = Transcript.from_result(event.result, req.task, seconds, req.temperature)
            await stream.send({"type": "transcript.text.done", "text": transcript.text.strip(),
                               "logprobs": None, "usage": transcript.usage()})
        finally:
            sup.close(handle)
        return await stream.close()


class TranscriptErrors(ErrorShape):
    """OpenAI's error bodies; in a transcript stream, an event of type "error" like its other events' types."""

    def stream_event(self, failure: RequestFailed) -> dict[str, Any]:
        return {"type": "error", **self.body(failure, None)}


TRANSCRIPT_ERRORS = TranscriptErrors()


class Upload:
    """One upload's admission, decided before its file is read where the form names the model first: the model
    looked up and a place in its queue reserved (so a busy model's 429 comes before the body is read), then one of
    the front's upload slots taken for the file (released once it is decoded)."""

    def __init__(self, routes: UploadRoutes, call: Call):
        self.routes, self.call = routes, call
        self.sup = None
        self.place: QueuePlace | None = None
        self.slot = False

    async def before_file(self, fields: dict[str, str]) -> int:
        """Called when the file part begins: admit the request if the form named its model, take an upload slot
        (waiting, unread, while MAX_UPLOADS_IN_FLIGHT files are held), and say how many bytes the file may have."""
        if fields.get("model"):
            self.call.label(fields)
            await self.admit(fields["model"])
        if not self.slot:  # one slot for all of a form's files (an image edit's image and mask)
            await self.routes.uploads.acquire()
            self.slot = True
        return self.routes.upload_limit(self.sup.model) if self.sup else self.routes._upload_cap()

    async def admit(self, name: str):
        """The model's supervisor, with a place reserved in its queue (RequestFailed if there is none)."""
        if self.sup is None:
            sup = await lookup.model_for(self.routes.appliance, name, self.call, (self.routes.kind,))
            self.place = QueuePlace(sup)
            self.sup = sup
        return self.sup

    async def follow(self, name: str):
        """The model to open on now (QueuePlace.follow: its next load, if it was unloaded under the upload)."""
        self.sup = await self.place.follow(self.routes.appliance, name, self.call, (self.routes.kind,))
        return self.sup

    def hand_over(self) -> bool:
        """The reserved place goes to the request being opened now (ModelSupervisor.open(reserved=True))."""
        return self.place is not None and self.place.hand_over()

    def release_slot(self) -> None:
        if self.slot:
            self.slot = False
            self.routes.uploads.release()

    def close(self) -> None:
        self.release_slot()
        if self.place is not None:
            self.place.release()


async def read_form(request: web.Request, before_file, file_parts: tuple[str, ...] = ("file",),
                    max_files: int = 1) -> Form:
    """The multipart form, each file part (`file_parts` name them) held in memory up to the bytes
    `before_file(fields so far)` allows (413 past it); `before_file` may refuse the request before a file is read.
    More than `max_files` file parts are a 400 before the next is read: each may hold the whole limit, and a form of
    MAX_FIELDS of them held that many times it (1.6 GB of an image edit's) before the route looked at them."""
    if request.content_type != "multipart/form-data":
        raise InvalidRequest(f"the request must be multipart/form-data with a '{file_parts[0]}' part (as the OpenAI "
                             "SDK sends it)")
    form = Form()
    try:
        reader = await request.multipart()
        count = 0
        while (part := await reader.next()) is not None:
            count += 1
            if count > MAX_FIELDS:
                raise InvalidRequest(f"the form has more than {MAX_FIELDS} fields")
            if not isinstance(part, BodyPartReader):  # (aiohttp hands a multipart/mixed part over as a reader of its
                # own parts: no field or file of a form route is one)
                raise InvalidRequest("the form's parts must be fields and files, not a nested multipart")
            if part.name in file_parts:
                if sum(map(len, form.files.values())) == max_files:
                    raise InvalidRequest(f"the form has more than {max_files} file{'s' if max_files > 1 else ''} "
                                         f"({' or '.join(file_parts)})", part.name)
                data = await _read_part(part, await before_file(form.fields), part.name)
                form.files.setdefault(part.name, []).append(data)
                form.file = data if part.name == "file" else form.file
            else:
                value = (await _read_part(part, MAX_FIELD_BYTES, part.name or "")).decode("utf-8")
                if part.name in ("timestamp_granularities[]", "timestamp_granularities"):
                    form.granularities.append(value)
                elif part.name:
                    form.fields[part.name] = value
    except InvalidRequest:
        raise
    except (ValueError, LookupError, http_exceptions.HttpProcessingError) as exc:  # (UnicodeDecodeError too)
        raise InvalidRequest(f"the multipart form could not be read: {exc}") from None
    return form


async def _read_part(part, limit: int, name: str) -> bytearray:
    data = bytearray()  # kept as it is: a copy to bytes would double the upload in memory
    while chunk := await part.read_chunk(1 << 16):
        data += chunk
        if len(data) > limit:
            raise RequestFailed(413, "invalid_request", f"the '{name}' part exceeds the limit of {limit} bytes",
                                "upload_too_large")
    return data


def parse(form: Form, task: str) -> AudioRequest:
    fields = form.fields
    model = fields.get("model")
    if not model:
        raise InvalidRequest("'model' is required", "model")
    if form.file is None:
        raise InvalidRequest("'file' is required: the audio to transcribe", "file")
    if not form.file:
        raise InvalidRequest("'file' is empty", "file", "audio_empty")
    response_format = fields.get("response_format") or "json"
    if response_format not in RESPONSE_FORMATS:
        raise InvalidRequest(f"'response_format' must be one of {', '.join(RESPONSE_FORMATS)}", "response_format")
    for granularity in form.granularities:
        if granularity not in GRANULARITIES:
            raise InvalidRequest("'timestamp_granularities' may hold 'segment' and 'word'", "timestamp_granularities")
    stream = _boolean(fields, "stream") and task == "transcribe" and response_format in ("json", "text")
    return AudioRequest(model=model, task=task, file=form.file, response_format=response_format,
                        language=_language(fields.get("language")), prompt=fields.get("prompt") or None,
                        temperature=_temperature(fields.get("temperature")),
                        words=response_format == "verbose_json" and "word" in form.granularities, stream=stream)


def check_model_limits(req: AudioRequest, model) -> None:
    if len(req.file) > model.max_upload_bytes:
        raise RequestFailed(413, "invalid_request", f"the file is {len(req.file)} bytes; the model '{model.name}' "
                            f"takes at most max_upload_bytes={model.max_upload_bytes}", "upload_too_large")
    if req.words and not model.word_timestamps:
        raise InvalidRequest(f"word timestamps need the model '{model.name}' to be configured with "
                             "word_timestamps: true", "timestamp_granularities")


def _language(value: str | None) -> str | None:
    if not value:
        return None
    code = value.strip().lower()
    code = LANGUAGE_CODES.get(code, code)
    if code not in LANGUAGE_NAMES:
        raise InvalidRequest(f"'language' must be an ISO-639-1 code such as 'en' (got {value!r})", "language")
    return code


def _temperature(value: str | None) -> float:
    if value is None or value == "":
        return 0.0
    temperature = fields.form_number(value, "temperature")
    if not 0.0 <= temperature <= 1.0:
        raise InvalidRequest(f"'temperature' must be a number between 0 and 1 (got {value!r})", "temperature")
    return temperature


def _boolean(fields: dict[str, str], key: str) -> bool:
    value = fields.get(key, "false").strip().lower()
    if value not in BOOLEANS:
        raise InvalidRequest(f"'{key}' must be true or false", key)
    return BOOLEANS[value]
