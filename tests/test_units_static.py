"""The shipped systemd units and their companions, checked without booting systemd.

`systemd-analyze verify` also checks that ExecStart's binary exists, so run these
after `make install` (which creates /opt/openarc/venv/bin/openarc).
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

UNITS_DIR = Path(__file__).resolve().parent.parent / "units"
UNIT_FILES = ("openarc.service", "openarc@.service")
EXEC_START_BINARY = Path("/opt/openarc/venv/bin/openarc")
MAX_EXPOSURE = 2.5
# The two units must differ only in what they serve (one model or all of them).
PER_UNIT_KEYS = {("Unit", "Description"), ("Service", "ExecStart")}


def unit_settings(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of every assignment, in order (keys may repeat)."""
    settings, section = [], None
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        settings.append((section, key.strip(), value.strip()))
    return settings


def verify(unit_path: Path) -> subprocess.CompletedProcess:
    assert EXEC_START_BINARY.exists(), f"{EXEC_START_BINARY} missing: run `make install` first"
    return subprocess.run(["systemd-analyze", "verify", str(unit_path)],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("unit", UNIT_FILES)
def test_unit_verifies_without_any_warning(unit):
    result = verify(UNITS_DIR / unit)
    assert (result.returncode, result.stderr) == (0, "")


def test_template_instance_verifies_without_any_warning(tmp_path):
    """As systemd loads it for `systemctl start openarc@demo` (with %i expanded)."""
    instance = tmp_path / "openarc@demo.service"
    shutil.copy(UNITS_DIR / "openarc@.service", instance)
    result = verify(instance)
    assert (result.returncode, result.stderr) == (0, "")


SOCKET_UNITS = ("openarc.socket", "openarc@.socket")
PORT_DROPIN = "[Socket]\nListenStream=\nListenStream=127.0.0.1:8002\n"  # README: Socket activation


@pytest.mark.parametrize("unit", SOCKET_UNITS)
def test_socket_unit_verifies_without_any_warning(unit):
    result = verify(UNITS_DIR / unit)
    assert (result.returncode, result.stderr) == (0, "")


def test_socket_instance_with_its_port_dropin_verifies(tmp_path):
    """openarc@qwen.socket plus the README's port.conf, as systemd loads it, next to the service it starts."""
    shutil.copy(UNITS_DIR / "openarc@.service", tmp_path / "openarc@.service")
    combined = tmp_path / "openarc@qwen.socket"
    combined.write_text((UNITS_DIR / "openarc@.socket").read_text() + PORT_DROPIN)
    result = verify(combined)
    assert (result.returncode, result.stderr) == (0, "")


def test_socket_backlog_matches_what_the_server_listens_with():
    """asyncio calls listen() again on the passed socket: the server must not shrink the unit's Backlog=."""
    from appliance.front.listen import BACKLOG
    for unit in SOCKET_UNITS:
        assert ("Socket", "Backlog", str(BACKLOG)) in unit_settings(UNITS_DIR / unit)


def exposure(unit_path: Path) -> float:
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit_path)],
                            capture_output=True, text=True, timeout=60)
    match = re.search(r"Overall exposure level for \S+: ([0-9.]+)", result.stdout)
    assert match, f"no exposure line in:\n{result.stdout}\n{result.stderr}"
    return float(match.group(1))


@pytest.mark.parametrize("unit", UNIT_FILES)
def test_unit_exposure_is_at_most_2_5(unit):
    assert exposure(UNITS_DIR / unit) <= MAX_EXPOSURE


def test_unit_with_kmsg_dropin_verifies_and_keeps_exposure_at_most_2_5(tmp_path):
    """A drop-in's assignments apply as if appended to the unit file, so the two concatenated are the unit."""
    combined = tmp_path / "openarc@demo.service"
    combined.write_text((UNITS_DIR / "openarc@.service").read_text() + (UNITS_DIR / "openarc-kmsg.conf").read_text())
    result = verify(combined)
    assert (result.returncode, result.stderr) == (0, "")
    assert exposure(combined) <= MAX_EXPOSURE


def test_units_differ_only_in_description_and_exec_start():
    single, every = (
        [s for s in unit_settings(UNITS_DIR / unit) if s[:2] not in PER_UNIT_KEYS]
        for unit in ("openarc@.service", "openarc.service"))
    assert single == every


def test_sysusers_creates_openarc_user_in_render_group(tmp_path):
    (tmp_path / "etc").mkdir()
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(UNITS_DIR / "openarc.sysusers.conf")],
                   check=True, capture_output=True, timeout=60)
    groups = {line.split(":")[0]: line.split(":")[3].split(",")
              for line in (tmp_path / "etc/group").read_text().splitlines()}
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    assert "openarc" in groups["render"]
    assert users["openarc"][6] == "/usr/sbin/nologin"
    assert 0 < int(users["openarc"][2]) < 1000  # a system user


def test_tmpfiles_creates_models_directory_readable_by_the_service(tmp_path):
    subprocess.run(["systemd-tmpfiles", f"--root={tmp_path}", "--create", str(UNITS_DIR / "openarc.tmpfiles.conf")],
                   check=True, capture_output=True, timeout=60)
    models = tmp_path / "var/lib/openarc/models"
    assert models.is_dir()
    assert models.stat().st_mode & 0o005 == 0o005  # others (the openarc user) may list and read
