"""Counting a conversation's prompt tokens for a model whose worker is not loaded, with the model's own tokenizer and
chat template and no pipeline (`python -m appliance.worker.token_counter`, one process for the whole server).

`/v1/messages/count_tokens` (Claude Code sends it beside its messages) must not load a model, let alone evict
another, just to count: a load takes seconds to minutes on an Arc card and the room may be another model's. A
loaded model counts in its worker; an unloaded, loading or restarting one is counted here, from the tokenizer
files of its directory (openvino_tokenizer.xml: a few MiB on the CPU, loaded in well under a second) through the
same appliance.worker.prompt.Prompts the worker renders with, so the count equals the usage its message reports.

Protocol (appliance.ipc.serve_requests, one request at a time): {"spec": the model's worker spec, "body": the
count frame's body} -> the worker's own reply frame (`result` {"input_tokens": n}, or `error`). With "check": true
the body is a generate frame's prompt and params, and the reply also has the answer's fitted limit, or the window's
refusal exactly as the worker words it (Prompts.check): a stream that waits is checked before its headers go out.
The tokenizers of the last few models counted are kept.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import OrderedDict
from typing import Any

from appliance.host import faults
from appliance.ipc import frame, serve_requests
from appliance.worker.prompt import Prompts

log = logging.getLogger("openarc.worker")

KEPT_TOKENIZERS = 4  # a few models' tokenizers (each a few MiB); the least recently used is dropped


class Counter:
    def __init__(self):
        self.prompts: OrderedDict[str, Prompts] = OrderedDict()

    def count(self, request: dict[str, Any], _data: bytes) -> dict[str, Any]:
        spec = request["spec"]
        try:
            prompts = self.model(spec)
        except Exception as exc:  # no tokenizer files there (a model directory deleted under a running server)
            # the path and the runtime's text are the operator's (the log): a client learns no server path
            log.error("the tokenizer of model %s cannot be loaded from %s: %s", spec["name"], spec["path"],
                      str(exc).strip() or type(exc).__name__)
            return frame("error", id=0, kind="model_unavailable", code="model_unavailable", hint=None,
                         message=f"the tokenizer of model {spec['name']} cannot be loaded (the server's log says why)",
                         retryable=True)
        if request.get("check"):  # a generate frame's window check (appliance.front.api.stream_start)
            return prompts.check(0, request["body"])
        return prompts.count(0, request["body"])

    def model(self, spec: dict[str, Any]) -> Prompts:
        """The model's Prompts, loaded on first use (its spec decides: a reload may change the template)."""
        key = json.dumps([spec["path"], spec.get("chat_template"), spec.get("tool_parser"),
                          spec.get("reasoning_parser"), spec.get("canonicalize_agent_noise", True)])
        if key not in self.prompts:
            import openvino_genai
            tokenizer = openvino_genai.Tokenizer(spec["path"])
            tokenizer.encode("")  # genai builds a Tokenizer without its files and fails only when it is used
            classify = lambda message: faults.classify_error(message, device="CPU")  # noqa: E731
            self.prompts[key] = Prompts(spec, tokenizer, classify)
            while len(self.prompts) > KEPT_TOKENIZERS:
                self.prompts.popitem(last=False)
        self.prompts.move_to_end(key)
        return self.prompts[key]


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="token counter: %(message)s")
    serve_requests(sys.stdin.buffer, sys.stdout.buffer, Counter().count)


if __name__ == "__main__":
    main()
