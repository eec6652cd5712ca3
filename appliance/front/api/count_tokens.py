"""POST /v1/messages/count_tokens (Anthropic Messages): how many prompt tokens a message would have, never loading a
model to say it.

The count is the model's chat template rendered and tokenized exactly as the message would be, so it equals the
`input_tokens` of that message's usage. A model whose worker is ready counts in its worker (the tokenizer it
serves with). Any other (unloaded on demand, loading, restarting, failed) is counted by the token counter process
(appliance.worker.token_counter, started on the first such count), from its directory's tokenizer files and
template alone: a count takes well under a second, never waits for a load, and never evicts a model that a chat
is using. The front itself has neither tokenizer nor template (it never imports OpenVINO).
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from appliance.front.api import bounds, lookup, messages
from appliance.front.api.fields import json_body
from appliance.front.api.results import one_result
from appliance.front.api.route import Call, route
from appliance.front.decoder_process import DecoderFailed, DecoderProcess
from appliance.front.device_faults import CLIENT_ERROR_KINDS
from appliance.front.request import RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

COUNTER_MODULE = "appliance.worker.token_counter"
# Starting the process (OpenVINO's import) and loading a tokenizer take a few seconds on a slow host; a count,
# milliseconds. Past this the process is taken for hung, killed and replaced.
COUNT_TIMEOUT_S = 60.0


class CountTokensRoute:
    def __init__(self, appliance):
        self.appliance = appliance  # appliance.front.server.Appliance: its models, supervisors, draining
        self.counter = DecoderProcess(COUNTER_MODULE, COUNT_TIMEOUT_S, "token counter")

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages/count_tokens",
                            route(self.appliance, "messages/count_tokens", self.handler, messages.ANTHROPIC))
        app.on_cleanup.append(lambda app: self.counter.close())

    async def handler(self, request: web.Request, call: Call) -> web.Response:
        body = await json_body(request)
        call.label(body)
        name, count_body = messages.count_frame(body)
        sup = lookup.model_served(self.appliance, name, call, GENERATIVE_KINDS)
        call.admit()  # the key's limits
        # a prompt no context could hold is not counted: rendering and tokenizing 900 KB held the worker for 2 s
        bounds.prompt_chars_fit(bounds.text_chars(count_body), sup.model.max_context, name)
        if sup.life.admits():
            event = await one_result(sup, {"kind": sup.model.kind, "body": count_body})
            return web.json_response(event.result)
        return web.json_response(await self.count_unloaded(sup.spec, count_body))

    async def count_unloaded(self, spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """The count of a model without a ready worker, from the token counter process."""
        try:
            reply = await self.counter.ask({"spec": spec, "body": body}, b"")
        except DecoderFailed as exc:  # it died twice (a fresh process too) or hung: ours, not the conversation's
            raise RequestFailed(503, "model_unavailable", f"the tokens of model {spec['name']} cannot be counted "
                                f"now: the token counter process {exc.how}; try again", retry_after=1) from None
        if reply["op"] == "error":
            status = 400 if reply["kind"] in CLIENT_ERROR_KINDS else 503
            raise RequestFailed(status, reply["kind"], reply["message"], reply["code"], reply.get("hint"),
                                retry_after=None if status == 400 else 1)
        return reply["result"]
