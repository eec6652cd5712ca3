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

import asyncio
from typing import Any

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import bounds, lookup, messages
from appliance.front.api.fields import json_body
from appliance.front.api.results import one_result
from appliance.front.api.route import Call, route
from appliance.front.api.token_budget import NO_TOKENS
from appliance.front.helper_process import HelperFailed, HelperProcess
from appliance.front.device_faults import CLIENT_ERROR_KINDS, WINDOW_FIELDS
from appliance.front.request import RequestFailed
from appliance.config.kinds import GENERATIVE_KINDS

COUNTER_MODULE = "appliance.worker.token_counter"
# Starting the process (OpenVINO's import) and loading a tokenizer take a few seconds on a slow host; a count,
# milliseconds. Past this the process is taken for hung, killed and replaced.
COUNT_TIMEOUT_S = 60.0
# What a window check reads of a generate frame: the prompt (messages or text), its tools and template arguments, and
# the request's limit.
CHECKED_FIELDS = ("kind", "messages", "prompt", "tools", "template_kwargs", "params")
# Counts the token counter holds at once (one answered, the rest waiting their turn); past this a count is a 429
# with Retry-After: a burst of them must not queue unbounded behind one process (Claude Code sends one per turn).
MAX_PENDING_COUNTS = 8


class PromptCounter:
    """The token counter process, one for the server: counts for /v1/messages/count_tokens, and the window check
    of a stream whose request waits (appliance.front.api.stream_start), neither of which may wait for a load."""

    def __init__(self):
        self.process = HelperProcess(COUNTER_MODULE, COUNT_TIMEOUT_S, "token counter")
        self.pending = 0  # questions handed to the process and not yet answered (their clients may have left)

    async def count(self, spec: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
        """The count of a conversation (a count frame's body), as the model's worker would count it."""
        if self.pending >= MAX_PENDING_COUNTS:
            raise RequestFailed(429, "overloaded", f"{self.pending} token counts are waiting for the token counter "
                                                   f"(at most {MAX_PENDING_COUNTS}); retry shortly", retry_after=1)
        return await self._ask({"spec": spec, "body": body})

    async def check(self, spec: dict[str, Any], frame: dict[str, Any]) -> dict[str, Any]:
        """A generate frame's prompt tokens and fitted answer limit; its refusal (a prompt over the window) raised
        as the worker's would be."""
        body = {key: frame[key] for key in CHECKED_FIELDS if key in frame}
        return await self._ask({"spec": spec, "body": body, "check": True})

    async def _ask(self, request: dict[str, Any]) -> dict[str, Any]:
        """One exchange with the process, shielded as the speech encoder's is: a client that hangs up (Claude Code
        cancels counts routinely) must not cancel it, whose cancellation kills the process so that its stale reply
        reaches no other question."""
        spec = request["spec"]
        self.pending += 1
        exchange = asyncio.ensure_future(self.process.ask(request, b""))
        exchange.add_done_callback(self._answered)
        try:
            reply = await asyncio.shield(exchange)
        except HelperFailed as exc:  # it died twice (a fresh process too) or hung: ours, not the conversation's
            raise RequestFailed(503, "model_unavailable", f"the tokens of model {spec['name']} cannot be counted "
                                f"now: the token counter process {exc.how}; try again", retry_after=1) from None
        if reply["op"] == "error":
            status = 400 if reply["kind"] in CLIENT_ERROR_KINDS else 503
            details = {key: reply[key] for key in WINDOW_FIELDS if key in reply}
            raise RequestFailed(status, reply["kind"], reply["message"], reply["code"], reply.get("hint"),
                                retry_after=None if status == 400 else 1, details=details)
        return reply["result"]

    def _answered(self, _: asyncio.Future) -> None:
        self.pending -= 1

    async def close(self) -> None:
        await self.process.close()


class CountTokensRoute:
    def __init__(self, appliance: ServerView):
        self.appliance = appliance  # appliance.front.server.Appliance: its models, supervisors, draining

    def mount(self, app: web.Application) -> None:
        app.router.add_post("/v1/messages/count_tokens",
                            route(self.appliance, "messages/count_tokens", self.handler, messages.ANTHROPIC))

    async def handler(self, request: web.Request, call: Call) -> web.Response:
        body = await json_body(request)
        call.label(body)
        name, count_body = messages.count_frame(body)
        sup = lookup.model_served(self.appliance, name, call, GENERATIVE_KINDS)
        call.admit(NO_TOKENS)  # the key's limits
        # a prompt no context could hold is not counted: rendering and tokenizing 900 KB held the worker for 2 s
        bounds.prompt_chars_fit(bounds.text_chars(count_body), sup.spec["max_context"], name)
        if sup.life.admits():
            event = await one_result(sup, {"kind": sup.model.kind, "body": count_body})
            return web.json_response(event.result)
        return web.json_response(await self.appliance.prompt_counter.count(sup.spec, count_body))
