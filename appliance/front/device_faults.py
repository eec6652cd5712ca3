"""Why a GPU model's worker failed, as the kernel log tells it: a GPU hang or reset turns a worker's crash, or a
request's device out-of-memory, into a lost device (the runtime aborts on a lost context, and a hung kernel also
ends in CL_OUT_OF_RESOURCES). The pure classification is appliance.host.faults'; this joins it to the kernel log.
"""

from __future__ import annotations

from typing import Any

from appliance.config import ModelConfig
from appliance.front.lifecycle import Exit, ExitReason
from appliance.front.request import RequestFailed
from appliance.host import faults, gpus
from appliance.host.gpu_events import GpuEvent
from appliance.host.kernel_log import KernelLog

# Worker error kinds that are the request's fault: HTTP 400.
CLIENT_ERROR_KINDS = ("invalid_request", "invalid_grammar")
# The figures of a prompt over the window that an error frame may carry (appliance.worker.prompt.Refused).
WINDOW_FIELDS = ("prompt_tokens", "max_context", "tool_tokens")


class DeviceFaults:
    """One model's view of the kernel log (None: not read, as in tests without one)."""

    def __init__(self, model: ModelConfig, kernel_log: KernelLog | None):
        self.model = model
        self.kernel_log = kernel_log
        # The PCI address of the worker's card, as its device probe resolved `GPU.N` (the ready frame's
        # device_bdf); None until a worker said it.
        self.card: str | None = None

    def trouble(self) -> GpuEvent | None:
        """The GPU hang or reset the kernel logged lately on this model's card, for a model on a GPU: a reset
        of another card is not this worker's. Where the card is unknown, a reset of any card."""
        if self.kernel_log is None or "GPU" not in self.model.device.upper():
            return None
        return self.kernel_log.gpu_trouble(bdf=self.card or sole_card())

    def crash(self, returncode: int | None) -> Exit:
        """The exit of a worker nobody asked to go, and that no OOM killer took."""
        trouble = self.trouble()
        if trouble:  # whatever the worker died of, it died of the reset (the runtime aborts on a lost context)
            fault = faults.classify_exit(returncode or 0, gpu_reset_seen=True, pci_family=gpu_family(trouble))
            return Exit(ExitReason.DEVICE_LOST, detail=describe_gpu_trouble(trouble), hint=fault.hint)
        if returncode == faults.EXIT_DEVICE_LOST:
            return Exit(ExitReason.DEVICE_LOST)
        return Exit(ExitReason.CRASH)

    def request_error(self, message: dict[str, Any]) -> tuple[RequestFailed, Exit | None]:
        """A request's error frame as the client's failure, and the worker's end when the error means its device
        context is gone (a device out-of-memory next to a kernel-logged GPU hang was the hang)."""
        kind, code, hint, retryable = message["kind"], message["code"], message.get("hint"), message["retryable"]
        text = message["message"]
        trouble = self.trouble() if kind == "device_oom" else None
        end = None
        if trouble:
            fault = faults.after_gpu_reset(faults.Fault(kind, code, hint, retryable), gpu_family(trouble))
            kind, code, hint, retryable = fault.kind, fault.code, fault.hint, fault.retryable
            text = faults.client_message(fault)
            end = Exit(ExitReason.DEVICE_LOST, detail=describe_gpu_trouble(trouble), hint=hint)
        status = 400 if kind in CLIENT_ERROR_KINDS else 500
        # A fault that a retry on this model may get past (a scheduler out-of-memory, a lost device the restart
        # replaces) tells the client when to try again.
        retry_after = max(1.0, self.model.restart.backoff_initial_s) if retryable else None
        details = {key: message[key] for key in WINDOW_FIELDS if key in message}
        return RequestFailed(status, kind, text, code, hint, retry_after, details), end


def sole_card() -> str | None:
    """The PCI address of the machine's only GPU card, if it has exactly one (then every GPU.N is it)."""
    cards = [gpu.bdf for gpu in gpus.list_gpus() if gpu.bdf]
    return cards[0] if len(cards) == 1 else None


def gpu_family(event: GpuEvent) -> str | None:
    """The family ("DG2", "BMG") of the card a kernel GPU event names, for its known-issue hint."""
    return next((gpu.family for gpu in gpus.list_gpus() if gpu.bdf == event.bdf), None)


def describe_gpu_trouble(event: GpuEvent) -> str:
    return f"GPU {event.kind} on {event.bdf or 'an unnamed card'} in the kernel log: {event.text}"
