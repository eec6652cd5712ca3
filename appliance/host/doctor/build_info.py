"""What this box runs, as the labels of `openarc_build_info` (=1), /openarc/status's `build` and doctor's `build`
line: openarc's version, OpenVINO's and GenAI's (from the Python packages' metadata, without importing them: the
front never loads OpenVINO), the kernel, the GPU's kernel driver, the compute runtime's package version, and the
card. Read once per process from the same recorded readers doctor judges (appliance.host.doctor.box, cards,
runtime), so a regression on a dashboard lines up with the update that caused it.
"""

from __future__ import annotations

from importlib import metadata

from appliance import __version__
from appliance.host.doctor import cards as card_readers, runtime
from appliance.host.doctor.box import Box
from appliance.host.doctor.cards import CardFacts

LABELS = ("version", "openvino", "genai", "kernel", "gpu_driver", "compute_runtime", "card")
UNKNOWN = "unknown"
MAX_LABEL_CHARS = 120  # a version or a kernel release is far shorter; a longer value is a reader's garbage
NONE = "none"  # no Intel GPU, no driver bound, no runtime package: said, not left empty


def package_version(name: str) -> str:
    """A Python distribution's version from its metadata, or "unknown" where it is not installed."""
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def joined(values: list[str]) -> str:
    """Several cards' values as one label: each distinct value once, in order ("xe" for two xe cards)."""
    return ",".join(dict.fromkeys(values)) or NONE


def read(box: Box, cards: list[CardFacts]) -> dict[str, str]:
    """The build info labels, each a string (Prometheus labels have no null), each made a label by label()."""
    raw = {"version": __version__,
           "openvino": package_version("openvino"),
           "genai": package_version("openvino-genai"),
           "kernel": box.kernel_release() or UNKNOWN,
           "gpu_driver": joined([card.driver or NONE for card in cards]),
           "compute_runtime": runtime.installed_version(box.packages()) or NONE,
           "card": joined([card.name for card in cards])}
    return {key: label(value) for key, value in raw.items()}


def label(value: object, default: str = UNKNOWN) -> str:
    """A reader's text as a label: one printable line (a kernel release or package version is whatever a box's file
    holds: it must not split the log line or the dashboard header it is shown in), at most MAX_LABEL_CHARS, never
    empty."""
    text = " ".join("".join(c if c.isprintable() else " " for c in str(value or "")).split())
    if len(text) > MAX_LABEL_CHARS:
        text = text[:MAX_LABEL_CHARS - 1] + "…"
    return text or default


def read_machine(root: str = "/") -> tuple[list[CardFacts], dict[str, str]]:
    """The cards (as doctor and /openarc/status show them) and the build info of the box under `root`."""
    box = Box(root)
    facts = card_readers.card_facts(box)
    return facts, read(box, facts)


def describe(info: dict[str, str]) -> str:
    """One line for doctor and the log: openarc 0.1.0, OpenVINO 2026.4.1, GenAI ..., kernel ..."""
    return (f"openarc {info['version']}, OpenVINO {info['openvino']}, GenAI {info['genai']}, kernel {info['kernel']}, "
            f"GPU driver {info['gpu_driver']}, compute runtime {info['compute_runtime']}, card {info['card']}")
