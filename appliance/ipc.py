"""The front <-> worker channel: length-prefixed JSON frames over one end each of a socketpair.

A frame is a 4-byte big-endian length followed by that many bytes of UTF-8 JSON (one object with an "op").
Front -> worker ops: generate, cancel, shutdown.  Worker -> front ops: ready, tokens, done, error, telemetry, fatal, and batch
(the frames of one engine step sent as one).
EOF on the socket is the only liveness signal either side needs: the kernel closes it the moment the peer dies.
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import threading
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20  # a prompt is bounded by the HTTP body limit; this only guards against garbage


class ProtocolError(RuntimeError):
    pass


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message, separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(body)) + body


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
        try:
            header = await self._reader.readexactly(HEADER.size)
            return json.loads(await self._reader.readexactly(decode_length(header)))
        except (asyncio.IncompleteReadError, ConnectionError):
            return None

    def send(self, message: dict[str, Any]) -> bool:
        """Queue a frame; False when the worker is already gone (its requests are failed elsewhere)."""
        if self._writer.is_closing():
            return False
        try:
            self._writer.write(encode(message))
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
        return json.loads(body) if body is not None else None

    def send(self, message: dict[str, Any]) -> None:
        frame = encode(message)
        with self._send_lock:
            self._sock.sendall(frame)
