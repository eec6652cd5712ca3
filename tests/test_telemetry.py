"""The readers of appliance.host.device_memory (fdinfo, OpenVINO statistics), appliance.host.gpus (sysfs) and
appliance.host.telemetry (RSS).

Fake /proc and /sys trees are built under tmp_path from the recorded samples in
tests/fixtures/gpu (see its README); a few tests read this machine's real /proc.
"""

import logging
import os
import re
from pathlib import Path

import pytest

from appliance.host.device_memory import (
    DrmClient,
    device_memory_regions,
    device_memory_used,
    parse_fdinfo,
    parse_gpu_memory_statistics,
    read_drm_clients,
)
from appliance.sizes import parse_size  # the project's one size parser reads fdinfo's sizes too
from appliance.host.gpus import GpuInfo, list_gpus, parse_uevent
from appliance.host.telemetry import process_rss_bytes

FIXTURES = Path(__file__).parent / "fixtures" / "gpu"
KiB, MiB = 1 << 10, 1 << 20


def fixture(name: str) -> str:
    return (FIXTURES / name).read_text()


def make_process(proc_root: Path, pid: int, fds: dict[int, str]) -> None:
    """/proc/<pid>/fdinfo/<fd> files with the given contents."""
    fdinfo = proc_root / str(pid) / "fdinfo"
    fdinfo.mkdir(parents=True)
    for fd, text in fds.items():
        (fdinfo / str(fd)).write_text(text)


NON_DRM_KINDS = ("pipe", "epoll", "eventfd", "socket")
NON_DRM_FDS = {fd: fixture(f"fdinfo/non-drm-{kind}.txt") for fd, kind in enumerate(NON_DRM_KINDS)}


# --- fdinfo -------------------------------------------------------------------------------

def test_tab_and_space_separated_fdinfo_parse_alike():
    tabs = parse_fdinfo(fixture("fdinfo/i915-a770-compute.txt"))
    spaces = parse_fdinfo(fixture("fdinfo/i915-igpu-manpage.txt"))
    assert tabs["drm-resident-local0"] == "7342084 KiB"
    assert tabs["drm-driver"] == spaces["drm-driver"] == "i915"
    assert spaces["drm-engine-render"] == "346249 ns"
    assert spaces["drm-pdev"] == "0000:00:02.0"  # the value keeps its own colons


def test_fdinfo_of_epoll_keeps_its_lines_without_inventing_drm_keys():
    fields = parse_fdinfo(fixture("fdinfo/non-drm-epoll.txt"))
    assert "tfd" in fields and not any(key.startswith("drm-") for key in fields)


@pytest.mark.parametrize(
    ("text", "size"),
    [("7342084 KiB", 7342084 * KiB), ("4 MiB", 4 * MiB), ("16384 MiB", 16 << 30), ("0", 0), ("192", 192),
     ("3 ns", None), ("many", None)],
)
def test_sizes_take_an_optional_unit(text, size):
    assert parse_size(text) == size


A770_CLIENT = DrmClient(
    pid=4242,
    driver="i915",
    pdev="0000:03:00.0",
    client_id=41,
    client_name=None,
    vram_resident_bytes=7342084 * KiB,
    vram_total_bytes=7342084 * KiB,
    system_resident_bytes=18944 * KiB,
)


def test_i915_client_from_a_process_with_other_fds(tmp_path):
    # fds 5 and 6 are one client (dup'ed fd): counted once.
    a770 = fixture("fdinfo/i915-a770-compute.txt")
    make_process(tmp_path, 4242, {**NON_DRM_FDS, 5: a770, 6: a770})
    assert read_drm_clients(4242, proc_root=tmp_path) == [A770_CLIENT]


def test_xe_client_reports_vram0(tmp_path):
    make_process(tmp_path, 77, {3: fixture("fdinfo/xe-b580-llm.txt")})
    (client,) = read_drm_clients(77, proc_root=tmp_path)
    assert (client.driver, client.pdev, client.client_id) == ("xe", "0000:03:00.0", 57)
    assert client.vram_resident_bytes == client.vram_total_bytes == 8388612 * KiB


@pytest.mark.parametrize(
    ("name", "resident", "total"),
    [
        ("xe-kerneldoc.txt", 23992 * KiB, 23992 * KiB),  # the 16 MiB of drm-shared-vram0 is not resident
        ("i915-a770-memory-alias.txt", 7342084 * KiB, 8 << 30),  # deprecated drm-memory- alias
        ("xe-b580-total-only.txt", 8388612 * KiB, 8388612 * KiB),
        ("i915-igpu-manpage.txt", None, None),  # integrated GPU: system memory only
        ("i915-a770-engines-only.txt", None, None),  # pre-2023 kernel
    ],
)
def test_vram_falls_back_from_resident_to_memory_to_total(tmp_path, name, resident, total):
    make_process(tmp_path, 1, {9: fixture(f"fdinfo/{name}")})
    (client,) = read_drm_clients(1, proc_root=tmp_path)
    assert (client.vram_resident_bytes, client.vram_total_bytes) == (resident, total)


def test_resident_is_preferred_over_allocated(tmp_path):
    text = fixture("fdinfo/i915-a770-compute.txt")
    allocated_more = text.replace("drm-total-local0:\t7342084 KiB", "drm-total-local0:\t8 MiB")
    assert allocated_more != text
    make_process(tmp_path, 1, {9: allocated_more})
    (client,) = read_drm_clients(1, proc_root=tmp_path)
    assert (client.vram_resident_bytes, client.vram_total_bytes) == (7342084 * KiB, 8 * MiB)


def test_device_memory_sums_unique_clients_per_card(tmp_path):
    a770 = fixture("fdinfo/i915-a770-compute.txt")
    second_client = a770.replace("drm-client-id:\t41", "drm-client-id:\t42").replace("7342084 KiB", "1 MiB")
    other_card = fixture("fdinfo/xe-b580-llm.txt").replace("0000:03:00.0", "0000:07:00.0")
    make_process(tmp_path, 100, {5: a770, 6: second_client})
    make_process(tmp_path, 101, {5: a770, 8: other_card})  # a forked child sharing client 41
    make_process(tmp_path, 102, NON_DRM_FDS)
    used = device_memory_used([100, 101, 102, 99999], proc_root=tmp_path)
    assert used == {"0000:03:00.0": 7342084 * KiB + 1 * MiB, "0000:07:00.0": 8388612 * KiB}


@pytest.mark.parametrize(
    ("name", "vram", "system"),
    [
        ("xe-b580-llm.txt", 8388612 * KiB, 6148 * KiB),  # after load: all in VRAM, gtt holds the page tables
        ("xe-b580-evicted.txt", 1024 * MiB, 15360 * MiB),  # the cliff: the model's buffers moved to system memory
        ("xe-kerneldoc.txt", 23992 * KiB, 192 * KiB),  # system 0 + gtt 192 KiB; stolen is neither
        ("i915-a770-compute.txt", 7342084 * KiB, 18944 * KiB),  # system0, never stolen-local0
        ("i915-a770-evicted.txt", 1069060 * KiB, 6144 * MiB),
        ("i915-a770-memory-alias.txt", 7342084 * KiB, 18944 * KiB),  # the deprecated drm-memory- alias
    ],
)
def test_device_memory_by_region_from_recorded_fdinfo(tmp_path, name, vram, system):
    make_process(tmp_path, 7, {**NON_DRM_FDS, 9: fixture(f"fdinfo/{name}"), 10: fixture(f"fdinfo/{name}")})
    assert device_memory_regions([7], proc_root=tmp_path) == {"vram": vram, "system": system}


def test_device_memory_by_region_without_memory_lines_is_empty(tmp_path):
    make_process(tmp_path, 7, {3: fixture("fdinfo/i915-a770-engines-only.txt")})
    make_process(tmp_path, 8, NON_DRM_FDS)
    assert device_memory_regions([7, 8, 99999], proc_root=tmp_path) == {}


def test_card_without_device_memory_is_left_out(tmp_path):
    make_process(tmp_path, 5, {3: fixture("fdinfo/i915-igpu-manpage.txt")})
    assert device_memory_used([5], proc_root=tmp_path) == {}


def test_vanished_process_has_no_clients(tmp_path):
    assert read_drm_clients(31337, proc_root=tmp_path) == []


def test_this_process_has_no_drm_clients_in_the_real_proc():
    # pytest holds pipes, files and sockets; none of them may be taken for a GPU client.
    assert len(os.listdir(f"/proc/{os.getpid()}/fdinfo")) > 3
    assert read_drm_clients(os.getpid()) == []


# --- OpenVINO GPU_MEMORY_STATISTICS ------------------------------------------------------

def test_memory_statistics_dict_is_summed():
    assert parse_gpu_memory_statistics({"cl_mem": 4718592000, "unknown": 0, "usm_host": 8388608}) == 4726980608


def test_memory_statistics_printed_map_is_summed():
    assert parse_gpu_memory_statistics(fixture("openvino/gpu_memory_statistics-7b-int4.txt")) == 4726980608


def test_memory_statistics_before_any_compile_is_zero():
    printed = re.search(r"GPU_MEMORY_STATISTICS : (.*)", fixture("openvino/hello_query_device-a770.txt"))[1]
    assert printed == '""'
    assert parse_gpu_memory_statistics(printed) == 0
    assert parse_gpu_memory_statistics("") == parse_gpu_memory_statistics({}) == 0


# --- sysfs --------------------------------------------------------------------------------

def make_card(sys_root: Path, card: int, pci_uevent: str) -> Path:
    """A PCI GPU as the kernel lays it out: devices/.../<BDF>/{vendor,device,uevent,driver,drm/}
    with class/drm/cardN and renderD<128+N> symlinks into it, plus a connector entry."""
    props = parse_uevent(pci_uevent)
    vendor, device = (int(part, 16) for part in props["PCI_ID"].split(":"))
    pci_dir = sys_root / "devices/pci0000:00/0000:00:01.0" / props["PCI_SLOT_NAME"]
    for minor in (f"card{card}", f"renderD{128 + card}", f"card{card}-DP-1"):
        (pci_dir / "drm" / minor).mkdir(parents=True)
        os.symlink(f"../../devices/pci0000:00/0000:00:01.0/{pci_dir.name}/drm/{minor}", sys_root / "class/drm" / minor)
        os.symlink(f"../../../{pci_dir.name}", pci_dir / "drm" / minor / "device")
    (pci_dir / "vendor").write_text(f"0x{vendor:04x}\n")
    (pci_dir / "device").write_text(f"0x{device:04x}\n")
    (pci_dir / "uevent").write_text(pci_uevent)
    os.symlink(f"../../../../bus/pci/drivers/{props['DRIVER']}", pci_dir / "driver")
    return pci_dir


@pytest.fixture
def sys_root(tmp_path):
    (tmp_path / "class/drm").mkdir(parents=True)
    (tmp_path / "class/drm/version").write_text("drm 1.1.0 20060810\n")
    return tmp_path


def test_list_gpus_identifies_arc_cards(sys_root, caplog):
    make_card(sys_root, 0, fixture("sysfs/a770-le.uevent"))
    b580 = make_card(sys_root, 1, fixture("sysfs/b580.uevent"))
    (b580 / "tile0").mkdir()
    (b580 / "tile0/physical_vram_size_bytes").write_text("12226592768\n")  # xe_tile_sysfs.c
    make_card(sys_root, 2, fixture("sysfs/virtio-gpu.uevent"))
    make_card(sys_root, 10, fixture("sysfs/intel-unknown-dg2-range.uevent"))
    with caplog.at_level(logging.WARNING, logger="appliance.host.gpus"):
        gpus = list_gpus(sys_root)
    assert gpus == [
        GpuInfo("card0", "0000:03:00.0", 0x8086, 0x56A0, "i915", "renderD128", "DG2", "DG2-G10", "Intel Arc A770",
                None, None),
        GpuInfo("card1", "0000:07:00.0", 0x8086, 0xE20B, "xe", "renderD129", "BMG", "BMG-G21", "Intel Arc B580",
                12226592768, None),
        GpuInfo("card2", "0000:00:02.0", 0x1AF4, 0x1050, "virtio-pci", "renderD130", "other", None, "PCI 1af4:1050",
                None, None),
        GpuInfo("card10", "0000:0a:00.0", 0x8086, 0x56FF, "i915", "renderD138", "DG2", None, "Intel GPU 0x56ff", None,
                "Intel GPU device id 0x56ff is not in openarc's table (family by id range: DG2); please report it"),
    ]
    assert [record.getMessage() for record in caplog.records] == [f"card10: {gpus[3].warning}"]


@pytest.mark.parametrize(
    ("pci_id", "family", "variant", "name"),
    [("8086:56A5", "DG2", "DG2-G11", "Intel Arc A380"), ("8086:E20C", "BMG", "BMG-G21", "Intel Arc B570"),
     ("8086:E221", "BMG", "BMG-G31", "Intel BMG-G31 (0xe221)"), ("8086:4F85", "DG2", "DG2", "Intel DG2 (0x4f85)"),
     ("8086:E21F", "BMG", None, "Intel GPU 0xe21f"), ("8086:46A6", "other", None, "Intel GPU 0x46a6")],
)
def test_family_comes_from_the_table_then_the_id_range(sys_root, pci_id, family, variant, name):
    make_card(sys_root, 0, fixture("sysfs/a770-le.uevent").replace("8086:56A0", pci_id))
    (gpu,) = list_gpus(sys_root)
    assert (gpu.family, gpu.variant, gpu.name, gpu.warning is None) == (family, variant, name, variant is not None)


def test_no_drm_class_means_no_gpus(tmp_path):
    assert list_gpus(tmp_path) == []


# --- process memory -----------------------------------------------------------------------

def test_rss_from_statm_then_status(tmp_path):
    statm_dir, status_dir = tmp_path / "10", tmp_path / "11"
    statm_dir.mkdir()
    status_dir.mkdir()
    (statm_dir / "statm").write_text(fixture("proc/statm"))
    (status_dir / "status").write_text(fixture("proc/status"))
    resident_pages = int(fixture("proc/statm").split()[1])
    vm_rss_kib = int(re.search(r"VmRSS:\s+(\d+) kB", fixture("proc/status"))[1])
    assert process_rss_bytes(10, proc_root=tmp_path) == resident_pages * os.sysconf("SC_PAGE_SIZE")
    assert process_rss_bytes(11, proc_root=tmp_path) == vm_rss_kib * 1024
    assert process_rss_bytes(12, proc_root=tmp_path) == 0


def test_rss_of_this_process_follows_a_real_allocation():
    before = process_rss_bytes(os.getpid())
    block = bytearray(64 * MiB)  # zero-filled, so every page is touched
    after = process_rss_bytes(os.getpid())
    assert after - before >= 60 * MiB
    del block
