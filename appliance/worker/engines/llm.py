"""The LLM worker kind: chat and text completions on ContinuousBatchingPipeline or the stateful LLMPipeline.

This module is the half both pipelines share: the request record, prompts (appliance.worker.prompt), the generation
config, the grammar probe thread, stop sequences, reasoning counts and the text replies. Each pipeline's own loop
lives in a module of its own: appliance.worker.engines.batching (BatchingEngine) and
appliance.worker.engines.stateful (SequentialEngine).
"""

from __future__ import annotations

import json
import logging
import os
import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from appliance import chat_formats
from appliance.config import window
from appliance.host import faults
from appliance.worker.detokenize import make_detokenizer
from appliance.worker.engines import speculative
from appliance.worker.adapter_rotation import BASE
from appliance.worker.engines.adapters import Adapters
from appliance.worker.engines.base import PROGRESS_INTERVAL_S, Engine, InjectedFault
from appliance.worker.engines.constraints import GrammarProbe, InvalidGrammar, after_reasoning, genai_message
from appliance.worker.prompt import INVALID_REQUEST, Prompts, Refused
from appliance.ipc import frame

log = logging.getLogger("openarc.worker")

# Test knob, never set in production: the probe thread raises after compiling a constraint whose JSON holds this
# text, to prove that an exception there fails loudly instead of ending the thread in silence.
PROBE_FAULT_ENV = "OPENARC_DEBUG_PROBE_FAULT"
# Test knob, never set in production: each compile on the probe thread lasts at least this many seconds (the thread
# is held inside the compile's heartbeat), so a test's slow compile is slow by construction on any machine.
PROBE_HOLD_ENV = "OPENARC_DEBUG_PROBE_HOLD_S"

INVALID_GRAMMAR = faults.Fault("invalid_grammar", "invalid_grammar", None, False)


@dataclass
class Request:
    id: int
    input_ids: Any  # ov.Tensor of shape [1, n]
    prompt_tokens: int
    max_tokens: int
    params: dict[str, Any]
    bound: str = window.BOUND_REQUEST  # what set max_tokens (appliance.config.window): an answer cut there says so
    generated: list[int] = field(default_factory=list)
    steps: int = 0  # engine steps since its first token: a non-streamed answer, read only at its end, grew at most
    #                 (1 + proposal) tokens a step (the prefix cache model counts them against the cache)
    prefix_offset: int = 0  # detokenizer state (appliance.worker.detokenize)
    read_offset: int = 0
    decoder: Any = None
    stream: bool = True    # a non-streaming request gets its text once, decoded at the end
    reported: int = 0      # tokens already counted to the front
    held: str = ""         # text that may be the start of a stop sequence, not yet sent
    stopped: bool = False  # a stop sequence was found: the request is finished
    stop_sequence: str | None = None  # the one found (Anthropic's stop_reason "stop_sequence" names it)
    structured: Any = None  # openvino_genai.StructuredOutputConfig of a constrained request
    prefix: str = ""       # text the template already wrote for the answer (an opened <think>), sent first
    template_opened: bool = False  # the prompt ends inside a think block the template opened
    chat: bool = True      # a chat completion (a text completion's answer is never split into reasoning)
    # genai's rng_seed defaults to 0, which would sample every unseeded request alike ("regenerate" giving the
    # same answer): a request without a seed gets a random one.
    seed: int = field(default_factory=lambda: random.getrandbits(32))
    logprobs: list[float] | None = None  # per generated token, when the request asked for them
    config: Any = None     # its openvino_genai.GenerationConfig, built and validated once
    text: str = ""         # the prompt as text (a VLM's pipeline takes the text with its image tags)
    images: list = field(default_factory=list)  # a VLM request's images (ov.Tensor, HWC uint8)
    handle: Any = None     # its GenerationHandle, where the engine reads it after the request has left the batch
    proposal: int = 0      # speculative decoding: tokens proposed a step (speculative.apply)
    tally: Any = None      # speculative.DraftTally of a request on a speculative pipeline
    cached_tokens: int = 0  # prompt tokens the prefix cache served (appliance.worker.prefix_cache)
    adapter: str = BASE    # the LoRA adapter it names (BASE: none), by the name the worker holds it under


def cut_at_stop(req: Request, text: str) -> str:
    """Apply the request's stop sequences to newly decoded text: return what may be sent now.

    genai stops generating at a stop string but still streams its tokens, so the cut happens here. Text that
    could be the beginning of a stop sequence is held back until the next token decides.
    """
    stops = req.params.get("stop") or ()
    buffer = req.held + text
    hits = [i for i in (buffer.find(s) for s in stops) if i >= 0]
    if hits:
        at = min(hits)
        req.stop_sequence = next(s for s in stops if buffer.find(s) == at)
        req.held, req.stopped = "", True
        return buffer[:at]
    hold = max((k for s in stops for k in range(1, len(s)) if buffer.endswith(s[:k])), default=0)
    req.held = buffer[len(buffer) - hold:] if hold else ""
    return buffer[:len(buffer) - hold]


class CompileHeartbeat:
    """While a grammar compiles (one C++ call: the probe's, then the pipeline's own when the request first steps),
    send progress frames so the front's stall timer does not take a slow compile for a hung GPU; for `bound_s` at
    most: a compile still running then is hung, and the stall timer ends the worker stall_timeout_s later."""

    def __init__(self, channel, bound_s: float, active: bool = True):
        self.channel, self.bound_s = channel, bound_s
        self.done = threading.Event()
        if active:
            threading.Thread(target=self._beat, name="compile-heartbeat", daemon=True).start()
        else:
            self.done.set()

    def stop(self) -> None:
        self.done.set()

    def __enter__(self) -> CompileHeartbeat:
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()

    def _beat(self) -> None:
        deadline = time.monotonic() + self.bound_s
        while not self.done.wait(PROGRESS_INTERVAL_S) and time.monotonic() < deadline:
            try:
                self.channel.send(frame("progress"))
            except OSError:  # the front is gone: the reader thread ends the worker
                return


class LLMEngine(Engine):
    """Shared half of both LLM engines: prompt building, generation config, text replies."""

    def __init__(self, spec: dict[str, Any], channel, tokenizer):
        super().__init__(spec, channel)
        self.tokenizer = tokenizer
        self.detok = make_detokenizer(tokenizer)
        self.prompts = Prompts(spec, tokenizer, self.classify)
        self.formats = self.prompts.formats
        self.probe = GrammarProbe(tokenizer)
        # Constraints never compiled before are probed on a thread of their own (genai releases the GIL), so a
        # slow compile does not hold up the batch that is generating; the request joins the inbox afterwards.
        self.probe_jobs: queue.Queue[dict[str, Any]] = queue.Queue()
        self.probing: set[int] = set()  # request ids on the probe thread
        self.cancelled_while_probing: set[int] = set()
        self.probe_fault = os.environ.get(PROBE_FAULT_ENV) or None
        self.probe_hold_s = float(os.environ.get(PROBE_HOLD_ENV) or 0)

    def threads(self) -> list[tuple[str, Any]]:
        return [("grammar-probe", self._probe_loop)]

    def submit(self, message: dict[str, Any]) -> None:
        """(channel reader thread) A request with a constraint not compiled yet goes by the probe thread; a
        `request` op (count a conversation's prompt tokens) is counted here, where tokenizing releases the GIL."""
        if message["op"] == "request" and "adapter" in message["body"]:  # an admin load or unload
            self.inbox.put(("adapter", message))
            return
        if message["op"] == "request":
            self.inbox.put(("count", self.prompts.count(message["id"], message["body"])))
            return
        constraint = message.get("constraint")
        if constraint and not self.probe.known(constraint, self.formats["tool_parser"]):
            self.probing.add(message["id"])
            self.probe_jobs.put(message)
        else:
            self._admit(message)

    def _admit(self, message: dict[str, Any]) -> None:
        """(channel reader or probe thread) Template and tokenize the request here, not on the engine thread:
        both release the GIL, so a running batch keeps stepping meanwhile (with sixteen clients on a fast model,
        preparing requests on the engine thread took several percent of its time). prepare() takes the result."""
        try:
            message["prepared"] = self._request(message)
        except Refused as refused:
            message["prepared"] = refused
        super().submit(message)

    def on_count(self, reply: dict[str, Any]) -> None:
        self.post(reply)

    def on_adapter(self, message: dict[str, Any]) -> None:
        """(engine thread, between two steps) Load or unload a LoRA adapter (POST/DELETE
        /openarc/models/NAME/adapters); a file genai cannot read is the caller's 400."""
        adapter = message["body"]["adapter"]
        try:
            if adapter["action"] == "load":
                self.adapters.load(adapter["name"], adapter["path"], adapter["alpha"])
            else:
                self.unload_adapter(adapter["name"])
        except Exception as exc:
            self.post(Refused(INVALID_REQUEST, f"the adapter cannot be loaded: {genai_message(exc)}")
                      .frame(message["id"]))
            return
        self.post(frame("result", id=message["id"], result={"adapters": sorted(self.adapters.loaded)}, counts={}))

    def unload_adapter(self, name: str) -> None:
        self.adapters.unload(name)

    def _probe_loop(self) -> None:
        """(probe thread) Compile each new constraint, then admit its request. An exception outside the compile
        is a bug: it leaves through the worker's one exit path (the front fails the requests and restarts)."""
        while True:
            message = self.probe_jobs.get()
            with self.compiling():
                held_until = time.monotonic() + self.probe_hold_s
                try:
                    self.check_constraint(message["constraint"])
                except InvalidGrammar as exc:
                    message["probe_error"] = str(exc)
                except Exception as exc:  # never lose a request: the engine thread reports whatever this was
                    message["probe_error"] = f"the grammar probe failed: {exc}"
                time.sleep(max(0.0, held_until - time.monotonic()))
            if self.probe_fault and self.probe_fault in json.dumps(message["constraint"]):
                raise InjectedFault(f"{PROBE_FAULT_ENV}={self.probe_fault} matched")
            self._admit(message)

    def check_constraint(self, constraint: dict[str, Any]):
        """The constraint's StructuredOutputConfig if it compiles within this model's budgets (the probe's
        verdict, remembered), else InvalidGrammar."""
        return self.probe.check(constraint, self.formats["tool_parser"], self.spec["grammar_compile_budget_s"],
                                self.spec["grammar_step_budget_s"])

    def compiling(self, active: bool = True) -> CompileHeartbeat:
        return CompileHeartbeat(self.channel, self.spec["grammar_compile_timeout_s"], active)

    def cancel_probing(self, request_id: int) -> None:
        """A cancel that overtook its request (still on the probe thread): drop the request when it arrives.
        A cancel of a request that is gone already (finished, failed) leaves nothing behind."""
        if request_id in self.probing:
            self.cancelled_while_probing.add(request_id)

    def forget(self, request_id: int) -> None:
        """(engine thread) A request dropped before prepare(): its probe bookkeeping goes with it."""
        self.probing.discard(request_id)
        self.cancelled_while_probing.discard(request_id)

    def ready_info(self) -> dict[str, Any]:
        return {"formats": self.formats}

    def prepare(self, message: dict[str, Any]) -> Request | None:
        """The request ready to generate, or None after replying with why it cannot be (the request's own fault
        alone: the worker goes on)."""
        self.probing.discard(message["id"])
        if message["id"] in self.cancelled_while_probing:
            self.cancelled_while_probing.discard(message["id"])
            return None
        prepared = message["prepared"]
        if isinstance(prepared, Refused):
            self.post(prepared.frame(message["id"]))
            return None
        return prepared

    def _request(self, message: dict[str, Any]) -> Request:
        params = message["params"]
        input_ids, prefix, thinking, text = self.prompts.prompt(message)
        prompt_tokens = int(input_ids.get_shape()[1])
        max_tokens, bound = self.prompts.answer_limit(message, prompt_tokens)
        if params.get("logprobs") and not self.reports_logprobs:
            raise Refused(INVALID_REQUEST, "'logprobs' is not available with pipeline: stateful "
                                           "(genai's LLMPipeline streams token ids only)")
        req = Request(message["id"], input_ids, prompt_tokens, max_tokens, params, bound=bound,
                      stream=message.get("stream", True), structured=self._structured(message, thinking, opened=bool(prefix)),
                      prefix=prefix,
                      template_opened=bool(prefix), logprobs=[] if params.get("logprobs") else None,
                      chat=message["kind"] == "chat", text=text)
        if params.get("seed") is not None:
            req.seed = params["seed"]
        req.adapter = message.get("adapter") or BASE
        if req.adapter not in self.adapters:  # unloaded between the front's lookup and here
            raise Refused(INVALID_REQUEST, f"the adapter {req.adapter!r} is not loaded on this model")
        try:
            req.config = self.generation_config(req)
            req.config.validate()
        except Exception as exc:  # a combination genai refuses: the caller's to fix
            raise Refused(INVALID_REQUEST, f"invalid sampling parameters: {genai_message(exc)}") from None
        return req

    def _structured(self, message: dict[str, Any], thinking: bool, opened: bool):
        """The request's StructuredOutputConfig (compiled by the probe already, or now), or None. On a reasoning
        model, response_format and tool calls apply after the think block (structured_outputs as written)."""
        constraint = message.get("constraint")
        if not constraint:
            return None
        try:
            if "probe_error" in message:
                raise InvalidGrammar(message["probe_error"])
            config = self.check_constraint(constraint)
            if thinking and constraint.get("after_reasoning"):
                return after_reasoning(constraint, self.formats["tool_parser"], opened=opened)
            return config
        except InvalidGrammar as exc:
            log.info("request %s: constraint does not compile: %s", message["id"], exc)
            raise Refused(INVALID_GRAMMAR, f"the output constraint cannot be compiled: {exc}") from None

    reports_logprobs = True
    adapters = Adapters({})  # an engine with LoRA adapters sets its own before building its pipeline

    def generation_config(self, req: Request):
        import openvino_genai
        config = openvino_genai.GenerationConfig()
        config.max_new_tokens = req.max_tokens
        temperature = req.params.get("temperature")
        if temperature:
            config.do_sample = True
            config.temperature = temperature
            config.top_p = req.params.get("top_p") or 1.0
        config.rng_seed = req.seed
        for key in ("top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            if req.params.get(key) is not None:
                setattr(config, key, req.params[key])
        if req.logprobs is not None:
            config.logprobs = 1
        if req.structured is not None:
            config.structured_output_config = req.structured
        if req.params.get("stop"):
            config.stop_strings = set(req.params["stop"])
            # genai stops at a stop string but, left to itself, drops the whole token that holds it (text before
            # the string included) and never says which string it was: cut_at_stop cuts at the string itself and
            # records it (Anthropic's stop_sequence names it).
            config.include_stop_str_in_output = True
        config.set_eos_token_id(self.tokenizer.get_eos_token_id())
        req.proposal = speculative.apply(config, self.spec.get("speculative") or {}, req.params)
        if self.adapters:  # (read by the stateful pipeline; the batching one applies its group's set: BatchingEngine)
            config.adapters = self.adapters.config_for(req.adapter)
        return config

    def post_text(self, req: Request, text: str) -> None:
        tokens = frame("tokens", id=req.id, text=req.prefix + text, n=len(req.generated) - req.reported)
        if not req.reported:  # the first: the prompt's size is known from here on (Anthropic's message_start has it)
            tokens["prompt_tokens"] = req.prompt_tokens
            tokens["cached_tokens"] = req.cached_tokens
            tokens["max_tokens"] = req.max_tokens  # the limit fitted to the window (the Responses object repeats it)
        if req.logprobs is not None:
            new = range(req.reported, min(len(req.generated), len(req.logprobs)))
            tokens["logprobs"] = [[self.tokenizer.decode([req.generated[i]]), req.logprobs[i]] for i in new]
        req.prefix = ""
        self.post(tokens, urgent=not req.reported)  # a request's first text goes out at once (time to first token)
        req.reported = len(req.generated)

    def emit_tokens(self, updates: list[tuple[Request, list[int]]]) -> None:
        """Post newly generated tokens' text; a request whose stop sequence appeared is finished here.

        Only streaming requests are decoded token by token; a non-streaming one reports just its first token (the
        front's time to first token) and is decoded once when it finishes.
        """
        streamed = []
        for req, ids in updates:
            if req.stopped:
                continue
            first = not req.generated
            req.generated.extend(ids)
            if req.stream:
                streamed.append(req)
            elif first:
                self.post_text(req, "")
        for req, text in zip(streamed, self.detok.deltas(streamed) if streamed else []):
            self.post_text(req, cut_at_stop(req, text))
            if req.stopped:
                self.finish(req, "stop")

    def finish(self, req: Request, finish_reason: str) -> None:
        if not req.stream:
            text = cut_at_stop(req, self.detok.decode(req.generated))
            self.post_text(req, text + req.held)
        elif req.held:  # a partial stop sequence that never completed is ordinary text after all
            self.post_text(req, req.held)
        req.held = ""
        reasoning = self.formats["reasoning_parser"] and req.chat
        extra = {"reasoning_tokens": self.reasoning_tokens(req)} if reasoning else {}
        if req.tally is not None:
            extra.update(req.tally.frame_fields())
        if req.stop_sequence is not None:
            extra["stop_sequence"] = req.stop_sequence
        if finish_reason == "length":
            extra["limit"] = req.bound  # the bound that cut it: counted in openarc_answers_cut_total
        self.post(frame("done", id=req.id, finish_reason=finish_reason, prompt_tokens=req.prompt_tokens,
                        cached_tokens=req.cached_tokens, completion_tokens=len(req.generated), **extra))

    def reasoning_tokens(self, req: Request) -> int:
        """Generated tokens up to the one that closes the think block (all of them if it never closes; none if
        the answer does not start with one). Decoded prefixes only grow, so a binary search finds the close."""
        opened = req.template_opened or self.detok.decode(req.generated[:16]).lstrip().startswith(chat_formats.THINK_OPEN)
        if not opened:
            return 0
        low, high = 1, len(req.generated)
        if chat_formats.THINK_CLOSE not in self.detok.decode(req.generated):
            return high
        while low < high:
            middle = (low + high) // 2
            if chat_formats.THINK_CLOSE in self.detok.decode(req.generated[:middle]):
                high = middle
            else:
                low = middle + 1
        return low
