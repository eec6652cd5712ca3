"""Whether a model split over several devices (`HETERO:GPU.0,GPU.1`, pipeline parallel) may serve: the on-load
probe's decision, as one pure function of what the probe saw (appliance.worker.split_probe runs the pipelines).

Why a probe at all: every public multi-card split on Arc has shipped wrong answers or crashes (OpenArc's two-B580
HETERO split answering garbage, OpenVINO's multi-GPU pipeline-parallel wrong-output reports), and a split that
quietly runs on one card only is a slower single-card load that holds memory on neither card the owner meant. So
a split loads only after it proves, on this box, with this model and driver:

- its greedy answers to fixed prompts are those of the same model on one device (the first device it names),
  where the model loads on one device. Where it does not (the reason to split), the check is weaker: asked twice,
  the split answers the same, and no answer is empty or one word over and over (the garbage such splits gave);
- device memory grew on every device it names while it loaded (it is really split).

Otherwise it is refused, and the refusal names the first prompt whose answers differ, or the device that held
nothing: the front shows it in status as the model's last error and logs it.
"""

from __future__ import annotations

from dataclasses import dataclass

from appliance.sizes import format_size

# Fixed prompts: short, varied (a fact, a sequence, free text), answered greedily for PROBE_TOKENS tokens each.
PROMPTS = ("The capital of France is", "1, 2, 3, 4, 5,", "Write one sentence about the sea.")
PROBE_TOKENS = 16
COMPOSITE = "HETERO:"


def split_devices(device: str) -> tuple[str, ...]:
    """The distinct devices a split names ("HETERO:GPU.0,GPU.1" -> GPU.0, GPU.1; a device named twice is one); ()
    for a device that is no split (AUTO and MULTI pick one device per request: nothing is divided)."""
    if not device.startswith(COMPOSITE):
        return ()
    return tuple(dict.fromkeys(part for part in device[len(COMPOSITE):].split(",") if part))


@dataclass(frozen=True)
class ProbeResult:
    device: str                           # the composite as configured
    split: tuple[str, ...]                # its greedy answers to PROMPTS
    grown: dict[str, int]                 # device -> bytes its memory grew by while the split loaded
    reference: tuple[str, ...] | None     # the answers on one device; None: the model does not load on one
    reference_device: str | None = None
    again: tuple[str, ...] | None = None  # the split's answers asked a second time (the check without a reference)
    reference_error: str | None = None    # why the model did not load on one device


@dataclass(frozen=True)
class Verdict:
    ok: bool
    evidence: str  # what the probe saw: the refusal's message, or the log line of a split that passed


def verdict(result: ProbeResult, prompts: tuple[str, ...] = PROMPTS) -> Verdict:
    devices = split_devices(result.device)
    problems = _answer_problems(result, prompts)
    if len(devices) < 2:
        problems.append(f"{result.device} names {len(devices)} device{'s' if len(devices) != 1 else ''}: nothing is "
                        "split (name two or more, such as HETERO:GPU.0,GPU.1)")
    else:
        idle = [device for device in devices if result.grown.get(device, 0) <= 0]
        if idle:
            problems.append(f"device memory did not grow on {', '.join(idle)} while it loaded (grown: "
                            f"{_grown(result.grown, devices)}): the split does not use every device it names")
    if problems:
        return Verdict(False, f"split {result.device} refused: " + "; ".join(problems))
    check = (f"greedy answers to {len(prompts)} fixed prompts identical to {result.reference_device}'s"
             if result.reference is not None else
             f"greedy answers to {len(prompts)} fixed prompts repeatable and not degenerate (no single-device "
             f"reference: {result.reference_error or 'it does not load on one device'})")
    return Verdict(True, f"split {result.device} passed its probe: {check}; memory grown: "
                         f"{_grown(result.grown, devices)}")


def _answer_problems(result: ProbeResult, prompts: tuple[str, ...]) -> list[str]:
    if result.reference is not None:
        return [f"prompt {i + 1} {prompt!r}: {result.reference_device} answered {ref!r}, {result.device} answered "
                f"{got!r} (they differ from character {_first_difference(ref, got)})"
                for i, (prompt, ref, got) in enumerate(zip(prompts, result.reference, result.split)) if ref != got][:1]
    problems = []
    for i, (prompt, got) in enumerate(zip(prompts, result.split)):
        if result.again is not None and result.again[i] != got:
            problems.append(f"prompt {i + 1} {prompt!r}: greedy answers differ when asked twice ({got!r}, then "
                            f"{result.again[i]!r})")
        elif _degenerate(got):
            problems.append(f"prompt {i + 1} {prompt!r}: {result.device} answered {got!r} (empty, or one word "
                            "repeated)")
    return problems[:1]


def _degenerate(answer: str) -> bool:
    words = answer.split()
    return not words or (len(words) >= 4 and len(set(words)) == 1)


def _first_difference(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _grown(grown: dict[str, int], devices: tuple[str, ...]) -> str:
    return ", ".join(f"{device} {format_size(max(0, grown.get(device, 0)))}" for device in devices or tuple(grown))
