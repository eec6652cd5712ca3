"""The Podman quadlets in containers/, rendered by podman 5.4's real quadlet generator.

Debian 12's podman (4.3) has no quadlet; containers/fetch-quadlet.sh unpacks Debian 13's (static, runs here).
Each test renders the real files and checks what systemd and podman would be handed: the exact `podman run`
flags, a health command whose argv survives quadlet's quoting, a unit `systemd-analyze verify` accepts, and
the drop-ins the README tells users to write.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CONTAINERS = REPO / "containers"
QUADLET_DIR = Path(os.environ.get("OPENARC_QUADLET_DIR", "/var/tmp/openarc-quadlet"))
QUADLET_FILES = ("openarc.container", "openarc@.container")

HEALTH_ARGV = ["/opt/openarc/venv/bin/openarc", "health", "--url", "http://127.0.0.1:8000"]
# What `podman run` must get for openarc@demo on a host with a GPU: every flag, nothing else.
INSTANCE_OPTIONS = [
    ("--name", "openarc-demo"),
    ("--cidfile", "%t/%N.cid"),
    ("--replace", None),
    ("--rm", None),
    ("--cgroups", "split"),
    ("--stop-timeout", "40"),
    ("--device", "/dev/dri"),
    ("--group-add", "keep-groups"),
    ("--sdnotify", "container"),
    ("--detach", None),
    ("--security-opt", "no-new-privileges"),
    ("--volume", "%E/openarc:/etc/openarc:ro"),
    ("--volume", "/var/lib/openarc/models:/models:ro"),
    ("--volume", "openarc-cache:/var/cache/openarc"),
    ("--publish", "127.0.0.1:8000:8000"),
    ("--health-cmd", json.dumps(HEALTH_ARGV)),
    ("--health-interval", "15s"),
    ("--health-on-failure", "kill"),
    ("--health-retries", "3"),
    ("--health-timeout", "10s"),
    ("--health-startup-cmd", json.dumps(HEALTH_ARGV)),
    ("--health-startup-interval", "5s"),
    ("--health-startup-timeout", "10s"),
    ("--env", "WATCHDOG_USEC"),
    # AutoUpdate=registry: `podman auto-update` updates it, and rolls back a start that fails (docs/updating.md)
    ("--label", "io.containers.autoupdate=registry"),
]
INSTANCE_COMMAND = ["serve", "--model", "demo", "--host", "0.0.0.0", "--port", "8000"]
IMAGE = "localhost/openarc:latest"

# podman run options quadlet emits, by whether they take a value; anything else fails the parse loudly.
VALUE_OPTIONS = {"--name", "--stop-timeout", "--device", "--group-add", "--volume", "--publish", "--env",
                 "--health-cmd", "--health-interval", "--health-on-failure", "--health-retries",
                 "--health-timeout", "--health-startup-cmd", "--health-startup-interval", "--health-startup-timeout", "--security-opt", "--cidfile", "--cgroups", "--sdnotify",
                 "--label"}
FLAG_OPTIONS = {"--replace", "--rm", "--detach"}
SHORT_OPTIONS = {"-v": "--volume", "-d": "--detach"}


@pytest.fixture(scope="session")
def quadlet_root() -> Path:
    """Debian 13's podman package unpacked (fetched once; .ci/run fetches it before the tests)."""
    subprocess.run([str(CONTAINERS / "fetch-quadlet.sh"), str(QUADLET_DIR)], check=True, timeout=300,
                   stdout=subprocess.DEVNULL)
    return QUADLET_DIR


# --- rendering -------------------------------------------------------------------------------------------

@dataclass
class Rendered:
    returncode: int
    stderr: str
    out: Path

    def unit(self, name: str) -> str:
        return (self.out / name).read_text()


def write_sources(src: Path, extra: dict[str, str], links: dict[str, str]) -> None:
    """The real quadlets, plus extra files (drop-ins, broken copies) and instance symlinks."""
    src.mkdir()
    for name in QUADLET_FILES:
        (src / name).write_text((CONTAINERS / name).read_text())
    for name, text in extra.items():
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        (src / name).write_text(text)
    for link, target in links.items():
        (src / link).symlink_to(target)


def render(quadlet_root: Path, workdir: Path, *, extra: dict[str, str] | None = None,
           links: dict[str, str] | None = None, gpu: bool = True, user: bool = False) -> Rendered:
    """Run quadlet as systemd runs it at daemon-reload, on a /dev of our making: quadlet drops
    AddDevice=-/dev/dri when /dev/dri is missing at generation time, so the test decides whether it is."""
    src, out = workdir / "src", workdir / "out"
    workdir.mkdir(parents=True, exist_ok=True)
    write_sources(src, extra or {}, {"openarc@demo.container": "openarc@.container"} if links is None else links)
    out.mkdir()
    quadlet = [str(quadlet_root / "usr/libexec/podman/quadlet"), "-no-kmsg-log", *(["-user"] if user else []), str(out)]
    make_dev = "mount -t tmpfs tmpfs /dev && if [ \"$1\" = gpu ]; then mkdir /dev/dri; fi && shift && exec \"$@\""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", make_dev, "sh",
                           "gpu" if gpu else "cpu", *quadlet],
                          env={**os.environ, "QUADLET_UNIT_DIRS": str(src)}, capture_output=True, text=True, timeout=30)
    return Rendered(done.returncode, done.stderr, out)


def unit_values(text: str, section: str, key: str) -> list[str]:
    """All values of key in [section] of a systemd unit (quadlet writes no continuation lines)."""
    values, current = [], None
    for line in text.splitlines():
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and line.startswith(key + "="):
            values.append(line[len(key) + 1:])
    return values


def unit_value(text: str, section: str, key: str) -> str:
    (value,) = unit_values(text, section, key)
    return value


def expand_instance(text: str, instance: str) -> str:
    """systemd's %i (and %%), the only specifier whose value the tests need to see."""
    return re.sub(r"%([i%])", lambda m: instance if m.group(1) == "i" else "%", text)


@dataclass
class PodmanRun:
    options: list[tuple[str, str | None]]
    image: str
    command: list[str]

    def values(self, option: str) -> list[str | None]:
        return [value for name, value in self.options if name == option]


def parse_podman_run(exec_start: str) -> PodmanRun:
    """Split ExecStart as systemd does (shell-like quoting) into podman run's options, image and command."""
    argv = shlex.split(exec_start)
    assert argv[:2] == ["/usr/bin/podman", "run"], argv
    options: list[tuple[str, str | None]] = []
    rest = iter(argv[2:])
    for arg in rest:
        if not arg.startswith("-"):
            return PodmanRun(options, arg, list(rest))
        name, eq, inline = arg.partition("=")
        name = SHORT_OPTIONS.get(name, name)
        if name in FLAG_OPTIONS and not eq:
            options.append((name, None))
        elif name in VALUE_OPTIONS:
            options.append((name, inline if eq else next(rest)))
        else:
            raise AssertionError(f"podman option {arg!r} not in this test's table: add it on purpose")
    raise AssertionError(f"no image in {argv}")


def rendered_run(rendered: Rendered, service: str, instance: str | None = None) -> PodmanRun:
    text = rendered.unit(service)
    return parse_podman_run(expand_instance(unit_value(text, "Service", "ExecStart"), instance or ""))


def health_argv(run: PodmanRun, option: str = "--health-cmd") -> list[str]:
    """The health command as podman will exec it: a JSON array is exec form (no shell in the way)."""
    (value,) = run.values(option)
    try:
        argv = json.loads(value)
    except json.JSONDecodeError as exc:
        raise AssertionError(f"--health-cmd is not the JSON argv written in HealthCmd=: {value!r}") from exc
    assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), value
    return argv


def seconds(duration: str) -> float:
    """A systemd/podman duration such as 900, 15m, 10s, 1h30m."""
    if duration.isdigit():
        return float(duration)
    units = {"h": 3600, "min": 60, "m": 60, "s": 1, "ms": 0.001}
    parts = re.findall(r"(\d+)\s*(min|ms|h|m|s)", duration)
    assert "".join(n + u for n, u in parts) == duration.replace(" ", ""), duration
    return sum(int(n) * units[u] for n, u in parts)


# --- the quadlets as shipped -----------------------------------------------------------------------------

@pytest.mark.parametrize("user", [False, True], ids=["rootful", "rootless"])
def test_every_quadlet_renders_and_enables(quadlet_root, tmp_path, user):
    rendered = render(quadlet_root, tmp_path, user=user)
    assert rendered.returncode == 0, rendered.stderr
    assert rendered.stderr == ""
    for service in ("openarc.service", "openarc@.service", "openarc@demo.service"):
        assert unit_value(rendered.unit(service), "Service", "ExecStart").startswith("/usr/bin/podman run ")
    # [Install] is applied at generation time: the instance symlink enables openarc@demo.
    wants = "default.target.wants" if user else "multi-user.target.wants"
    assert (rendered.out / wants / "openarc@demo.service").exists()
    assert (rendered.out / wants / "openarc.service").exists()


def test_instance_gets_exactly_the_podman_flags_meant(quadlet_root, tmp_path):
    run = rendered_run(render(quadlet_root, tmp_path), "openarc@demo.service", "demo")
    assert sorted(run.options, key=str) == sorted(INSTANCE_OPTIONS, key=str)
    assert run.image == IMAGE
    assert run.command == INSTANCE_COMMAND


def test_all_models_unit_differs_from_the_template_only_in_name_and_model(quadlet_root, tmp_path):
    rendered = render(quadlet_root, tmp_path)
    single, instance = rendered_run(rendered, "openarc.service"), rendered_run(rendered, "openarc@demo.service", "demo")
    assert single.values("--name") == ["openarc"]
    assert [o for o in single.options if o[0] != "--name"] == [o for o in instance.options if o[0] != "--name"]
    assert single.command == [a for a in INSTANCE_COMMAND if a not in ("--model", "demo")]
    service_keys = ("Type", "NotifyAccess", "TimeoutStartSec", "TimeoutStopSec", "WatchdogSec", "Restart", "RestartSec")
    for key in service_keys:
        assert (unit_values(rendered.unit("openarc.service"), "Service", key)
                == unit_values(rendered.unit("openarc@demo.service"), "Service", key)), key


def test_health_command_argv_survives_quadlet_quoting(quadlet_root, tmp_path):
    """quadlet drops the closing '"' of a HealthCmd= that ends in one; the argv podman gets must be ours."""
    for service, instance in (("openarc.service", None), ("openarc@demo.service", "demo")):
        run = rendered_run(render(quadlet_root, tmp_path / service), service, instance)
        assert health_argv(run) == HEALTH_ARGV
        assert health_argv(run, "--health-startup-cmd") == HEALTH_ARGV
        # The probe asks the port the server is told to listen on, inside the container.
        port = run.command[run.command.index("--port") + 1]
        assert HEALTH_ARGV[-1] == f"http://127.0.0.1:{port}"
        assert {p.rsplit(":", 1)[1] for p in run.values("--publish")} == {port}


def test_gpu_is_optional_at_generation_time(quadlet_root, tmp_path):
    """AddDevice=-/dev/dri: a CPU-only host still gets a unit that starts, just without the device."""
    run = rendered_run(render(quadlet_root, tmp_path, gpu=False), "openarc@demo.service", "demo")
    assert run.values("--device") == []
    assert run.values("--group-add") == ["keep-groups"]


def test_service_readiness_watchdog_and_restart(quadlet_root, tmp_path):
    rendered = render(quadlet_root, tmp_path)
    text = rendered.unit("openarc@demo.service")
    run = rendered_run(rendered, "openarc@demo.service", "demo")
    assert unit_value(text, "Service", "Type") == "notify"
    assert unit_value(text, "Service", "NotifyAccess") == "all"
    assert run.values("--sdnotify") == ["container"]  # the server's own READY=1, not conmon's at container start
    # A watchdog only works if the server inside learns its period: WATCHDOG_USEC is passed through.
    assert seconds(unit_value(text, "Service", "WatchdogSec")) > 0
    assert run.values("--env") == ["WATCHDOG_USEC"]
    assert unit_value(text, "Service", "Restart") == "on-failure"
    # Model loads: systemd's start timeout covers a cold load; the startup check (which never kills) stands
    # in for the health check until the first 200. No start period: podman would ignore all failures in it.
    assert seconds(unit_value(text, "Service", "TimeoutStartSec")) >= 900  # ModelConfig.load_timeout_s default
    assert run.values("--health-startup-cmd") and not run.values("--health-startup-retries")
    assert run.values("--health-start-period") == []
    # Stop: systemd waits longer than podman's SIGTERM->SIGKILL grace, which covers the 30 s drain.
    (stop_timeout,) = run.values("--stop-timeout")
    assert 30 < seconds(stop_timeout) < seconds(unit_value(text, "Service", "TimeoutStopSec"))


def verify(quadlet_root: Path, rendered: Rendered, service: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """systemd-analyze verify on the rendered unit; /usr/bin/podman is the unpacked 5.4 binary (none on this host)."""
    unit = tmp_path / "verify" / service
    unit.parent.mkdir()
    unit.write_text(rendered.unit(service).replace("/usr/bin/podman", str(quadlet_root / "usr/bin/podman")))
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("service", ["openarc.service", "openarc@demo.service"])
def test_rendered_unit_passes_systemd_analyze_verify(quadlet_root, tmp_path, service):
    done = verify(quadlet_root, render(quadlet_root, tmp_path), service, tmp_path)
    assert (done.returncode, done.stderr) == (0, "")


def test_auto_update_policy_is_registry_with_local_one_uncommented_line_away(quadlet_root, tmp_path):
    """Issue 38: the quadlets ship AutoUpdate=registry, and the commented `local` for an image built on the box
    renders once switched on (tests/test_podman_e2e.py rolls a bad local image back with it)."""
    for name in QUADLET_FILES:
        text = (CONTAINERS / name).read_text()
        assert "\nAutoUpdate=registry\n" in text and "\n#AutoUpdate=local\n" in text, name
    dropin = {"openarc@.container.d/local.conf": "[Container]\nAutoUpdate=local\n"}
    run = rendered_run(render(quadlet_root, tmp_path, extra=dropin), "openarc@demo.service", "demo")
    assert run.values("--label") == ["io.containers.autoupdate=local"]


# --- the checks above would catch typos ------------------------------------------------------------------

def test_unknown_container_key_fails_generation(quadlet_root, tmp_path):
    broken = (CONTAINERS / "openarc.container").read_text().replace("HealthOnFailure=", "HealthOnFailur=")
    rendered = render(quadlet_root, tmp_path, extra={"broken.container": broken})
    assert rendered.returncode == 1
    assert "unsupported key 'HealthOnFailur'" in rendered.stderr


def test_unknown_service_key_fails_verify(quadlet_root, tmp_path):
    """quadlet copies [Service] through unchecked: systemd-analyze verify is what sees a typo there."""
    broken = (CONTAINERS / "openarc.container").read_text().replace("WatchdogSec=", "WatchdogSecs=")
    rendered = render(quadlet_root, tmp_path, extra={"broken.container": broken})
    done = verify(quadlet_root, rendered, "broken.service", tmp_path)
    assert "Unknown key 'WatchdogSecs' in section [Service]" in done.stderr


# --- the drop-ins the README documents (Running in a container) ---------------------------------------------------------

def test_rootful_render_gid_drop_in_replaces_keep_groups(quadlet_root, tmp_path):
    drop_in = "[Container]\nGroupAdd=\nGroupAdd=992\n"
    rendered = render(quadlet_root, tmp_path, extra={"openarc.container.d/render.conf": drop_in,
                                                     "openarc@.container.d/render.conf": drop_in})
    assert rendered.returncode == 0, rendered.stderr
    for service, instance in (("openarc.service", None), ("openarc@demo.service", "demo")):
        assert rendered_run(rendered, service, instance).values("--group-add") == ["992"]


def test_per_instance_port_drop_in(quadlet_root, tmp_path):
    drop_in = "[Container]\nPublishPort=\nPublishPort=127.0.0.1:8001:8000\n"
    rendered = render(quadlet_root, tmp_path, extra={"openarc@qwen.container.d/port.conf": drop_in},
                      links={"openarc@demo.container": "openarc@.container", "openarc@qwen.container": "openarc@.container"})
    assert rendered.returncode == 0, rendered.stderr
    assert rendered_run(rendered, "openarc@qwen.service", "qwen").values("--publish") == ["127.0.0.1:8001:8000"]
    assert rendered_run(rendered, "openarc@demo.service", "demo").values("--publish") == ["127.0.0.1:8000:8000"]



def test_socket_activation_drop_in_leaves_publishing_to_the_socket(quadlet_root, tmp_path):
    """README "Socket activation" (Podman): the socket unit holds the port, so the container publishes none."""
    rendered = render(quadlet_root, tmp_path, extra={"openarc@qwen.container.d/socket.conf": "[Container]\nPublishPort=\n"},
                      links={"openarc@demo.container": "openarc@.container", "openarc@qwen.container": "openarc@.container"})
    assert rendered.returncode == 0, rendered.stderr
    assert rendered_run(rendered, "openarc@qwen.service", "qwen").values("--publish") == []
    assert rendered_run(rendered, "openarc@demo.service", "demo").values("--publish") == ["127.0.0.1:8000:8000"]

# --- the image the quadlets run --------------------------------------------------------------------------

def containerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of containers/Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (CONTAINERS / "Containerfile").read_text())
    lines = [line.strip() for line in text.splitlines()]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines if line and not line.startswith("#")]


def test_image_matches_what_the_quadlets_expect(quadlet_root, tmp_path):
    instructions = containerfile_instructions()
    last = {name: args for name, args in instructions}
    run = rendered_run(render(quadlet_root, tmp_path), "openarc.service")
    # The health check runs the image's own entrypoint; the image's default command is the unit's.
    assert json.loads(last["ENTRYPOINT"]) == [HEALTH_ARGV[0]]
    assert json.loads(last["CMD"]) == run.command
    assert last["USER"] not in ("root", "0")
    # Every volume the image declares is mounted by the unit (the models read-only).
    mounts = {v.split(":")[1]: v.split(":")[2:] for v in run.values("--volume")}
    assert set(json.loads(last["VOLUME"])) <= set(mounts)
    assert mounts["/models"] == ["ro"]
    # Buildable from a locally imported base: the base is a build argument used by every stage.
    assert instructions[0][0] == "ARG" and instructions[0][1].startswith("BASE_IMAGE=")
    assert {args for name, args in instructions if name == "FROM"} <= {"${BASE_IMAGE}", "${BASE_IMAGE} AS build"}


def test_example_container_config_is_valid_and_uses_container_paths(tmp_path, demo_model):
    config = yaml.safe_load((CONTAINERS / "openarc.yaml").read_text())
    assert config["models"] and all(m["path"].startswith("/models/") for m in config["models"])
    # check-config reads the models' directories: give it /models as the container sees it (the demo model).
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "demo").symlink_to(demo_model)
    for model in config["models"]:
        model["path"] = str(tmp_path / model["path"].lstrip("/"))
    (tmp_path / "openarc.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run([sys.executable, "-m", "appliance", "check-config", str(tmp_path / "openarc.yaml")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr



# --- the Kubernetes Deployment through podman kube play --------------------------------------------------

def test_kube_quadlet_plays_the_deployment_with_its_config_models_volume_and_gpu_module(quadlet_root, tmp_path):
    """openarc-kube.kube beside the kubernetes/ directory, as the README installs them (tests/test_podman_e2e.py
    runs the result)."""
    extra = {name: (CONTAINERS / name).read_text() for name in ("openarc-kube.kube", "openarc-models.volume")}
    extra |= {f"kubernetes/{name}": (CONTAINERS / "kubernetes" / name).read_text()
              for name in ("openarc-qwen.yaml", "configmap.yaml")}
    rendered = render(quadlet_root, tmp_path, extra=extra)
    assert rendered.returncode == 0 and rendered.stderr == "", rendered.stderr
    kube = rendered.unit("openarc-kube.service")
    src = tmp_path / "src" / "kubernetes"
    module = "--module=%E/containers/containers.conf.modules/openarc-gpu.conf"
    assert shlex.split(unit_value(kube, "Service", "ExecStart")) == [
        "/usr/bin/podman", module, "kube", "play", "--replace", "--service-container=true",
        "--configmap", f"{src}/configmap.yaml", "--publish", "127.0.0.1:8000:8000", f"{src}/openarc-qwen.yaml"]
    assert shlex.split(unit_value(kube, "Service", "ExecStopPost")) == [
        "/usr/bin/podman", module, "kube", "down", f"{src}/openarc-qwen.yaml"]
    assert (unit_value(kube, "Service", "Type"), unit_value(kube, "Service", "NotifyAccess")) == ("notify", "all")
    # A stop that ends "inactive", not "failed": the pod drains, then kube play (the main process) ends by itself.
    assert unit_values(kube, "Service", "ExecStop") == ["/usr/bin/podman pod stop openarc-qwen-pod",
                                                        "/usr/bin/tail --pid=${MAINPID} -f /dev/null"]
    assert "openarc-models-volume.service" in unit_values(kube, "Unit", "Requires")
    assert "openarc-models-volume.service" in unit_values(kube, "Unit", "After")
    # podman kube down stops the pod within terminationGracePeriodSeconds: systemd must wait longer.
    deployment = next(doc for doc in yaml.safe_load_all(extra["kubernetes/openarc-qwen.yaml"]) if doc["kind"] == "Deployment")
    assert seconds(unit_value(kube, "Service", "TimeoutStopSec")) > deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    volume = rendered.unit("openarc-models-volume.service")
    assert shlex.split(unit_value(volume, "Service", "ExecStart")) == [
        "/usr/bin/podman", "volume", "create", "--ignore", "--opt", "device=/var/lib/openarc/models",
        "--opt", "type=none", "--opt", "o=bind", "openarc-models"]
