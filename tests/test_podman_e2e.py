"""End to end: the real image, run by the real quadlet, under a real systemd, with podman 5.4.

Debian 12 has no usable podman, so this boots Debian 13's systemd as PID 1 of fresh namespaces
(tests/systemd_ns.py) on an overlay of a debootstrapped trixie root that has podman, crun and conmon.
The image is built from containers/Containerfile, on a forky base imported from debootstrap (no container
registry is reachable here), into a storage the namespace sees as a read-only additional image store.
All of that is cached under $OPENARC_E2E_DIR (first run about 4 minutes; then seconds, plus a rebuild of
the last layers when the sources change). Needs debootstrap on the host, root, and the Debian and PyPI
registries.

The Kubernetes Deployment (containers/kubernetes/openarc-qwen.yaml, as shipped) is played by `podman kube
play`, directly and through the openarc-kube.kube quadlet, in a namespace with a network of its own, so that
podman's bridge, nftables rules and published port exist there and nowhere else. Two test-only changes: the
ConfigMap's model `qwen` is the demo model on the CPU (no GPU here), and the Deployment's memory request and
limit are dropped (this sandbox's cgroup2 hierarchy has no memory controller to enforce them). The quadlet gets
the shipped openarc-gpu.conf module, and a stand-in render node (/dev/null's numbers, owned by the render GID
the Deployment names) shows that the pod's user opens it through its supplementary group.

Adjustments for this sandbox only, none in the shipped files: containers.conf with no pids limit and
rlimits the host allows (no pids controller, nofile capped at 20000); Network=none for the quadlet tests
(the namespace shares the host's network: no bridge, no firewall rules there); the sandbox's TLS CA and a
tolerance for an old snapshot Release in the build's base image.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

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
# For the kube play tests (installed into roots cached before they were needed): netavark's firewall for their
# bridge network, and the init of the pause image podman builds for a pod's infra container.
TRIXIE_EXTRA_PACKAGES = ("nftables", "catatonit")

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
    debootstrap(TRIXIE, "trixie", f"--include={TRIXIE_PACKAGES},{','.join(TRIXIE_EXTRA_PACKAGES)}")
    missing = [name for name in TRIXIE_EXTRA_PACKAGES if not (TRIXIE / f"var/lib/dpkg/info/{name}.list").exists()]
    if missing:
        in_trixie("sh", "-c", "apt-get -q -o Acquire::Check-Valid-Until=false update && DEBIAN_FRONTEND=noninteractive "
                  f"apt-get install -y -q --no-install-recommends {' '.join(missing)}")
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
        build = ("podman", "--cgroup-manager=cgroupfs", "build", "--isolation=chroot", "--network=host",
                 "--build-arg", "BASE_IMAGE=localhost/debian:forky", "-f", "/context/containers/Containerfile",
                 "-t", IMAGE, "/context")
        for attempt in (1, 2):  # the build installs from the package registries: one retry for a network hiccup
            try:
                in_trixie(*build, timeout=1800)
                break
            except subprocess.CalledProcessError as exc:
                if attempt == 2:
                    raise AssertionError(f"podman build failed twice:\n{exc.stdout[-2000:]}\n{exc.stderr[-3000:]}")
                print(f"podman build failed, once more:\n{exc.stderr[-2000:]}")
        in_trixie("podman", "image", "prune", "-f")
        print(f"image built in {time.monotonic() - started:.0f} s")
        stamp.write_text(digest)
    return STORAGE


# --- a booted trixie with the quadlet installed ------------------------------------------------------------

@contextlib.contextmanager
def booted_trixie(image_store: Path, files: dict, private_network: bool = False):
    """trixie booted with these files, dbus and the container storage up (the image store read-only)."""
    files = {"/etc/containers/storage.conf": STORAGE_CONF, **files}
    ns = SystemdNamespace(lower=TRIXIE, units={"var-lib-containers.mount": CONTAINERS_TMPFS}, files=files,
                          binds={str(image_store): "/var/lib/openarc-images"}, name="openarc-e2e", boot_timeout=60,
                          private_network=private_network)
    with ns:
        ns.systemctl("start", "dbus.socket", "var-lib-containers.mount")
        try:
            yield ns
        except BaseException:
            print(ns.journal()[-6000:])
            raise


@contextlib.contextmanager
def booted(image_store: Path, tmp_path: Path, service_dropin: str = "", container_dropin: str = "",
           extra_files: dict[str, str] | None = None):
    """trixie booted with openarc@.container (plus test drop-ins and extra_files)."""
    empty = tmp_path / "empty"
    empty.mkdir(exist_ok=True)
    quadlets = "/etc/containers/systemd"
    files = {
        f"{quadlets}/openarc@.container": (CONTAINERS / "openarc@.container").read_text(),
        f"{quadlets}/openarc@.container.d/50-sandbox.conf": NO_NETWORK + container_dropin,
        "/etc/openarc": empty,  # no openarc.yaml: the built-in demo model
        "/var/lib/openarc/models": empty,
    }
    if service_dropin:
        files[f"{quadlets}/openarc@.container.d/60-test.conf"] = "[Service]\n" + service_dropin
    files.update(extra_files or {})
    with booted_trixie(image_store, files) as ns:
        yield ns


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


# Kill the model's worker with a signal, once (seconds=0) or again and again for a while (bounded); print each
# pid killed. The parked spare (server.parked_workers) holds no model and is left alone. Crashing it again and again keeps /ready at 503 while the front itself stays responsive and
# keeps pinging the watchdog.
KILL_WORKER = """
import os, signal, time
deadline = time.monotonic() + {seconds}
while True:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) == os.getpid():  # this script's own argv names the worker too
            continue
        try:
            cmdline = open(f"/proc/{{pid}}/cmdline", "rb").read()
            # a parked spare holds no model until it is handed one (its name is openarc-worker from then on)
            spare = b"--parked" in cmdline and open(f"/proc/{{pid}}/comm").read().strip() != "openarc-worker"
            if b"appliance.worker" in cmdline and not spare:
                os.kill(int(pid), signal.{signal})
                print(pid, flush=True)
        except OSError:
            pass
    if time.monotonic() >= deadline:
        break
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
        exec_python(ns, KILL_WORKER.format(signal="SIGKILL", seconds=20))  # ends when the health check kills it
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


# --- the Kubernetes Deployment under podman kube play ------------------------------------------------------

KUBE_DIR = CONTAINERS / "kubernetes"
KUBE_YAML = KUBE_DIR / "openarc-qwen.yaml"
KUBE_POD = "openarc-qwen-pod"                # podman's name for the Deployment's pod ...
KUBE_CONTAINER = f"{KUBE_POD}-openarc"       # ... and for its container
RENDER_NODE = "/dev/dri/renderD128"
KUBE_PORT = 8000  # the namespace has a network of its own: the shipped port is free there
# The kube play tests' own network namespace: the default bridge network, forwarded by nftables rules.
NFTABLES_NETWORK = '[network]\nfirewall_driver = "nftables"\n'


def deployment_for_tests() -> str:
    """openarc-qwen.yaml as shipped but for the memory request and limit, which no cgroup here can enforce."""
    documents = list(yaml.safe_load_all(KUBE_YAML.read_text()))
    for doc in documents:
        if doc["kind"] == "Deployment":
            resources = doc["spec"]["template"]["spec"]["containers"][0]["resources"]
            del resources["requests"]["memory"], resources["limits"]["memory"]
    return yaml.safe_dump_all(documents, sort_keys=False)


# The Deployment's pod template; what `id`/`/proc/self/status` must show inside its container.
POD_SECURITY = next(doc for doc in yaml.safe_load_all(KUBE_YAML.read_text())
                    if doc["kind"] == "Deployment")["spec"]["template"]["spec"]["securityContext"]


def configmap_for_tests() -> str:
    """configmap.yaml with its model `qwen` served by the demo model on the CPU: this machine has no GPU."""
    configmap = yaml.safe_load((KUBE_DIR / "configmap.yaml").read_text())
    config = yaml.safe_load(configmap["data"]["openarc.yaml"])
    config["models"] = [{"name": "qwen", "path": "/models/demo", "device": "CPU"}]
    configmap["data"]["openarc.yaml"] = yaml.safe_dump(config)
    return yaml.safe_dump(configmap)


@contextlib.contextmanager
def kube_booted(image_store: Path, demo_model: Path, files: dict):
    """trixie with a network of its own, the demo model in /var/lib/openarc/models/demo, and these files."""
    files = {"/etc/containers/containers.conf.d/91-kube-network.conf": NFTABLES_NETWORK,
             "/var/lib/openarc/models/demo": demo_model, **files}
    with booted_trixie(image_store, files, private_network=True) as ns:
        ns.run(["chmod", "-R", "a+rX", "/var/lib/openarc/models"])  # the pod runs as UID 990
        yield ns


def http_get(ns, path: str) -> tuple[int, str]:
    """GET through the published port, from the namespace's network (the host's python)."""
    code = ("import sys, urllib.request, urllib.error\n"
            f"try:\n    r = urllib.request.urlopen('http://127.0.0.1:{KUBE_PORT}{path}', timeout=10)\n"
            "    print(r.status); print(r.read().decode())\n"
            "except urllib.error.HTTPError as e:\n    print(e.code); print(e.read().decode())\n"
            "except OSError as e:\n    print(0); print(e)\n")
    status, _, body = ns.in_network([sys.executable, "-c", code]).stdout.partition("\n")
    return int(status or 0), body


CHAT_SDK = f"""
import json
from openai import OpenAI
client = OpenAI(base_url="http://127.0.0.1:{KUBE_PORT}/v1", api_key="unused", max_retries=0, timeout=60)
reply = client.chat.completions.create(model="qwen", messages=[{{"role": "user", "content": "hi"}}], max_tokens=4)
print(json.dumps({{"content": reply.choices[0].message.content, "usage": reply.usage.completion_tokens}}))
"""


def chat_through_published_port(ns) -> dict:
    """A chat completion with the official SDK, through the port podman published."""
    done = ns.in_network([sys.executable, "-c", CHAT_SDK], timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout)


def model_status(ns) -> dict:
    status, body = http_get(ns, "/openarc/status")
    assert status == 200, body
    (model,) = json.loads(body)["models"]
    return model


def check_pod_security(ns) -> None:
    """What the Deployment's securityContext asks for, as the server (the container's PID 1) has it under podman."""
    probe = exec_python(ns, "import os; print(dict(l.split(':', 1) for l in open('/proc/1/status'))); "
                            "print(os.access('/', os.W_OK), os.access('/models', os.W_OK), "
                            "os.access('/var/cache/openarc', os.W_OK), os.access('/tmp', os.W_OK))",
                        name=KUBE_CONTAINER)
    status_line, writable = probe.stdout.splitlines()
    status = {key: value.split() for key, value in ast.literal_eval(status_line).items()}
    assert status["Uid"] == [str(POD_SECURITY["runAsUser"])] * 4
    assert status["Gid"] == [str(POD_SECURITY["runAsGroup"])] * 4
    assert {str(gid) for gid in POD_SECURITY["supplementalGroups"]} <= set(status["Groups"])  # the render group
    assert status["CapEff"] == status["CapPrm"] == ["0000000000000000"]
    assert status["NoNewPrivs"] == ["1"]
    # (podman exec runs as the same user:) read-only root and models; the cache and /tmp volumes are writable
    assert writable == "False False True True"


def check_survives_worker_abort(ns) -> None:
    """SIGABRT to the worker: the front (the container's PID 1) stays, the model is back, and serves again."""
    front = container_identity(ns, KUBE_CONTAINER)
    before = model_status(ns)
    killed = exec_python(ns, KILL_WORKER.format(signal="SIGABRT", seconds=0), name=KUBE_CONTAINER).stdout.split()
    assert killed == [str(before["pid"])], killed
    ns.wait_for(lambda: model_status(ns)["state"] == "ready" and model_status(ns)["pid"] != before["pid"],
                timeout=60, what="the worker restarted")
    after = model_status(ns)
    assert after["restarts"] == before["restarts"] + 1 and after["crashes"] == before["crashes"] + 1
    assert container_identity(ns, KUBE_CONTAINER) == front
    assert chat_through_published_port(ns)["usage"] >= 1


def wait_healthy(ns) -> None:
    """The startup probe (/ready) and then the liveness probe (/health) pass: httpGet probes run as curl."""
    ns.wait_for(lambda: container_state(ns, KUBE_CONTAINER).get("Health", {}).get("Status") == "healthy",
                timeout=90, interval=1, what="the probes to pass")


def test_kube_play_serves_the_deployment_survives_a_worker_abort_and_stops_cleanly(image_store, demo_model):
    kube = "/root/kube"
    files = {f"{kube}/openarc-qwen.yaml": deployment_for_tests(), f"{kube}/configmap.yaml": configmap_for_tests()}
    with kube_booted(image_store, demo_model, files) as ns:
        # What openarc-models.volume does for the quadlet: the claim openarc-models is the host's model directory.
        ns.run(["podman", "volume", "create", "--opt", "type=none", "--opt", "o=bind",
                "--opt", "device=/var/lib/openarc/models", "openarc-models"])
        ns.run(["podman", "kube", "play", "--configmap", f"{kube}/configmap.yaml",
                "--publish", f"127.0.0.1:{KUBE_PORT}:8000", f"{kube}/openarc-qwen.yaml"], timeout=300)
        ns.wait_for(lambda: http_get(ns, "/ready")[0] == 200, timeout=120, interval=0.5, what="/ready")
        assert chat_through_published_port(ns)["usage"] >= 1
        check_pod_security(ns)
        wait_healthy(ns)
        check_survives_worker_abort(ns)

        started = time.monotonic()
        ns.run(["podman", "pod", "stop", KUBE_POD], timeout=120)
        print(f"podman pod stop: {time.monotonic() - started:.1f} s")
        state = container_state(ns, KUBE_CONTAINER)
        assert (state["Status"], state["ExitCode"]) == ("exited", 0)  # SIGTERM: drained and exited by itself
        ns.run(["podman", "kube", "down", f"{kube}/openarc-qwen.yaml"], timeout=120)
        assert ns.run(["podman", "ps", "-a", "-q"]).stdout.strip() == ""
        # The compiled-model cache claim outlives the pod, as a PVC does.
        assert ns.run(["podman", "volume", "exists", "openarc-cache-qwen"], check=False).returncode == 0


def test_kube_quadlet_plays_the_deployment_and_stops_cleanly(image_store, demo_model):
    quadlets = "/etc/containers/systemd"
    files = {f"{quadlets}/openarc-kube.kube": (CONTAINERS / "openarc-kube.kube").read_text(),
             f"{quadlets}/openarc-models.volume": (CONTAINERS / "openarc-models.volume").read_text(),
             f"{quadlets}/kubernetes/openarc-qwen.yaml": deployment_for_tests(),
             f"{quadlets}/kubernetes/configmap.yaml": configmap_for_tests(),
             "/etc/containers/containers.conf.modules/openarc-gpu.conf": (CONTAINERS / "openarc-gpu.conf").read_text()}
    render_gid = POD_SECURITY["supplementalGroups"][0]
    with kube_booted(image_store, demo_model, files) as ns:
        # A render node stand-in for openarc-gpu.conf's /dev/dri: /dev/null's numbers, the host's usual 0660 root:render.
        ns.run(["sh", "-c", f"mkdir -p /dev/dri && mknod -m 0660 {RENDER_NODE} c 1 3 && chgrp {render_gid} {RENDER_NODE}"])
        ns.systemctl("daemon-reload")
        seconds = start(ns, "openarc-kube")
        print(f"systemctl start openarc-kube: {seconds:.1f} s")
        # Type=notify with the pod's sdnotify annotation: start returned after the server's own READY=1.
        assert http_get(ns, "/ready")[0] == 200
        assert chat_through_published_port(ns)["usage"] >= 1
        check_pod_security(ns)
        # The GPU path on a Podman host: openarc-gpu.conf hands /dev/dri in, the render group lets the user open it.
        opened = exec_python(ns, f"import os; os.close(os.open({RENDER_NODE!r}, os.O_RDWR)); print('opened')",
                             name=KUBE_CONTAINER)
        assert opened.stdout.strip() == "opened", opened.stderr
        wait_healthy(ns)
        check_survives_worker_abort(ns)
        assert ns.show("openarc-kube", "NRestarts") == "0"

        started = time.monotonic()
        ns.systemctl("stop", "openarc-kube", timeout=120)
        print(f"systemctl stop openarc-kube: {time.monotonic() - started:.1f} s")
        assert ns.show("openarc-kube", "ActiveState") == "inactive", (
            ns.show("openarc-kube", "ExecMainStatus"), ns.journal("openarc-kube")[-5000:])
        assert ns.show("openarc-kube", "Result") == "success"
        assert ns.run(["podman", "ps", "-a", "-q"]).stdout.strip() == ""


# --- podman auto-update: a canary that fails rolls the image back --------------------------------------------

UPDATE_IMAGE = "localhost/openarc-update:latest"
# The box's config: one model, its golden answers checked before READY=1. canary_min_speed 0.1: v1 passes however
# loaded this machine is; the bad image is a hundred times slower than its record.
ROLLBACK_CONFIG = {"server": {"canary": "gate", "canary_min_speed": 0.1},
                   "models": [{"name": "demo", "path": "/models/demo", "device": "CPU"}]}
# Images built on the box under one tag (no registry here: AutoUpdate=local, docs/updating.md). v2 is the update that
# breaks quietly: the same answers at a fraction of the tokens/s (the test knob that delays each generation step,
# standing in for a runtime that slowed the kernels); v3 is a good update.
BUILDS = {"v1": "FROM localhost/openarc:latest\nLABEL org.openarc.test.build=v1\n",
          "v2": "FROM localhost/openarc:latest\nLABEL org.openarc.test.build=v2\nENV OPENARC_DEBUG_STEP_DELAY_S=0.25\n",
          "v3": "FROM localhost/openarc:latest\nLABEL org.openarc.test.build=v3\n"}
CANARY_FAILED = 'openarc_canary_failures_total{model="demo",reason="speed"} 1.0'


def build_update(ns, name: str) -> str:
    """Build one of BUILDS under UPDATE_IMAGE in the namespace's writable store; its image id."""
    ns.run(["podman", "build", "--quiet", "-t", UPDATE_IMAGE, f"/root/build/{name}"], timeout=120)
    return ns.run(["podman", "image", "inspect", "--format", "{{.Id}}", UPDATE_IMAGE]).stdout.strip()


def running_image(ns) -> str:
    return ns.run(["podman", "inspect", "--format", "{{.Image}}", "openarc-demo"], check=False).stdout.strip()


def canary_failure_scraped(ns) -> str | None:
    """The running container's /metrics when it counts the canary's failure (the failed start lingers for it)."""
    done = ns.run(["podman", "exec", "openarc-demo", "curl", "-s", "http://127.0.0.1:8000/metrics"], check=False)
    return done.stdout if CANARY_FAILED in done.stdout else None


def auto_update(ns) -> list[str]:
    """`podman auto-update` (rollback on, its default): one "unit image updated" line per container."""
    done = ns.run(["podman", "auto-update", "--format", "{{.Unit}} {{.Image}} {{.Updated}}"], check=False, timeout=600)
    print(f"podman auto-update exited {done.returncode}:\n{done.stdout}{done.stderr}")
    return done.stdout.splitlines()


def test_auto_update_rolls_back_an_image_whose_canary_fails_and_keeps_one_that_passes(image_store, tmp_path,
                                                                                       demo_model):
    config_dir = tmp_path / "etc-openarc"
    config_dir.mkdir()
    (config_dir / "openarc.yaml").write_text(yaml.safe_dump(ROLLBACK_CONFIG))
    extra = {"/etc/openarc": config_dir, "/var/lib/openarc/models/demo": demo_model,
             **{f"/root/build/{name}/Containerfile": text for name, text in BUILDS.items()}}
    # What a box with images built on it runs: the shipped quadlet with its commented AutoUpdate=local on.
    dropin = f"Image={UPDATE_IMAGE}\nAutoUpdate=local\n"
    with booted(image_store, tmp_path, container_dropin=dropin, extra_files=extra) as ns:
        ns.run(["chmod", "-R", "a+rX", "/var/lib/openarc/models"])  # the server runs as UID 990
        v1 = build_update(ns, "v1")
        # The golden answers, recorded by v1 on this box (as docs/updating.md says: on a box known to be good).
        ns.run(["podman", "run", "--rm", "--network=none", "--user", "0", "-v", "/etc/openarc:/etc/openarc",
                "-v", "/var/lib/openarc/models:/models:ro", UPDATE_IMAGE, "golden", "record",
                "--config", "/etc/openarc/openarc.yaml"], timeout=300)
        start(ns)  # READY=1 only after the canary passed
        assert running_image(ns) == v1 and exec_python(ns, CHAT).returncode == 0
        assert "canary: model demo answers as recorded" in ns.journal("openarc@demo")

        # A bad update under the same tag: the restarted unit never becomes ready, podman rolls it back.
        v2 = build_update(ns, "v2")
        with ThreadPoolExecutor(1) as pool:
            update = pool.submit(auto_update, ns)
            # The failed start lingers (server.CANARY_LINGER_S) with the failure on /metrics, for Prometheus.
            try:
                ns.wait_for(lambda: canary_failure_scraped(ns), timeout=300, interval=1,
                            what="the canary failure on /metrics")
            finally:
                lines = update.result()
                print("\n".join(l for l in ns.journal("openarc@demo").splitlines()
                                if "podman[" not in l and "conmon[" not in l)[-20000:])
        assert lines == [f"openarc@demo.service {UPDATE_IMAGE} rolled back"], lines
        journal = ns.journal("openarc@demo")
        failure = [line for line in journal.splitlines() if "canary failed (server.canary: gate), not ready" in line]
        assert len(failure) == 1 and "model demo: " in failure[0] and "below canary_min_speed 0.1" in failure[0], failure
        # The service answers from v1 again, and the tag is v1's once more.
        ns.wait_for(lambda: ns.show("openarc@demo", "ActiveState") == "active", timeout=120, what="the unit active")
        assert running_image(ns) == v1 != v2
        assert ns.run(["podman", "image", "inspect", "--format", "{{.Id}}", UPDATE_IMAGE]).stdout.strip() == v1
        assert exec_python(ns, CHAT).returncode == 0

        # A good update goes through.
        v3 = build_update(ns, "v3")
        assert auto_update(ns) == [f"openarc@demo.service {UPDATE_IMAGE} true"]
        assert running_image(ns) == v3 and exec_python(ns, CHAT).returncode == 0
        assert ns.show("openarc@demo", "ActiveState") == "active"
