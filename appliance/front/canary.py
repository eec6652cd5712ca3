"""The canary before READY: a model with a golden record (appliance.golden) answers its probes once its worker has
loaded, before it takes a request, and the answers are judged against the record (server.canary).

`gate`: a model that fails is refused (it ends failed, with the difference as its error: a restart would answer
the same), and at the server's start the server exits without READY (appliance.front.server). `warn`: it serves,
and the difference is logged. Both count it in openarc_canary_failures_total{model,reason}. `off`: no check.

The probes run through the model's own request path: the route's own parsing builds each request's frame, the
model's router queues it to its worker like any client's (appliance.front.routing); the front runs no pipeline.
`openarc golden record` and `check` run the same probes (observe()) on a model that is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from typing import Any, Callable

from appliance.config import Config, ModelConfig
from appliance.config.replicas import model_name
from appliance.front.api import embeddings, rerank
from appliance.front.api.audio import AudioRequest
from appliance.front.api.completions import parse_chat
from appliance.front.api.speech import choose_voice
from appliance.front.metrics import Metrics
from appliance.front.request import Event, RequestFailed
from appliance.front.routing import RequestRouter
from appliance.golden import probes
from appliance.golden.compare import ERROR, Difference, compare
from appliance.golden.record import Answer, ModelRecord, RecordError, golden_path, load
from appliance.model_files import voice_files

log = logging.getLogger("openarc.canary")


class Canary:
    """The server's canary: which models it checks (server.canary, the record beside the config), and the check."""

    def __init__(self, config_of: Callable[[], Config], metrics: Metrics):
        self.config_of = config_of  # the config in force (a reload may change the mode or the record's place)
        self.metrics = metrics
        self.failures: dict[str, Difference] = {}  # the latest failed check of each unit (a pass removes it)
        # the record file as last read: (path, its version), and its models or why it cannot be read
        self._read: tuple[tuple, dict[str, ModelRecord] | RecordError] | None = None

    @property
    def mode(self) -> str:
        return self.config_of().server.canary

    def wants(self, model: ModelConfig) -> bool:
        """Whether a worker of this model that just loaded is checked before it serves: canary on, and a record of
        it (or a record file that cannot be read, which is a failure of every model: under gate, nothing
        unchecked serves); never a kind without probes (image). The record is the model's, under its name: each
        replica's worker is checked against it (a replica's unit key, NAME@DEVICE#i, names no record)."""
        if self.mode == "off" or not probed(model.kind):
            return False
        try:
            return model.name in self._records()
        except RecordError:
            return True

    async def refresh(self) -> None:
        """Read the record file in a thread if it changed since it was last read: a large one takes seconds to parse,
        and the front's event loop (health, the watchdog, every other model's requests) must not wait for it.
        Called before a worker is vetted, so wants() and check() find it read."""
        if self.mode != "off":
            with contextlib.suppress(RecordError):  # kept as read: wants() and check() say it
                await asyncio.to_thread(self._records)

    def _records(self) -> dict[str, ModelRecord]:
        """The record file's models, parsed once per version of the file (its inode, size and mtime)."""
        path = golden_path(self.config_of().source)
        if path is None:
            return {}
        version = (path, _file_version(path))
        if self._read is None or self._read[0] != version:
            try:
                self._read = (version, load(path))
            except RecordError as exc:
                self._read = (version, exc)
        result = self._read[1]
        if isinstance(result, RecordError):
            raise result
        return result

    async def check(self, model: ModelConfig, router: RequestRouter, load_seconds: float | None) -> Difference | None:
        """Check one freshly loaded worker against its record (bounded by the model's load_timeout_s): the first
        difference, or None when it passes. Judged by judge(), unless the worker's life ended meanwhile."""
        await self.refresh()
        try:
            recorded = self._records().get(model.name)
        except RecordError as exc:
            return Difference(ERROR, f"model {model.name}: {exc.summary}")
        if recorded is None:  # its record was taken out since it loaded
            return None
        try:
            async with asyncio.timeout(model.load_timeout_s):  # (not wait_for: appliance.front.lifecycle.Changes.wait)
                observed = await observe(model, router, load_seconds)
        except TimeoutError:
            return Difference(ERROR, f"model {model.name}: the probes took longer than load_timeout_s="
                                     f"{model.load_timeout_s:g}")
        except RequestFailed as exc:
            return Difference(ERROR, f"model {model.name}: a probe failed: {exc.message}")
        return compare(model.name, recorded, observed, self.config_of().server.canary_min_speed)

    def judge(self, name: str, difference: Difference | None) -> None:
        """A check's outcome for the model (or replica: its unit key) `name`: a pass clears its failure; a failure
        is kept (the start's gate reads it), counted under the model's name, and under warn logged (under gate the
        refused model's error says it)."""
        if difference is None:
            self.failures.pop(name, None)
            log.info("canary: model %s answers as recorded", name)
            return
        self.failures[name] = difference
        self.metrics.canary_failures.labels(model=model_name(name), reason=difference.reason).inc()
        if self.mode == "warn":
            log.warning("canary (server.canary: warn): %s", difference)


def _file_version(path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:  # absent (no record), or unreadable (load() says why)
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


async def observe(model: ModelConfig, router: RequestRouter, load_seconds: float | None) -> ModelRecord:
    """The model's answers to its kind's probes now, with their speed: what a record holds. The probes run twice:
    the answers are the first run's, the speed the faster run's (a fresh worker's first requests pay one-off
    costs that say nothing about its kernels)."""
    async def run(spool: str) -> tuple[list[Answer], float]:
        started = time.monotonic()
        answers, work = await PROBES[model.kind](model, router, spool)
        return answers, work / max(time.monotonic() - started, 1e-6)

    with tempfile.TemporaryDirectory(prefix="openarc-canary-") as spool:
        (answers, speed), (_, again) = [await run(spool) for _ in range(2)]
    return ModelRecord(kind=model.kind, answers=answers, speed=max(speed, again),
                       speed_unit=probes.speed_unit(model.kind), load_seconds=load_seconds)


async def _chat(model: ModelConfig, router: RequestRouter, spool: str) -> tuple[list[Answer], int]:
    answers = []
    for prompt in probes.CHAT_PROMPTS:
        req = parse_chat({"model": model.name, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                          "max_tokens": probes.CHAT_MAX_TOKENS, "logprobs": True})
        tokens: list[str] = []
        for event in await _events(router, req.frame(), "generate"):
            tokens.extend(text for text, _ in event.logprobs or ())
        answers.append(Answer(prompt, tokens=tokens))
    return answers, sum(len(a.tokens) for a in answers)


async def _embedding(model: ModelConfig, router: RequestRouter, spool: str) -> tuple[list[Answer], int]:
    # truncate: a model configured with a window shorter than a probe still answers it (as the record did)
    req = embeddings.parse({"model": model.name, "input": list(probes.EMBEDDING_TEXTS), "truncate": True})
    result = await _result(router, model, req.body)
    vectors = [json.loads(v) if isinstance(v, str) else v for v in result["embeddings"]]
    return [Answer(text, vector=[round(x, 6) for x in vector[:probes.VECTOR_VALUES]])
            for text, vector in zip(probes.EMBEDDING_TEXTS, vectors)], len(vectors)


async def _rerank(model: ModelConfig, router: RequestRouter, spool: str) -> tuple[list[Answer], int]:
    req = rerank.parse({"model": model.name, "query": probes.RERANK_QUERY, "documents": list(probes.RERANK_DOCUMENTS),
                        "truncate": True})
    result = await _result(router, model, req.body)
    return [Answer(probes.RERANK_QUERY, vector=[round(s, 6) for s in result["scores"]])], 1


async def _transcription(model: ModelConfig, router: RequestRouter, spool: str) -> tuple[list[Answer], int]:
    path = os.path.join(spool, "clip.f32")
    with open(path, "wb") as out:
        out.write(probes.clip_f32())
    req = AudioRequest(model=model.name, task="transcribe", file=b"", response_format="json", language=None,
                       prompt=None, temperature=0.0, words=False, stream=False)
    result = await _result(router, model, req.body(path))
    return [Answer(probes.CLIP_NAME, tokens=probes.words(result["text"]))], 1


async def _tts(model: ModelConfig, router: RequestRouter, spool: str) -> tuple[list[Answer], int]:
    path = os.path.join(spool, "speech.f32")
    voice = choose_voice(None, voice_files(model.path, model.voices), model.default_voice, model.name)
    result = await _result(router, model, {"text": probes.SPEECH_TEXT, "voice_path": voice, "speed": 1.0, "out": path})
    with open(path, "rb") as audio:
        first = audio.read(int(probes.CHECKSUM_SECONDS * result["sample_rate"]) * 4)  # float32 samples
    return [Answer(probes.SPEECH_TEXT, samples=result["samples"], checksum=hashlib.sha256(first).hexdigest()[:16])], 1


PROBES = {"llm": _chat, "vlm": _chat, "embedding": _embedding, "rerank": _rerank, "transcription": _transcription,
          "tts": _tts}


def probed(kind: str) -> bool:
    """Whether models of this kind have golden probes: `golden record` skips the others, and the canary never
    holds one of them in `loading` for a check it cannot run (an image model: no probe yet)."""
    return kind in PROBES


async def _result(router: RequestRouter, model: ModelConfig, body: dict[str, Any]) -> dict[str, Any]:
    events = await _events(router, {"kind": model.kind, "body": body}, "request")
    return next(event.result for event in events if event.op == "result")


async def _events(router: RequestRouter, frame: dict[str, Any], op: str) -> list[Event]:
    """Every event of one request queued on the model's router, as a route's request is; closed whatever happens."""
    handle = router.open(frame, op)
    try:
        return [event async for event in router.events(handle)]
    finally:
        router.close(handle)
