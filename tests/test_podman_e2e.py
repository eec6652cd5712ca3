"""End to end: the real image, run by the real quadlet, under a real systemd, with podman 5.4.

Debian 12 has no usable podman, so this boots Debian 13's systemd as PID 1 of fresh namespaces
(tests/systemd_ns.py) on an overlay of a debootstrapped trixie root that has podman, crun and conmon.
The image is built from containers/Containerfile, on a forky base imported from debootstrap (no container
registry is reachable here), into a storage the namespace sees as a read-only additional image store.
All of that is cached under $OPENARC_E2E_DIR (first run about 4 minutes; then seconds, plus a rebuild of
the last layers when the sources change). Needs debootstrap on the host, root, and the Debian and PyPI
registries.

Adjustments for this sandbox only, none in the shipped files: containers.conf with no pids limit and
rlimits the host allows (no pids controller, nofile capped at 20000); Network=none (the namespace shares
the host's network: no bridge, no firewall rules there); the sandbox's TLS CA and a tolerance for an
old snapshot Release in the build's base image.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import free_port
from load_client import Load
from systemd_ns import SystemdNamespace

pytestmark = [pytest.mark.slow, pytest.mark.systemd]

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = REPO / "containers"
E2E_DIR = Path(os.environ.get("OPENARC_E2E_DIR", "/var/tmp/openarc-e2e"))
TRIXIE, FORKY, STORAGE, CONTEXT = (E2E_DIR / name for name in ("trixie", "forky", "storage", "context"))
IMAGE = "localhost/openarc:latest"
BUILD_INPUTS = ("containers/Containerfile", "pyproject.toml", "README.md", "appliance")
TRIXIE_PACKAGES = "systemd,dbus,podman,crun,conmon,netavark,aardvark-dns,passt,iproute2,ca-certificates"

SANDBOX_CONTAINERS_CONF = """[containers]
# This sandbox: no pids cgroup controller, and no rlimit above the host's (nofile 20000).
pids_limit = 0
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
"""
# The image store built outside is read-only inside; containers live in a tmpfs (overlay needs a
# non-overlay upper, and the namespace's / is an overlay).
STORAGE_CONF = """[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
[storage.options]
additionalimagestores = ["/var/lib/openarc-images/storage"]
"""
CONTAINERS_TMPFS = "[Mount]\nWhat=tmpfs\nWhere=/var/lib/containers\nType=tmpfs\n"
NO_NETWORK = "[Container]\n# The namespace shares the host's network: create no bridge there.\nNetwork=none\n"

CHROOT_SCRIPT = r"""
set -eu
root=$1; storage=$2; context=$3; shift 3
mount --bind "$root" "$root"
mount -t proc proc "$root/proc"
mount --rbind /sys "$root/sys"
mount --rbind /dev "$root/dev"
mount -t tmpfs tmpfs "$root/run"
mount -t tmpfs tmpfs "$root/tmp"
mkdir -p "$root/var/lib/containers" "$root/context"
mount --bind "$storage" "$root/var/lib/containers"
mount --bind -o ro "$context" "$root/context"
cp /etc/resolv.conf "$root/etc/resolv.conf"
exec chroot "$root" "$@"
"""


# --- the cached trixie root and image ----------------------------------------------------------------------

def debian_mirror() -> str:
    """The mirror the host's apt uses for its own release (as containers/fetch-quadlet.sh finds it)."""
    targets = subprocess.run(["apt-get", "indextargets", "--no-release-info", "--format", "$(REPO_URI) $(RELEASE) $(TARGET_OF)"],
                             check=True, capture_output=True, text=True).stdout
    return next(uri for uri, release, kind in (line.split() for line in targets.splitlines())
                if kind == "deb" and "-" not in release)


def debootstrap(dest: Path, suite: str, *options: str) -> None:
    """A minbase root, built beside dest and renamed into place: dest exists only when complete."""
    if dest.exists():
        return
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    script = ["/usr/share/debootstrap/scripts/sid"] if suite == "forky" else []  # older debootstraps lack forky
    subprocess.run(["debootstrap", "--variant=minbase", *options, suite, str(partial), debian_mirror(), *script],
                   check=True, capture_output=True, timeout=900)
    partial.rename(dest)


def in_trixie(*argv: str, stdin=None, timeout: float = 900) -> subprocess.CompletedProcess:
    """argv chrooted in the trixie root (host network, own PID and mount namespaces), the image store
    at /var/lib/containers and the build context at /context."""
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child",
                           "sh", "-c", CHROOT_SCRIPT, "sh", str(TRIXIE), str(STORAGE), str(CONTEXT), *argv],
                          stdin=stdin, capture_output=True, text=True, timeout=timeout, check=True)


def prepare_trixie() -> None:
    debootstrap(TRIXIE, "trixie", f"--include={TRIXIE_PACKAGES}")
    conf = TRIXIE / "etc/containers/containers.conf.d/90-openarc-sandbox.conf"
    conf.parent.mkdir(parents=True, exist_ok=True)
    conf.write_text(SANDBOX_CONTAINERS_CONF)


def import_forky_base() -> None:
    """localhost/debian:forky from debootstrap, with the sandbox's TLS CAs (pip reaches PyPI through them)
    and no Valid-Until check (the mirror here is a snapshot)."""
    debootstrap(FORKY, "forky")
    cas = FORKY / "usr/local/share/ca-certificates"
    cas.mkdir(parents=True, exist_ok=True)
    for ca in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy2(ca, cas / ca.name)
    (FORKY / "etc/apt/apt.conf.d/99-snapshot-mirror").write_text('Acquire::Check-Valid-Until "false";\n')
    tar = subprocess.Popen(["tar", "-C", str(FORKY), "-c", "."], stdout=subprocess.PIPE)
    try:
        in_trixie("podman", "import", "-", "localhost/debian:forky", stdin=tar.stdout)
    finally:
        tar.stdout.close()
        tar.wait()


def build_inputs() -> list[Path]:
    """The files the Containerfile copies (and itself), relative to the repository."""
    files = []
    for name in BUILD_INPUTS:
        path = REPO / name
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return [file.relative_to(REPO) for file in files]


def stage_context() -> str:
    """Copy the build inputs (not .git and the rest of the work tree) to CONTEXT; their digest."""
    shutil.rmtree(CONTEXT, ignore_errors=True)
    digest = hashlib.sha256()
    for file in build_inputs():
        (CONTEXT / file).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / file, CONTEXT / file)
        digest.update(str(file).encode() + b"\0" + (REPO / file).read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def image_store() -> Path:
    """The built image's storage; rebuilt (with podman's layer cache) when the build inputs change."""
    STORAGE.mkdir(parents=True, exist_ok=True)
    prepare_trixie()
    stamp, digest = E2E_DIR / "image.digest", stage_context()
    if not stamp.exists() or stamp.read_text() != digest:
        import_forky_base()
        started = time.monotonic()
        in_trixie("podman", "--cgroup-manager=cgroupfs", "build", "--isolation=chroot", "--network=host",
                  "--build-arg", "BASE_IMAGE=localhost/debian:forky", "-f", "/context/containers/Containerfile",
                  "-t", IMAGE, "/context", timeout=1800)
        in_trixie("podman", "image", "prune", "-f")
        print(f"image built in {time.monotonic() - started:.0f} s")
        stamp.write_text(digest)
    return STORAGE


# --- a booted trixie with the quadlet installed ------------------------------------------------------------

@contextlib.contextmanager
def booted(image_store: Path, tmp_path: Path, service_dropin: str = "", container_dropin: str = "",
           extra_files: dict[str, str] | None = None):
    """trixie booted with openarc@.container (plus test drop-ins and extra_files), dbus and the container storage up."""
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    quadlets = "/etc/containers/systemd"
    files = {
        f"{quadlets}/openarc@.container": (CONTAINERS / "openarc@.container").read_text(),
        f"{quadlets}/openarc@.container.d/50-sandbox.conf": NO_NETWORK + container_dropin,
        "/etc/containers/storage.conf": STORAGE_CONF,
        "/etc/openarc": empty,  # no openarc.yaml: the built-in demo model
        "/var/lib/openarc/models": empty,
    }
    if service_dropin:
        files[f"{quadlets}/openarc@.container.d/60-test.conf"] = "[Service]\n" + service_dropin
    files.update(extra_files or {})
    ns = SystemdNamespace(lower=TRIXIE, units={"var-lib-containers.mount": CONTAINERS_TMPFS}, files=files,
                        binds={str(image_store): "/var/lib/openarc-images"}, name="openarc-e2e", boot_timeout=60)
    with ns:
        ns.systemctl("start", "dbus.socket", "var-lib-containers.mount")
        try:
            yield ns
        except BaseException:
            print(ns.journal()[-6000:])
            raise


def start(ns, unit: str = "openarc@demo") -> float:
    started = time.monotonic()
    done = ns.systemctl("start", unit, check=False, timeout=300)
    assert done.returncode == 0, done.stderr + ns.journal(unit)[-4000:]
    return time.monotonic() - started


def container_state(ns, name: str = "openarc-demo") -> dict:
    done = ns.run(["podman", "inspect", name], check=False, timeout=30)
    return json.loads(done.stdout)[0]["State"] if done.returncode == 0 else {}


def container_identity(ns, name: str = "openarc-demo") -> tuple[int, str]:
    """(pid, container id): both change when the container is replaced."""
    info = json.loads(ns.run(["podman", "inspect", name], timeout=30).stdout)[0]
    return info["State"]["Pid"], info["Id"]


def exec_python(ns, code: str, name: str = "openarc-demo") -> subprocess.CompletedProcess:
    return ns.run(["podman", "exec", name, "/opt/openarc/venv/bin/python", "-c", code], check=False, timeout=60)


CHAT = """
import json, urllib.request
body = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
request = urllib.request.Request("http://127.0.0.1:8000/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
print(json.load(urllib.request.urlopen(request, timeout=60))["choices"][0]["message"]["content"])
"""


def test_start_returns_when_ready_serves_and_stops_cleanly(image_store, tmp_path):
    with booted(image_store, tmp_path) as ns:
        seconds = start(ns)
        print(f"systemctl start openarc@demo: {seconds:.1f} s")
        # Type=notify through conmon: start returned after the server's own READY=1, so it serves now.
        assert ns.run(["podman", "exec", "openarc-demo", "openarc", "health"], check=False).returncode == 0
        assert exec_python(ns, CHAT).returncode == 0
        assert ns.show("openarc@demo", "StatusText") == "demo: ready"
        state = container_state(ns)
        assert state["Running"] and state["Health"]["Status"] in ("starting", "healthy")
        # The server runs as the image's user, with the cache volume writable and /models read-only.
        who = exec_python(ns, "import os; print(os.getuid(), os.access('/var/cache/openarc', os.W_OK), "
                              "os.access('/models', os.W_OK))")
        assert who.stdout.split() == ["990", "True", "False"]

        started = time.monotonic()
        ns.systemctl("stop", "openarc@demo", timeout=120)
        print(f"systemctl stop: {time.monotonic() - started:.1f} s")
        assert ns.show("openarc@demo", "ActiveState") == "inactive"
        assert ns.run(["podman", "ps", "-a", "-q"]).stdout.strip() == ""


def test_watchdog_pings_reach_systemd_and_a_wedged_server_is_restarted(image_store, tmp_path):
    # A 3 s watchdog: the server pings every second only if it learnt WATCHDOG_USEC and conmon forwards
    # WATCHDOG=1; otherwise systemd kills the unit within 3 s.
    with booted(image_store, tmp_path, service_dropin="WatchdogSec=3\n") as ns:
        start(ns)
        time.sleep(8)
        assert ns.show("openarc@demo", "ActiveState") == "active"
        assert ns.show("openarc@demo", "NRestarts") == "0"
        # Wedge the server (PID 1 of the container): the pings stop and systemd restarts the unit.
        ns.run(["podman", "kill", "--signal", "STOP", "openarc-demo"])
        ns.wait_for(lambda: ns.show("openarc@demo", "NRestarts") == "1", timeout=60, what="a watchdog restart")
        assert "Watchdog timeout" in ns.journal("openarc@demo")
        ns.wait_for(lambda: ns.show("openarc@demo", "ActiveState") == "active", timeout=120, what="restarted unit")


# Crash the model's worker again and again (bounded: 20 s): the supervisor keeps restarting it, so /ready
# answers 503 while the front itself stays responsive and keeps pinging the watchdog.
CRASH_LOOP = """
import os, signal, time
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():  # this script's own argv names the worker too
            continue
        try:
            if b"appliance.worker" in open(f"/proc/{pid}/cmdline", "rb").read():
                os.kill(int(pid), signal.SIGKILL)
        except OSError:
            pass
    time.sleep(0.2)
"""


def test_unready_container_is_killed_by_its_health_check_and_restarted(image_store, tmp_path):
    # Fast health checks so the test is short.
    fast_health = "HealthInterval=1s\nHealthTimeout=5s\nHealthRetries=2\nHealthStartupInterval=1s\n"
    with booted(image_store, tmp_path, container_dropin=fast_health) as ns:
        start(ns)
        ns.wait_for(lambda: container_state(ns).get("Health", {}).get("Status") == "healthy", timeout=30,
                    what="a healthy container")
        first_id = container_identity(ns)
        crashing_at = time.monotonic()
        exec_python(ns, CRASH_LOOP)  # ends when the health check kills the container
        ns.wait_for(lambda: ns.show("openarc@demo", "NRestarts") == "1", timeout=60, what="a restart after unhealthy")
        print(f"worker crash loop -> unit restarted: {time.monotonic() - crashing_at:.1f} s")
        events = ns.run(["podman", "events", "--stream=false", "--format", "{{.Status}} {{.HealthStatus}}"]).stdout
        assert "health_status unhealthy" in events
        assert "Watchdog timeout" not in ns.journal("openarc@demo")
        ns.wait_for(lambda: container_state(ns).get("Health", {}).get("Status") == "healthy", timeout=120,
                    what="the restarted container healthy")
        assert container_identity(ns) != first_id


def test_socket_activated_quadlet_answers_every_request_across_a_killed_container(image_store, tmp_path):
    """openarc@.socket in front of openarc@.container: systemd's listener reaches the server inside the container
    (podman passes LISTEN_FDS on), and it stays open while the unit restarts a killed container."""
    port = free_port()
    socket_unit = {"/etc/systemd/system/openarc@.socket": (REPO / "units/openarc@.socket").read_text(),
                   # The README's drop-ins: the instance's port, and no PublishPort= (the socket publishes).
                   "/etc/systemd/system/openarc@demo.socket.d/port.conf":
                       f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n"}
    with booted(image_store, tmp_path, container_dropin="PublishPort=\n", extra_files=socket_unit) as ns:
        ns.systemctl("start", "openarc@demo.socket")
        with Load(port, "demo") as load:  # its first connection starts the unit
            load.wait_for_answers(10)
            first = container_identity(ns)
            logs = ns.run(["podman", "logs", "openarc-demo"])
            assert "(socket activation)" in logs.stdout + logs.stderr
            killed = time.monotonic()
            ns.run(["podman", "kill", "--signal", "KILL", "openarc-demo"])
            ns.wait_for(lambda: ns.show("openarc@demo", "NRestarts") == "1", timeout=60, what="a unit restart")
            ns.wait_for(lambda: container_state(ns).get("Running") and container_identity(ns) != first, timeout=120,
                        what="a new container")
            load.wait_for_answers(10)
            print(f"container killed, answered again after {time.monotonic() - killed:.1f} s")
        summary = load.summary()
        print(f"socket-activated quadlet, SIGKILL of the container under load: {summary}")
        assert summary["refused"] == 0, summary
        assert sum(summary["failed"].values()) <= 1, summary  # only the request in flight when it died
