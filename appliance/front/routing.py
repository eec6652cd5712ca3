"""A model's requests in the front: the queue, their dispatch to the worker, and the worker's frames turned into
each request's events.

The router holds no model state: whether the model admits requests is its WorkerLife's (appliance.front.worker_life),
which attaches the ready worker's channel and detaches it when that worker's life ends. Without a channel nothing
is dispatched; a request that was admitted waits in the queue until its worker is attached or its failure comes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, AsyncIterator, Callable

from appliance import ipc
from appliance.config import ModelConfig
from appliance.front import keys
from appliance.front.admission import AdmissionQueue
from appliance.front.metrics import ModelMetrics
from appliance.front.priority import BACKGROUND
from appliance.front.request import Event, Request, RequestFailed
from appliance.front.request_ledger import LEDGER
from appliance.ipc import AsyncChannel, ProtocolError

log = logging.getLogger(__name__)

# What a result frame's "counts" may add to the model's counters (ModelMetrics fields).
# (prompt_tokens goes to the token counters of the request's key and class: RequestRouter._count_prompt.)
RESULT_COUNTERS = frozenset({"embedding_inputs", "audio_seconds", "speech_audio_seconds", "speech_characters"})
# The frames of one request (an `id`); every one of them is progress for the stall timer.
IMAGE_OPS = frozenset({"step", "picture"})  # an image request's progress and pictures (appliance.worker.engines.image)
REQUEST_OPS = frozenset({"tokens", "done", "result", "error", "progress"}) | IMAGE_OPS


def adapter_of(req: Request) -> str:
    """The LoRA adapter a request names ("" for the base model, and for requests that are not generations)."""
    return req.frame.get("adapter", "") if req.op == "generate" else ""


class RequestRouter:
    """One model's running and queued requests."""

    def __init__(self, model: ModelConfig, series: ModelMetrics):
        self.model = model
        self.series = series
        # the LoRA adapters the model serves now (its ModelSupervisor sets it: its worker's spec)
        self.adapters_served: Callable[[], dict] = dict
        self.running: dict[int, Request] = {}
        # ordered by priority class (appliance.front.admission)
        self.waiting = AdmissionQueue(model.background_max_wait_s)
        self.awaiting_ready = 0  # requests waiting for this model to become ready (Supervisor.ready_model)
        self.reserved = 0  # places held for requests whose body is still being read (reserve())
        # Requests handed this model (Supervisor.ready_model) that have neither opened nor reserved yet: when, by the
        # request's ticket. Its open() or reserve() ends the hand-out; Placement counts the fresh ones as busy.
        self.handouts: dict[int, float] = {}
        self.ids = itertools.count(1)
        self.idle = asyncio.Event()  # nothing running, queued or reserved: what a drain waits for
        self.idle.set()
        self.on_idle: Callable[[], None] = lambda: None  # the Supervisor's residency bookkeeping: replan, last used
        self.on_first_output: Callable[[], None] = lambda: None  # once: a switch's last stage (the residency owner)
        self.first_output: float | None = None  # when the first tokens or result of any request went out
        self.last_progress = time.monotonic()  # the stall timer's reference (WorkerLife._monitor)
        self.channel: AsyncChannel | None = None  # the ready worker's, while it serves
        self.aging: asyncio.TimerHandle | None = None  # a dispatch at the queue's next aging (_watch_aging)
        # False while the model's supervisor does not serve its name (a replacement not switched to yet, or one
        # replaced): only the serving one writes the model's gauges.
        self.reports = True

    # --- the worker, as the life attaches it ----------------------------------------------------------------

    def attach(self, channel: AsyncChannel) -> None:
        self.channel = channel
        self._dispatch()

    def detach(self, failure: RequestFailed) -> None:
        """The worker's life ended (or is ending): nothing more goes to it, and every request fails with `failure`."""
        self.channel = None
        self.fail_all(failure)

    # --- requests, as the routes use them -------------------------------------------------------------------

    def hand_out(self, now: float, grace_s: float) -> None:
        """A request was handed this model and will open on it (or reserve a place) shortly; stale hand-outs (a
        request that never opened: a 400 after its model was ready) are forgotten here."""
        for ticket, at in list(self.handouts.items()):
            if now - at >= grace_s:
                del self.handouts[ticket]
        self.handouts[id(keys.CURRENT.get())] = now

    def _opened(self) -> None:
        """This task's request opened or reserved: its hand-out, if any, is over."""
        self.handouts.pop(id(keys.CURRENT.get()), None)

    def reserve(self, continuing: bool = False) -> None:
        """Hold a place for a request whose body is still to be read (an audio upload), or refuse it with 429 now,
        before the body is read. open(reserved=True) takes the place; unreserve() gives it back. `continuing`: the
        place is for the next part of a request already admitted (a speech request's next sentence), held whatever
        the queue's length, so that an admitted request is never refused halfway."""
        if not continuing:
            self._check_room()
        self._opened()
        self.reserved += 1
        self.publish_queue()
        self._note_idle()

    def unreserve(self) -> None:
        self._give_back_place()
        self.publish_queue()
        self._note_idle()

    def _give_back_place(self) -> None:
        """One reserved place less. A place given back that was never held is a bug in its holder: it is logged and
        the count kept at zero, since a count below zero would keep the model from ever looking idle (its drain
        would then wait out the whole drain_timeout_s)."""
        if self.reserved <= 0:
            log.error("model %s: a reserved queue place was given back that was not held", self.model.name)
            return
        self.reserved -= 1

    def open(self, frame: dict[str, Any], op: str = "generate", reserved: bool = False) -> Request:
        """Queue a request, or refuse it with 429 when the queue is full (unless its place was `reserved`: then the
        reserved place becomes its place in the queue, never free in between for a drain to end at).
        `frame`: the fields of its ipc `op` (generate for an LLM, request for the one-answer kinds) but the id."""
        if not reserved:
            self._check_room()
        # the key and class the route wrapper admitted this request with (appliance.front.keys.CURRENT)
        req = Request(next(self.ids), frame, op, ticket=keys.current_ticket())
        req.frame["id"] = req.id
        LEDGER.opened(req, self.model.name)
        self._opened()
        self.waiting.push(req, req.ticket.priority, req.submitted)
        if reserved:
            self._give_back_place()
        self._dispatch()
        return req

    def _check_room(self) -> None:
        held = len(self.running) + len(self.waiting) + self.reserved
        if held >= self.model.effective_max_running + self.model.max_queue:
            queued = held - min(held, self.model.effective_max_running)
            raise RequestFailed(429, "overloaded", f"model {self.model.name} has {queued} requests queued "
                                                   f"(max_queue={self.model.max_queue}); retry later", retry_after=1)

    def close(self, req: Request) -> None:
        """The caller is done with a request (finished, failed or disconnected): cancel it if it is still live."""
        LEDGER.closed(req, self.model.name)
        if req.ended:
            return
        req.ended = True
        if req in self.waiting:
            self.waiting.remove(req)
        elif self.running.pop(req.id, None) is not None and self.channel:
            self.channel.send(ipc.frame("cancel", id=req.id))
        self._dispatch()

    @staticmethod
    async def events(req: Request) -> AsyncIterator[Event]:
        """Yield a request's events until done; a failure is raised as RequestFailed.

        Token events that queued up while the caller was busy (writing to a slow client, say) come out merged,
        so a caller that falls behind catches up with one write instead of many.
        """
        pending: Event | RequestFailed | None = None
        while True:
            item, pending = pending or await req.events.get(), None
            while isinstance(item, Event) and item.op == "tokens" and not req.events.empty():
                following = req.events.get_nowait()
                if isinstance(following, Event) and following.op == "tokens":
                    logprobs = (item.logprobs or []) + (following.logprobs or []) if item.logprobs is not None else None
                    item = Event("tokens", text=item.text + following.text, n=item.n + following.n, logprobs=logprobs,
                                 prompt_tokens=item.prompt_tokens or following.prompt_tokens,
                                 cached_tokens=item.cached_tokens or following.cached_tokens,
                                 max_tokens=item.max_tokens or following.max_tokens)
                else:
                    pending = following
                    break
            if isinstance(item, RequestFailed):
                raise item
            yield item
            if item.op in ("done", "result"):
                return

    def _dispatch(self) -> None:
        while self.waiting and len(self.running) < self.model.effective_max_running and self.channel:
            background = sum(r.ticket.priority == BACKGROUND for r in self.running.values())
            entry = self.waiting.pop_next(time.monotonic(), background, self.model.background_slots)
            if entry is None:  # only background requests wait, and their slots are taken
                break
            req = entry.item
            if not self.running:
                self.last_progress = time.monotonic()  # an idle worker's stall clock starts now
            req.dispatched = time.monotonic()
            self.running[req.id] = req
            self.series.queue_time[req.ticket.priority].observe(req.dispatched - req.submitted)
            try:
                self.channel.send(ipc.frame(req.op, **req.frame))
            except ipc.FrameTooLarge as exc:  # the request's own size: it fails, the worker and the others go on
                self.finish(req, RequestFailed(413, "invalid_request", f"the request is too large to pass to its "
                                               f"model's worker: {exc}", "request_too_large"))
            except (ValueError, ProtocolError) as exc:  # a frame that cannot be sent must not hold a slot forever
                self.finish(req, RequestFailed(500, "internal", f"cannot pass the request to its worker: {exc}"))
            else:
                req.ticket.dispatched = True  # its prompt's work begins: it is charged whatever the client does
        self._watch_aging()
        self.publish_queue()
        self._note_idle()

    def _watch_aging(self) -> None:
        """One timer for the queue's earliest aging deadline (AdmissionQueue.ages_at), replaced at every dispatch:
        a background request held back by the background slots ages with no request opening or ending, and must
        then take a free slot at once rather than at the next request's arrival or end."""
        if self.aging is not None:
            self.aging.cancel()
            self.aging = None
        now = time.monotonic()
        at = self.waiting.ages_at(now) if self.channel else None
        if at is not None:  # the loop's clock is time.monotonic (asyncio's default)
            self.aging = asyncio.get_running_loop().call_later(max(0.0, at - now), self._dispatch)

    def _note_idle(self) -> None:
        """A reserved place is work as a queued request is: the model is idle only when it has none of them."""
        if self.running or self.waiting or self.reserved:
            self.idle.clear()
        elif not self.idle.is_set():
            self.idle.set()
            self.on_idle()

    def publish_queue(self) -> None:
        if not self.reports:
            return
        self.series.requests_running.set(len(self.running))
        self.series.requests_waiting.set(self.queued())
        if self.model.adapters:  # the endpoint picker's LoRA affinity reads which adapters run and wait here
            self.series.lora_info(self._served_adapters(self.running.values()), self._served_adapters(self.waiting),
                                  self.model.max_adapters)

    def _adapter_series(self, req: Request):
        """The counters of the adapter a request names, on a model with adapters; None once it is unloaded (its
        series went with it, appliance.front.api.adapters: a request finishing after must not bring them back)."""
        adapter = adapter_of(req)
        if not self.model.adapters or adapter and adapter not in self.adapters_served():
            return None
        return self.series.adapter(adapter)

    def _served_adapters(self, requests) -> list[str]:
        """The served names (BASE:ADAPTER, what a client and the endpoint picker name) of the adapters requests use."""
        return [f"{self.model.name}:{adapter}" for adapter in map(adapter_of, requests) if adapter]

    def queued(self) -> int:
        """Requests waiting: in the queue, for the model to be ready, or for their body to be read."""
        return len(self.waiting) + self.awaiting_ready + self.reserved

    # --- the worker's frames --------------------------------------------------------------------------------

    def request_of(self, message: dict[str, Any]) -> Request | None:
        """The running request a request frame is for (None: a late frame for one its caller closed); the frame
        is progress either way."""
        self.last_progress = time.monotonic()
        return self.running.get(message.get("id"))

    def on_frame(self, req: Request, message: dict[str, Any]) -> None:
        """A tokens, done or result frame of a running request."""
        op = message["op"]
        if self.first_output is None and op in ("tokens", "result"):
            self.first_output = time.monotonic()
            self.on_first_output()
        if op == "tokens":
            self._on_tokens(req, message)
        elif op in IMAGE_OPS:  # an image request's progress and pictures, to its route as they come
            self._on_image_frame(req, message)
        elif op == "done":
            cached = min(message.get("cached_tokens", 0), message["prompt_tokens"])
            self._count_prompt(req, message["prompt_tokens"], cached)
            if "draft_accepted" in message:
                self.series.draft.add(message["draft_accepted"], message["draft_rejected"])
            if message["finish_reason"] == "length" and message.get("limit") in self.series.answers_cut:
                self.series.answers_cut[message["limit"]].inc()  # silent truncation has a witness
            self.finish(req, Event("done", finish_reason=message["finish_reason"],
                                   prompt_tokens=message["prompt_tokens"], cached_tokens=cached,
                                   completion_tokens=message["completion_tokens"],
                                   reasoning_tokens=message.get("reasoning_tokens"),
                                   stop_sequence=message.get("stop_sequence")))
        elif op == "result":
            counts = message.get("counts", {})
            for name in RESULT_COUNTERS.intersection(counts):
                getattr(self.series, name).inc(counts[name])
            self._count_prompt(req, counts.get("prompt_tokens", 0))
            self.finish(req, Event("result", result=message["result"], prompt_tokens=counts.get("prompt_tokens", 0)))

    def _on_tokens(self, req: Request, message: dict[str, Any]) -> None:
        now = time.monotonic()
        if req.first_token is None:
            req.first_token = now
            mostly_cached = 2 * message.get("cached_tokens", 0) >= message.get("prompt_tokens", 0) > 0
            (self.series.ttft_cached if mostly_cached else self.series.ttft).observe(now - req.submitted)
        elif message["n"]:
            self.series.itl.observe((now - req.last_token) / message["n"])
        req.last_token = now
        self.series.tokens(req.ticket.key, req.ticket.priority).generation.inc(message["n"])
        if adapter := self._adapter_series(req):
            adapter.generation.inc(message["n"])
        req.ticket.count_tokens(message["n"])
        if message.get("prompt_tokens"):  # tokens_per_minute counts the prompt now
            req.ticket.charge_prompt(message["prompt_tokens"])
        req.events.put_nowait(Event("tokens", text=message["text"], n=message["n"], logprobs=message.get("logprobs"),
                                    prompt_tokens=message.get("prompt_tokens", 0),
                                    cached_tokens=message.get("cached_tokens", 0),
                                    max_tokens=message.get("max_tokens")))

    def _on_image_frame(self, req: Request, message: dict[str, Any]) -> None:
        req.events.put_nowait(Event(message["op"], result=message))

    def count_image_frame(self, message: dict[str, Any]) -> None:
        """An image worker's step or picture in the model's metrics, whether its caller is still there or not: the
        work was done (and a step counted after its caller hung up shows a worker that did not stop)."""
        if message["op"] == "step":
            self.series.image_step_seconds.observe(message["seconds"])
        else:
            self.series.images_generated.inc()
            self.series.image_seconds.observe(message["seconds"])

    def _count_prompt(self, req: Request, prompt_tokens: int, cached_tokens: int = 0) -> None:
        """A finished generation's prompt tokens in the metrics (`cached_tokens` of them served by the prefix
        cache) and against its key, once per HTTP request however many choices (`n`) share its ticket, as its
        `usage` counts them."""
        ticket = req.ticket
        if not ticket.prompt_metered:
            ticket.prompt_metered = True
            series = self.series.tokens(ticket.key, ticket.priority)
            series.prompt.inc(prompt_tokens - cached_tokens)
            series.cached_prompt.inc(cached_tokens)
            if req.op == "generate" and (adapter := self._adapter_series(req)):
                adapter.requests.inc()
                adapter.prompt.inc(prompt_tokens)
        ticket.charge_prompt(prompt_tokens)

    def fail(self, req: Request, failure: RequestFailed) -> None:
        """The worker's error frame for a request. A client's error (4xx) is the worker's refusal before any work on
        the prompt: the key pays nothing for it (a 400 must not cost a retry a 429)."""
        if failure.status < 500:
            req.ticket.refused()
        self.finish(req, failure)

    def finish(self, req: Request, outcome: Event | RequestFailed) -> None:
        self.running.pop(req.id, None)
        req.ended = True
        req.events.put_nowait(outcome)
        self._dispatch()

    def fail_all(self, failure: RequestFailed) -> None:
        """Fail every running and queued request at once: the worker is gone or stuck, or the model stops."""
        for req in list(self.running.values()) + list(self.waiting):
            req.ended = True
            req.events.put_nowait(failure)
        self.running.clear()
        self.waiting.clear()
        self._dispatch()
