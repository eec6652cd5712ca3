"""Replicas on two cards (`device: [GPU.0, GPU.1]`), for a box that has two (run with `pytest -m gpu`; deselected
elsewhere, skipped on a box with one card): each replica's worker sees its own card only and holds memory there."""

from __future__ import annotations

import time

import pytest

from appliance.config.devices import available_devices
from appliance.host.device_memory import device_memory_used
from conftest import model_entry

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def two_cards():
    gpus = [d for d in available_devices() if d.startswith("GPU")]
    if len(gpus) < 2:
        pytest.skip(f"needs two GPUs; OpenVINO lists {gpus or 'none'}")


def test_each_replica_holds_its_own_card_only(two_cards, appliance_factory, demo_model):
    app = appliance_factory({"server": {"parked_workers": 0},
                             "models": [model_entry("twin", demo_model, device=["GPU.0", "GPU.1"])]})
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not all(r["state"] == "ready" for r in app.model_status("twin")["replicas"]):
        time.sleep(0.5)
    replicas = app.model_status("twin")["replicas"]
    assert [r["state"] for r in replicas] == ["ready", "ready"], replicas
    for _ in range(4):  # both take requests
        app.client().chat.completions.create(model="twin", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    masks, cards = [], []
    for replica in replicas:
        environ = dict(item.split("=", 1) for item in
                       open(f"/proc/{replica['pid']}/environ").read().split("\0") if "=" in item)
        masks.append(environ.get("ZE_AFFINITY_MASK"))
        used = {card: size for card, size in device_memory_used([replica["pid"]]).items() if size > 0}
        assert len(used) == 1, (replica, used)  # one card, and only one
        cards.append(next(iter(used)))
    assert None not in masks and len(set(masks)) == 2, masks
    assert len(set(cards)) == 2, cards  # two different cards
