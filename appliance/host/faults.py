"""One classifier for every error the appliance sees.

`classify_error` maps an exception message from OpenVINO / OpenVINO GenAI / the
GPU runtime to a `Fault`; `classify_exit` does the same for a worker process that
died. Both are table-driven: the first row whose pattern matches wins, so more
specific rows come first. The strings come from the sources cited per row and are
tested against recorded samples in tests/fixtures/gpu/errors/.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Fault:
    # device_oom | device_lost | scheduler_oom | invalid_request | invalid_config | runtime_missing
    # | worker_crash | internal
    kind: str
    code: str  # short machine code for the OpenAI error body "code" field
    hint: str | None  # known-issue hint for operators, or None
    retryable: bool  # does retrying on a restarted worker plausibly help

    @property
    def hint_suffix(self) -> str:
        """The hint as log lines append it: " (hint: ...)", or nothing."""
        return f" (hint: {self.hint})" if self.hint else ""


# Operator hints. They name the openarc config key and the OpenVINO property behind it.
OOM_HINT = "reduce context or max_tokens, or set KV_CACHE_PRECISION u8"
SCHEDULER_OOM_HINT = "raise scheduler_config.cache_size / num_kv_blocks or use the stateful pipeline"
RUNTIME_MISSING_HINT = "install Intel's compute runtime (intel-opencl-icd)"
DG2_RESET_HINT = "set sdpa_optimization: false (GPU_ENABLE_SDPA_OPTIMIZATION)"
LOAD_OOM_KILL_HINT = ("the host ran out of RAM while loading: set enable_weightless: true (ENABLE_WEIGHTLESS) "
                      "and server.load_concurrency: 1")
INVALID_DEVICE_HINT = "OpenVINO device names are upper-case (CPU, GPU, GPU.0, ...); got {device!r}"
OOM_KILL_HINT = "the kernel OOM killer stopped the worker: lower max context or run fewer models per host"

# OpenVINO GPU plugin, ocl_common.hpp OCL_ERR_MSG_FMT: "[GPU] <cl call>, error code: <n> <CL name>".
# Older releases print no CL name, so it is optional.
OPENCL_ERROR = r"\[GPU\] (cl\w+), error code: (-?\d+)(?: (CL_\w+))?"


def _opencl_code(*codes: int) -> str:
    """OPENCL_ERROR narrowed to the given codes (`(?!\\d)` keeps -5 from matching -58)."""
    alternatives = "|".join(str(code) for code in codes)
    return OPENCL_ERROR.replace(r"(-?\d+)", rf"({alternatives})(?!\d)")


_DEVICE_OOM = Fault("device_oom", "device_out_of_memory", OOM_HINT, False)
_DEVICE_LOST = Fault("device_lost", "device_lost", None, True)
_SCHEDULER_OOM = Fault("scheduler_oom", "scheduler_out_of_memory", SCHEDULER_OOM_HINT, True)
_RUNTIME_MISSING = Fault("runtime_missing", "gpu_runtime_missing", RUNTIME_MISSING_HINT, False)
# Also built directly by the worker when a prompt leaves its answer no room in the window (appliance.config.window).
CONTEXT_LENGTH_EXCEEDED = Fault("invalid_request", "context_length_exceeded", None, False)

# One ordered table: (compiled pattern, fault). First match wins.
_ERROR_RULES = tuple(
    (re.compile(pattern, re.DOTALL), fault)
    for pattern, fault in (
        # ocl_common.cpp: -5 CL_OUT_OF_RESOURCES, -4 CL_MEM_OBJECT_ALLOCATION_FAILURE.
        (_opencl_code(-5, -4), _DEVICE_OOM),
        # ocl_common.cpp rethrow(): -5 while the device is still enumerable gets its own text.
        (r"\[GPU\] CL_OUT_OF_RESOURCES exception", _DEVICE_OOM),
        # -14 CL_EXEC_STATUS_ERROR_FOR_EVENTS_IN_WAIT_LIST, -58 CL_INVALID_EVENT: a kernel in the
        # queue died (GPU reset); -2 CL_DEVICE_NOT_AVAILABLE.
        (_opencl_code(-14, -58, -2), _DEVICE_LOST),
        # -1001 CL_PLATFORM_NOT_FOUND_KHR: the ICD loader is there but no Intel ICD is installed.
        (r"\[GPU\] clGetPlatformIDs,? error code: -1001(?!\d)", _RUNTIME_MISSING),
        # intel_gpu engine.cpp allocation guards (both the total and the single-object one).
        (r"Exceeded max size of memory (?:object )?allocation", _DEVICE_OOM),
        # Level Zero ze_api.h: DEVICE_LOST 0x70000001, DEVICE_REQUIRES_RESET 0x70000006;
        # ze_common.hpp ZE_CHECK prints "... command failed with code <decimal>".
        (r"(?<!\d)18790481(?:93|98)(?!\d)|[ZU][ER]_RESULT_ERROR_DEVICE_(?:LOST|REQUIRES_RESET)", _DEVICE_LOST),
        # ze_api.h OUT_OF_DEVICE_MEMORY 0x70000003.
        (r"(?<!\d)1879048195(?!\d)|[ZU][ER]_RESULT_ERROR_OUT_OF_DEVICE_MEMORY", _DEVICE_OOM),
        # Kernel hang/reset lines (i915 / xe, see appliance/host/gpu_events.py) quoted in a message.
        (r"GPU HANG: ecode|Fence expiration time out|context reset due to GPU hang"
         r"|Resetting chip for|declared device \S+ as wedged|device wedged", _DEVICE_LOST),
        # openvino.genai continuous_batching: the scheduler could not fit the request in the KV cache.
        (r"was dropped by the scheduler\b.*\(out of memory\)", _SCHEDULER_OOM),
        # LLMPipeline generate(): "Got unfinished GenerationStatus" (KV cache full in the CB backend).
        (r"unfinished GenerationStatus", _SCHEDULER_OOM),
        # Our worker's wording for a GenerationStatus::IGNORED result (appliance/worker/main.py).
        (r"scheduler ignored the request|GenerationStatus::IGNORED", _SCHEDULER_OOM),
        # The GPU plugin links libOpenCL.so.1; without the ICD loader the plugin cannot load.
        (r"libOpenCL\.so\.1", _RUNTIME_MISSING),
        # core_impl.cpp: device names are case-sensitive.
        (r'Device with "(?P<device>[^"]*)" name is not registered',
         Fault("invalid_config", "invalid_device", INVALID_DEVICE_HINT, False)),
        # openvino.genai sampling_params check: prompt plus max_length do not fit.
        (r"'max_length' must be greater than the number of prompt tokens", CONTEXT_LENGTH_EXCEEDED),
    )
)

_INTERNAL = Fault("internal", "internal_error", None, False)

# Family-specific hints for faults whose row has none: (pci_family, kind) -> hint.
# DG2 fence timeouts / resets under LLM load are a known SDPA-kernel issue.
_FAMILY_HINTS = {("DG2", "device_lost"): DG2_RESET_HINT}

def classify_error(
    message: str, *, device: str = "", pci_family: str | None = None, gpu_reset_seen: bool = False
) -> Fault:
    """Classify an error message.

    `device` is the configured OpenVINO device (used in hints), `pci_family` the card's
    family from gpus.list_gpus ("DG2", "BMG", "other"). Set `gpu_reset_seen` when the
    kernel log reported a hang/reset of that card around the failure: a kernel that hung
    also ends in CL_OUT_OF_RESOURCES, so the error is then the reset, not an out-of-memory.
    """
    for pattern, fault in _ERROR_RULES:
        match = pattern.search(message)
        if match:
            return _fault_from(fault, match, device, pci_family, gpu_reset_seen)
    return _INTERNAL


def _fault_from(fault: Fault, match: re.Match, device: str, pci_family: str | None, gpu_reset_seen: bool) -> Fault:
    if gpu_reset_seen:
        fault = _after_reset(fault)
    hint = fault.hint or _FAMILY_HINTS.get((pci_family, fault.kind))
    return replace(fault, hint=hint and hint.format_map({"device": device, **match.groupdict()}))


def after_gpu_reset(fault: Fault, pci_family: str | None = None) -> Fault:
    """A fault the worker classified, as it reads next to a kernel-logged hang or reset of its card (a device
    out-of-memory was the reset), with the card family's hint: judged by the fault, not by the runtime's text, which
    the worker keeps to its log."""
    fault = _after_reset(fault)
    return replace(fault, hint=fault.hint or _FAMILY_HINTS.get((pci_family, fault.kind)))


def _after_reset(fault: Fault) -> Fault:
    """An out-of-memory error next to a kernel-logged reset of the same card was the reset."""
    if fault.kind != "device_oom":
        return fault
    return replace(fault, kind="device_lost", code="device_lost", hint=None, retryable=True)


# What a client is told of a runtime fault, by its code: the runtime's own text starts with the C++ source
# locations of its build ("Exception from src/cpp/src/...hpp:148:") and may name server paths, so it goes to the
# worker's log (the journal) in full and the client gets the classified line; hints are sent as they are.
_CLIENT_MESSAGES = {
    "device_out_of_memory": "the device ran out of memory running this request",
    "device_lost": "the model's device was lost (a GPU reset); the model is restarted",
    "scheduler_out_of_memory": "the model's KV cache is out of memory for this request now (a shorter one may fit)",
    "gpu_runtime_missing": "the GPU runtime is missing on the server",
    "invalid_device": "the model's device is misconfigured on the server",
    "context_length_exceeded": "the prompt and the answer's limit do not fit in the model's context window",
}
INTERNAL_MESSAGE = "internal error in the model's worker (the server's log has the details)"


def client_message(fault: Fault) -> str:
    """The error body's message for a fault classified from a runtime's exception (never the exception's text)."""
    return _CLIENT_MESSAGES.get(fault.code, INTERNAL_MESSAGE)


# The worker's exit status after its device was lost (EX_TEMPFAIL): restart it with a fresh device context.
EXIT_DEVICE_LOST = 75


@dataclass(frozen=True)
class _ExitRule:
    signal: str | None  # signal_name() of the return code, None = any
    during_load: bool | None  # None = either
    oom_killed: bool | None
    gpu_reset_seen: bool | None
    fault: Fault


# Worker deaths, first match wins. A SIGKILL from the OOM killer while loading is the
# compile-time host-RAM peak (weights held twice); a crash mid-request is worth one retry.
# A worker that exits EXIT_DEVICE_LOST said so itself; one that crashes while the kernel
# logs a reset of a GPU died of the reset (the runtime aborts on a lost context).
_EXIT_RULES = (
    _ExitRule("SIGKILL", True, True, None, Fault("worker_crash", "worker_oom_killed", LOAD_OOM_KILL_HINT, False)),
    _ExitRule(None, None, True, None, Fault("worker_crash", "worker_oom_killed", OOM_KILL_HINT, True)),
    _ExitRule(f"exit_{EXIT_DEVICE_LOST}", None, None, None, _DEVICE_LOST),
    _ExitRule(None, None, None, True, _DEVICE_LOST),
    _ExitRule(None, True, None, None, Fault("worker_crash", "worker_load_crashed", None, False)),
    _ExitRule(None, None, None, None, Fault("worker_crash", "worker_crashed", None, True)),
)


def classify_exit(returncode: int, *, during_load: bool = False, oom_killed: bool = False,
                  gpu_reset_seen: bool = False, pci_family: str | None = None) -> Fault:
    """Classify a worker death (Popen.returncode: negative = killed by that signal).

    `oom_killed`: appliance.host.oom said the kernel OOM killer chose it; `gpu_reset_seen`: the kernel
    log reported a GPU hang/reset shortly before (appliance.host.kernel_log.KernelLog.gpu_trouble), of a
    card of `pci_family` where known (for its family's hint).
    """
    observed = (signal_name(returncode), during_load, oom_killed, gpu_reset_seen)
    for rule in _EXIT_RULES:
        wanted = (rule.signal, rule.during_load, rule.oom_killed, rule.gpu_reset_seen)
        if all(want is None or want == seen for want, seen in zip(wanted, observed, strict=True)):
            return replace(rule.fault, hint=rule.fault.hint or _FAMILY_HINTS.get((pci_family, rule.fault.kind)))
    raise AssertionError("the last exit rule matches everything")


def signal_name(returncode: int) -> str:
    """Label for openarc_worker_crashes_total{signal}: -6 -> "SIGABRT", 1 -> "exit_1".

    Return codes above 128 (a shell's "killed by signal") are left as exit_N: the
    supervisor starts workers directly, so it sees negative codes for signals.
    """
    if returncode >= 0:
        return f"exit_{returncode}"
    try:
        return signal.Signals(-returncode).name
    except ValueError:
        return f"signal_{-returncode}"

