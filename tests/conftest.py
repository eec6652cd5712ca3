"""Shared fixtures: the tiny demo model, and live appliances on loopback that are always cleaned up."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
FIXTURES = Path(__file__).resolve().parent / "fixtures"
STARTUP_TIMEOUT_S = 120  # only catches a hang: the demo model loads in well under a second



def parked_spare(stat: str, cmdline: bytes) -> bool:
    """Whether a process (its /proc stat and cmdline) is the front's parked spare worker (appliance.front.parked),
    which holds no model until it is handed one (its process name is openarc-worker from then on)."""
    return b"\0--parked" in cmdline and stat[stat.index("(") + 1:stat.rindex(")")] != "openarc-worker"

@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> Path:
    """The demo model as the tests know it: stops by itself after 48 tokens, 64 at most by default."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "demo", eos_after=48, max_new_tokens=64)


@pytest.fixture(scope="session")
def long_demo_model(tmp_path_factory) -> Path:
    """A demo model that never stops by itself, for requests that must still be generating when a fault lands."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "long", eos_after=0, max_new_tokens=4096)


@pytest.fixture(scope="session")
def embedding_model(tmp_path_factory) -> Path:
    """The embedding demo model (appliance.demo.encoder): 128 dimensions, Matryoshka sizes 32 and 64."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "embedding", "embedding")


@pytest.fixture(scope="session")
def rerank_model(tmp_path_factory) -> Path:
    """The rerank demo model (appliance.demo.encoder): scores documents by the query words they share."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "rerank", "rerank")


@pytest.fixture(scope="session")
def demo_tts(tmp_path_factory) -> Path:
    """The tiny SpeechT5-shaped model: a chord per letter, 64 ms per character, a voice per OpenAI name."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "tts", "tts")


@pytest.fixture(scope="session")
def demo_whisper(tmp_path_factory) -> Path:
    """The tiny Whisper-shaped model: any sound is " hello world from a tiny model.", silence is ""."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "whisper", "transcription")


@pytest.fixture(scope="session")
def demo_vlm(tmp_path_factory) -> Path:
    """The tiny LLaVA-shaped model (appliance.demo.vlm): its answer starts by naming the images' dominant colour
    ("Red image:", ...), then walks the chat demo's phrases; stops by itself after 12 tokens."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "vlm", "vlm", eos_after=12, max_new_tokens=64)


@pytest.fixture(scope="session")
def demo_image(tmp_path_factory) -> Path:
    """The tiny Stable-Diffusion-shaped model (appliance.demo.image): a flat picture of the colour the prompt names
    (gray for none), 64 x 64 by default; its LoRA adapter (appliance.demo.catalog.image_adapter_path) swaps red and
    blue."""
    from appliance.demo.catalog import build_demo_model
    return build_demo_model(tmp_path_factory.mktemp("models") / "image", "image")


def wait_until(predicate, timeout: float, what: str, interval: float = 0.02):
    """Poll predicate() until it returns something truthy (returned) or the timeout passes (AssertionError naming
    `what`). OSError counts as not yet: the server may not be listening. The one poll loop of the tests."""
    deadline = time.monotonic() + timeout
    last_error = None
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except OSError as exc:
            result, last_error = None, exc
        if result:
            return result
        time.sleep(interval)
    raise AssertionError(f"not {what} after {timeout}s" + (f" (last error: {last_error})" if last_error else ""))


def run_as_nobody(code: str, *modules: str) -> subprocess.CompletedProcess:
    """Run Python `code` as user nobody with copies of the named appliance modules importable ("host/kernel_log",
    "host/oom"): the checkout and pytest's tmp dirs may be private to root. Needs root."""
    root = Path(tempfile.mkdtemp(prefix="openarc-modules-"))
    try:
        for module in modules:
            dest = root / "appliance" / f"{module}.py"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / "appliance" / f"{module}.py", dest)
        for package in {path.parent for path in root.rglob("*.py")} | {root / "appliance"}:
            (package / "__init__.py").touch()
        for path in (root, *root.rglob("*")):
            path.chmod(0o755)
        return subprocess.run([sys.executable, "-c", code], user=65534, group=65534, cwd=root,
                              env={**os.environ, "PYTHONPATH": str(root)}, capture_output=True, text=True, timeout=60)
    finally:
        shutil.rmtree(root)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: Any = None, headers: dict | None = None, raw: bytes | None = None,
         timeout: float = 60) -> tuple[int, dict, Any]:
    """One HTTP request; returns (status, headers, parsed JSON body or text)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    request = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            status, hdrs, text = response.status, dict(response.headers), response.read().decode()
    except urllib.error.HTTPError as exc:
        status, hdrs, text = exc.code, dict(exc.headers), exc.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


class Appliance:
    """A live `openarc serve` on loopback, started from this source tree."""

    def __init__(self, config: dict, tmp: Path, env: dict | None = None, name: str = "openarc",
                 python: str = sys.executable, prefix: list[str] | None = None):
        self.prefix = prefix or []  # a command that execs the rest, e.g. tests/memcg.py's entry into a cgroup
        self.port = config.setdefault("server", {}).setdefault("port", free_port())
        config["server"].setdefault("host", "127.0.0.1")
        self.base = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp / f"{name}-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{name}-{self.port}.log"
        # Every appliance checks the residency invariants after each step of its owner (appliance.front.invariants)
        self.env = {**os.environ, "PYTHONPATH": str(REPO), "OPENARC_DEBUG_INVARIANTS": "1", **(env or {})}
        self.python = python  # the front's interpreter, and so its workers' (sys.executable)
        self.proc: subprocess.Popen | None = None
        self.worker_pids: set[int] = set()
        server = config["server"]  # the single key, else the first named key (docs/sharing.md)
        key = self.env.get(server.get("api_key_env") or next((k["key_env"] for k in server.get("api_keys") or ()), ""))
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def start(self, wait_ready: bool = True) -> Appliance:
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*self.prefix, self.python, "-m", "appliance", "serve",
                                      "--config", str(self.config_path)],
                                     cwd=REPO, env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        def ready():
            assert self.proc.poll() is None, f"appliance exited with {self.proc.returncode}:\n{self.logs()}"
            return http("GET", self.base + "/ready", timeout=2)[0] == 200
        try:
            wait_until(ready, timeout, "ready", interval=0.05)
        except AssertionError as exc:
            raise AssertionError(f"{exc}:\n{self.logs()}") from None
        self.remember_workers()

    def logs(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def status(self) -> dict:
        status, _, body = http("GET", self.base + "/openarc/status", headers=self.auth, timeout=5)
        assert status == 200, body
        return body

    def model_status(self, model: str) -> dict:
        return next(m for m in self.status()["models"] if m["name"] == model)

    def remember_workers(self) -> None:
        for m in self.status()["models"]:
            if m["pid"]:
                self.worker_pids.add(m["pid"])

    def worker_pid(self, model: str) -> int:
        pid = self.model_status(model)["pid"]
        assert pid, f"model {model} has no worker"
        self.worker_pids.add(pid)
        return pid

    def wait_model(self, model: str, state: str, timeout: float = 60, new_pid_not: int | None = None) -> dict:
        def reached():
            m = self.model_status(model)
            if m["pid"]:
                self.worker_pids.add(m["pid"])
            return m if m["state"] == state and (new_pid_not is None or m["pid"] not in (None, new_pid_not)) else None
        try:
            return wait_until(reached, timeout, f"{model} {state}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {self.model_status(model)}\n{self.logs()[-3000:]}") from None

    def helper_pid(self, module: str) -> int:
        """The pid of the front's one helper process running `python -m module` (a decoder or the speech encoder)."""
        children = open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read().split()
        pids = [int(pid) for pid in children if module in open(f"/proc/{pid}/cmdline").read()]
        assert len(pids) == 1, pids
        return pids[0]

    def metrics(self) -> str:
        status, _, body = http("GET", self.base + "/metrics", headers=self.auth)
        assert status == 200
        return body

    def client(self, **kwargs):
        import openai
        return openai.OpenAI(base_url=self.base + "/v1", api_key=kwargs.pop("api_key", "unused"),
                             max_retries=0, timeout=kwargs.pop("timeout", 60), **kwargs)

    def stop(self) -> None:
        """SIGTERM (graceful drain), SIGKILL if it hangs; then make sure no worker outlived it."""
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        deadline = time.monotonic() + 5
        while any(pid_alive(p) for p in self.worker_pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        survivors = [p for p in self.worker_pids if pid_alive(p)]
        for pid in survivors:
            os.kill(pid, signal.SIGKILL)
        if getattr(self, "log", None):
            self.log.close()
        assert not survivors, f"workers {survivors} outlived the front"
        # appliance.front.lifecycle logs a state change its table does not allow: a supervisor bug, in any test
        assert "illegal transition" not in self.logs(), self.logs()[-3000:]
        # ... and one that breaks an invariant of residency, or a step its state machine does not list
        assert "BUG: residency" not in self.logs(), self.logs()[-3000:]


def model_entry(name: str, path: Path, **overrides) -> dict:
    """A model config as tests use it: quick restarts so a test can crash a worker many times."""
    entry = {"name": name, "path": str(path), "device": "CPU",
             "restart": {"backoff_initial_s": 0.05, "backoff_max_s": 0.2, "max_failures": 50, "window_s": 60}}
    entry.update(overrides)
    return entry


@pytest.fixture
def appliance_factory(tmp_path):
    started: list[Appliance] = []

    def start(config: dict, env: dict | None = None, wait_ready: bool = True, python: str = sys.executable,
              prefix: list[str] | None = None) -> Appliance:
        app = Appliance(config, tmp_path, env, python=python, prefix=prefix)
        started.append(app)
        return app.start(wait_ready)

    yield start
    errors = []
    for app in started:
        try:
            app.stop()
        except AssertionError as exc:
            errors.append(str(exc))
    assert not errors, errors


def quoted_as_met(figures: list[dict]) -> list[str]:
    """The figures a bench run judged MISS that the docs quote as met: a row of a table in README.md or docs/ with
    the verdict PASS whose name is the figure's (or the start of it, before a parenthesis). A quick run that misses
    a target the docs say is met is a failure, whatever the machine: the docs, or the code, are wrong."""
    met = set()
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for line in page.read_text().splitlines():
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            if line.startswith("|") and "PASS" in cells[1:]:
                met.add(cells[0])
    return [f"{f['name']}: {f['measured']} (target {f['target']})" for f in figures if f["verdict"] == "MISS"
            and any(f["name"] == name or f["name"].split(" (")[0] == name.split(" (")[0] for name in met)]


def quick_side_bench(stem: str, tmp_path: Path) -> dict[str, dict]:
    """Run `python -m bench.<stem> --quick` into tmp_path and check its report is complete and well formed (shapes
    only, never a timing, but no MISS of a row the docs quote as met: quoted_as_met): the table it prints is <stem>.md,
    and it leaves no process behind.  Its figures by name."""
    done = subprocess.run([sys.executable, "-m", f"bench.{stem}", "--quick", "--out", str(tmp_path)], cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp_path)},
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout == (tmp_path / f"{stem}.md").read_text()
    leftovers = subprocess.run(["pgrep", "-f", str(tmp_path)], capture_output=True, text=True).stdout.split()
    assert not leftovers, f"processes left behind: {leftovers}"
    figures = json.loads((tmp_path / f"{stem}.json").read_text())["figures"]
    assert not quoted_as_met(figures), quoted_as_met(figures)
    return {f["name"]: f for f in figures}


# `make test` runs the suite on several pytest-xdist workers (`--dist loadgroup`): most tests wait on worker
# processes, sockets and systemd, not on the CPU. The files of one group share something of the machine's own and
# so run one after another on one xdist worker: the systemd boots (units and paths of PID 1 namespaces), podman's
# storage and the roots and image cached under /var/tmp (the quadlet and end-to-end tests build and use them). The
# real clients' tests share one server and one run of each client (module fixtures): one worker runs them all.
XDIST_GROUPS = {"test_systemd.py": "systemd", "test_zero_downtime.py": "systemd", "test_hostile.py": "hostile",
                "test_podman_e2e.py": "podman", "test_quadlet.py": "podman", "test_real_clients.py": "real-clients",
                "test_bench.py": "alone", "test_bench_constrained.py": "alone"}
# Files whose tests judge timings against the targets the docs quote as met (quoted_as_met): each runs alone on
# the machine, the other xdist workers waiting between their tests (MachineShare), so that a figure is not judged
# on two cores shared with the rest of the suite. One xdist group, so that they run back to back on one worker
# and the others drain once for all of them, not once for each (a drain waits for the longest test running).
ALONE_FILES = {"test_bench.py", "test_bench_constrained.py"}
MACHINE_LOCKS = Path(tempfile.gettempdir()) / "openarc-tests-machine"


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        group = XDIST_GROUPS.get(item.path.name)
        if group:
            item.add_marker(pytest.mark.xdist_group(group))
        if item.path.name in ALONE_FILES:
            item.add_marker(pytest.mark.alone)


class MachineShare:
    """Under xdist, every test holds the machine lock shared and an `alone` test holds it exclusively. A turnstile
    taken before the lock keeps new shared holders out while an exclusive one waits, so it cannot starve. A shared
    holder lets go after each test (an exclusive waiter waits for one test, not a worker's whole run); an exclusive
    one keeps the lock while the worker's next test is `alone` too."""

    def __init__(self):
        self.files = None  # (turnstile, machine) while the lock is held
        self.alone = False

    def take(self, alone: bool) -> None:
        MACHINE_LOCKS.mkdir(exist_ok=True)
        turnstile, machine = open(MACHINE_LOCKS / "turnstile", "a"), open(MACHINE_LOCKS / "machine", "a")
        fcntl.flock(turnstile, fcntl.LOCK_EX)
        try:
            fcntl.flock(machine, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        finally:
            fcntl.flock(turnstile, fcntl.LOCK_UN)
        self.files, self.alone = (turnstile, machine), alone

    def drop(self) -> None:
        if self.files:
            fcntl.flock(self.files[1], fcntl.LOCK_UN)
            for file in self.files:
                file.close()
            self.files = None


MACHINE_SHARE = MachineShare()


def _alone(item) -> bool:
    return item is not None and item.get_closest_marker("alone") is not None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """The machine lock around a test's setup, call and teardown (module fixtures included: a bench file's servers
    start and stop under it)."""
    if "PYTEST_XDIST_WORKER" not in os.environ:
        yield
        return
    alone = _alone(item)
    if MACHINE_SHARE.files and MACHINE_SHARE.alone != alone:
        MACHINE_SHARE.drop()
    if not MACHINE_SHARE.files:
        MACHINE_SHARE.take(alone)
    try:
        yield
    finally:
        if not (alone and _alone(nextitem)):
            MACHINE_SHARE.drop()


@pytest.fixture(autouse=True)
def groups_in_effect(request):
    """Under `--dist loadgroup` a grouped test's id ends in `@group`: that is how xdist keeps a group on one worker.
    pytest 9.2 moved where a test keeps its id, and pytest-xdist 3.8 then renames a field nothing reads: every
    test was scheduled alone and the groups silently ran side by side (three podman builds into one storage)."""
    if "PYTEST_XDIST_WORKER" in os.environ and getattr(request.config.option, "loadgroup", False) \
            and XDIST_GROUPS.get(request.node.path.name) and "@" not in request.node.nodeid:
        pytest.fail("--dist loadgroup is not in effect: this pytest / pytest-xdist pair does not keep xdist groups "
                    "together (pyproject.toml holds pytest below 9.2)", pytrace=False)
    yield
