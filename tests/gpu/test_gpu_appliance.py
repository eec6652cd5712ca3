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


def test_embedding_and_rerank_models_serve_on_the_gpu(appliance_factory, embedding_model, rerank_model):
    """The other worker kinds on the card: the same genai pipelines, compiled for the GPU plugin."""
    app = appliance_factory({"models": [model_entry("embed", embedding_model, kind="embedding", device="GPU"),
                                        model_entry("rank", rerank_model, kind="rerank", device="GPU")]})
    vectors = [d.embedding for d in app.client().embeddings.create(model="embed", input=["a cat on a mat",
                                                                                         "the cat sat on the mat",
                                                                                         "GPU drivers crash"]).data]
    similarity = [sum(a * b for a, b in zip(vectors[0], v)) for v in vectors[1:]]  # unit vectors: dot = cosine
    assert similarity[0] > similarity[1] + 0.3
    reply = app.client().post("/rerank", body={"model": "rank", "query": "cat",
                                               "documents": ["GPU drivers crash", "a cat on a mat"]}, cast_to=object)
    assert reply["results"][0]["index"] == 1


def test_doctor_and_status_see_the_same_card(appliance_factory, demo_model):
    """On an Arc box: doctor finds a render node this user can open, OpenVINO's GPU, and each card's driver; the
    running server's /openarc/status shows the same cards, and the demo worker's buffers by region."""
    from appliance.host import doctor
    checks = {check.name: check for check in doctor.diagnose("/")}
    assert checks["render nodes"].status == "ok" and checks["openvino devices"].status == "ok"
    app = appliance_factory({"models": [model_entry("demo", demo_model, device="GPU")]})
    cards = app.status()["cards"]
    assert cards and all(checks[f"card {card['bdf']} driver"].status != "skip" or not card["generation"]
                         for card in cards)
    deadline = time.monotonic() + 10
    regions = {}
    while time.monotonic() < deadline and "vram" not in regions:
        regions = {dict(k[1])["region"]: v for k, v in samples(app.metrics()).items()
                   if k[0] == "openarc_model_device_memory_bytes"}
        time.sleep(0.5)
    assert regions.get("vram", 0) > 0, "no VRAM-resident bytes from the worker's fdinfo"
