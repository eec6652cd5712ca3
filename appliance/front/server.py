"""The aiohttp front: the app, health and status, metrics, and the process lifecycle.

The front never imports OpenVINO. Each API route family lives in appliance.front.api and hands requests to a model's
supervisor. Lifecycle follows aiohttp's web_runner: setup, start, serve until SIGTERM/SIGINT, drain, cleanup.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from typing import Callable

from aiohttp import web

from appliance import __version__
from appliance.front import listen
from appliance.front.device_faults import sole_card
from appliance.front.gpu_sentinel import GpuSentinel
from appliance.host.doctor import box, cards
from appliance.front.keys import KeyRing
from appliance.host import oom, telemetry
from appliance.front.api import audio, dialects, embeddings, generate, messages, models, rerank, speech, sse
from appliance.front.api.errors import error_response
from appliance.config import Config, ConfigError
from appliance.front.lifecycle import ModelState
from appliance.front.metrics import Metrics
from appliance.host.notify import LoopHealth, Notifier, watchdog_loop
from appliance.front.supervisor import Supervisor

log = logging.getLogger("openarc.server")

OPEN_ROUTES = {"/health", "/ready"}
KMSG_POLL_INTERVAL_S = 1.0
# Test knob: read kernel log records from this file or FIFO instead of /dev/kmsg. Never set in production.
KMSG_PATH_ENV = "OPENARC_DEBUG_KMSG_PATH"
# Test knob: read the machine's files (sysfs, the kernel's boot log) for /openarc/status's cards under this root, as
# `openarc doctor --root` does. Never set in production.
SYSTEM_ROOT_ENV = "OPENARC_DEBUG_SYSTEM_ROOT"
LOAD_EXTEND_EVERY_S = 20.0  # well inside notify.LOAD_EXTEND_USEC



class Appliance:
    """The front process's state: config, supervisor, metrics and notifier, and the HTTP handlers."""

    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None):
        self.config = config
        self.reload_config = reload_config  # reads the config again on SIGHUP (None: reload not supported)
        self.reloading = asyncio.Lock()
        self.metrics = Metrics()
        # GPU resets and OOM kills, for the metrics and for classifying a worker's failure
        self.sentinel = GpuSentinel()  # card-level mitigations (SDPA off after repeated hangs)
        self.kernel_log = telemetry.KernelLog(os.environ.get(KMSG_PATH_ENV, "/dev/kmsg"), on_reset=self.on_gpu_reset,
                                              on_event=self.on_gpu_event)
        self.card_facts: list[cards.CardFacts] | None = None  # what doctor checks per card, read once
        self.supervisor = Supervisor(config, self.metrics, self.kernel_log)
        self.notifier = Notifier()
        self.loop_health = LoopHealth(self.metrics.event_loop_lag.set)
        self.keys = KeyRing(config, config.key_secrets())  # a ConfigError names an unset or empty variable
        self.draining = False
        self.started = time.time()
        self.background: list[asyncio.Task] = []
        self.reloads: set[asyncio.Task] = set()  # SIGHUP reloads in progress or queued: shutdown awaits them
        self.sites: list[web.BaseSite] = []

    # --- app -----------------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.server.max_body_bytes,
                              middlewares=[self.errors_middleware, self.auth_middleware])
        app.on_response_prepare.append(sse.record_prepared)  # a request whose answer began is never answered again
        app.router.add_get("/health", self.health)
        app.router.add_get("/ready", self.ready)
        app.router.add_get("/metrics", self.metrics_route)
        app.router.add_get("/openarc/status", self.status)
        app.router.add_get("/v1/models", self.list_models)
        generate.add_routes(app, self)
        dialects.add_routes(app, self)
        embeddings.add_routes(app, self)
        rerank.add_routes(app, self)
        audio.add_routes(app, self)
        speech.add_routes(app, self)
        models.add_routes(app, self)
        return app

    @web.middleware
    async def errors_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Every error leaves as an error body in the route's dialect; no traceback ever reaches a client. A request
        whose answer began (its headers went out, on any route) is never answered again: an event stream is ended
        (the route wrapper sent the error event), any other body cut short."""
        sse.watch(request)
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            raise
        except Exception as exc:
            stream, response = sse.opened(request), sse.prepared(request)
            if response is None:
                return self.error_answer(request, exc)
            log.error("%s after the answer of %s %s began", type(exc).__name__, request.method, request.path,
                      exc_info=exc)
            if stream is not None:
                with contextlib.suppress(Exception):  # a stream that cannot even end: its connection does
                    return await stream.close()
            sse.cut(request)  # a body of another kind (chunked audio) is cut short
            return response

    def error_answer(self, request: web.Request, exc: Exception) -> web.StreamResponse:
        """The error body of a request that raised before its answer began."""
        if not isinstance(exc, web.HTTPException):
            log.error("unhandled error in %s %s", request.method, request.path, exc_info=exc)
            return self.error_shape(request)(500, "internal server error", code="internal_error")
        if exc.status < 400:
            raise exc
        message = {404: f"no route {request.method} {request.path}",
                   405: f"method {request.method} is not allowed on {request.path}",
                   413: f"request body exceeds the limit of {self.config.server.max_body_bytes} bytes"}
        return self.error_shape(request)(exc.status, message.get(exc.status, exc.reason),
                                         code=exc.reason.lower().replace(" ", "_"))

    @staticmethod
    def error_shape(request: web.Request) -> Callable[..., web.Response]:
        """Anthropic's error body on its routes, OpenAI's everywhere else."""
        return messages.error_response if request.path.startswith("/v1/messages") else error_response

    @web.middleware
    async def auth_middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """The key a request presents (request["api_key"], for the route wrapper), or a 401. Anthropic's clients
        send x-api-key, OpenAI's Authorization: Bearer; the presented key is never logged."""
        if self.keys and not self._open_route(request.path):
            key = self.keys.identify(request.headers.get("Authorization", ""), request.headers.get("x-api-key", ""))
            if key is None:
                return self.error_shape(request)(401, "invalid or missing API key (Authorization: Bearer ... or "
                                                      "x-api-key: ...)", "invalid_api_key")
            request["api_key"] = key
        return await handler(request)

    def _open_route(self, path: str) -> bool:
        return path in OPEN_ROUTES or (path == "/metrics" and not self.config.server.metrics_require_key)

    # --- health, status, metrics -----------------------------------------------------------------------

    async def health(self, request: web.Request) -> web.Response:
        """Liveness, meaning what the systemd watchdog means: 503 once this service can no longer serve (every
        model failed, a supervising task dead, the event loop wedged), so a kubelet or podman restarts it as
        systemd would; a worker that crashes and restarts is the front's business and keeps it 200."""
        reason = self.unhealthy_reason()
        if reason:
            return web.json_response({"status": "unhealthy", "reason": reason}, status=503)
        return web.json_response({"status": "ok"})

    async def ready(self, request: web.Request) -> web.Response:
        ready = self.supervisor.all_ready() and not self.draining
        models = {name: m.state.value for name, m in self.supervisor.models.items()}
        return web.json_response({"ready": ready, "draining": self.draining, "models": models},
                                 status=200 if ready else 503)

    async def status(self, request: web.Request) -> web.Response:
        sup = self.supervisor
        if self.card_facts is None:  # the same facts `openarc doctor` judges (sysfs, the kernel's boot lines)
            machine = box.Box(os.environ.get(SYSTEM_ROOT_ENV, "/"))
            self.card_facts = await asyncio.get_running_loop().run_in_executor(None, cards.card_facts, machine)
        return web.json_response({"version": __version__, "uptime_s": round(time.time() - self.started, 3),
                                  "draining": self.draining, "residency": sup.placement.summary(),
                                  "keys": [key.status() for key in self.keys.keys],
                                  "cards": cards.status_view(self.card_facts, self.sentinel.in_force),
                                  "gpu_mitigations": self.sentinel.status(),
                                  "models": [{**m.status(), **sup.placement.status(m.name)}
                                             for m in sup.models.values()]})

    async def metrics_route(self, request: web.Request) -> web.Response:
        body, content_type = self.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def list_models(self, request: web.Request) -> web.Response:
        key = request.get("api_key")  # a key sees the models it may use
        data = [{"id": name, "object": "model", "created": int(self.started), "owned_by": "openarc",
                 "kind": sup.model.kind} for name, sup in self.supervisor.models.items()
                if key is None or key.may_use(name)]
        return web.json_response({"object": "list", "data": data})

    # --- lifecycle -----------------------------------------------------------------------------------------

    def status_line(self) -> str:
        parts = []
        for m in self.supervisor.models.values():
            part = f"{m.name}: {m.state.value}"
            if m.life.restarts:
                part += f", {m.life.restarts} restarts"
            if m.state is not ModelState.READY and m.life.last_error:
                part += f", last error: {m.life.last_error[:120]}"
            parts.append(part)
        return ("draining; " if self.draining else "") + "; ".join(parts)

    def trigger_reason(self) -> str | None:
        if self.supervisor.all_failed():
            return "every model of this service is failed: " + self.status_line()
        return None

    def healthy(self) -> bool:
        """The watchdog pings while this holds; /health fails on its reason, and on a trigger_reason() too."""
        return self._broken() is None

    def unhealthy_reason(self) -> str | None:
        return self._broken() or self.trigger_reason()

    def _broken(self) -> str | None:
        if not self.loop_health.healthy():
            return f"the event loop runs {self.loop_health.lag:.1f} s late"
        if not self.supervisor.healthy():
            return "a model's supervising task died (see the log)"
        return None

    def on_gpu_reset(self, event: telemetry.GpuEvent) -> None:
        log.error("GPU %s on %s: %s", event.kind, event.bdf or "?", event.text)
        self.metrics.gpu_resets.labels(device=event.bdf or "unknown").inc()

    def on_gpu_event(self, event: telemetry.GpuEvent) -> None:
        """A hang line of the kernel log: the sentinel counts it per card; a mitigation it turns on restarts that
        card's workers (gpu_sentinel)."""
        for mitigation in self.sentinel.observe(event):
            log.warning("GPU mitigation %s on %s: %s; restarting its models with sdpa_optimization: false",
                        mitigation.mitigation, mitigation.card, mitigation.reason)
            self.metrics.gpu_mitigations.labels(card=mitigation.card, mitigation=mitigation.mitigation).inc()
            self.request_reload(self.apply_mitigations())

    def model_cards(self) -> dict[str, str | None]:
        """The card each model's worker runs on: its ready frame's PCI address, else the box's only card."""
        only = sole_card()
        return {name: sup.life.device_faults.card or only for name, sup in self.supervisor.models.items()}

    async def apply_mitigations(self) -> None:
        async with self.reloading:
            if self.draining:
                return
            self.config = self.sentinel.apply(self.config, self.model_cards())
            changed = await self.supervisor.apply(self.config)
            log.warning("GPU mitigation: %s restarted", ", ".join(changed) or "no model")

    async def watch_kernel_log(self) -> None:
        while True:
            self.kernel_log.update()
            await asyncio.sleep(KMSG_POLL_INTERVAL_S)

    async def await_first_loads(self) -> None:
        """Until every model has loaded (or failed), keep systemd's start timeout from firing."""
        last_extend = 0.0
        while not self.supervisor.settled():
            if time.monotonic() - last_extend > LOAD_EXTEND_EVERY_S:
                self.notifier.extend_start_timeout()
                last_extend = time.monotonic()
            self.notifier.status("loading: " + self.status_line())
            await self.supervisor.changes.wait(LOAD_EXTEND_EVERY_S)

    async def serve(self, host: str, port: int, also_bind: bool = False) -> int:
        """Serve until SIGTERM/SIGINT; the exit status: 0 after a clean stop, 1 if no model could load at all.

        Listens on the sockets systemd passed, else on host:port (on both with also_bind: listen.start_sites)."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.request_reload)
        runner = web.AppRunner(self.make_app(), handler_cancellation=True, access_log=None)
        await runner.setup()
        self.sites = await listen.start_sites(runner, host, port, also_bind)
        oom.set_oom_score_adj(oom.FRONT_OOM_SCORE_ADJ)  # before the workers: they raise theirs from here
        self.supervisor.start()
        self.background = [asyncio.create_task(c) for c in (
            self.loop_health.run(),
            watchdog_loop(self.notifier, self.healthy, self.trigger_reason, self.status_line),
            self.watch_kernel_log())]
        loads = asyncio.create_task(self.await_first_loads())
        await asyncio.wait([loads, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if stop.is_set():
            loads.cancel()
        elif self.supervisor.all_failed():
            # Not READY: the start fails, and the journal says why, instead of a "running" unit that serves nothing.
            log.error("no model could be loaded: %s", self.status_line())
            status = 1
        else:
            self.notifier.ready(self.status_line())
            log.info("ready: %s", self.status_line())
            await stop.wait()
        await self.shutdown(runner)
        return status

    def request_reload(self, work=None) -> None:
        """SIGHUP: a reload (or other `work` on the models' config), queued behind any in progress; kept until done,
        so shutdown can wait for it."""
        task = asyncio.create_task(work or self.reload())
        self.reloads.add(task)
        task.add_done_callback(self.reloads.discard)

    async def reload(self) -> None:
        """Read the config again and apply it model by model; an invalid file changes nothing."""
        if self.reload_config is None:
            return
        async with self.reloading:
            if self.draining:  # a reload queued behind another must not start models during shutdown
                return
            self.notifier.reloading()
            try:
                config = await asyncio.get_running_loop().run_in_executor(None, self.reload_config)
                # a new config's keys, or the error naming an unset variable: the previous keys keep serving
                await self._apply(config, KeyRing(config, config.key_secrets(), previous=self.keys))
            except ConfigError as exc:
                log.error("reload refused, still serving the previous config: %s", exc)
            except Exception:  # a bug: loud in the log, and the server goes on with what it has
                log.exception("reload failed")
            finally:  # systemd leaves "reloading" only on READY=1, whatever happened
                self.notifier.ready(self.status_line())

    async def _apply(self, config: Config, keys: KeyRing) -> None:
        if (config.server.host, config.server.port) != (self.config.server.host, self.config.server.port):
            log.warning("reload: a new listen address takes a restart; keeping %s:%d",
                        self.config.server.host, self.config.server.port)
        self.keys = keys
        config = self.sentinel.apply(config, self.model_cards())  # mitigations in force outlive a reload
        changed = await self.supervisor.apply(config)
        self.config = dataclasses.replace(config, server=dataclasses.replace(
            config.server, host=self.config.server.host, port=self.config.server.port))
        log.info("reloaded %s: %s", config.source, ", ".join(changed) + " (re)started" if changed else "no model changed")

    async def shutdown(self, runner: web.AppRunner) -> None:
        log.info("stopping: draining requests for up to %gs", self.config.server.drain_timeout_s)
        self.draining = True
        self.notifier.stopping()
        # Socket activation: new connections wait in systemd's socket for the next start instead of getting 503.
        for site in listen.activated(self.sites):
            await site.stop()
        await self.supervisor.stop(self.config.server.drain_timeout_s)
        # A reload in progress ends once its models have stopped (a replacement stops with the rest); one queued
        # behind it sees `draining` and does nothing.
        await asyncio.gather(*self.reloads, return_exceptions=True)
        for task in self.background:
            task.cancel()
        await runner.cleanup()
        self.kernel_log.close()
        log.info("stopped")
