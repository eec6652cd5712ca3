"""appliance.host.faults against recorded error texts (tests/fixtures/gpu/errors, see its README)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from appliance.host.faults import (
    DG2_RESET_HINT,
    INVALID_DEVICE_HINT,
    LOAD_OOM_KILL_HINT,
    OOM_HINT,
    OOM_KILL_HINT,
    RUNTIME_MISSING_HINT,
    SCHEDULER_OOM_HINT,
    Fault,
    classify_error,
    classify_exit,
    signal_name,
)

ERRORS = Path(__file__).parent / "fixtures" / "gpu" / "errors"

DEVICE_OOM = Fault("device_oom", "device_out_of_memory", OOM_HINT, False)
DEVICE_LOST = Fault("device_lost", "device_lost", None, True)
SCHEDULER_OOM = Fault("scheduler_oom", "scheduler_out_of_memory", SCHEDULER_OOM_HINT, True)
RUNTIME_MISSING = Fault("runtime_missing", "gpu_runtime_missing", RUNTIME_MISSING_HINT, False)

EXPECTED = {
    "ocl-5-clflush-openvino35528.txt": DEVICE_OOM,
    "ocl-5-noname-notebooks2740.txt": DEVICE_OOM,
    "ocl-out-of-resources-exception-ov2026.txt": DEVICE_OOM,
    "exceeded-max-memory-allocation.txt": DEVICE_OOM,
    "exceeded-max-memory-object-allocation.txt": DEVICE_OOM,
    "ocl-14-clwaitforevents-openvino36349.txt": DEVICE_LOST,
    "ocl-58-clwaitforevents-openarc87.txt": DEVICE_LOST,
    "ze-device-lost.txt": DEVICE_LOST,
    "ze-device-requires-reset.txt": DEVICE_LOST,
    "ur-device-lost.txt": DEVICE_LOST,
    "genai-request-dropped-ov2026.txt": SCHEDULER_OOM,
    "genai-unfinished-generation-status.txt": SCHEDULER_OOM,
    "worker-request-ignored.txt": SCHEDULER_OOM,
    "libopencl-missing-ov2026.txt": RUNTIME_MISSING,
    "ocl-no-platform.txt": RUNTIME_MISSING,
    "genai-max-length.txt": Fault("invalid_request", "context_length_exceeded", None, False),
    "device-cpu-lowercase-ov2026.txt": Fault(
        "invalid_config", "invalid_device", INVALID_DEVICE_HINT.format(device="cpu"), False
    ),
    "model-missing-ov2026.txt": Fault("internal", "internal_error", None, False),
}


def test_every_error_fixture_has_an_expectation():
    assert sorted(path.name for path in ERRORS.iterdir()) == sorted(EXPECTED)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_recorded_error_is_classified(name):
    assert classify_error((ERRORS / name).read_text()) == EXPECTED[name]


def test_minus_five_is_not_confused_with_minus_fifty_eight():
    # -58 starts with -5; the -5 row must not swallow it.
    assert classify_error("[GPU] clFinish, error code: -58").kind == "device_lost"
    assert classify_error("[GPU] clFinish, error code: -5").kind == "device_oom"


def test_other_opencl_codes_are_internal():
    assert classify_error("[GPU] clEnqueueNDRangeKernel, error code: -54 unknown macro name").kind == "internal"


@pytest.mark.parametrize(
    "name", ["ocl-14-clwaitforevents-openvino36349.txt", "ocl-58-clwaitforevents-openarc87.txt", "ze-device-lost.txt"]
)
def test_device_lost_on_dg2_points_at_sdpa(name):
    message = (ERRORS / name).read_text()
    assert classify_error(message, pci_family="DG2").hint == DG2_RESET_HINT
    assert classify_error(message, pci_family="BMG").hint is None


def test_fence_timeout_on_dg2_points_at_sdpa():
    fault = classify_error("Fence expiration time out i915-0000:03:00.0:clpeak[2387]:2!", pci_family="DG2")
    assert (fault.kind, fault.hint) == ("device_lost", DG2_RESET_HINT)


def test_out_of_resources_next_to_a_kernel_reset_is_the_reset():
    message = (ERRORS / "ocl-5-clflush-openvino35528.txt").read_text()
    assert classify_error(message, gpu_reset_seen=True) == DEVICE_LOST
    dg2 = classify_error(message, gpu_reset_seen=True, pci_family="DG2")
    assert (dg2.kind, dg2.hint) == ("device_lost", DG2_RESET_HINT)
    # A reset does not change faults that are not memory errors.
    scheduler = (ERRORS / "genai-request-dropped-ov2026.txt").read_text()
    assert classify_error(scheduler, gpu_reset_seen=True) == SCHEDULER_OOM


def test_oom_hint_is_kept_on_dg2():
    message = (ERRORS / "ocl-5-clflush-openvino35528.txt").read_text()
    assert classify_error(message, pci_family="DG2") == DEVICE_OOM


def test_live_openvino_error_for_a_lower_case_device():
    parameter = ov.opset13.parameter([1, 4], np.float32)
    model = ov.Model([ov.opset13.relu(parameter)], [parameter])
    with pytest.raises(RuntimeError) as raised:
        ov.Core().compile_model(model, "cpu")
    fault = classify_error(str(raised.value), device="cpu")
    assert (fault.kind, fault.code, fault.retryable) == ("invalid_config", "invalid_device", False)
    assert "'cpu'" in fault.hint


def test_signal_names():
    assert [signal_name(code) for code in (-6, -9, -11, -15, 0, 1, 137)] == [
        "SIGABRT", "SIGKILL", "SIGSEGV", "SIGTERM", "exit_0", "exit_1", "exit_137",
    ]
    assert signal_name(-200) == "signal_200"


@pytest.mark.parametrize(
    ("returncode", "during_load", "oom_killed", "code", "hint", "retryable"),
    [
        (-9, True, True, "worker_oom_killed", LOAD_OOM_KILL_HINT, False),
        (-9, False, True, "worker_oom_killed", OOM_KILL_HINT, True),
        (-6, True, False, "worker_load_crashed", None, False),
        (-9, True, False, "worker_load_crashed", None, False),
        (-11, False, False, "worker_crashed", None, True),
        (1, False, False, "worker_crashed", None, True),
    ],
)
def test_worker_exit_is_classified(returncode, during_load, oom_killed, code, hint, retryable):
    fault = classify_exit(returncode, during_load=during_load, oom_killed=oom_killed)
    assert fault == Fault("worker_crash", code, hint, retryable)


@pytest.mark.parametrize("during_load", [False, True])
def test_exit_75_is_a_lost_device_not_a_crash(during_load):
    assert classify_exit(75, during_load=during_load) == DEVICE_LOST


@pytest.mark.parametrize("returncode", [-6, -11, 1])
def test_a_crash_right_after_a_gpu_reset_is_a_lost_device(returncode):
    assert classify_exit(returncode, gpu_reset_seen=True) == DEVICE_LOST
    assert classify_exit(returncode, gpu_reset_seen=True, pci_family="DG2").hint == DG2_RESET_HINT
    assert classify_exit(returncode, gpu_reset_seen=False).kind == "worker_crash"


def test_an_oom_kill_is_an_oom_kill_even_next_to_a_gpu_reset():
    fault = classify_exit(-9, during_load=True, oom_killed=True, gpu_reset_seen=True, pci_family="DG2")
    assert (fault.code, fault.hint) == ("worker_oom_killed", LOAD_OOM_KILL_HINT)


def test_real_worker_deaths_get_their_signal_label():
    aborted = subprocess.run([sys.executable, "-c", "import os; os.abort()"], timeout=60)
    killed = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed.kill()
    killed.wait(timeout=60)
    assert signal_name(aborted.returncode) == "SIGABRT"
    assert signal_name(killed.returncode) == "SIGKILL"
    assert classify_exit(killed.returncode, during_load=True, oom_killed=True).hint == LOAD_OOM_KILL_HINT


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_a_runtime_error_reaches_the_client_as_its_classified_line_and_the_log_whole(name, caplog):
    """The engine's failure path (Engine.fail_all, what a pipeline exception mid-generation takes) with each
    recorded runtime text: the client's error frame carries the fault's code and a short line, never the text's
    source locations or server paths; the worker's log (the journal) keeps the whole text."""
    from appliance.worker.engines.base import Engine
    text = (ERRORS / name).read_text().strip()
    engine = Engine({"device": "GPU"}, channel=None)
    fault = engine.fail_all([type("Req", (), {"id": 7})()], RuntimeError(text))
    (sent,) = engine.outbox
    assert sent["op"] == "error" and sent["id"] == 7 and sent["code"] == fault.code == EXPECTED[name].code
    for line in text.splitlines():
        assert line.strip() not in sent["message"]
    assert ".cpp" not in sent["message"] and "/" not in sent["message"], sent["message"]
    assert text in caplog.text


def test_a_tokenizer_error_reaches_the_client_as_its_classified_line_and_the_log_whole(caplog):
    """A prompt the tokenizer fails on (Prompts.prompt): the request's refusal carries the fault's short line, never
    the runtime's text with its source files and server paths; the log keeps it whole. (The tokenizer's encode is a
    stand-in that raises: the demo's real tokenizer takes any text.)"""
    from appliance.worker.engines.base import Engine
    from appliance.worker.prompt import Prompts, Refused
    text = ("Exception from src/core/src/runtime/tokenizer.cpp:201:\n"
            "Check 'ok' failed: cannot read /var/lib/openarc/models/secret/openvino_tokenizer.xml")

    class Failing:
        def encode(self, *args, **kwargs):
            raise RuntimeError(text)
    prompts = Prompts.__new__(Prompts)
    prompts.tokenizer, prompts.classify = Failing(), Engine({"device": "CPU"}, channel=None).classify
    with pytest.raises(Refused) as refused:
        prompts.prompt({"kind": "completion", "prompt": "hi"})
    sent = refused.value.frame(3)
    assert sent["op"] == "error" and ".cpp" not in sent["message"] and "/" not in sent["message"], sent
    assert text in caplog.text
