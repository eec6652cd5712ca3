"""The worker process: owns one model's pipeline and nothing else.

Started fresh by the supervisor (`python -m appliance.worker --fd N --spec JSON`, never forked from the front),
it loads the pipeline, says `ready`, then serves generate/cancel frames until EOF on its channel. Pipeline calls
all happen on one engine thread (appliance.worker.engines), so the channel reader never blocks behind a generation and a
cancel is seen at the next step. The worker never runs a pipeline destructor after an error: it leaves with
os._exit(), so a corrupted device context cannot turn an error into a SIGABRT.
"""

from __future__ import annotations

import argparse
import ctypes
import faulthandler
import json
import logging
import os
import signal
import socket
import sys
import threading
import time

from appliance.host import compile_cache, device_memory, faults, gpus, oom, telemetry
from appliance.worker.engines import load_engine
from appliance.worker.engines.base import Engine
from appliance.worker.split_verdict import split_devices
from appliance.ipc import BlockingChannel, frame

log = logging.getLogger("openarc.worker")

EXIT_LOAD_FAILED = 3
EXIT_INTERNAL_ERROR = 70  # EX_SOFTWARE: a bug in the worker; the supervisor restarts it
TELEMETRY_INTERVAL_S = 2.0
INTERNAL = faults.Fault("internal", "internal_error", None, True)
SPLIT_HINT = ("a model split over several cards loads only once it answers as on one card and holds memory on each "
              "(docs/operations.md, Two or more cards); serve it on one card (device: auto) instead")
# Test knob: touch this many MiB of host RAM before loading, so a test can make the kernel OOM killer end a load
# inside a small memory cgroup.  Never set in production.
LOAD_HOG_ENV = "OPENARC_DEBUG_LOAD_HOG_MB"
# /proc/PID/comm of a parked worker (appliance.front.parked) and of one that was handed a model.
PARKED_NAME = "openarc-parked"
WORKER_NAME = "openarc-worker"


def die_with_parent() -> None:
    """PR_SET_PDEATHSIG: even a SIGSTOPped worker is killed when the front dies, so no orphan holds VRAM."""
    PR_SET_PDEATHSIG = 1
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


class DeviceProbe:
    """What this worker can learn about its GPU: the PCI address that labels its metrics, the card's family for
    known-issue hints, and VRAM (total from OpenVINO, used from our own DRM fdinfo, else OpenVINO's statistics)."""

    def __init__(self, device: str):
        self.device = device
        self.label: str | None = None
        self.bdf: str | None = None  # the card's PCI address, where OpenVINO tells it
        self.family: str | None = None
        self.total: int | None = None
        self._core = None
        if device.startswith("GPU"):
            self._identify()

    def _identify(self) -> None:
        import openvino
        self._core = openvino.Core()
        self.label = self.device
        try:
            pci = self._core.get_property(self.device, "DEVICE_PCI_INFO")
            self.label = self.bdf = f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.{pci.function:x}"
        except Exception as exc:  # an older driver or plugin: keep the OpenVINO name as the label
            log.info("PCI address of %s unknown: %s", self.device, exc)
        try:
            self.total = int(self._core.get_property(self.device, "GPU_DEVICE_TOTAL_MEM_SIZE"))
        except Exception as exc:
            log.info("VRAM size of %s unknown to OpenVINO: %s", self.device, exc)
        card = next((gpu for gpu in gpus.list_gpus() if gpu.bdf == self.label), None)
        self.family = card.family if card else None
        if self.total is None and card:  # where OpenVINO cannot tell, the driver's sysfs may
            self.total = card.memory_total_bytes

    def regions(self, pid: int) -> dict[str, int]:
        """Where this worker's GPU buffers are resident ({vram, system} bytes; {} off the GPU): the eviction cliff."""
        return device_memory.device_memory_regions([pid]) if self.label is not None else {}

    def memory(self, pid: int) -> tuple[dict[str, int], dict[str, int]]:
        """(used, total) VRAM by device label."""
        if self.label is None:
            return {}, {}
        used = device_memory.device_memory_used([pid])
        if not used:
            stats = self._core.get_property(self.device, "GPU_MEMORY_STATISTICS")
            used = {self.label: device_memory.parse_gpu_memory_statistics(stats)}
        return used, ({self.label: self.total} if self.total else {})


def report_telemetry(channel: BlockingChannel, probe: DeviceProbe, engine: Engine) -> None:
    pid = os.getpid()
    while True:
        try:
            used, total = probe.memory(pid)
            kv_cache = {} if engine.kv_cache_usage_ratio is None else {"kv_cache_usage_ratio": engine.kv_cache_usage_ratio}
            regions = probe.regions(pid)
            channel.send(frame("telemetry", rss_bytes=telemetry.process_rss_bytes(pid),
                               device_memory_used_bytes=used, device_memory_total_bytes=total,
                               **({"device_memory_regions": regions} if regions else {}), **kv_cache))
        except OSError:
            return
        except Exception:  # telemetry must never take a worker down
            log.debug("telemetry failed", exc_info=True)
        time.sleep(TELEMETRY_INTERVAL_S)


def fail_loudly(channel: BlockingChannel, thread: str, exc: BaseException, engine: Engine | None = None) -> None:
    """An exception escaped one of the worker's threads: nothing here can be trusted to go on. Answer the engine's
    requests (only from the engine thread itself, which owns them), tell the front why, and leave at once: the
    front fails what is left and restarts the model."""
    message = f"internal error in the worker's {thread} thread: {type(exc).__name__}: {exc}"
    log.error("%s; exiting", message, exc_info=exc)
    try:
        if engine is not None:
            for request_id in engine.live_request_ids():
                engine.fail(request_id, INTERNAL, faults.client_message(INTERNAL))  # the text is the log's
            engine.flush()
        channel.send(frame("fatal", kind=INTERNAL.kind, message=message))
    except Exception as report_exc:  # the front still sees EOF and our exit status
        log.error("could not report the error to the front: %s", report_exc)
    finally:
        os._exit(EXIT_INTERNAL_ERROR)


def run_guarded(channel: BlockingChannel, thread: str, target, engine: Engine | None = None) -> None:
    """Run one of the worker's threads; whatever escapes it goes through fail_loudly (pass the engine only from
    the engine thread, which owns its requests)."""
    try:
        target()
    except BaseException as exc:
        fail_loudly(channel, thread, exc, engine)


def serve(channel: BlockingChannel, engine: Engine) -> None:
    """The channel reader: dispatch frames to the engine until EOF (the front is gone) or shutdown."""
    try:
        read_frames(channel, engine)
    except Exception as exc:
        fail_loudly(channel, "channel reader", exc)


def read_frames(channel: BlockingChannel, engine: Engine) -> None:
    while True:
        message = channel.recv()
        if message is None or message["op"] == "shutdown":
            return
        if message["op"] in ("generate", "request"):
            engine.submit(message)
        elif message["op"] == "cancel":
            engine.cancel(message["id"])


def refuse_unproven_split(channel: BlockingChannel, spec: dict) -> None:
    """A model split over several devices loads only after its probe passed (appliance.worker.split_verdict);
    refused, the worker says why and leaves before its engine loads."""
    if not split_devices(spec["device"]):
        return
    from appliance.worker.split_probe import probe
    result = probe(spec)
    if result.ok:
        log.info("%s", result.evidence)
        return
    log.error("%s", result.evidence)
    # public: the evidence is openarc's own words (devices and answers compared), a client's to read; a runtime's
    # text is not (its source files, server paths)
    channel.send(frame("fatal", kind="split_refused", hint=SPLIT_HINT, message=result.evidence, public=True))
    os._exit(EXIT_LOAD_FAILED)


def set_process_name(name: str) -> None:
    """The name ps and /proc/PID/comm show (15 bytes at most): a parked worker is told from a model's by it."""
    PR_SET_NAME = 15
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def parked_until_spec(channel: BlockingChannel) -> dict | None:
    """A parked worker: OpenVINO GenAI imported ahead (the interpreter's start and the imports are what a switch
    saves), nothing loaded, no device touched (so one spare serves a model on any device); waits for the model to
    load. None: the front closed the channel or asked it to leave."""
    import openvino_genai  # noqa: F401
    set_process_name(PARKED_NAME)  # imported: warm (a spare taken before this still loads, paying the rest)
    message = channel.recv()
    if message is None or message["op"] != "spec":
        return None
    set_process_name(WORKER_NAME)
    return message["spec"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="openarc-worker")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--spec", help="the model's spec as JSON")
    parser.add_argument("--parked", action="store_true", help="import OpenVINO, then wait for the spec on the channel")
    args = parser.parse_args(argv)
    die_with_parent()
    faulthandler.enable()
    # Under memory pressure the kernel should end a worker (restarted with backoff), never the front.
    oom.set_oom_score_adj(oom.WORKER_OOM_SCORE_ADJ)
    channel = BlockingChannel(socket.socket(fileno=args.fd))
    spec = parked_until_spec(channel) if args.parked else json.loads(args.spec)
    if spec is None:
        os._exit(0)
    from appliance.logs import setup_logging
    setup_logging(spec.get("log_level", "info"), prefix=f"worker[{spec['name']}] ")
    started = time.monotonic()
    try:
        hog = b"\xff" * (int(os.environ.get(LOAD_HOG_ENV, "0")) << 20)
        import openvino_genai  # noqa: F401  imported before the clock starts: pipeline_load_seconds is the load alone
        cache_dir = compile_cache.place(spec, compile_cache.current_runtime())  # this runtime's, this model's
        cached_before = compile_cache.snapshot(cache_dir)
        loading = time.monotonic()
        refuse_unproven_split(channel, spec)
        engine = load_engine(spec, channel)
        pipeline_seconds = time.monotonic() - loading
        load_source = compile_cache.load_source(cached_before, compile_cache.snapshot(cache_dir))
        compile_cache.mark_used(cache_dir)  # the pruning's "least recently used"
        del hog
    except Exception as exc:
        message = str(exc).strip() or type(exc).__name__
        fault = faults.classify_error(message, device=spec["device"])
        log.error("loading %s failed (%s): %s%s", spec["path"], fault.kind, message, fault.hint_suffix)
        channel.send(frame("fatal", kind=fault.kind, hint=fault.hint, message=message))
        os._exit(EXIT_LOAD_FAILED)
    probe = DeviceProbe(spec["device"])
    engine.pci_family = probe.family
    card = {"device_bdf": probe.bdf} if probe.bdf else {}
    channel.send(frame("ready", load_seconds=time.monotonic() - started, pipeline_load_seconds=pipeline_seconds,
                       load_source=load_source, **engine.ready_info(), **card))
    threading.Thread(target=run_guarded, args=(channel, "engine", engine.run, engine), name="engine",
                     daemon=True).start()
    for name, target in engine.threads():
        threading.Thread(target=run_guarded, args=(channel, name, target), name=name, daemon=True).start()
    threading.Thread(target=report_telemetry, args=(channel, probe, engine), name="telemetry", daemon=True).start()
    try:
        serve(channel, engine)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # no pipeline destructor, ever


if __name__ == "__main__":
    main()
