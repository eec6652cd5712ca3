"""The service's own routes, beside the model API: / (what this server is), /health (liveness), /ready,
/openarc/status, /metrics and /v1/models.

A route family like the others (`add_routes(app, appliance)`), so that the Appliance only owns the states these
report (draining, the supervisor, the reasons it is unhealthy) and not how each one is shown. /health and /ready take
no API key (appliance.front.middleware.OPEN_ROUTES); /metrics takes one if server.metrics_require_key says so.
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from appliance.front.api import lookup
from appliance.front.api.server_view import ServerView
from appliance import __version__
from appliance.config.kinds import GENERATIVE_KINDS
from appliance.host.doctor import cards

# Test knob: read the machine's files (sysfs, the kernel's boot log, the package database) for /openarc/status's
# cards and build info under this root, as `openarc doctor --root` does. Never set in production.
SYSTEM_ROOT_ENV = "OPENARC_DEBUG_SYSTEM_ROOT"


def add_routes(app: web.Application, appliance: ServerView) -> None:
    routes = HealthRoutes(appliance)
    app.router.add_get("/", routes.root)  # and HEAD /, which Claude Code sends before a session
    app.router.add_get("/health", routes.health)
    app.router.add_get("/ready", routes.ready)
    app.router.add_get("/metrics", routes.metrics)
    app.router.add_get("/openarc/status", routes.status)
    app.router.add_get("/v1/models", routes.list_models)


class HealthRoutes:
    def __init__(self, appliance: ServerView):
        self.appliance = appliance  # appliance.front.server.Appliance: supervisor, keys, metrics, draining, health

    async def root(self, request: web.Request) -> web.Response:
        """What answers here: a client probing the root (Claude Code's `HEAD /`) or a person with a browser."""
        return web.json_response({"name": "openarc", "version": __version__, "api": "/v1",
                                  "models": "/v1/models", "health": "/health"})

    async def health(self, request: web.Request) -> web.Response:
        """Liveness, meaning what the systemd watchdog means: 503 once this service can no longer serve (every
        model failed, a supervising task dead, the event loop wedged), so a kubelet or podman restarts it as
        systemd would; a worker that crashes and restarts is the front's business and keeps it 200."""
        reason = self.appliance.unhealthy_reason(names=not self.appliance.keys)  # no key, no model name (as /ready)
        if reason:
            return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness for probes, which carry no key: with keys configured it names no model (a key learns no name
        beyond its list, and a caller without one learns none); /openarc/status has the states."""
        ready = self.appliance.supervisor.all_ready() and not self.appliance.draining
        answer = {"ready": ready, "draining": self.appliance.draining}
        if not self.appliance.keys:
            answer["models"] = {name: m.state.value for name, m in self.appliance.supervisor.models.items()}
            reason = None if ready else self.appliance.not_ready_reason()  # it names models: no key, no name
            if reason:
                answer["reason"] = reason
        return web.json_response(answer, status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        """The server's state as the request's key may see it: its own models only, and its own key only (the
        operator's key, server.api_key_env, sees every key); everything while no key is configured."""
        appliance, sup, sentinel = self.appliance, self.appliance.supervisor, self.appliance.gpu.sentinel
        key = request.get("api_key")
        return web.json_response({"version": __version__, "uptime_s": round(time.time() - appliance.started, 3),
                                  "build": appliance.build,
                                  "draining": appliance.draining, "residency": residency_view(sup, key),
                                  "keys": [k.status() for k in appliance.keys.keys
                                           if key is None or key.operator or k is key],
                                  "cards": cards.status_view(appliance.cards, sentinel.in_force),
                                  "gpu_mitigations": sentinel.status(),
                                  "models": [sup.status(name) for name in sup.models
                                             if key is None or key.may_use(name)]})

    async def metrics(self, request: web.Request) -> web.Response:
        body, content_type = self.appliance.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def list_models(self, request: web.Request) -> web.Response:
        key = request.get("api_key")  # a key sees the models it may use
        created = int(self.appliance.started)
        data = []
        for name, sup in self.appliance.supervisor.models.items():
            if key is not None and not key.may_use(name):
                continue
            entry = {"id": name, "object": "model", "created": created, "owned_by": "openarc",
                     "kind": sup.model.kind, **window_fields(sup.spec)}
            # each LoRA adapter as its own model, with `parent` and `root` as vLLM lists its LoRA modules; `root` is
            # the adapter's name, never its file: a path on the server is no client's business
            data += [entry] + [{**entry, "id": f"{name}{lookup.ADAPTER_SEPARATOR}{adapter}", "parent": name,
                                "root": adapter}
                               for adapter in lookup.served_adapters(sup)]
        return web.json_response({"object": "list", "data": data})


def window_fields(spec: dict) -> dict[str, int]:
    """A generative model's window as clients read it from /v1/models: `context_length` (OpenRouter's, LM Studio's
    and Open WebUI's name) and `max_model_len` (vLLM's)."""
    if spec["kind"] not in GENERATIVE_KINDS:
        return {}
    return {"context_length": spec["max_context"], "max_model_len": spec["max_context"]}


def residency_view(sup, key) -> dict[str, Any]:
    """The residency summary as `key` may see it: a named key sees the worker processes of its own models (and the
    parked spares, which hold no model), never another model's name (docs/sharing.md)."""
    summary = sup.placement.summary()
    if key is not None and not key.operator:
        summary["workers"] = [w for w in summary["workers"] if w.get("model") is None or key.may_use(w["model"])]
    return summary
