"""POST /openarc/models/{name}/load and /unload: load a model now (returns when it is ready, or 503 with why), or
drain and stop one (it stays unloaded until a request or a load). Behind the API key like every route but /health and
/ready; 404 for a model the config does not have, or the key may not use; 429 past the key's limits, as any request.
What decides residency is appliance.front.residency."""

from __future__ import annotations

from aiohttp import web

from appliance.front.api.server_view import ServerView
from appliance.front.api import lookup
from appliance.front.api.route import Call, route
from appliance.front.api.token_budget import NO_TOKENS
from appliance.front.request import shutting_down


def add_routes(app: web.Application, appliance: ServerView) -> None:
    async def load(request: web.Request, call: Call) -> web.Response:
        name = admitted_model(request, call)
        if appliance.draining:
            raise shutting_down()
        sup = await appliance.supervisor.ready_model(name, call.may_use, reason="api")
        if sup is None:  # removed by a reload while it waited
            raise lookup.not_found(appliance, name, call.api_key)
        return web.json_response({"model": name, "state": sup.state.value, "pid": sup.life.pid,
                                  "load_seconds": sup.life.load_seconds})

    async def unload(request: web.Request, call: Call) -> web.Response:
        name = admitted_model(request, call)
        if not await appliance.supervisor.unload(name, "api"):
            raise lookup.not_found(appliance, name, call.api_key)
        return web.json_response({"model": name, "state": appliance.supervisor.get(name).state.value})

    def admitted_model(request: web.Request, call: Call) -> str:
        """The model a load or unload names, once the key may use it (a key loads and unloads its own models only,
        and learns no other names) and its limits admit the call as any request (so a limited key cannot force
        loads, evictions and drains without bound)."""
        name = request.match_info["name"]
        if not call.may_use(name):
            raise lookup.not_found(appliance, name, call.api_key)
        call.label({"model": name})
        call.admit(NO_TOKENS)
        return name

    app.router.add_post("/openarc/models/{name}/load", route(appliance, "openarc/models/load", load))
    app.router.add_post("/openarc/models/{name}/unload", route(appliance, "openarc/models/unload", unload))
