"""One model: its worker's life (appliance.front.worker_life: spawn, ready, stalls, the one exit path, restarts,
and the model's state) and its requests (appliance.front.routing: queue, dispatch, frames to requests), joined
here: the frames a ready worker sends are routed, its telemetry becomes the model's gauges, and a request's
device error may end the worker (appliance.front.device_faults).

The Supervisor (appliance.front.supervisor) and the routes know a model by its ModelSupervisor; what it does is
the life's or the router's.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any, AsyncIterator, Callable

from appliance import ipc
from appliance.config import Config, ModelConfig
from appliance.front.canary import Canary
from appliance.front.lifecycle import Exit, ExitReason, ModelState
from appliance.front.metrics import Metrics
from appliance.front.request import Event, Request
from appliance.front.routing import IMAGE_OPS, REQUEST_OPS, RequestRouter
from appliance.front.parked import ParkedWorkers
from appliance.front.worker_ledger import Ledger
from appliance.front.worker_life import WorkerLife
from appliance.host.kernel_log import KernelLog
from appliance.ipc import ProtocolError
from appliance.config.launch_spec import worker_spec
from appliance.config.kinds import GENERATIVE_KINDS


# States in which no worker serves: the model's KV cache is empty.
NO_WORKER = frozenset({ModelState.RESTARTING, ModelState.FAILED, ModelState.STOPPED})


class ModelSupervisor:
    """One model: its worker's life, and the requests routed to it."""

    def __init__(self, model: ModelConfig, config: Config, metrics: Metrics, load_gate: asyncio.Semaphore,
                 on_change: Callable[[ModelSupervisor, ModelState], None] = lambda *_: None, kernel_log: KernelLog | None = None,
                 ledger: Ledger | None = None, spawner: ParkedWorkers | None = None, canary: Canary | None = None,
                 key: str | None = None):
        self.model = model
        # what residency knows it by: the model's name, or a replica's unit key (appliance.config.replicas)
        self.name = key or model.name
        self.metrics = metrics
        self.series = metrics.for_model(self.name, model.kind)
        self._on_change = on_change  # the Supervisor's "some model changed state" signal
        self.router = RequestRouter(model, self.series)
        # the spec the config gives (a reload compares the new config's with it); the life's own copy also holds the
        # LoRA adapters loaded and unloaded at runtime since (appliance.front.api.adapters), which are no config change
        self.configured_spec = worker_spec(model, config)
        self.life = WorkerLife(model, copy.deepcopy(self.configured_spec), metrics, self.series, load_gate, self.router,
                               self._on_frame, self._state_changed, kernel_log, ledger, spawner, canary, self.name)
        self.router.adapters_served = lambda: self.spec.get("adapters") or {}

    # --- the model, as the Supervisor sees it -------------------------------------------------------------

    @property
    def spec(self) -> dict[str, Any]:
        return self.life.spec

    @property
    def state(self) -> ModelState:
        return self.life.state

    @property
    def reports(self) -> bool:
        """Whether this supervisor serves the model's name, and so writes its gauges (Supervisor._switch)."""
        return self.router.reports

    @reports.setter
    def reports(self, value: bool) -> None:
        self.router.reports = value

    def start(self) -> None:
        self.life.start()

    async def stop(self, drain_timeout_s: float) -> None:
        await self.life.stop(drain_timeout_s)

    def status(self) -> dict[str, Any]:
        life, formats = self.life, self.life.formats or {}
        return {"name": self.name, "kind": self.model.kind, "state": life.state.value, "pid": life.pid,
                "device": self.model.device, "pipeline": self.model.pipeline if self.model.kind in GENERATIVE_KINDS else None,
                "restarts": life.restarts, "crashes": life.crashes, "restart_backoff_s": life.last_backoff_s,
                "last_error": life.last_error, "hint": life.last_hint,
                "last_exit": life.last_exit.reason.value if life.last_exit else None,
                "load_seconds": life.load_seconds, "pipeline_load_seconds": life.pipeline_load_seconds,
                "canary_failure": self.canary_failure(),
                # chat formats: as the worker resolved them (configured, else detected), or as configured until then
                "tool_parser": formats.get("tool_parser", self.model.tool_parser),
                "reasoning_parser": formats.get("reasoning_parser", self.model.reasoning_parser),
                **({"window": self.spec["window"]} if self.model.kind in GENERATIVE_KINDS else {}),
                "requests_running": len(self.router.running),
                "requests_waiting": self.router.queued(),
                **({"speculative": self.model.speculative, **self.series.draft.status()} if self.model.kind == "llm"
                   else {})}

    def canary_failure(self) -> str | None:
        """The model's latest failed golden-answer check (appliance.front.canary), until one passes."""
        failure = self.life.canary.failures.get(self.name) if self.life.canary else None
        return str(failure) if failure else None

    def _state_changed(self, old: ModelState, new: ModelState) -> None:
        if self.reports:
            self.metrics.set_state(self.name, new.value)
            if new in NO_WORKER:
                self.series.kv_cache_usage.set(0)  # its cache went with it
        self._on_change(self, new)

    # --- requests, as the routes see them -----------------------------------------------------------------

    def reserve(self, continuing: bool = False) -> None:
        """Hold a queue place for a request whose body is yet to be read, or refuse it now (503, 429).
        `continuing`: for the next part of a request already admitted (a speech's next sentence), which a draining
        model still takes, as it takes the request's reserved place: the drain exists to let admitted work end."""
        if not self.life.admits(reserved=continuing):
            raise self.life.unavailable()
        self.router.reserve(continuing)

    def open(self, frame: dict[str, Any], op: str = "generate", reserved: bool = False) -> Request:
        """Admit a request or refuse it at once: nothing waits on a model that cannot serve it.
        `frame`: the fields of its ipc `op` (generate for an LLM, request for the one-answer kinds) but the id;
        `reserved`: it holds a place from reserve() (a drain waits for it), which this takes, admitted or not."""
        if not self.life.admits(reserved):
            if reserved:
                self.router.unreserve()
            raise self.life.unavailable()
        return self.router.open(frame, op, reserved)

    def close(self, req: Request) -> None:
        self.router.close(req)

    def events(self, req: Request) -> AsyncIterator[Event]:
        return self.router.events(req)

    # --- a ready worker's frames --------------------------------------------------------------------------

    def _on_frame(self, message: dict[str, Any]) -> None:
        """One frame from a ready worker (checked against ipc.OPS by the channel; a batch's frames here)."""
        op = message["op"]
        if op == "batch":  # everything one engine step produced
            for frame in message["frames"]:
                self._on_frame(ipc.check(frame))
        elif op == "telemetry":
            self._on_telemetry(message)
        elif op == "fatal":  # an internal error after loading: the worker has failed its requests and exits
            self.life.end_worker(Exit(ExitReason.WORKER_ERROR, detail=f"{message['kind']}: {message['message']}",
                                      hint=message.get("hint")), kill=False)
        elif op not in REQUEST_OPS:
            raise ProtocolError(f"a ready worker sent {op!r}")
        else:
            self._on_request_frame(message)

    def _on_request_frame(self, message: dict[str, Any]) -> None:
        op = message["op"]
        if op in IMAGE_OPS:  # counted whether its caller is still there or not (RequestRouter.count_image_frame)
            self.router.count_image_frame(message)
        req = self.router.request_of(message)
        if req is None:
            return  # a late frame for a request its caller already closed
        if op == "error":
            failure, end = self.life.device_faults.request_error(message)
            if end:  # the device context is lost: the worker is ended too
                self.life.end_worker(end)
            self.router.fail(req, failure)
        else:
            self.router.on_frame(req, message)

    def _on_telemetry(self, message: dict[str, Any]) -> None:
        """A worker's figures become the model's gauges only while it serves the model's name: during a side-by-
        side reload the replacement (loading) and the replaced worker (draining) do not write them."""
        if not self.reports:
            return
        self.series.worker_rss.set(message.get("rss_bytes", 0))
        if "kv_cache_usage_ratio" in message and self.state not in NO_WORKER:  # not a late figure of a gone one
            self.series.kv_cache_usage.set(message["kv_cache_usage_ratio"])
        self.metrics.set_device_memory(self.name, message.get("device_memory_regions") or {})
        for device, used in (message.get("device_memory_used_bytes") or {}).items():
            self.metrics.device_memory_used.labels(device=device).set(used)
        for device, total in (message.get("device_memory_total_bytes") or {}).items():
            self.metrics.device_memory_total.labels(device=device).set(total)
