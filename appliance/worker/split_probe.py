"""The on-load probe of a model split over several devices (HETERO:...): runs the pipelines the decision needs and
hands what it saw to appliance.worker.split_verdict, which decides. The worker runs it before its engine loads; a
refusal goes to the front as the load's fatal error (kind split_refused), so status and the log show the evidence.

Order matters: the split loads first, in a worker that holds nothing yet, so the memory it grows on each device is
its own; then it answers; then it goes, and the single-device reference loads and answers (a CPU's freed memory
does not go back to the system at once: measured after the reference, the split's growth would read short).
"""

from __future__ import annotations

import gc
import logging
import os
from typing import Any

from appliance.host import device_memory, telemetry
from appliance.worker.split_verdict import PROBE_TOKENS, PROMPTS, ProbeResult, Verdict, split_devices, verdict

log = logging.getLogger("openarc.worker")

# Properties that only make sense for a split: the single-device reference loads without them.
SPLIT_ONLY = ("MODEL_DISTRIBUTION_POLICY",)


def probe(spec: dict[str, Any]) -> Verdict:
    """Load the split, answer PROMPTS greedily, then the same on its first device alone, and decide."""
    import openvino
    import openvino_genai

    device, path, properties = spec["device"], spec["path"], spec.get("properties") or {}
    if spec.get("kind", "llm") != "llm":
        return Verdict(False, f"split {device} refused: the split probe compares an LLM's answers; a "
                              f"{spec.get('kind')} model is not split (give it one device)")
    devices = split_devices(device)
    core = openvino.Core()
    config = openvino_genai.GenerationConfig()
    config.max_new_tokens, config.do_sample = PROBE_TOKENS, False
    before = _memory(core, devices)
    pipe = openvino_genai.LLMPipeline(path, device, **properties)
    after = _memory(core, devices)
    split = tuple(str(pipe.generate(prompt, config)) for prompt in PROMPTS)
    again = tuple(str(pipe.generate(prompt, config)) for prompt in PROMPTS)
    del pipe
    gc.collect()
    reference, error = None, None
    single = {key: value for key, value in properties.items() if key not in SPLIT_ONLY}
    try:
        pipe = openvino_genai.LLMPipeline(path, devices[0], **single) if devices else None
        reference = tuple(str(pipe.generate(prompt, config)) for prompt in PROMPTS) if pipe else None
    except Exception as exc:  # it does not load on one device (the reason to split): the weaker check
        error = " ".join(str(exc).split())[:200] or type(exc).__name__
        log.info("split probe: the model does not load on %s alone (%s); checking the split's answers alone",
                 devices[0], error)
    finally:
        pipe = None
        gc.collect()
    return verdict(ProbeResult(device, split, {d: after.get(d, 0) - before.get(d, 0) for d in devices}, reference,
                               devices[0] if devices else None, None if reference else again, error))


def _memory(core, devices: tuple[str, ...]) -> dict[str, int]:
    """Bytes this process holds on each device now: a GPU's from our DRM fdinfo on its card (its PCI address from
    OpenVINO), else OpenVINO's own count; the CPU's as our RSS."""
    pid, used = os.getpid(), {}
    per_card = device_memory.device_memory_used([pid])
    for device in devices:
        if device.startswith("GPU"):
            try:
                pci = core.get_property(device, "DEVICE_PCI_INFO")
                bdf = f"{pci.domain:04x}:{pci.bus:02x}:{pci.device:02x}.{pci.function:x}"
            except Exception:
                bdf = None
            if bdf in per_card:
                used[device] = per_card[bdf]
            else:
                stats = core.get_property(device, "GPU_MEMORY_STATISTICS")
                used[device] = device_memory.parse_gpu_memory_statistics(stats)
        elif device == "CPU":
            used[device] = telemetry.process_rss_bytes(pid) or 0
    return used
