"""A long-lived helper process of the front: the decoders it sends untrusted media to (uploaded audio, images in
chat), so a decoder library that crashes on a malformed file takes down only that process, never the front or a
model's worker; and the token counter and the speech encoder, which keep OpenVINO and the audio codecs out of the
front the same way.

Protocol, one request at a time: the front writes a JSON line (the request) and its n bytes of data; the process
answers with one JSON line.  A process that dies on a request gets one more try in a fresh process (it may have
died of an earlier file); one that hangs past the timeout is killed.

Whose fault a failure is decides what the client is told: an input that crashes a fresh decoder is the client's
(a 400 its route words); a decoder that hangs past its timeout, or output that cannot be written (a full spool
disk: the decoder answers WRITE_FAILED), is the server's, a HelperFault: a 503 with Retry-After, never counted
as a bad input.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Any, Callable

from appliance.front.request import RequestFailed
from appliance.front.request_ledger import LEDGER

log = logging.getLogger("openarc")

WRITE_FAILED = "write_failed"  # a decoder's reply when its output could not be written


class HelperFailed(Exception):
    """The process died on this input twice, or hung on it: `how` is "crashed" or "hung"."""

    def __init__(self, how: str):
        super().__init__(how)
        self.how = how


class HelperFault(Exception):
    """A fault of ours, not of the input: the decoder hung (killed and replaced) or could not write its output.
    The input may well be fine: the client is told to retry."""

    def __init__(self, what: str, message: str):
        super().__init__(message)
        self.what = what  # "audio decoder", "image decoder"

    def failure(self) -> RequestFailed:
        """The fault as the client sees it: the server's (503), worth a retry."""
        log.error("%s: %s", self.what, self)
        code = self.what.replace(" ", "_")
        return RequestFailed(503, code, f"the {self.what.split()[0]} could not be decoded because of a server "
                             f"fault: {self}", f"{code}_unavailable", retry_after=1)


def write_failed(out: str, what: str, exc: OSError) -> dict[str, Any]:
    """A decoder's reply when it cannot write its output (ENOSPC, EDQUOT, EIO): the server's trouble."""
    return {"error": WRITE_FAILED, "message": f"cannot write the decoded {what} to {out}: {exc}"}


class HelperProcess:
    """The front's handle on one helper process (`python -m <module>`: a decoder, the token counter, the speech
    encoder): started on first use, restarted after a crash."""

    def __init__(self, module: str, timeout_s: float, what: str, reply_bytes: int = 1 << 16):
        self.module = module
        self.timeout_s = timeout_s
        self.what = what  # for the log: "audio decoder", "image decoder", "token counter", "speech encoder"
        self.reply_bytes = reply_bytes  # the longest reply line it may send
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    async def ask(self, request: dict[str, Any], data: bytes,
                  at_turn: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """The process's reply to `request` with `data`; HelperFailed if it crashed twice or hung. `at_turn`: called
        once the process is this request's (other requests were ahead of it), its fields added to the request: what
        the request may take (a spool file's bytes) is judged and reserved then, not while it waited its turn."""
        async with self._lock:
            header = json.dumps({**request, **(at_turn() if at_turn else {}), "bytes": len(data)}).encode() + b"\n"
            for _ in range(2):
                proc = await self.start()
                try:
                    line = await self._exchange(proc, header, data)
                except asyncio.TimeoutError:
                    await self._discard(proc, "hung")
                    raise HelperFailed("hung") from None
                if line:
                    return json.loads(line)
                await self._discard(proc, "died")
        raise HelperFailed("crashed")

    async def answer(self, request: dict[str, Any], data: bytes,
                     at_turn: Callable[[], dict[str, Any]] | None = None) -> dict[str, Any]:
        """ask(), with the server's own faults raised as HelperFault; HelperFailed("crashed") is left to the
        caller (the input crashed a fresh decoder: the client's)."""
        try:
            reply = await self.ask(request, data, at_turn)
        except HelperFailed as exc:
            if exc.how == "hung":
                raise HelperFault(self.what, f"the {self.what} did not answer within {self.timeout_s:g} s; it was "
                                              "killed and is replaced") from None
            raise
        if reply.get("error") == WRITE_FAILED:
            raise HelperFault(self.what, reply["message"])
        return reply

    async def start(self) -> asyncio.subprocess.Process:
        """The process, started if there is none (the front starts it early when a model needs it)."""
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", self.module, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                limit=self.reply_bytes)
        return self._proc

    async def _exchange(self, proc: asyncio.subprocess.Process, header: bytes, data: bytes) -> bytes:
        """One request and its reply line; b"" if the process died on it."""
        try:
            proc.stdin.write(header)
            proc.stdin.write(data)
            await proc.stdin.drain()
            async with asyncio.timeout(self.timeout_s):  # (not wait_for: appliance.front.lifecycle.Changes.wait)
                return await proc.stdout.readline()
        except ConnectionError:
            return b""
        except asyncio.CancelledError:  # the client left mid-decode: its reply must not reach the next request
            proc.kill()
            self._proc = None
            raise

    async def _discard(self, proc: asyncio.subprocess.Process, how: str) -> None:
        """Kill a process that died or hung, and reap it."""
        if proc.returncode is None:
            proc.kill()
        returncode = await proc.wait()
        log.warning("%s process %d %s on its input (exit %d); starting a new one", self.what, proc.pid, how, returncode)
        self._proc = None

    async def close(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.stdin.close()
            try:
                async with asyncio.timeout(5):
                    await self._proc.wait()
            except TimeoutError:
                self._proc.kill()
                await self._proc.wait()
        self._proc = None


class HelperUser:
    """A route family that hands media to a helper process and keeps a spool directory for its files (the audio
    routes, the speech route): the helper is started with the server when a model of `kind` is configured, so the
    first request does not wait for it, and both end with the server."""

    def __init__(self, appliance, kind: str, helper: HelperProcess, spool_prefix: str):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, metrics, config
        self.kind, self.helper = kind, helper
        self.spool = tempfile.mkdtemp(prefix=spool_prefix)

    def spool_file(self, name: str) -> str:
        """The path of a spool file of the current request, `name` in the spool directory: named here, so that
        the request ledger (appliance.front.request_ledger) checks it is gone when its request ends."""
        path = os.path.join(self.spool, name)
        LEDGER.spooled(path)
        return path

    def mount(self, app) -> None:
        app.on_startup.append(self.start)
        app.on_cleanup.append(self.close)

    async def start(self, app) -> None:
        if any(model.kind == self.kind for model in self.appliance.config.models):
            await self.helper.start()

    async def close(self, app) -> None:
        await self.helper.close()
        shutil.rmtree(self.spool, ignore_errors=True)
