"""Build info (issue 38): `openarc_build_info` on /metrics, `build` on /openarc/status and doctor's `build` line say
the same thing, read by doctor's own readers: here over a recorded A770 box (i915, Ubuntu's compute runtime
packages, kernel 6.8) and over this machine (no Intel GPU: said as "none", never left empty)."""

from __future__ import annotations

from importlib import metadata

from hypothesis import given, settings, strategies as st
from prometheus_client.parser import text_string_to_metric_families

from appliance import __version__
from appliance.host import doctor
from appliance.host.doctor import box, build_info, cards
from conftest import model_entry
from doctor_roots import build_root

A770_BUILD = {"version": __version__, "openvino": metadata.version("openvino"),
              "genai": metadata.version("openvino-genai"), "kernel": "6.8.0-51-generic", "gpu_driver": "i915",
              "compute_runtime": "25.35.35096.9-1~24.04~ppa3", "card": "Intel Arc A770"}


def build_series(metrics_text: str) -> list[dict[str, str]]:
    return [sample.labels for family in text_string_to_metric_families(metrics_text)
            if family.name == "openarc_build_info" for sample in family.samples if sample.value == 1]


def test_doctor_reads_the_build_of_a_recorded_box(tmp_path):
    root = build_root(tmp_path / "root", "a770")
    machine = box.Box(root)
    assert build_info.read(machine, cards.card_facts(machine)) == A770_BUILD
    line = {check.name: check for check in doctor.diagnose(root)}["build"]
    assert line.status == "ok" and line.detail == build_info.describe(A770_BUILD)
    assert "GPU driver i915, compute runtime 25.35.35096.9-1~24.04~ppa3, card Intel Arc A770" in line.detail


def test_a_box_without_gpu_or_runtime_says_none():
    info = build_info.read(box.Box("/"), [])
    assert set(info) == set(build_info.LABELS) and all(info.values())
    assert info["card"] == info["gpu_driver"] == "none"


def test_metrics_status_and_doctor_agree_on_the_build(appliance_factory, demo_model, tmp_path):
    root = build_root(tmp_path / "root", "a770")
    app = appliance_factory({"models": [model_entry("demo", demo_model)]},
                            env={"OPENARC_DEBUG_SYSTEM_ROOT": str(root)})
    assert build_series(app.metrics()) == [A770_BUILD]
    assert app.status()["build"] == A770_BUILD
    assert f"build: {build_info.describe(A770_BUILD)}" in app.logs()


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=3000), st.text(alphabet=st.characters(blacklist_characters="\n"), max_size=3000))
def test_any_reader_text_makes_a_short_single_line_label(tmp_path_factory, osrelease, version):
    """The readers give whatever a box's files hold (a recorded root, a patched kernel, a hand-built package): each
    label is still one printable line, never empty, short enough for a dashboard header and a log line."""
    root = tmp_path_factory.mktemp("root")
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/osrelease").write_text(osrelease, encoding="utf-8", errors="surrogateescape")
    (root / "var/lib/dpkg").mkdir(parents=True)
    (root / "var/lib/dpkg/status").write_text(
        f"Package: intel-opencl-icd\nStatus: install ok installed\nVersion: {version}\n", errors="surrogateescape")
    _, info = build_info.read_machine(str(root))
    for value in info.values():
        assert value and value.isprintable() and value.strip() == value and len(value) <= build_info.MAX_LABEL_CHARS
    assert "\n" not in build_info.describe(info)
