"""The continuous batching LLM engine: every admitted request advances together, one
ContinuousBatchingPipeline.step() at a time, each read through its GenerationHandle.

A module apart from the shared half (appliance.worker.engines.llm: prompts, generation config, stop sequences,
replies) because this loop is what only this pipeline has: the step, the scheduler's statuses (a request it
ignored is admitted again or failed as out of memory), the prefix cache model, the KV-cache usage figure and
speculative decoding's tally. `scheduler_config` lives here too: this pipeline's scheduler is built with it, and
the benches' in-process pipelines build theirs with it as the worker does.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any

from appliance.worker import adapter_rotation, prefix_cache
from appliance.worker.engines import speculative
from appliance.worker.engines.adapters import Adapters
from appliance.worker.engines.llm import LLMEngine, Request
from appliance.worker.prompt import INVALID_REQUEST, Refused

log = logging.getLogger("openarc.worker")

# LoRA: requests a group takes after its turn began while another group waits (appliance.worker.adapter_rotation).
TURN_REQUESTS = 8
DRAIN_STEPS = 8  # steps a switch waits for genai to drop cancelled requests (one is enough), then generate() says why


class BatchingEngine(LLMEngine):
    """Continuous batching: every admitted request advances together, one pipeline.step() at a time."""

    def __init__(self, spec, channel):
        import openvino_genai
        self.adapters = Adapters(spec)
        self.pipe = speculative.load_pipeline(spec, scheduler_config(spec["scheduler_config"]),
                                              self.adapters.construction())
        self.cache_model = prefix_cache.for_spec(spec)  # None with prefix caching off
        self.speculative = bool(spec.get("speculative"))
        super().__init__(spec, channel, self.pipe.get_tokenizer())
        self.active: dict[int, tuple[Request, Any]] = {}
        status = openvino_genai.GenerationStatus
        self.status_values = (status.RUNNING.value, status.FINISHED.value, status.IGNORED.value)
        self.finish_none = openvino_genai.GenerationFinishReason.NONE.value
        self.kv_cache_usage_ratio = 0.0
        self.fresh_constraint = False  # a request with a constraint joined since the last step
        # LoRA (appliance.worker.adapter_rotation): the group whose adapter set the pipeline runs (None: none applied
        # yet), how many requests joined since its turn began, and the requests of other groups waiting their turn.
        self.group: str | None = None
        self.joined = 0
        self.held: dict[str, collections.deque[Request]] = {}

    def run(self) -> None:
        while True:
            self.drain_inbox(block=not self.active and not self.holding())
            if not self.active and self.holding():
                self._next_turn()
            if self.active:
                self._step()
            self.flush()

    def holding(self) -> bool:
        return any(self.held.values())

    def _joins(self, req: Request) -> bool:
        """Whether a request may join the pipeline now (its adapter's group has the turn), else it waits in held."""
        if not self.adapters:
            return True
        if self._may_join(req.adapter):
            self.joined += 1
            return True
        self.held.setdefault(req.adapter, collections.deque()).append(req)
        return False

    def _may_join(self, group: str) -> bool:
        others = any(queue for held, queue in self.held.items() if held != self.group)
        return adapter_rotation.may_join(group, self.group, self.joined, others, TURN_REQUESTS)

    def _next_turn(self) -> None:
        """The pipeline has drained: the next waiting group's adapter set is applied (genai applies adapters in
        generate() only: one token of one token's prompt), and its waiting requests join."""
        group = adapter_rotation.next_group(self.group, [g for g, queue in self.held.items() if queue])
        waiting = self.held[group]
        try:
            self._apply(group)
        except Exception as exc:
            requests = list(waiting)
            waiting.clear()
            self.exit_if_device_lost(self.fail_all(requests, exc))
            return
        self.group, self.joined = group, 0
        while waiting and self._may_join(group):
            self.joined += 1
            self.on_generate_prepared(waiting.popleft(), joined=True)

    def unload_adapter(self, name: str) -> None:
        """Requests running with it finish with it (genai holds the adapter while a config names it); those waiting
        for its turn fail, as a request naming it after the unload would."""
        super().unload_adapter(name)
        if self.group == name:
            # the pipeline still runs this adapter's weights: a request naming an adapter loaded later under the same
            # name must wait for a turn of its own, whose generate() applies the new one (joining now, it would run
            # the old file's weights)
            self.group = None
        for req in self.held.pop(name, ()):
            self.fail(req.id, INVALID_REQUEST, f"the adapter {name!r} was unloaded before the request ran")

    def _apply(self, group: str) -> None:
        import numpy as np
        import openvino as ov
        import openvino_genai
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = 1
        config.adapters = self.adapters.config_for(group)
        # generate() refuses while genai holds any request: one cancelled since the last step (a client gone, a stop
        # sequence) leaves at the next step
        for _ in range(DRAIN_STEPS):
            if not self.pipe.has_non_finished_requests():
                break
            self.pipe.step()
        token = self.tokenizer.get_eos_token_id()
        self.pipe.generate([ov.Tensor(np.array([[token]], dtype=np.int64))], [config])
        log.debug("adapter group %r applied", group)

    def _step(self) -> None:
        # genai compiles a constraint again (its own cache) in the first step of the request that brings it
        fresh, self.fresh_constraint = self.fresh_constraint, False
        try:
            # a heartbeat only when a constraint may compile: every other step pays nothing for it
            with self.compiling() if fresh else contextlib.nullcontext():
                self.pipe.step()
        except Exception as exc:  # the whole batch failed inside the plugin
            fault = self.fail_all([req for req, _ in self.active.values()], exc)
            self._drop_all()
            self.exit_if_device_lost(fault)
            return
        self._collect()
        # genai's figure is the last step's and stays put once nothing runs; an idle model's blocks are free
        # for new requests (what a load balancer asks), so idle reads 0.
        self.kv_cache_usage_ratio = self.pipe.get_metrics().cache_usage / 100 if self.active else 0.0
        self.after_step()

    def busy(self) -> bool:
        return bool(self.active) or self.holding()

    def on_cancel(self, request_id: int) -> None:
        if request_id in self.active:
            self.active.pop(request_id)[1].cancel()
        elif any(req.id == request_id for queue in self.held.values() for req in queue):
            for group, queue in self.held.items():
                self.held[group] = collections.deque(req for req in queue if req.id != request_id)
            self.forget(request_id)
        else:
            self.cancel_probing(request_id)

    def on_generate(self, message: dict[str, Any]) -> None:
        req = self.prepare(message)
        if req is None:
            return
        if self.cache_model is not None and self.models_prefix(req):  # once: not again for a re-admission
            prompt = req.input_ids.data[0].tolist()
            req.cached_tokens = self.cache_model.lookup(prompt)
        self.on_generate_prepared(req)

    def on_generate_prepared(self, req: Request, joined: bool = False) -> None:
        if not joined and not self._joins(req):
            return
        if self.speculative:
            req.tally = speculative.DraftTally(req.proposal, req.max_tokens)
        try:
            handle = self.add_request(req)
        except Refused as refused:
            self.fail(req.id, refused.fault, str(refused))
            return
        except Exception as exc:
            self.exit_if_device_lost(self.fail_all([req], exc))
            return
        self.active[req.id] = (req, handle)
        self.fresh_constraint = self.fresh_constraint or req.structured is not None

    def add_request(self, req: Request):
        return self.pipe.add_request(req.id, req.input_ids, req.config)

    @staticmethod
    def models_prefix(req: Request) -> bool:
        """Whether the cache model can follow this request's prompt (its token ids are what genai hashes)."""
        return True

    def prompt_computed(self, req: Request) -> None:
        """A request's first token came: genai holds its prompt's blocks now, shared with the requests that follow.
        Not at admission: a request refused there, dropped by the scheduler or cancelled before its prefill computed
        nothing, and its retry would have been reported as served from the cache."""
        if self.cache_model is not None and self.models_prefix(req):
            self.cache_model.store(req.input_ids.data[0].tolist())

    def finish(self, req: Request, finish_reason: str) -> None:
        if self.cache_model is not None and self.models_prefix(req) and req.generated:
            # the prompt and the answer, but the last token, whose KV was never computed, stay for the next turn
            self.cache_model.store(req.input_ids.data[0].tolist() + req.generated[:-1])
        super().finish(req, finish_reason)

    def _collect(self) -> None:
        # Statuses as plain ints: a pybind enum comparison costs a microsecond or two, and this loop made several per
        # request per step (with sixteen requests on a fast model, a few percent of the engine thread's time).
        running, finished, ignored = self.status_values
        progress = []  # (req, handle, status, finish reason) of every request, read before any text is decoded
        updates = []
        for req, handle in self.active.values():
            # A non-streaming request is read for its first token (the front's time to first token), then only
            # once it has ended: a dozen pybind calls fewer per step for a batch of sixteen.
            status, finish, new_ids = None, None, []
            if req.stream or not req.generated:
                finish = self._read(req, handle, new_ids)
                # tokens and no finish reason yet: genai still runs it, and get_status() (2 us of pybind and enum
                # a request a step, the largest Python cost of the step loop in a profile) is not needed
                if new_ids and finish is not None and finish.value == self.finish_none:
                    status = running
            if status is None:
                status = handle.get_status().value
                if status != running and not (req.stream or not req.generated):
                    finish = self._read(req, handle, new_ids)
            if new_ids:
                if not req.generated:
                    self.prompt_computed(req)
                updates.append((req, new_ids))
            elif req.generated:
                req.steps += 1
            progress.append((req, handle, status, finish))
        self.emit_tokens(updates)
        # genai drops every request of a step that schedules no token; the oldest of them is the one that did not fit
        oldest_ignored = min((req.id for req, _, status, _ in progress if status == ignored), default=None)
        for req, handle, status, finish in progress:
            if req.stopped:  # finished by a stop sequence: done was posted
                handle.cancel()
            elif status == running:
                continue
            del self.active[req.id]
            if req.stopped:
                continue
            if status == ignored and req.id != oldest_ignored and not req.generated:
                self.on_generate_prepared(req, joined=True)  # dropped with the one that did not fit: admit it again
            elif status == ignored:
                # A scheduler out-of-memory through the CB API is a status, not an exception.
                message = f"Request {req.id} was dropped by the scheduler: scheduler ignored the request (out of memory)"
                self.fail(req.id, self.classify(message), message)
            elif status == finished:
                self.finish(req, finish_reason_name(finish, req))
            # CANCEL / STOP: the front already forgot this request
        if self.cache_model is not None:
            self.cache_model.set_running(self._generated_at_most(req) for req, _ in self.active.values())

    @staticmethod
    def _generated_at_most(req: Request) -> int:
        """The tokens a running request holds beyond its prompt, or more: a streamed one's are all read; a
        non-streamed one is read at its first token and its end, so its steps since then bound the rest."""
        if req.stream:
            return len(req.generated)
        return min(req.max_tokens, len(req.generated) + req.steps * (1 + req.proposal))

    @staticmethod
    def _read(req: Request, handle, new_ids: list[int]):
        """Everything a handle has for a request (read() returns one step's output; after the end several may
        wait), appended to new_ids; the last output's finish reason, or None when there was none."""
        finish = None
        while handle.can_read():
            for output in handle.read().values():
                new_ids += output.generated_ids
                if req.tally is not None:
                    req.tally.read(len(output.generated_ids))
                finish = output.finish_reason
                if req.logprobs is not None:
                    req.logprobs += output.generated_log_probs
        return finish

    def _drop_all(self) -> None:
        for req, handle in self.active.values():
            try:
                handle.cancel()
            except Exception as exc:  # the batch already failed; its callers have their error
                log.warning("cancelling request %s after a failed step: %s", req.id, exc)
        self.active.clear()

    def live_request_ids(self) -> list[int]:
        return list(self.active) + [req.id for queue in self.held.values() for req in queue]


def scheduler_config(settings: dict[str, Any]):
    """openvino_genai.SchedulerConfig with these fields set (config.ModelConfig.scheduler_settings: openarc's
    defaults and the model's scheduler_config); the benches' in-process pipelines build theirs here too."""
    import openvino_genai
    scheduler = openvino_genai.SchedulerConfig()
    for key, value in settings.items():
        setattr(scheduler, key, value)
    return scheduler


def finish_reason_name(reason, req: Request) -> str:
    """genai's own reason where it gives one (NONE until the last chunk), else judged by the token count."""
    name = getattr(reason, "name", "NONE")
    if name in ("STOP", "LENGTH"):
        return name.lower()
    return "length" if len(req.generated) >= req.max_tokens else "stop"
