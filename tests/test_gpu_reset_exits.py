"""A GPU hang or reset in the kernel log classifies a GPU model's worker failure as a lost device.

Recorded i915/xe sequences (tests/fixtures/gpu/kmsg) are replayed through a file the front's KernelLog reads.
Without a GPU to run a worker on, the failures go through the model's supervisor directly: the exit of a worker
nobody asked to go (then status, log line and crash metric), and a request's device_oom error frame. A real
worker's exit 75 is tests/test_lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import signal
import types
from pathlib import Path

import pytest
import yaml

from appliance.config import load_config
from appliance.host.faults import OOM_HINT
from appliance.front.lifecycle import Exit, ExitReason, ModelState
from appliance.front.metrics import Metrics
from appliance.front.model_supervisor import ModelSupervisor
from appliance.front.request import Request, RequestFailed
from appliance.host.kernel_log import KernelLog

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
OCL_OUT_OF_RESOURCES = (FIXTURES / "errors/ocl-5-clflush-openvino35528.txt").read_text()


@pytest.fixture
def kernel_log(tmp_path):
    source = tmp_path / "kmsg"
    source.write_text((FIXTURES / "kmsg/dev-kmsg-abi-example.kmsg").read_text())
    with KernelLog(source) as log:
        yield log, source


def supervisor(tmp_path, demo_model, kernel_log, device: str) -> tuple[ModelSupervisor, Metrics]:
    config_path = tmp_path / "openarc.yaml"
    config_path.write_text(yaml.safe_dump({"models": [{"name": "m", "path": str(demo_model), "device": device}]}))
    config, metrics = load_config(config_path), Metrics()
    sup = ModelSupervisor(config.models[0], config, metrics, asyncio.Semaphore(1), kernel_log=kernel_log)
    sup.life.enter(ModelState.LOADING)
    return sup, metrics


def worker_error_frame(text: str) -> dict:
    """The error frame a GPU worker's engine sends when genai raises `text` mid-generation (Engine.fail_all: the
    classified fault and its client line; the text itself stays in the worker's log)."""
    from appliance.worker.engines.base import Engine
    engine = Engine({"device": "GPU"}, channel=None)
    engine.fail_all([types.SimpleNamespace(id=1)], RuntimeError(text))
    (frame,) = engine.outbox
    return frame


def request_error(sup: ModelSupervisor, frame: dict) -> RequestFailed:
    """The failure a running request gets from its worker's error frame, as the front routes that frame."""
    req = Request(frame["id"], {})
    sup.router.running[req.id] = req
    sup._on_frame(frame)
    return req.events.get_nowait()


@pytest.mark.parametrize("sequence", ["i915-a770-guc-hang.kmsg", "xe-b580-wedge-gt.kmsg"])
def test_a_gpu_workers_crash_after_a_kernel_logged_reset_is_a_lost_device(tmp_path, demo_model, kernel_log, sequence):
    log, source = kernel_log
    sup, metrics = supervisor(tmp_path, demo_model, log, "GPU.0")
    assert sup.life.unasked_exit(None, -signal.SIGABRT).reason is ExitReason.CRASH
    with open(source, "a") as kmsg:
        kmsg.write((FIXTURES / "kmsg" / sequence).read_text())
    exit = sup.life.unasked_exit(None, -signal.SIGABRT)
    assert exit.reason is ExitReason.DEVICE_LOST and "0000:03:00.0 in the kernel log" in exit.detail
    sup.life._on_exit(Exit(exit.reason, -signal.SIGABRT, exit.detail, exit.hint, ever_ready=True, served_s=5))
    assert sup.status()["last_exit"] == "device_lost"
    assert sup.life.last_error.startswith("worker exited: device lost (SIGABRT); a fresh worker gets a new device context: "
                                     "GPU ")
    assert b'openarc_worker_crashes_total{model="m",reason="device_lost",signal="SIGABRT"} 1.0' in \
        metrics.exposition()[0]


def test_a_cpu_workers_crash_is_not_blamed_on_a_gpu_reset(tmp_path, demo_model, kernel_log):
    log, source = kernel_log
    sup, _ = supervisor(tmp_path, demo_model, log, "CPU")
    with open(source, "a") as kmsg:
        kmsg.write((FIXTURES / "kmsg/i915-a770-guc-hang.kmsg").read_text())
    assert sup.life.unasked_exit(None, -signal.SIGSEGV).reason is ExitReason.CRASH


def test_a_device_oom_next_to_a_gpu_hang_is_a_lost_device_and_ends_the_worker(tmp_path, demo_model, kernel_log):
    log, source = kernel_log
    sup, _ = supervisor(tmp_path, demo_model, log, "GPU")
    frame = worker_error_frame(OCL_OUT_OF_RESOURCES)
    plain = request_error(sup, frame)
    assert (plain.status, plain.kind, plain.code, plain.hint) == (500, "device_oom", "device_out_of_memory", OOM_HINT)
    assert sup.life.current.ending is None
    with open(source, "a") as kmsg:
        kmsg.write((FIXTURES / "kmsg/xe-b580-wedge-tile.kmsg").read_text())
    after_hang = request_error(sup, frame)
    assert (after_hang.status, after_hang.kind, after_hang.code, after_hang.hint) == (500, "device_lost", "device_lost", None)
    assert sup.life.current.ending.reason is ExitReason.DEVICE_LOST  # the worker's context is gone: it is ended and restarted


def as_kmsg(dmesg_lines: str, first_seq: int) -> str:
    """Recorded dmesg lines as /dev/kmsg records (prefix 6 = kernel, info), with the PCI properties the kernel adds."""
    records = []
    for i, line in enumerate(dmesg_lines.strip().splitlines()):
        bdf = line.split()[1].rstrip(":")
        records.append(f"6,{first_seq + i},{9_000_000_000 + i},-;{line}\n SUBSYSTEM=pci\n DEVICE=+pci:{bdf}\n")
    return "".join(records)


CARD0, CARD1 = "0000:03:00.0", "0000:0b:00.0"  # the A770 of i915-a770-guc-hang.kmsg; the B60 of xe-b60-vllm55425


def test_a_reset_on_another_card_leaves_this_gpus_failures_its_own(tmp_path, demo_model, kernel_log):
    """Two cards: a B60 at 0b:00.0 resets (its recorded lines), then the GPU.0 worker, whose card is the A770 at
    03:00.0 as the worker's device probe resolved it, runs out of device memory and later crashes: each is
    classified as itself. A hang on its own card is what makes either a lost device."""
    log, source = kernel_log
    sup, metrics = supervisor(tmp_path, demo_model, log, "GPU.0")
    sup.life.device_faults.card = CARD0  # what the worker's ready frame reported (device_bdf)
    frame = worker_error_frame(OCL_OUT_OF_RESOURCES)
    with open(source, "a") as kmsg:
        kmsg.write(as_kmsg((FIXTURES / "dmesg/xe-b60-vllm55425.txt").read_text(), 50001))
    assert log.gpu_trouble() is not None and log.gpu_trouble().bdf == CARD1  # the reset was seen, on card 1
    failure = request_error(sup, frame)
    assert (failure.status, failure.kind, failure.code) == (500, "device_oom", "device_out_of_memory")
    assert sup.life.current.ending is None  # the worker goes on
    assert sup.life.unasked_exit(None, -signal.SIGSEGV).reason is ExitReason.CRASH
    # the same failures after a hang on its own card
    with open(source, "a") as kmsg:
        kmsg.write((FIXTURES / "kmsg/i915-a770-guc-hang.kmsg").read_text())
    assert request_error(sup, frame).kind == "device_lost"
    exit = sup.life.unasked_exit(None, -signal.SIGSEGV)
    assert exit.reason is ExitReason.DEVICE_LOST and CARD0 in exit.detail


def test_a_worker_that_never_said_its_card_is_judged_by_any_cards_reset(tmp_path, demo_model, kernel_log):
    """Without the card (a worker that died loading, an old driver without a PCI address) and more than one card
    or none in sysfs, a reset anywhere is the likeliest cause, as before."""
    log, source = kernel_log
    sup, _ = supervisor(tmp_path, demo_model, log, "GPU.0")
    with open(source, "a") as kmsg:
        kmsg.write(as_kmsg((FIXTURES / "dmesg/xe-b60-vllm55425.txt").read_text(), 50001))
    assert sup.life.unasked_exit(None, -signal.SIGSEGV).reason is ExitReason.DEVICE_LOST
