"""Constrained decoding in the worker: the front's constraint (appliance.front.api.structured / appliance.front.api.tools)
as an openvino_genai.StructuredOutputConfig, and a probe that compiles it before the request joins a batch.

Why the probe: ContinuousBatchingPipeline compiles a request's grammar inside step(), and a grammar that does not
compile makes step() raise for the whole batch and leaves the scheduler broken for good ("cannot be called when we
are already in scheduling phase" on every later step). So each new constraint is first compiled by a stateful
LLMPipeline over a one-operation model sharing this worker's tokenizer (built in memory in milliseconds); genai is
the judge of what genai can compile, and a failure there is a 400 for that request alone. Constraints that
compiled once are remembered, so an agent resending the same tools pays the probe once.

Why the probe is timed: the pipeline compiles a constraint and computes its token mask on the engine thread, inside
step(), where every other request of the model waits. A grammar inside every size limit can still cost seconds
there: 1,500 alternatives of a short character class under `+` (22 KB of Lark) took 13.5 s to its first token on the
demo vocabulary, then 2-8 s a step (xgrammar's parser state grows with the ambiguous text). So the probe generates
PROBE_TOKENS tokens and times each one; a first token (compile and first mask) past grammar_compile_budget_s or a
later one (a mask) past grammar_step_budget_s refuses the constraint, which never reaches the engine. The probe
stops at the first token past its bound, so it holds its own thread for about one bound and one token at most;
a verdict is remembered either way, so a grammar is compiled once by the probe whatever the answer.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from typing import Any

from appliance.chat_formats import THINK_CLOSE, THINK_OPEN

log = logging.getLogger("openarc.worker")

PROBE_CACHE_SIZE = 256
PROBE_TOKENS = 8  # a first token (compile and mask) and seven masks: enough to see a step cost that grows
PROBE_FALLBACK_VOCAB = 1 << 18  # wider than any tokenizer's vocabulary (genai pads a shorter one)
# genai's errors start with the C++ source location of the check that failed: keep what follows it.
SOURCE_LOCATION = re.compile(r"^.*?\.(?:cc|cpp|hpp|h):\d+:\s*", re.ASCII)


class InvalidGrammar(ValueError):
    """A constraint genai cannot compile; the message says why (for the 400 body)."""


# How each tool-call format (appliance.chat_formats) writes one call: (begin, end) around the arguments, the
# trigger that starts a call, the separator between calls, and whether the arguments are JSON (or Qwen's XML).
TOOL_CALL_TAGS = {
    "hermes": ('<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>", "<tool_call>", "\n", "json"),
    "qwen3_coder": ("<tool_call>\n<function={name}>\n", "</function>\n</tool_call>", "<tool_call>", "\n", "xml"),
    "llama3_json": ('{{"name": "{name}", "parameters": ', "}", '{"name": ', "; ", "json"),
    "mistral": ('[TOOL_CALLS][{{"name": "{name}", "arguments": ', "}]", "[TOOL_CALLS]", "", "json"),
}
# A custom tool's call (free text, or text in the tool's grammar) in every family: its input raw between the tags,
# as no family's JSON could carry a grammar's text unescaped (appliance.front.api.tool_parsers reads it back).
CUSTOM_CALL_BEGIN, CUSTOM_CALL_END, CUSTOM_CALL_TRIGGER = '<custom_tool_call name="{name}">', "</custom_tool_call>", \
    "<custom_tool_call"


def structured_output_config(constraint: dict[str, Any], tool_parser: str | None):
    """The genai StructuredOutputConfig of a constraint frame."""
    import openvino_genai
    config = openvino_genai.StructuredOutputConfig
    kind = constraint["type"]
    if kind == "json_schema":
        return config(json_schema=constraint["schema"])
    if kind == "regex":
        return config(regex=constraint["regex"])
    if kind == "grammar":
        return config(grammar=constraint["grammar"])
    if kind == "tool_calls":
        return config(structural_tags_config=_tool_call_tags(constraint, tool_parser))
    raise InvalidGrammar(f"unknown constraint type {kind!r}")


def after_reasoning(constraint: dict[str, Any], tool_parser: str | None, opened: bool):
    """The constraint applied after a think block the model writes freely (opened by the template already, or
    by the model): reasoning models are trained to think before they answer or call a tool, and a JSON grammar
    from the first token would forbid it."""
    import openvino_genai
    config = openvino_genai.StructuredOutputConfig
    kind = constraint["type"]
    answer = {"json_schema": lambda: config.JSONSchema(constraint["schema"]),
              "regex": lambda: config.Regex(constraint.get("regex", "")),
              "grammar": lambda: config.EBNF(constraint.get("grammar", "")),
              "tool_calls": lambda: _tool_call_tags(constraint, tool_parser)}[kind]()
    think = config.Tag("" if opened else THINK_OPEN, config.AnyText(), THINK_CLOSE)
    return config(structural_tags_config=config.Concat(think, config.Regex(r"\s*"), answer))


def _tool_call_tags(constraint: dict[str, Any], tool_parser: str | None):
    """Structural tags for tool calls in the model's own format: `required` allows nothing but calls (at least
    one); otherwise free text until the model writes the trigger, then a call whose arguments match the schema."""
    import openvino_genai
    config = openvino_genai.StructuredOutputConfig
    if tool_parser not in TOOL_CALL_TAGS:
        raise InvalidGrammar(f"no tool-call format to constrain (tool_parser: {tool_parser})")
    begin, end, trigger, separator, arguments = TOOL_CALL_TAGS[tool_parser]
    content = config.QwenXMLParametersFormat if arguments == "xml" else config.JSONSchema
    tags, triggers = [], {}  # each trigger must begin some tag (genai refuses one that begins none)
    for tool in constraint["tools"]:
        if "custom" in tool:
            tags.append(config.Tag(CUSTOM_CALL_BEGIN.format(name=tool["name"]), _custom_input(tool["custom"]),
                                   CUSTOM_CALL_END))
            triggers[CUSTOM_CALL_TRIGGER] = None
        else:
            tags.append(config.Tag(begin.format(name=tool["name"]), content(tool["parameters"]), end))
            triggers[trigger] = None
    single = constraint["single"] or tool_parser == "llama3_json"  # Llama 3 templates refuse a second call
    if constraint["required"]:
        return config.TagsWithSeparator(tags, separator or "\n", at_least_one=True, stop_after_first=single)
    return config.TriggeredTags(list(triggers), tags, at_least_one=False, stop_after_first=single)


def _custom_input(custom: dict[str, Any]):
    """What a custom tool's input may be: its grammar (EBNF, converted from Lark by the front), its regex, or any
    text."""
    import openvino_genai
    config = openvino_genai.StructuredOutputConfig
    if custom["type"] == "grammar":
        return config.EBNF(custom["grammar"])
    if custom["type"] == "regex":
        return config.Regex(custom["regex"])
    return config.AnyText()


def probed_parts(constraint: dict[str, Any], tool_parser: str | None) -> list[tuple[str, dict[str, Any], str | None]]:
    """What the probe compiles and times for a constraint: the constraint itself, and for tool calls each tool's
    input on its own (a custom tool's grammar or regex, a function's parameters): inside structural tags genai
    compiles little up front and a tool's grammar costs its time only once the model has opened that tool's call,
    which the probe's zero logits never do. Each part is remembered on its own, so a tool set that changes by one
    tool probes that tool alone. Each comes with what a refusal of it says first (which tool)."""
    parts = [("", constraint, tool_parser)]
    for tool in constraint.get("tools", ()) if constraint["type"] == "tool_calls" else ():
        custom, label = tool.get("custom"), f"tool {tool['name']!r}: "
        if custom is None:
            parts.append((label, {"type": "json_schema", "schema": tool["parameters"]}, None))
        elif custom["type"] in ("grammar", "regex"):
            parts.append((label, {"type": custom["type"], custom["type"]: custom[custom["type"]]}, None))
    return parts


def cost_verdict(token_seconds: list[float], compile_budget_s: float, step_budget_s: float) -> str | None:
    """Why a constraint costs the engine too much, or None when it does not: the probe's first token (the compile
    and the first mask) against the compile budget, each later token (a mask, paid on every step) against the step
    budget. Pure: the probe and its tests both ask it."""
    if not token_seconds:
        return None
    first, later = token_seconds[0], token_seconds[1:]
    if first > compile_budget_s:
        return (f"the grammar takes {first:.1f} s to compile, over this model's budget of "
                f"{compile_budget_s:g} s (grammar_compile_budget_s): simplify it (fewer alternatives or repeats)")
    slowest = max(later, default=0.0)
    if slowest > step_budget_s:
        return (f"the grammar takes {slowest:.2f} s a token to apply, over this model's budget of "
                f"{step_budget_s:g} s (grammar_step_budget_s): make it less ambiguous (fewer alternatives that "
                f"match the same text under a repeat)")
    return None


class _TokenTimer:
    """A genai streamer that times each token the probe generates and stops the probe at the first one past its
    budget (the budgets of cost_verdict)."""

    def __init__(self, compile_budget_s: float, step_budget_s: float):
        self.budgets = (compile_budget_s, step_budget_s)
        self.seconds: list[float] = []
        self.last = time.monotonic()

    def write(self, token) -> Any:
        import openvino_genai
        now = time.monotonic()
        self.seconds.append(now - self.last)
        self.last = now
        over = cost_verdict(self.seconds, *self.budgets) is not None
        return openvino_genai.StreamingStatus.STOP if over else openvino_genai.StreamingStatus.RUNNING

    def streamer(self):
        import openvino_genai
        timer = self

        class Streamer(openvino_genai.StreamerBase):
            def write(self, token):
                return timer.write(token)

            def end(self):
                pass
        return Streamer()


def genai_message(exc: BaseException) -> str:
    """genai's message without the C++ source locations it starts its lines with."""
    lines = [SOURCE_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    return " ".join(line for line in lines if line) or type(exc).__name__


class GrammarProbe:
    """Compiles constraints with genai before a real pipeline sees them (see the module doc)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pipe = None
        # constraint key -> None (it compiled within its budgets) or why not; insertion-ordered: the oldest is
        # forgotten first
        self.verdicts: dict[str, str | None] = {}
        self.lock = threading.Lock()  # the probe pipeline runs one compile at a time, whichever thread asks

    @staticmethod
    def _key(constraint: dict[str, Any], tool_parser: str | None) -> str:
        return json.dumps([constraint, tool_parser], sort_keys=True)

    def known(self, constraint: dict[str, Any], tool_parser: str | None) -> bool:
        """Probed before (and still remembered), whatever the verdict."""
        parts = probed_parts(constraint, tool_parser)
        return all(self._key(part, parser) in self.verdicts for _, part, parser in parts)

    def check(self, constraint: dict[str, Any], tool_parser: str | None, compile_budget_s: float = float("inf"),
              step_budget_s: float = float("inf")):
        """The constraint's StructuredOutputConfig, probed once (compiled and timed); InvalidGrammar if it does not
        compile or costs more than its budgets (cost_verdict)."""
        try:
            config = structured_output_config(constraint, tool_parser)
        except InvalidGrammar:
            raise
        except Exception as exc:  # genai refused to even build the config
            raise InvalidGrammar(genai_message(exc)) from None
        for label, part, parser in probed_parts(constraint, tool_parser):
            verdict = self._verdict(part, parser, compile_budget_s, step_budget_s)
            if verdict is not None:
                raise InvalidGrammar(label + verdict)
        return config

    def _verdict(self, constraint: dict[str, Any], tool_parser: str | None, compile_budget_s: float,
                 step_budget_s: float) -> str | None:
        """The remembered verdict on one part, probed now if there is none. A remembered one is read without the
        lock: the channel reader asks here too, and must not wait out another constraint's probe."""
        key = self._key(constraint, tool_parser)
        remembered = self.verdicts.get(key, self)
        if remembered is not self:
            return remembered
        with self.lock:
            if key not in self.verdicts:
                self._remember(key, self._probe(constraint, tool_parser, compile_budget_s, step_budget_s))
            return self.verdicts[key]

    def _probe(self, constraint: dict[str, Any], tool_parser: str | None, compile_budget_s: float,
               step_budget_s: float) -> str | None:
        """(under the lock) Why the probe refuses this constraint, or None."""
        import openvino_genai
        try:
            config = structured_output_config(constraint, tool_parser)
        except Exception as exc:
            return genai_message(exc)
        generation = openvino_genai.GenerationConfig(max_new_tokens=PROBE_TOKENS)
        generation.structured_output_config = config
        pipe, prompt = self._pipeline(), self._prompt()
        timer = _TokenTimer(compile_budget_s, step_budget_s)
        started = time.monotonic()
        try:
            pipe.generate(prompt, generation, timer.streamer())
        except Exception as exc:
            return genai_message(exc)
        # nothing streamed (the grammar ended at once): the whole call was the compile
        return cost_verdict(timer.seconds or [time.monotonic() - started], compile_budget_s, step_budget_s)

    def _remember(self, key: str, verdict: str | None) -> None:
        self.verdicts[key] = verdict
        if len(self.verdicts) > PROBE_CACHE_SIZE:
            self.verdicts.pop(next(iter(self.verdicts)), None)

    def _pipeline(self):
        if self.pipe is None:
            import openvino_genai
            xml, weights = _probe_model(self._vocab_size())
            self.pipe = openvino_genai.LLMPipeline(xml, weights, self.tokenizer, "CPU", ATTENTION_BACKEND="SDPA")
        return self.pipe

    def _vocab_size(self) -> int:
        try:
            return len(self.tokenizer.get_vocab())
        except Exception:  # a vocabulary the Python binding cannot decode: logits wider than any vocabulary will do
            return PROBE_FALLBACK_VOCAB

    @staticmethod
    def _prompt():
        import numpy as np
        import openvino
        return openvino.Tensor(np.array([[0]], dtype=np.int64))


def _probe_model(vocab_size: int):
    """A language model in one operation: logits of zeros over the vocabulary, whatever the input. Returned as
    (IR text, weights tensor), the form LLMPipeline takes without touching the disk."""
    import tempfile
    from pathlib import Path

    import numpy as np
    import openvino
    from openvino import opset13 as ops

    names = ("input_ids", "attention_mask", "position_ids")
    inputs = [ops.parameter([-1, -1], openvino.Type.i64, name=n) for n in names]
    beam_idx = ops.parameter([-1], openvino.Type.i32, name="beam_idx")
    shape = ops.concat([ops.shape_of(inputs[0]), ops.constant(np.array([vocab_size], dtype=np.int64))], 0)
    logits = ops.result(ops.broadcast(ops.constant(np.float32(0)), shape))
    logits.get_output_tensor(0).set_names({"logits"})
    model = openvino.Model([logits], [*inputs, beam_idx], "openarc-grammar-probe")
    with tempfile.TemporaryDirectory() as tmp:
        openvino.save_model(model, Path(tmp) / "probe.xml")
        xml = (Path(tmp) / "probe.xml").read_text()
        weights = np.fromfile(Path(tmp) / "probe.bin", dtype=np.uint8)
    return xml, openvino.Tensor(weights if weights.size else np.zeros(1, dtype=np.uint8))
