"""The telemetry readers against a real Intel Arc card (run with `-m gpu` on an Arc box).

Deselected by default (pyproject addopts `-m 'not gpu'`). Needs an Intel dGPU bound to i915
or xe, Intel's compute runtime (intel-opencl-icd) and the `render` group.
"""

import os
import re
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from appliance.host.faults import classify_error
from appliance.host.device_memory import device_memory_used, parse_gpu_memory_statistics, read_drm_clients
from appliance.host.gpus import INTEL_VENDOR_ID, list_gpus
from appliance.host.telemetry import BDF

pytestmark = pytest.mark.gpu
MiB = 1 << 20
ops = ov.opset13


@pytest.fixture(scope="module")
def arc():
    cards = [gpu for gpu in list_gpus() if gpu.vendor_id == INTEL_VENDOR_ID and gpu.driver in ("i915", "xe")]
    assert cards, "no Intel card bound to i915 or xe in /sys/class/drm"
    return cards[0]


@pytest.fixture(scope="module")
def core():
    core = ov.Core()
    assert "GPU" in core.available_devices, core.available_devices
    return core


def matmul_model(size: int) -> ov.Model:
    """x[1,size] @ W[size,size]: a size*size*4-byte weight the plugin must put on the card."""
    x = ops.parameter([1, size], np.float32)
    weights = ops.constant(np.random.default_rng(0).standard_normal((size, size), dtype=np.float32))
    return ov.Model([ops.matmul(x, weights, False, False)], [x])


def test_sysfs_lists_the_arc_card(arc):
    assert arc.family in ("DG2", "BMG"), arc
    assert arc.warning is None, arc.warning
    assert re.fullmatch(BDF, arc.bdf or ""), arc
    assert arc.render_node and Path("/dev/dri", arc.render_node).exists(), arc


def test_openvino_reports_total_memory(core):
    assert int(core.get_property("GPU", "GPU_DEVICE_TOTAL_MEM_SIZE")) > 0


def test_gpu_compile_shows_in_fdinfo_and_memory_statistics(arc, core):
    before = device_memory_used([os.getpid()]).get(arc.bdf, 0)
    compiled = core.compile_model(matmul_model(4096), "GPU")  # 64 MiB of weights
    compiled.create_infer_request().infer([np.ones((1, 4096), np.float32)])
    clients = read_drm_clients(os.getpid())
    after = device_memory_used([os.getpid()]).get(arc.bdf, 0)
    statistics = parse_gpu_memory_statistics(core.get_property("GPU", "GPU_MEMORY_STATISTICS"))
    assert any(client.pdev == arc.bdf and client.driver == arc.driver for client in clients), clients
    assert after > 0 and after > before, (before, after)
    assert statistics >= 64 * MiB, statistics
    del compiled


def test_allocation_beyond_the_device_limit_is_device_oom(core):
    # Broadcast to more than GPU_DEVICE_MAX_ALLOC_MEM_SIZE, reduced to a scalar so the big
    # buffer only exists on the card. The plugin's allocation guard must refuse it.
    max_alloc = int(core.get_property("GPU", "GPU_DEVICE_MAX_ALLOC_MEM_SIZE"))
    x = ops.parameter([1], np.float32)
    big = ops.broadcast(x, ops.constant(np.array([max_alloc // 4 + MiB], np.int64)))
    model = ov.Model([ops.reduce_sum(big, ops.constant(np.array([0], np.int64)))], [x])
    with pytest.raises(RuntimeError) as raised:
        core.compile_model(model, "GPU").create_infer_request().infer([np.ones(1, np.float32)])
    assert classify_error(str(raised.value)).kind == "device_oom", str(raised.value)
