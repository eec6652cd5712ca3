"""The front process's lifecycle owner, the Appliance: setup, start, serve until SIGTERM/SIGINT, reload on SIGHUP
(or when a GPU mitigation turns on), drain, cleanup, as aiohttp's web_runner steps them; every signal and every
state the process reports (draining, healthy, the status line systemd shows) lives here.

What it serves is elsewhere: the app (appliance.front.app: the middlewares, the route families of
appliance.front.api, which look models up through appliance.front.api.lookup), and the kernel log's watch
(appliance.front.gpu_watch). The front never imports OpenVINO.
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

from appliance.config import Config, ConfigError
from appliance.config.replicas import shown
from appliance.front import listen
from appliance.front.app import make_app
from appliance.front.api.health import SYSTEM_ROOT_ENV
from appliance.front.cache_keeper import CacheKeeper
from appliance.front.api.count_tokens import PromptCounter
from appliance.front.gpu_watch import GpuWatch
from appliance.front.keys import KeyRing
from appliance.front.lifecycle import ModelState
from appliance.front.metrics import Metrics
from appliance.front.spool_budget import SpoolBudget
from appliance.front.supervisor import Supervisor
from appliance.host import oom
from appliance.host.doctor import build_info
from appliance.host.notify import LoopHealth, Notifier, watchdog_loop

log = logging.getLogger("openarc.server")

LOAD_EXTEND_EVERY_S = 20.0  # well inside notify.LOAD_EXTEND_USEC
# The exit status of a start that a model's golden-answer check failed under server.canary: gate (1: no model loaded).
CANARY_EXIT = 3
# How long a start the canary refused goes on answering before it exits: /ready 503 with the reason, /metrics with
# openarc_canary_failures_total counted. Longer than one scrape of the shipped Prometheus config (15 s), so the
# failure reaches Prometheus before podman auto-update rolls the image back (docs/updating.md).
CANARY_LINGER_S = 20.0


class Appliance:
    """The front process's state (config, keys, supervisor, metrics, notifier, draining) and its lifecycle; the
    routes read the state, only the lifecycle changes it."""

    def __init__(self, config: Config, reload_config: Callable[[], Config] | None = None):
        self.config = config
        self.reload_config = reload_config  # reads the config again on SIGHUP (None: reload not supported)
        self.reloading = asyncio.Lock()
        self.metrics = Metrics()
        # a mitigation the GPU sentinel turns on restarts models: queued like a reload
        self.gpu = GpuWatch(self.metrics, on_mitigation=lambda: self.request_reload(self.apply_mitigations()))
        self.supervisor = Supervisor(config, self.metrics, self.gpu.kernel_log)
        self.notifier = Notifier()
        self.loop_health = LoopHealth(self.metrics.event_loop_lag.set)
        self.keys = KeyRing(config, config.key_secrets())  # a ConfigError names an unset or empty variable
        # counts a model's prompts without its worker (count_tokens, a waiting stream's window check); started on use
        self.prompt_counter = PromptCounter()
        # the bytes of every spool file the routes hold for requests in flight (images, edits, audio), one bound
        self.spool_budget = SpoolBudget(on_change=self.metrics.spool_bytes.set)
        self.draining = False
        self.ready_sent = False  # READY=1 went to systemd: from then on a service that cannot serve asks for a restart
        self.started = time.time()
        self.cards: list = []  # the Intel cards as doctor sees them (read at serve())
        self.build: dict[str, str] = {}  # openarc_build_info's labels (read at serve())
        self.background: list[asyncio.Task] = []
        self.reloads: set[asyncio.Task] = set()  # SIGHUP reloads in progress or queued: shutdown awaits them
        self.sites: list[web.BaseSite] = []

    def status_line(self) -> str:
        parts = []
        for name, m in self.supervisor.models.items():  # (a replicated model's: its best replica's)
            part = f"{name}: {m.state.value}" + (", checking its golden answers" if m.life.checking else "")
            if m.life.restarts:
                part += f", {m.life.restarts} restarts"
            if m.state is not ModelState.READY and m.life.last_error:
                part += f", last error: {m.life.last_error[:120]}"
            parts.append(part)
        return ("draining; " if self.draining else "") + "; ".join(parts)

    def trigger_reason(self, names: bool = True) -> str | None:
        """Why this service can no longer serve (/health says it), or None; `names`: with each model's state and last
        error (the journal's and the watchdog's; not /health's when keys are configured: a probe carries no key)."""
        if self.supervisor.all_failed():
            return "every model of this service is failed" + (": " + self.status_line() if names else "")
        return None

    def restart_reason(self) -> str | None:
        """Why the watchdog asks systemd for a restart, or None. Only after READY=1: before it, a start whose models
        all failed ends on its own (exit 1, or CANARY_EXIT after its linger), and a trigger would cut the canary's
        linger short, hide its failure from Prometheus and put "watchdog" in the journal instead of the cause."""
        return self.trigger_reason() if self.ready_sent else None

    def canary_refusal(self) -> str | None:
        """Under server.canary: gate, why this server must not be ready: the first model (in the config's order)
        whose check failed, or that has a record and did not load (it never got to its check)."""
        canary = self.supervisor.placement.canary
        if canary.mode != "gate":
            return None
        # by unit: a replica's check is its own (canary.failures is keyed as each worker's life is named)
        failed = next((canary.failures[key] for key in self.supervisor.units if key in canary.failures), None)
        return f"canary failed (server.canary: gate), not ready: {failed}" if failed else None

    def not_ready_reason(self) -> str | None:
        """Why /ready answers 503 beside a model's state: a check under way or failed (server.canary)."""
        # each replica under check, named as clients know it (`chat (replica CPU#1)`), never by its key chat@CPU#1
        checking = [shown(key) for key, m in self.supervisor.units.items() if m.life.checking]
        return self.canary_refusal() or (f"canary: checking {', '.join(checking)} against the golden record"
                                         if checking else None)

    def healthy(self) -> bool:
        """The watchdog pings while this holds; /health fails on its reason, and on a trigger_reason() too."""
        return self._broken() is None

    def unhealthy_reason(self, names: bool = True) -> str | None:
        return self._broken() or self.trigger_reason(names)

    def _broken(self) -> str | None:
        if not self.loop_health.healthy():
            return f"the event loop runs {self.loop_health.lag:.1f} s late"
        if not self.supervisor.healthy():
            return "a model's supervising task died (see the log)"
        return None

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
        runner = web.AppRunner(make_app(self), handler_cancellation=True, access_log=None)
        await runner.setup()
        self.cards, self.build = await loop.run_in_executor(None, build_info.read_machine,
                                                            os.environ.get(SYSTEM_ROOT_ENV, "/"))
        self.metrics.set_build_info(self.build)
        log.info("build: %s", build_info.describe(self.build))
        self.sites = await listen.start_sites(runner, host, port, also_bind)
        oom.set_oom_score_adj(oom.FRONT_OOM_SCORE_ADJ)  # before the workers: they raise theirs from here
        self.supervisor.start()
        self.background = [asyncio.create_task(c) for c in (
            self.loop_health.run(),
            watchdog_loop(self.notifier, self.healthy, self.restart_reason, self.status_line),
            self.gpu.watch(),
            CacheKeeper(self.supervisor).run())]
        loads = asyncio.create_task(self.await_first_loads())
        await asyncio.wait([loads, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        status = 0
        if stop.is_set():
            loads.cancel()
        elif (refused := self.canary_refusal()) is not None:
            # One line in the journal, naming the model and what differs; no READY=1: systemd marks the start
            # failed, and podman auto-update rolls the image back.
            log.error("%s", refused)
            self.notifier.status(refused)
            with contextlib.suppress(TimeoutError):  # SIGTERM ends the wait
                async with asyncio.timeout(CANARY_LINGER_S):
                    await stop.wait()
            status = CANARY_EXIT
        elif self.supervisor.all_failed():
            # Not READY: the start fails, and the journal says why, instead of a "running" unit that serves nothing.
            log.error("no model could be loaded: %s", self.status_line())
            status = 1
        else:
            self.notifier.ready(self.status_line())
            self.ready_sent = True
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
                if self.draining:  # the stop began while the file was read: nothing to bring in line
                    return
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
        config = self.gpu.mitigated(config, self.supervisor)  # mitigations in force outlive a reload
        # The keys and the config the routes read (aliases, metrics_require_key, body limits) switch together, in
        # one step before the models are brought in line: new keys never run under the old aliases while a changed
        # model drains (up to drain_timeout_s). supervisor.apply adds new models before its first wait, so a new
        # alias to one of them finds it.
        self.keys, self.config = keys, dataclasses.replace(config, server=dataclasses.replace(
            config.server, host=self.config.server.host, port=self.config.server.port))
        changed = await self.supervisor.apply(config)
        log.info("reloaded %s: %s", config.source, ", ".join(changed) + " (re)started" if changed else "no model changed")

    async def apply_mitigations(self) -> None:
        async with self.reloading:
            if self.draining:
                return
            self.config = self.gpu.mitigated(self.config, self.supervisor)
            changed = await self.supervisor.apply(self.config)
            log.warning("GPU mitigation: %s restarted", ", ".join(changed) or "no model")

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
        self.gpu.close()
        log.info("stopped")
