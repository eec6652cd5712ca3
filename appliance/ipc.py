"""The front <-> worker channel: length-prefixed JSON frames over one end each of a socketpair.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON: one object with an "op" and
the fields OPS lists for it. Both sides build frames with `frame()` and check what they receive with `check()`,
so a frame that is not in this table is a protocol error wherever it shows up.

EOF on the socket is the only liveness signal either side needs: the kernel closes it the moment the peer dies.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable

HEADER = struct.Struct(">I")
# Both ends refuse a frame past this: encode() before sending (the sender's request fails, FrameTooLarge), and
# decode_length() on receipt (a peer that sent one anyway is broken). The front expands client input (images,
# templates, grammars), so the HTTP body limit does not bound a frame: encode() does. OPENARC_DEBUG_MAX_FRAME
# lowers it for the test that sends one.
MAX_FRAME = int(os.environ.get("OPENARC_DEBUG_MAX_FRAME") or 64 << 20)


@dataclass(frozen=True)
class Op:
    sender: str                        # "front" or "worker"
    required: frozenset[str]
    optional: frozenset[str] = frozenset()
    doc: str = ""


def _op(sender: str, required: str = "", optional: str = "", doc: str = "") -> Op:
    return Op(sender, frozenset(required.split()), frozenset(optional.split()), doc)


OPS: dict[str, Op] = {
    # front -> worker
    "generate": _op("front", "id kind params stream", "messages prompt tools template_kwargs constraint images adapter",
                    "run one request: kind chat (messages, tools, chat_template_kwargs; images: the pixel files of "
                    "a VLM's, appliance.front.api.images) or completion (prompt), with its sampling params and "
                    "output constraint; adapter: the LoRA adapter it names (BASE:ADAPTER), by name"),
    "request": _op("front", "id kind body",
                   "run one request of a one-answer kind (embedding, rerank, transcription, tts): body holds the fields "
                   "its route validated, read by appliance.worker.engines.<kind>; to an llm worker: count the "
                   "prompt tokens of body (a chat generate frame's messages, tools, template_kwargs)"),
    "cancel": _op("front", "id", doc="the caller is gone: stop generating for it"),
    "shutdown": _op("front", doc="leave now (without destructors)"),
    "spec": _op("front", "spec", doc="to a parked worker (started with --parked, OpenVINO imported, nothing loaded): "
                "the model to load now, as --spec would have given it"),
    # worker -> front
    "ready": _op("worker", "load_seconds", "formats pipeline_load_seconds device_bdf load_source",
                 "the pipeline is loaded; its own load time (and the pipeline's part of it), its chat formats "
                 "(tool_parser, reasoning_parser), the PCI address of its GPU (to match kernel-logged resets to "
                 "the card), and whether the load came from the compiled-model cache or compiled "
                 "(appliance.host.compile_cache.load_source)"),
    "fatal": _op("worker", "kind message", "hint public",
                 "the worker cannot go on (a load error, or an internal error after loading) and exits; public: "
                 "the message is openarc's own words (a client's error body may carry it; a runtime's text never)"),
    "tokens": _op("worker", "id text n", "logprobs prompt_tokens cached_tokens max_tokens",
                  "new text of a request, how many tokens it took, and their [text, logprob] if asked for; the "
                  "first also the prompt's tokens, how many of them the prefix cache served, and the answer's "
                  "limit as fitted to the window"),
    "done": _op("worker", "id finish_reason prompt_tokens completion_tokens",
                "cached_tokens reasoning_tokens draft_accepted draft_rejected stop_sequence limit",
                "a request finished (cached_tokens: prompt tokens the prefix cache served; reasoning_tokens on a "
                "model with a reasoning format; draft_* on a model with a "
                "draft or prompt lookup: proposed tokens the main model accepted and rejected; stop_sequence: the one "
                "of the request's stop sequences that ended it; limit: with finish_reason length, the bound that cut it, "
                "appliance.config.window.BOUND_*)"),
    "result": _op("worker", "id result", "counts",
                  "the one answer of a request op; counts add to the model's counters (supervisor.RESULT_COUNTERS)"),
    "error": _op("worker", "id kind code message retryable", "hint prompt_tokens max_context tool_tokens",
                 "a request failed (retryable: a retry may succeed); the worker goes on. A prompt over the window "
                 "(context_length_exceeded) says its size, the window, and how much of it tool definitions are"),
    "step": _op("worker", "id index step steps seconds", "image",
                "an image request's denoising step done (step of steps, of its picture `index`), how long it took, "
                "and, at the steps a streamed request asked partial images for, the picture so far (base64, in the "
                "request's output format)"),
    "picture": _op("worker", "id index data seconds",
                   "one finished picture of an image request (base64, in the request's output format) and the "
                   "seconds it took"),
    "progress": _op("worker", doc="generation goes on though nothing was sent (keeps the stall timer honest)"),
    "telemetry": _op("worker", "rss_bytes",
                     "device_memory_used_bytes device_memory_total_bytes device_memory_regions kv_cache_usage_ratio",
                     "memory figures (and the KV cache's use, where the engine has one), every few seconds; "
                     "device_memory_regions: where its GPU buffers are resident, {vram, system} bytes (DRM fdinfo)"),
    "batch": _op("worker", "frames", doc="the frames of one engine step, sent as one"),
}


class ProtocolError(RuntimeError):
    pass


class FrameTooLarge(ProtocolError):
    """A frame past MAX_FRAME, refused before it was sent: the request it carries fails, the channel goes on."""

    def __init__(self, op: str, length: int):
        super().__init__(f"a {op} frame of {length} bytes exceeds the {MAX_FRAME}-byte frame limit")
        self.length = length


def frame(op: str, **fields: Any) -> dict[str, Any]:
    """Build a frame of `op`; a field the table does not list for it is a bug in the sender."""
    message = {"op": op, **fields}
    check(message)
    return message


def check(message: Any) -> dict[str, Any]:
    """The frame itself if it matches the table, else ProtocolError naming what is wrong."""
    if not isinstance(message, dict):
        raise ProtocolError(f"a frame must be a JSON object, got {type(message).__name__}")
    spec = OPS.get(message.get("op"))  # type: ignore[arg-type]
    if spec is None:
        raise ProtocolError(f"unknown op {message.get('op')!r}")
    fields = message.keys() - {"op"}
    if not spec.required <= fields or not fields <= spec.required | spec.optional:
        missing, extra = spec.required - fields, fields - spec.required - spec.optional
        raise ProtocolError(f"op {message['op']!r}: missing {sorted(missing)}, unexpected {sorted(extra)}")
    return message


def encode(message: dict[str, Any]) -> bytes:
    """The frame's bytes; FrameTooLarge past MAX_FRAME (nothing is sent: the peer would take it for garbage and
    leave, failing every request on the channel)."""
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    if len(body) > MAX_FRAME:
        raise FrameTooLarge(str(message.get("op")), len(body))
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    try:
        return check(json.loads(body))
    except (ValueError, RecursionError) as exc:  # bad JSON or bad UTF-8
        raise ProtocolError(f"a frame that is not JSON: {exc}") from None


def decode_length(header: bytes) -> int:
    (length,) = HEADER.unpack(header)
    if length > MAX_FRAME:
        raise ProtocolError(f"frame of {length} bytes exceeds the {MAX_FRAME}-byte limit")
    return length


class AsyncChannel:
    """The front's end: non-blocking sends, awaitable receives; recv() returns None at EOF."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self._reader = reader
        self._writer = writer

    @classmethod
    async def open(cls, sock: socket.socket) -> AsyncChannel:
        reader, writer = await asyncio.open_unix_connection(sock=sock)
        return cls(reader, writer)

    async def recv(self) -> dict[str, Any] | None:
        """The next frame, None at EOF; ProtocolError for anything that is not a frame of OPS."""
        try:
            header = await self._reader.readexactly(HEADER.size)
            return decode(await self._reader.readexactly(decode_length(header)))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def send(self, message: dict[str, Any]) -> bool:
        """Queue a frame; False when the worker is already gone (its requests are failed elsewhere)."""
        if self._writer.is_closing():
            return False
        frame = encode(message)  # FrameTooLarge is the caller's: its request fails, not the channel
        try:
            self._writer.write(frame)
        except (ConnectionError, RuntimeError):
            return False
        return True

    def close(self) -> None:
        self._writer.close()


class BlockingChannel:
    """The worker's end: a reader thread calls recv(); any thread may send()."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self._sock = sock
        self._rfile = sock.makefile("rb")
        self._send_lock = threading.Lock()

    def recv(self) -> dict[str, Any] | None:
        header = self._rfile.read(HEADER.size)
        if len(header) < HEADER.size:
            return None
        body = self._rfile.read(decode_length(header))
        if body is None or len(body) < HEADER.unpack(header)[0]:
            return None
        return decode(body)

    def send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        with self._send_lock:
            self._sock.sendall(frame)


def serve_requests(stdin, stdout, handle: Callable[[dict[str, Any], bytes], dict[str, Any]]) -> None:
    """A helper process's loop (the front's decoders, appliance.front.helper_process; the token counter): each
    request line and its data through `handle`, whose dict is the reply line; ends at EOF."""
    while True:
        line = stdin.readline()
        if not line:
            return
        request = json.loads(line)
        reply = handle(request, stdin.read(request["bytes"]))
        stdout.write(json.dumps(reply).encode() + b"\n")
        stdout.flush()
