"""The model's live gauges (worker RSS, KV-cache use) show the worker that serves the model's name, and no other:
during a side-by-side reload the replacement loads and the replaced worker drains while both report figures.
The supervisors run here without processes, fed the telemetry frames their workers would send."""

from __future__ import annotations

import asyncio

import yaml

from appliance import ipc
from appliance.config import load_config
from appliance.front.lifecycle import ModelState
from appliance.front.metrics import Metrics
from appliance.front.supervisor import Supervisor
from test_metrics import samples, value


def gauges(sup: Supervisor) -> tuple[float, float]:
    scrape = samples(sup.metrics.exposition()[0].decode())
    return (value(scrape, "openarc_worker_resident_memory_bytes", model="m"),
            value(scrape, "openarc_kv_cache_usage_ratio", model="m"))


def telemetry(rss: int, kv: float) -> dict:
    return ipc.frame("telemetry", rss_bytes=rss, kv_cache_usage_ratio=kv)


def one_model_config(tmp_path, demo_model):
    path = tmp_path / "openarc.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "m", "path": str(demo_model), "device": "CPU"}]}))
    return load_config(path)


def ready_model(sup: Supervisor):
    """The supervisor's model "m", as if its worker had loaded."""
    model = sup.models["m"]
    for state in (ModelState.LOADING, ModelState.READY):
        model.life.enter(state)
    return model


def test_only_the_serving_worker_writes_the_models_gauges(tmp_path, demo_model):
    config = one_model_config(tmp_path, demo_model)

    async def scenario() -> None:
        sup = Supervisor(config, Metrics())
        old = ready_model(sup)
        old._on_frame(telemetry(100, 0.5))
        new = sup.placement._new(config.models[0])  # the replacement, as the placement makes it for a reload
        new.reports = False
        new.life.enter(ModelState.LOADING)
        new.life.enter(ModelState.READY)
        new._on_frame(telemetry(200, 0.1))
        assert gauges(sup) == (100, 0.5)  # the old worker still serves
        sup.placement._switch(old, new)
        new._on_frame(telemetry(300, 0.2))
        old.life.enter(ModelState.DRAINING)
        old._on_frame(telemetry(150, 0.7))  # the replaced worker drains its last requests
        assert gauges(sup) == (300, 0.2)
        old.life.enter(ModelState.STOPPED)  # and leaves: the serving worker's cache is not emptied by it
        assert gauges(sup) == (300, 0.2)
        new.life.enter(ModelState.RESTARTING)  # the serving worker's own end does empty it
        assert gauges(sup)[1] == 0
    asyncio.run(scenario())


def test_a_gpu_workers_buffers_by_region_become_the_models_device_memory_gauge(tmp_path, demo_model):
    """The telemetry a GPU worker sends from its DRM fdinfo (appliance.host.device_memory.device_memory_regions, tested
    on recorded xe and i915 files in test_telemetry.py) as openarc_model_device_memory_bytes{model,region}."""
    config = one_model_config(tmp_path, demo_model)

    async def scenario() -> None:
        sup = Supervisor(config, Metrics())
        model = ready_model(sup)
        model._on_frame(ipc.frame("telemetry", rss_bytes=1, device_memory_regions={"vram": 8 << 30, "system": 6 << 20}))
        model._on_frame(ipc.frame("telemetry", rss_bytes=1, device_memory_regions={"vram": 1 << 30, "system": 15 << 30}))
        scrape = samples(sup.metrics.exposition()[0].decode())
        assert value(scrape, "openarc_model_device_memory_bytes", model="m", region="vram") == 1 << 30
        assert value(scrape, "openarc_model_device_memory_bytes", model="m", region="system") == 15 << 30
    asyncio.run(scenario())
