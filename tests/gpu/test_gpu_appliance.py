"""The appliance on a real Intel GPU (run with `pytest -m gpu` on an Arc box; deselected elsewhere)."""

from __future__ import annotations

import time

import pytest

from conftest import model_entry
from test_metrics import samples

pytestmark = pytest.mark.gpu


def test_demo_model_serves_on_the_gpu_and_reports_vram(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model, device="GPU")]})
    reply = app.client().chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8)
    assert reply.choices[0].finish_reason == "length"
    deadline = time.monotonic() + 10  # telemetry arrives every 2 s
    used = total = {}
    while time.monotonic() < deadline and not (used and total):
        scrape = samples(app.metrics())
        used = {k: v for k, v in scrape.items() if k[0] == "openarc_device_memory_used_bytes" and v > 0}
        total = {k: v for k, v in scrape.items() if k[0] == "openarc_device_memory_total_bytes" and v > 0}
        time.sleep(0.5)
    assert used and total, "no VRAM figures from the worker"
    device = dict(next(iter(total))[1])["device"]
    assert any(dict(k[1])["device"] == device for k in used)  # one label for a card: its PCI address
