"""The Arc sentinel (appliance.front.gpu_sentinel): repeated fence timeouts or hangs on one card turn the SDPA
mitigation on for that card; its GPU models restart with sdpa_optimization false, other cards' models and models
whose config says sdpa_optimization keep theirs.

The decision is tested as a pure function; the recorded kernel lines (tests/fixtures/gpu) are replayed through the
front's KernelLog; the restart is Supervisor.apply's (it restarts exactly the models whose worker spec changed); a
live server shows the mitigation in /openarc/status and counts it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from appliance.config import load_config, worker_spec
from appliance.front.gpu_sentinel import (INCIDENT_GAP_S, MITIGATION_WINDOW_S, SDPA_OFF, CardEvent, GpuSentinel,
                                          decide)
from appliance.front.gpu_watch import model_cards
from appliance.front.metrics import Metrics
from appliance.front.supervisor import Supervisor
from appliance.host.kernel_log import KernelLog
from conftest import http, model_entry, wait_until

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
A770, B580 = "0000:03:00.0", "0000:07:00.0"
TEN_MINUTES_US = 600_000_000


def incident(fixture: str, card: str, n: int) -> str:
    """The recorded kmsg sequence of one hang on `card`, as the n-th of a series ten minutes apart on one boot's
    clock (the sequences were recorded on different boxes: their timestamps are rebased to 900 s after boot)."""
    text = (FIXTURES / "kmsg" / fixture).read_text().replace("0000:03:00.0", card)
    first = int(re.search(r"^\d+,\d+,(\d+),", text, re.MULTILINE)[1])

    def shift(match: re.Match) -> str:
        prefix, seq, ts = match.groups()
        return f"{prefix},{int(seq) + 100 * n},{900_000_000 + int(ts) - first + n * TEN_MINUTES_US},"
    return re.sub(r"^(\d+),(\d+),(\d+),", shift, text, flags=re.MULTILINE)


# --- the decision, a pure function ------------------------------------------------------------------------

def test_three_incidents_within_the_window_turn_sdpa_off_for_that_card_only():
    events = [CardEvent(A770, t) for t in (0, 600, 1200)] + [CardEvent(B580, t) for t in (0, 600)]
    assert [(m.card, m.mitigation) for m in decide(events, now=1200, in_force={})] == [(A770, SDPA_OFF)]
    assert decide(events, now=1200, in_force={A770: {SDPA_OFF}}) == []  # once per card


def test_lines_of_one_incident_count_once_and_old_ones_not_at_all():
    one_hang = [CardEvent(A770, t) for t in (0, 1.8, 1.9, 2.0, INCIDENT_GAP_S - 1)]  # fence, HANG, guilty, reset...
    assert decide(one_hang * 3, now=10, in_force={}) == []
    spread = [CardEvent(A770, t) for t in (0, 600, MITIGATION_WINDOW_S + 601)]  # the first fell out of the window
    assert decide(spread, now=MITIGATION_WINDOW_S + 601, in_force={}) == []


# --- recorded kernel lines through the front's kernel log ---------------------------------------------------

def replay(tmp_path, sequences: list[str], sentinel: GpuSentinel) -> list:
    source = tmp_path / f"kmsg-{len(list(tmp_path.glob('kmsg-*')))}"
    source.write_text("")
    turned_on = []
    with KernelLog(source, on_event=lambda event: turned_on.extend(sentinel.observe(event))) as log:
        for text in sequences:
            with source.open("a") as file:
                file.write(text)
            log.update()
    return turned_on


def test_recorded_a770_hangs_mitigate_the_a770_and_not_the_b580(tmp_path):
    sentinel = GpuSentinel()
    sequences = [incident("i915-a770-guc-hang.kmsg", A770, 0), incident("xe-b580-wedge-gt.kmsg", B580, 0),
                 incident("i915-a770-guc-hang.kmsg", A770, 1), incident("xe-b580-wedge-gt.kmsg", B580, 1)]
    assert replay(tmp_path, sequences, sentinel) == []  # two incidents each: not yet
    turned_on = replay(tmp_path, sequences + [incident("i915-a770-guc-hang.kmsg", A770, 2)], GpuSentinel())
    assert [(m.card, m.mitigation) for m in turned_on] == [(A770, SDPA_OFF)]
    assert "3 fence timeouts or GPU hangs on 0000:03:00.0 within 60 min" == turned_on[0].reason


def test_only_the_cards_workers_restart_with_sdpa_off_and_an_explicit_value_wins(tmp_path, demo_model):
    config_path = tmp_path / "openarc.yaml"
    config_path.write_text(yaml.safe_dump({"models": [
        {"name": "a770-chat", "path": str(demo_model), "device": "GPU.0"},
        {"name": "a770-pinned", "path": str(demo_model), "device": "GPU.0", "sdpa_optimization": True},
        {"name": "a770-runtime", "path": str(demo_model), "device": "GPU.0",
         "runtime_config": {"GPU_ENABLE_SDPA_OPTIMIZATION": True}},
        {"name": "a770-off", "path": str(demo_model), "device": "GPU.0", "gpu_mitigations": "off"},
        {"name": "b580-chat", "path": str(demo_model), "device": "GPU.1"},
        {"name": "cpu-chat", "path": str(demo_model), "device": "CPU"}]}))
    config = load_config(config_path)
    cards = {"a770-chat": {A770}, "a770-pinned": {A770}, "a770-runtime": {A770}, "a770-off": {A770},
             "b580-chat": {B580}, "cpu-chat": set()}
    sentinel = GpuSentinel()
    replay(tmp_path, [incident("i915-a770-guc-hang.kmsg", A770, n) for n in range(3)], sentinel)
    mitigated = sentinel.apply(config, cards)
    # Supervisor.apply restarts exactly the models whose worker spec changed.
    changed = {old.name for old, new in zip(config.models, mitigated.models)
               if worker_spec(old, config) != worker_spec(new, mitigated)}
    assert changed == {"a770-chat"}
    spec = {m.name: worker_spec(m, mitigated)["properties"] for m in mitigated.models}
    assert spec["a770-chat"]["GPU_ENABLE_SDPA_OPTIMIZATION"] is False
    assert spec["a770-pinned"]["GPU_ENABLE_SDPA_OPTIMIZATION"] is True
    assert spec["a770-runtime"]["GPU_ENABLE_SDPA_OPTIMIZATION"] is True
    assert "GPU_ENABLE_SDPA_OPTIMIZATION" not in spec["b580-chat"] and "GPU_ENABLE_SDPA_OPTIMIZATION" not in spec["a770-off"]
    assert mitigated.model("a770-chat").reload == "restart"  # never two copies on a hanging card
    # a reload of the file keeps the mitigation (the model is remembered even before its worker says its card)
    assert sentinel.apply(load_config(config_path), {}).model("a770-chat").sdpa_optimization is False
    assert sentinel.status() == [{"card": A770, "mitigation": SDPA_OFF, "models": ["a770-chat"],
                                  "reason": "3 fence timeouts or GPU hangs on 0000:03:00.0 within 60 min"}]


def test_a_replicated_model_is_mitigated_by_a_hang_on_any_replicas_card(tmp_path, demo_model):
    """`device: [GPU.0, GPU.1]` with GPU.1 on the A770: the A770's hangs mitigate the model whichever replica
    speaks for it in status (before, the sentinel saw only that one's card, the B580 here, and never the A770's)."""
    config_path = tmp_path / "openarc.yaml"
    config_path.write_text(yaml.safe_dump({"models": [
        {"name": "twin", "path": str(demo_model), "device": ["GPU.0", "GPU.1"]},
        {"name": "b580-chat", "path": str(demo_model), "device": "GPU.0"}]}))
    config = load_config(config_path)
    supervisor = Supervisor(config, Metrics())  # not started: the cards are what each worker's ready frame said
    for key, card in (("twin@GPU.0", B580), ("twin@GPU.1", A770), ("b580-chat", B580)):
        supervisor.units[key].life.device_faults.card = card
    cards = model_cards(supervisor)
    assert cards == {"twin": {B580, A770}, "b580-chat": {B580}}
    sentinel = GpuSentinel()
    replay(tmp_path, [incident("i915-a770-guc-hang.kmsg", A770, n) for n in range(3)], sentinel)
    mitigated = sentinel.apply(config, cards)
    assert mitigated.model("twin").sdpa_optimization is False and mitigated.model("b580-chat") == config.model("b580-chat")
    assert sentinel.status()[0]["models"] == ["twin"]


def test_a_live_server_counts_the_mitigation_and_shows_it_in_status(appliance_factory, demo_model, tmp_path):
    source = tmp_path / "kmsg"
    source.write_text("")
    app = appliance_factory({"models": [model_entry("demo", demo_model)]}, env={"OPENARC_DEBUG_KMSG_PATH": str(source)})
    status = app.status()
    assert status["gpu_mitigations"] == [] and status["cards"] == []  # no Intel GPU on this machine
    with source.open("a") as file:
        file.write("".join(incident("i915-a770-guc-hang.kmsg", A770, n) for n in range(3)))
    shown = wait_until(lambda: app.status()["gpu_mitigations"], 10, "the mitigation in /openarc/status")
    assert shown[0]["card"] == A770 and shown[0]["mitigation"] == SDPA_OFF
    _, _, metrics = http("GET", app.base + "/metrics")
    assert f'openarc_gpu_mitigations_total{{card="{A770}",mitigation="sdpa_off"}} 1.0' in metrics
    assert "GPU mitigation sdpa_off on 0000:03:00.0: 3 fence timeouts or GPU hangs" in app.logs()
    assert app.model_status("demo")["state"] == "ready"  # a CPU model is never restarted for a GPU mitigation


def test_status_and_doctor_agree_on_the_cards_facts(appliance_factory, demo_model, tmp_path):
    """/openarc/status shows each card's driver, ReBAR and firmware from the functions doctor judges, with the
    mitigations in force; here over a recorded A770 root."""
    from appliance.host import doctor
    from doctor_roots import build_root
    root = build_root(tmp_path / "root", "a770")
    source = tmp_path / "kmsg"
    source.write_text("")
    app = appliance_factory({"models": [model_entry("demo", demo_model)]},
                            env={"OPENARC_DEBUG_KMSG_PATH": str(source), "OPENARC_DEBUG_SYSTEM_ROOT": str(root)})
    with source.open("a") as file:
        file.write("".join(incident("i915-a770-guc-hang.kmsg", A770, n) for n in range(3)))
    wait_until(lambda: app.status()["gpu_mitigations"], 10, "the mitigation in /openarc/status")
    (card,) = app.status()["cards"]
    assert {key: card[key] for key in ("bdf", "name", "pci_id", "generation", "driver", "kernel", "rebar",
                                       "vram_bar_bytes", "firmware", "mitigations")} == {
        "bdf": A770, "name": "Intel Arc A770", "pci_id": "8086:56a0", "generation": "Alchemist (DG2)",
        "driver": "i915", "kernel": "6.8.0-51-generic", "rebar": "on", "vram_bar_bytes": 16 << 30,
        "firmware": {"GuC": "70.36.0", "HuC": "7.10.16"}, "mitigations": ["sdpa_off"]}
    checks = {check.name: check for check in doctor.diagnose(root)}
    assert f"driver {card['driver']}, kernel {card['kernel']}" in checks[f"card {A770} driver"].detail
    assert checks[f"card {A770} resizable BAR"].detail.startswith("VRAM BAR 16.0 GiB")
    assert checks[f"card {A770} firmware"].detail.startswith(f"GuC {card['firmware']['GuC']}; HuC 7.10.16")
