"""`openarc doctor` over recorded machine roots (tests/doctor_roots.py builds them from tests/fixtures/doctor and
tests/fixtures/gpu): a healthy Arc box, a box without the runtime, a user outside `render`, a Battlemage card on an
old kernel, ReBAR off, an xe card and an i915 card; and the real command on this machine (no GPU)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from appliance.host import doctor
from doctor_roots import DOCTOR, REPO, add_model, build_root


def by_name(checks):
    return {check.name: check for check in checks}


def not_ok(checks):
    return [check for check in checks if check.status != "ok"]


def write_config(tmp_path, text):
    path = tmp_path / "openarc.yaml"
    path.write_text(text)
    return str(path)


def healthy_config(tmp_path, root, memory="4.5GiB"):
    model = add_model(root)
    return write_config(tmp_path, f"""
server: {{memory_budget: {{GPU.0: 14GiB}}}}
models:
  - {{name: qwen, path: {model}, device: GPU, memory: {memory}}}
""")


def test_healthy_i915_a770_box_is_all_ok(tmp_path):
    root = build_root(tmp_path / "root", "a770")
    checks = doctor.diagnose(root, healthy_config(tmp_path, root))
    assert not_ok(checks) == []
    named = by_name(checks)
    assert named["card 0000:03:00.0 driver"].detail.startswith("Intel Arc A770 [8086:56a0], Alchemist (DG2), driver i915")
    assert "GuC 70.36.0; HuC 7.10.16" in named["card 0000:03:00.0 firmware"].detail
    assert named["card 0000:03:00.0 resizable BAR"].detail == "VRAM BAR 16.0 GiB for 15.1 GiB of VRAM"
    assert "Arc(TM) A770 Graphics (dGPU), driver 25.35.35096, 15.1 GiB, 0000:03:00.0" in named["openvino devices"].detail
    assert named["access /dev/dri/renderD128"].detail.startswith("openarc (the unit openarc.service) can open it")
    assert {"unit", "unit device access", "unit kernel log", "compute runtime: OpenCL", "compute runtime: Level Zero",
            "known-bad versions", "config", "memory GPU.0", "model qwen", "disk models", "disk cache"} <= set(named)
    assert doctor.exit_status(checks) == 0


def test_healthy_xe_b580_box_is_all_ok(tmp_path):
    root = build_root(tmp_path / "root", "b580", kernel="6.14.0-1-generic")
    checks = doctor.diagnose(root)
    assert not_ok(checks) == []
    named = by_name(checks)
    assert "Battlemage (BMG), driver xe, kernel 6.14.0-1-generic (needs 6.12+)" in named[
        "card 0000:07:00.0 driver"].detail
    assert named["card 0000:07:00.0 firmware"].detail == "GuC 70.36.0; HuC 8.2.10 (kernel log)"


def test_box_without_the_compute_runtime_fails_with_the_install_command(tmp_path):
    root = build_root(tmp_path / "root", runtime=False, openvino="openvino-devices-cpu-only.json")
    checks = doctor.diagnose(root)
    named = by_name(checks)
    opencl = named["compute runtime: OpenCL"]
    assert opencl.status == "fail" and "OpenCL ICD" in opencl.detail
    assert opencl.fix.startswith("sudo apt install intel-opencl-icd libze-intel-gpu1")
    assert named["compute runtime: Level Zero"].status == "warn"
    assert named["openvino devices"].status == "fail" and "lists no GPU (only CPU)" in named["openvino devices"].detail
    assert doctor.exit_status(checks) == 1


def test_user_outside_render_is_told_to_join_it(tmp_path):
    root = build_root(tmp_path / "root", unit=False, status="proc-self-status-alice-no-render.txt")
    named = by_name(doctor.diagnose(root))
    access = named["access /dev/dri/renderD128"]
    assert access.status == "fail"
    assert access.detail.startswith("alice (the user running doctor) cannot open it: ")
    assert access.detail.endswith("rw-rw---- group render, and alice is not in group render")
    assert access.fix.startswith("sudo usermod -aG render alice")
    assert named["unit"].status == "skip" and named["kernel log"].status == "ok"


def test_unit_user_outside_render_is_told_the_unit_line(tmp_path):
    root = build_root(tmp_path / "root")
    unit = root / "etc/systemd/system/openarc.service"
    unit.write_text(unit.read_text().replace("SupplementaryGroups=render\n", ""))
    (root / "etc/group").write_text((DOCTOR / "group").read_text().replace("render:x:992:openarc,alice",
                                                                            "render:x:992:alice"))
    access = by_name(doctor.diagnose(root))["access /dev/dri/renderD128"]
    assert access.status == "fail" and access.detail.startswith("openarc (the unit openarc.service) cannot open it")
    assert access.fix.startswith("add `SupplementaryGroups=render` under [Service] of openarc.service")


def test_battlemage_on_an_old_kernel_names_the_kernel_it_needs(tmp_path):
    root = build_root(tmp_path / "root", "b580", kernel="6.8.0-51-generic", bound=False)
    checks = doctor.diagnose(root)
    named = by_name(checks)
    driver = named["card 0000:07:00.0 driver"]
    assert driver.status == "fail"
    assert "Battlemage (BMG), which needs Linux 6.12 or newer; this kernel is 6.8.0-51-generic" in driver.detail
    assert driver.fix.startswith("install a kernel >= 6.12")
    nodes = named["render nodes"]
    assert nodes.status == "fail" and "has no kernel driver bound" in nodes.detail
    assert doctor.exit_status(checks) == 1


def test_rebar_off_fails_with_the_firmware_setting(tmp_path):
    root = build_root(tmp_path / "root", resource="resource-a770-small-bar.txt")
    rebar = by_name(doctor.diagnose(root))["card 0000:03:00.0 resizable BAR"]
    assert rebar.status == "fail"
    assert rebar.detail.startswith("Resizable BAR is off: the VRAM BAR is 256 MiB for 15.1 GiB of VRAM")
    assert "Re-Size BAR Support" in rebar.fix and "Above 4G Decoding" in rebar.fix


def test_guc_that_failed_to_load_fails_with_the_firmware_package(tmp_path):
    root = build_root(tmp_path / "root", "b580", kernel="6.14.0-1-generic")
    # the verbatim xe lines of a B580 whose GuC load failed (tests/fixtures/gpu/dmesg), as kmsg records
    lines = (REPO / "tests/fixtures/gpu/dmesg/xe-b580-guc-load-wedged.txt").read_text().splitlines()
    records = [f"3,{i},{10539353 + i},-;" + line.split("] ", 1)[1].replace("0000:03:00.0", "0000:07:00.0")
               for i, line in enumerate(lines) if line.startswith("[")]
    (root / "dev/kmsg").write_text("\n".join(records) + "\n")
    firmware = by_name(doctor.diagnose(root))["card 0000:07:00.0 firmware"]
    assert firmware.status == "fail"
    assert firmware.detail.startswith("GuC firmware did not load: load failed: status = 0x80007134")
    assert firmware.fix.startswith("sudo apt install linux-firmware")


def test_unit_that_blocks_the_gpu_and_the_kernel_log(tmp_path):
    root = build_root(tmp_path / "root", kmsg_dropin=False)
    unit = root / "etc/systemd/system/openarc.service"
    unit.write_text(unit.read_text().replace("DeviceAllow=char-drm rw", "DeviceAllow=/dev/dri rw"))
    named = by_name(doctor.diagnose(root))
    assert named["unit device access"].status == "fail"
    assert "names a directory, which systemd ignores" in named["unit device access"].detail
    assert named["unit device access"].fix.startswith("add `DeviceAllow=char-drm rw`")
    assert named["unit kernel log"].status == "warn"
    assert "units/openarc-kmsg.conf" in named["unit kernel log"].fix


def test_config_problems_and_memory_arithmetic(tmp_path):
    root = build_root(tmp_path / "root")
    model = add_model(root)
    broken = write_config(tmp_path, f"models:\n  - {{name: qwen, path: {model}, device: gpu, max_contxt: 5}}\n")
    problems = [c for c in doctor.diagnose(root, broken) if c.name == "config"]
    assert [c.status for c in problems] == ["fail", "fail"]
    assert any("models[0].device" in c.detail for c in problems) and any("max_contxt" in c.detail for c in problems)
    too_much = write_config(tmp_path, f"server: {{memory_budget: {{GPU.0: 20GiB}}}}\nmodels:\n"
                                      f"  - {{name: qwen, path: {model}, device: GPU, memory: 4GiB}}\n")
    memory = by_name(doctor.diagnose(root, too_much))["memory GPU.0"]
    assert memory.status == "fail" and "20GiB is more than the card's 15.1 GiB of VRAM" in memory.detail
    assert memory.fix == "server: {memory_budget: {GPU.0: 13.5GiB}}"
    tight = write_config(tmp_path, f"models:\n  - {{name: qwen, path: {model}, device: GPU, memory: 14.5GiB}}\n")
    assert by_name(doctor.diagnose(root, tight))["memory GPU.0"].status == "warn"


def test_doctor_names_every_problem_check_config_names_and_the_directory_disk_measured(tmp_path):
    """An unknown key and a model directory that does not exist: check-config names both, and so does doctor (it
    named only the key); the disk check names the directory it measured (it said `/nonexistent: 69 GiB free`)."""
    root = build_root(tmp_path / "root")
    broken = write_config(tmp_path, "models:\n  - {name: x, path: /nonexistent/x, device: GPU, devise: GPU}\n")
    checks = doctor.diagnose(root, broken)
    problems = [c.detail for c in checks if c.name == "config"]
    assert any("devise" in line for line in problems) and any("models[0].path" in line for line in problems), problems
    from appliance.config import parse_config
    from appliance.host.doctor import box, disk
    config = parse_config({"models": [{"name": "x", "path": "/nonexistent/x", "device": "GPU"}]}, "t.yaml")
    models = next(c for c in disk.checks(box.Box(root), config) if c.name == "disk models")
    assert models.detail.startswith("/: ") and "(/nonexistent does not exist yet)" in models.detail, models.detail
    measured = by_name(checks)["disk models"].detail.split(":")[0]  # the config failed: the default directory's
    assert (root / measured.lstrip("/")).is_dir(), measured


def test_model_directory_the_service_user_cannot_read(tmp_path):
    root = build_root(tmp_path / "root")
    config = healthy_config(tmp_path, root)
    (root / "var/lib/openarc/models/qwen").chmod(0o700)
    check = by_name(doctor.diagnose(root, config))["model qwen"]
    assert check.status == "fail" and "openarc (the unit openarc.service) cannot read" in check.detail
    assert check.fix.startswith("sudo chmod -R o+rX /var/lib/openarc/models/qwen")


def test_every_failure_and_warning_names_its_fix(tmp_path):
    root = build_root(tmp_path / "root", "b580", bound=False, runtime=False, kmsg_dropin=False,
                      resource="resource-a770-small-bar.txt", openvino="openvino-devices-cpu-only.json")
    for check in doctor.diagnose(root):
        assert check.status in doctor.STATUSES
        assert (check.fix is not None) == (check.status in ("warn", "fail")), check


def run_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "appliance", "doctor", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def test_json_output_is_stable(tmp_path):
    root = build_root(tmp_path / "root", resource="resource-a770-small-bar.txt")
    done = run_cli("--root", str(root), "--json")
    assert done.returncode == 1, done.stderr
    body = json.loads(done.stdout)
    assert list(body) == ["checks"]
    assert all(list(check) == ["name", "status", "detail", "fix"] for check in body["checks"])
    assert {"name": "card 0000:03:00.0 resizable BAR", "status": "fail"}.items() <= next(
        c for c in body["checks"] if c["name"] == "card 0000:03:00.0 resizable BAR").items()


def test_on_this_machine_doctor_fails_on_the_missing_render_node_fast(tmp_path):
    """This machine has no GPU: doctor says so, exits 1, in seconds, without a traceback; --config adds the
    config's problems."""
    config = write_config(tmp_path, "models:\n  - {name: x, path: /nonexistent, device: GPU, max_contxt: 1}\n")
    started = time.monotonic()
    done = run_cli("--config", config)
    took = time.monotonic() - started
    assert done.returncode == 1
    assert "Traceback" not in done.stdout + done.stderr
    assert "FAIL  render nodes: no /dev/dri/renderD* node" in done.stdout
    assert "max_contxt" in done.stdout
    assert took < 60, took  # the OpenVINO child dominates; seconds on an idle machine


def test_the_shipped_quadlet_passes_and_one_without_the_gpu_fails(tmp_path):
    root = build_root(tmp_path / "root", unit=False)
    quadlet = root / "etc/containers/systemd/openarc.container"
    quadlet.parent.mkdir(parents=True)
    shipped = (REPO / "containers/openarc.container").read_text()
    quadlet.write_text(shipped)
    named = by_name(doctor.diagnose(root))
    assert named["unit"].detail.startswith("openarc.container at /etc/containers/systemd/openarc.container")
    assert named["unit device access"].status == named["unit render group"].status == "ok"
    quadlet.write_text(shipped.replace("AddDevice=-/dev/dri\n", "").replace("GroupAdd=keep-groups\n", ""))
    named = by_name(doctor.diagnose(root, unit="openarc.container"))
    assert named["unit device access"].status == "fail"
    assert named["unit device access"].fix == ("add `AddDevice=-/dev/dri` under [Container] of "
                                               "/etc/containers/systemd/openarc.container")
    assert named["unit render group"].status == "warn" and "GroupAdd=keep-groups" in named["unit render group"].fix


def test_a_named_unit_that_is_not_installed_fails(tmp_path):
    root = build_root(tmp_path / "root", unit=False)
    unit = by_name(doctor.diagnose(root, unit="openarc@qwen"))["unit"]
    assert unit.status == "fail" and unit.detail == "no unit or quadlet named openarc@qwen is installed"
    assert unit.fix.startswith("sudo units/install.sh")


def test_a_known_bad_runtime_version_warns_with_its_source(tmp_path):
    root = build_root(tmp_path / "root")
    status = root / "var/lib/dpkg/status"
    status.write_text(status.read_text().replace("25.35.35096.9-1~24.04~ppa3", "25.18.33578.6-1~24.04~ppa1"))
    checks = doctor.diagnose(root)
    bad = [check for check in checks if check.name.startswith("known issue")]
    assert [check.name for check in bad] == ["known issue: intel-opencl-icd 25.18.33578.6-1~24.04~ppa1",
                                             "known issue: libze-intel-gpu1 25.18.33578.6-1~24.04~ppa1"]
    assert all(check.status == "warn" and "(intel/compute-runtime#831)" in check.detail and
               "25.13.33276.16" in check.fix for check in bad)
    assert doctor.exit_status(checks) == 0  # a warning passes

