"""The shipped units under a real systemd 252: PID 1 of throwaway namespaces (tests/systemd_ns.py).

Each test boots its own namespace, installs the units with units/install.sh as a user would, writes
/etc/openarc/openarc.yaml and drives systemctl. The units are the real ones from units/; the only
drop-in sets PYTHONPATH so the installed /opt/openarc/venv/bin/openarc runs this source tree (run
`make install` first), and the watchdog tests shorten WatchdogSec.
"""

from __future__ import annotations

import contextlib
import json
import socket
import time
from http.client import HTTPConnection, HTTPException, HTTPResponse
from pathlib import Path

import pytest
import yaml

from appliance.host.oom import WORKER_OOM_SCORE_ADJ
from audio_samples import TRANSCRIPT, encoded, multipart
from conftest import REPO, free_port, http
from systemd_ns import SystemdNamespace, namespace_processes

pytestmark = pytest.mark.systemd

SRC = "/srv/openarc-src"  # the repository, bound read-only: ProtectHome would hide a clone under /root
MODELS = "/var/lib/openarc/models"
CONFIG = "/etc/openarc/openarc.yaml"
OPENARC = "/opt/openarc/venv/bin/openarc"
QUICK_RESTARTS = {"backoff_initial_s": 0.1, "backoff_max_s": 0.5, "max_failures": 20, "window_s": 60}
HANG_S = 60  # bounds that only catch hangs
LONG_REPLY_TOKENS = 3000  # the `long` demo model streams these for about 3 s
SHORT_WATCHDOG_S = 3
SHORT_WATCHDOG = f"[Service]\nWatchdogSec={SHORT_WATCHDOG_S}\n"
KMSG_OFF = "GPU reset detection from the kernel log is off"
RESTART_SEC = 2  # RestartSec= of the units


class Service:
    """A booted namespace with the units installed and a config: drives systemd, talks HTTP over loopback."""

    def __init__(self, ns: SystemdNamespace, config: dict):
        self.ns = ns
        self.config = config

    def port(self, model: str | None = None) -> int:
        """openarc@MODEL listens on the model's own port; openarc.service on server.port."""
        if model is None:
            return self.config["server"]["port"]
        return next(m["port"] for m in self.config["models"] if m["name"] == model)

    def url(self, path: str, model: str | None = None) -> str:
        return f"http://127.0.0.1:{self.port(model)}{path}"

    def start(self, unit: str) -> float:
        """systemctl start; the seconds it took to return."""
        started = time.monotonic()
        result = self.ns.systemctl("start", unit, check=False, timeout=HANG_S)
        elapsed = time.monotonic() - started
        assert result.returncode == 0, f"start {unit} failed: {result.stderr}\n{self.ns.journal(unit)[-5000:]}"
        return elapsed

    def restarts(self, unit: str) -> int:
        return int(self.ns.show(unit, "NRestarts"))

    def status(self, model: str, port: int | None = None) -> dict:
        """The model's entry of /openarc/status, on its own port unless `port` says otherwise."""
        status, _, body = http("GET", f"http://127.0.0.1:{port or self.port(model)}/openarc/status", timeout=5)
        assert status == 200, body
        return next(m for m in body["models"] if m["name"] == model)

    def chat(self, model: str, port: int | None = None) -> tuple[int, dict]:
        """A short chat completion to `model`, on its own port unless `port` says otherwise."""
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        url = f"http://127.0.0.1:{port or self.port(model)}/v1/chat/completions"
        status, _, reply = http("POST", url, body, timeout=HANG_S)
        return status, reply

    def ready(self, model: str | None = None) -> bool:
        with contextlib.suppress(OSError):
            return http("GET", self.url("/ready", model), timeout=2)[0] == 200
        return False

    def wait_ready(self, model: str | None = None) -> None:
        self.ns.wait_for(lambda: self.ready(model), HANG_S, what=f"/ready of {model or 'server'}")

    def wait_new_worker(self, model: str, old_pid: int, port: int | None = None) -> dict:
        """The model's status once it is ready again on a worker other than old_pid."""
        return self.ns.wait_for(
            lambda: (m := self.status(model, port))["state"] == "ready" and m["pid"] not in (None, old_pid) and m,
            HANG_S, what=f"a new ready worker of {model}")

    def process_status(self, pid: int) -> dict[str, str]:
        """/proc/PID/status of a process of the namespace, as {field: value}."""
        text = self.ns.run(["cat", f"/proc/{pid}/status"]).stdout
        return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)

    def alive(self, pid: int) -> bool:
        return self.ns.run(["kill", "-0", str(pid)], check=False).returncode == 0


def model_entry(name: str, restart: dict) -> dict:
    return {"name": name, "path": f"{MODELS}/{name}", "device": "CPU", "port": free_port(), "restart": restart}


@pytest.fixture
def boot_service(demo_model, long_demo_model):
    """boot(restart=..., dropins={name: text}, devices=(), with_config=True, extra_models={}) -> Service.

    The config has two models: `demo` (stops after 48 tokens) and `long` (never stops by itself), plus
    `extra_models` ({name: (model dir, config overrides)}).
    `dropins` are added to both units; every namespace ends with the test."""
    assert Path(OPENARC).exists(), f"{OPENARC} missing: run `make install` first (the units' ExecStart)"
    with contextlib.ExitStack() as namespaces:
        def boot(restart: dict = QUICK_RESTARTS, dropins: dict[str, str] | None = None, devices=(),
                 with_config: bool = True, extra_models: dict[str, tuple[Path, dict]] | None = None) -> Service:
            extra_models = extra_models or {}
            config = {"server": {"host": "127.0.0.1", "port": free_port()},
                      "models": [model_entry("demo", restart), model_entry("long", restart),
                                 *({**model_entry(name, restart), **overrides}
                                   for name, (_, overrides) in extra_models.items())]}
            unit_dropins = {"50-test.conf": f"[Service]\nEnvironment=PYTHONPATH={SRC}\n", **(dropins or {})}
            files = {}
            if with_config:
                files = {CONFIG: yaml.safe_dump(config), f"{MODELS}/demo": demo_model, f"{MODELS}/long": long_demo_model,
                         **{f"{MODELS}/{name}": path for name, (path, _) in extra_models.items()}}
            ns = namespaces.enter_context(SystemdNamespace(
                dropins={unit: unit_dropins for unit in ("openarc@.service", "openarc.service")},
                files=files, binds={REPO: SRC}, devices=devices))
            ns.run(["env", f"PYTHONPATH={SRC}", "sh", f"{SRC}/units/install.sh"], timeout=HANG_S)
            # As an admin would: the service user must be able to read the models (pytest's dirs are 0700).
            ns.run(["chmod", "-R", "u=rwX,go=rX", MODELS])
            return Service(ns, config)
        yield boot


def open_chat_stream(port: int, model: str, max_tokens: int) -> HTTPResponse:
    """A streaming chat completion whose first chunk has arrived: the request is being generated."""
    conn = HTTPConnection("127.0.0.1", port, timeout=HANG_S)
    body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": max_tokens,
            "stream": True}
    conn.request("POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    assert response.status == 200, response.read()
    assert response.readline().startswith(b"data: ")
    return response


def read_stream(response: HTTPResponse) -> tuple[list[str], Exception | None]:
    """The remaining `data:` payloads until the stream ends, and the error that cut it short, if any."""
    events: list[str] = []
    try:
        while line := response.readline():
            if line.startswith(b"data: "):
                events.append(line[len(b"data: "):].strip().decode())
    except (HTTPException, OSError) as exc:
        return events, exc
    return events, None


# --- the harness itself ----------------------------------------------------------------------------------

TOY_SERVICE = """[Service]
Type=notify
ExecStart=/opt/openarc/venv/bin/python -c "import sdnotify, time; n = sdnotify.SystemdNotifier(); n.notify('READY=1'); time.sleep(3600)"
"""


def test_namespace_leaves_nothing_behind_when_the_test_body_fails(tmp_path):
    host_file = tmp_path / "survives"  # on the host's /tmp, which Debian's `D /tmp` would wipe on the host root
    host_file.write_text("kept")
    hostname = socket.gethostname()
    with pytest.raises(RuntimeError, match="test body failed"):
        with SystemdNamespace(units={"toy.service": TOY_SERVICE}) as ns:
            ns.systemctl("start", "toy.service")  # pulls in sysinit.target: tmpfiles runs, in the namespace
            assert ns.show("toy.service", "ActiveState") == "active"
            pid_namespace, cgroup, stage = ns.pid_namespace, ns.cgroup, ns.stage
            raise RuntimeError("test body failed")
    assert namespace_processes(pid_namespace) == []
    assert not cgroup.exists() and not stage.exists()
    assert host_file.read_text() == "kept"
    assert socket.gethostname() == hostname


# --- the appliance under its units -----------------------------------------------------------------------

def test_start_returns_once_the_model_serves(boot_service):
    service = boot_service()
    service.start("openarc@demo")
    # No polling: the moment `systemctl start` returns, the model answers.
    status, _, models = http("GET", service.url("/v1/models", "demo"), timeout=5)
    assert status == 200 and [m["id"] for m in models["data"]] == ["demo"]
    status, reply = service.chat("demo")
    assert status == 200, reply
    assert reply["choices"][0]["message"]["content"]
    assert service.ns.show("openarc@demo", "ActiveState") == "active"


def test_all_models_unit_serves_every_model_on_the_server_port(boot_service):
    service = boot_service()
    service.start("openarc")
    status, _, models = http("GET", service.url("/v1/models"), timeout=5)
    assert status == 200 and sorted(m["id"] for m in models["data"]) == ["demo", "long"]
    assert service.chat("demo", port=service.port())[0] == 200
    assert service.chat("long", port=service.port())[0] == 200


def test_service_runs_unprivileged_and_sandboxed(boot_service):
    service = boot_service()
    service.start("openarc@demo")
    openarc_uid = service.ns.run(["id", "-u", "openarc"]).stdout.strip()
    assert "render" in service.ns.run(["id", "-nG", "openarc"]).stdout.split()
    for pid in (service.ns.main_pid("openarc@demo"), service.status("demo")["pid"]):
        proc = service.process_status(pid)
        assert proc["Uid"].split()[0] == openarc_uid
        assert proc["NoNewPrivs"] == "1"
        assert proc["Seccomp"] == "2"  # a syscall filter is in force
        assert int(proc["CapEff"], 16) == 0
    # The worker makes itself the OOM killer's first choice, inside the sandbox too.
    worker_oom_score_adj = service.ns.run(["cat", f"/proc/{service.status('demo')['pid']}/oom_score_adj"]).stdout
    assert int(worker_oom_score_adj) == WORKER_OOM_SCORE_ADJ


def test_transcription_decodes_and_transcribes_inside_the_sandbox(boot_service, demo_whisper):
    """The audio decoder (a child of the front) and the Whisper worker share the unit's private /tmp spool and
    run under its syscall filter."""
    service = boot_service(extra_models={"whisper": (demo_whisper, {"kind": "transcription"})})
    service.start("openarc@whisper")
    content_type, body = multipart({"model": "whisper", "file": encoded("mp3")})
    status, _, reply = http("POST", service.url("/v1/audio/transcriptions", "whisper"), raw=body,
                            headers={"Content-Type": content_type}, timeout=HANG_S)
    assert status == 200 and reply["text"] == TRANSCRIPT, reply


def test_embedding_and_rerank_instances_serve_inside_the_sandbox(boot_service, embedding_model, rerank_model):
    """openarc@NAME for the other worker kinds: the hardened unit runs their pipelines as it runs an LLM's."""
    service = boot_service(extra_models={"embed": (embedding_model, {"kind": "embedding"}),
                                         "rank": (rerank_model, {"kind": "rerank"})})
    service.start("openarc@embed")
    service.start("openarc@rank")
    assert service.status("embed")["kind"] == "embedding" and service.status("rank")["kind"] == "rerank"
    status, _, reply = http("POST", service.url("/v1/embeddings", "embed"),
                            {"model": "embed", "input": ["a cat on a mat", "GPU drivers crash"]}, timeout=HANG_S)
    assert status == 200 and [len(d["embedding"]) for d in reply["data"]] == [128, 128], reply
    status, _, reply = http("POST", service.url("/v1/rerank", "rank"),
                            {"model": "rank", "query": "cat", "documents": ["GPU drivers crash", "a cat on a mat"]},
                            timeout=HANG_S)
    assert status == 200 and reply["results"][0]["index"] == 1, reply


def test_main_process_abort_cuts_requests_and_restarts_the_unit(boot_service):
    service = boot_service()
    service.start("openarc@long")
    stream = open_chat_stream(service.port("long"), "long", LONG_REPLY_TOKENS)
    aborted = time.monotonic()
    service.ns.kill(service.ns.main_pid("openarc@long"), "ABRT")
    events, _ = read_stream(stream)
    cut_after = time.monotonic() - aborted
    assert "[DONE]" not in events
    assert cut_after < 5
    service.ns.wait_for(lambda: service.restarts("openarc@long") == 1, RESTART_SEC + HANG_S, what="a unit restart")
    service.wait_ready("long")
    assert service.chat("long")[0] == 200


def test_stopped_main_process_is_killed_by_the_watchdog_and_restarted(boot_service):
    service = boot_service(dropins={"60-watchdog.conf": SHORT_WATCHDOG})
    service.start("openarc@demo")
    stopped = time.monotonic()
    service.ns.kill(service.ns.main_pid("openarc@demo"), "STOP")
    service.ns.wait_for(lambda: service.restarts("openarc@demo") == 1, HANG_S, what="a unit restart")
    # The watchdog fires within WatchdogSec; the restart comes RestartSec later.
    assert time.monotonic() - stopped < SHORT_WATCHDOG_S + RESTART_SEC + 3
    assert "Failed with result 'watchdog'" in service.ns.journal("openarc@demo")
    service.wait_ready("demo")
    assert service.chat("demo")[0] == 200


def test_worker_abort_recovers_inside_the_running_unit(boot_service):
    service = boot_service()
    service.start("openarc@demo")
    main_pid, worker_pid = service.ns.main_pid("openarc@demo"), service.status("demo")["pid"]
    service.ns.kill(worker_pid, "ABRT")
    recovered = service.wait_new_worker("demo", worker_pid)
    assert recovered["crashes"] == 1
    assert service.restarts("openarc@demo") == 0
    assert service.ns.main_pid("openarc@demo") == main_pid
    assert service.chat("demo")[0] == 200
    # The crash is an error-priority journal entry, with the journal's timestamp only (no second one of our own).
    errors = service.ns.run(["journalctl", "--no-pager", "-o", "cat", "-p", "err", "-u", "openarc@demo"],
                            check=False, timeout=30).stdout.splitlines()
    crash = [line for line in errors if "worker exited: SIGABRT" in line]
    assert crash and crash[0].startswith("openarc.supervisor: model demo: worker exited: SIGABRT"), errors
    assert not any("-> ready" in line for line in errors)  # info lines stay below err


def test_model_out_of_restart_budget_restarts_the_unit_through_the_watchdog(boot_service):
    service = boot_service(restart={"max_failures": 2, "window_s": 60, "backoff_initial_s": 0.1, "backoff_max_s": 0.2})
    service.start("openarc@demo")
    first_main = service.ns.main_pid("openarc@demo")
    killed: set[int] = set()

    def kill_each_new_worker() -> bool:
        if service.restarts("openarc@demo"):
            return True
        with contextlib.suppress(OSError, AssertionError):  # the front may be gone between two looks
            model = service.status("demo")
            if model["state"] == "ready" and model["pid"] not in killed:
                killed.add(model["pid"])
                service.ns.kill(model["pid"], "ABRT")
        return False

    service.ns.wait_for(kill_each_new_worker, HANG_S, what="a unit restart")
    assert len(killed) >= 2
    journal = service.ns.journal("openarc@demo")
    assert "Watchdog request" in journal and "Failed with result 'watchdog'" in journal
    service.wait_ready("demo")
    assert service.ns.main_pid("openarc@demo") != first_main
    assert service.chat("demo")[0] == 200


def test_stop_drains_running_requests_and_ends_inactive(boot_service):
    service = boot_service()
    service.start("openarc@long")
    worker_pid = service.status("long")["pid"]
    stream = open_chat_stream(service.port("long"), "long", LONG_REPLY_TOKENS)
    service.ns.systemctl("stop", "--no-block", "openarc@long")
    service.ns.wait_for(lambda: service.ns.show("openarc@long", "ActiveState") == "deactivating", HANG_S,
                        what="deactivating")
    assert service.chat("long")[0] == 503  # no new work while draining
    events, error = read_stream(stream)
    assert error is None and events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    service.ns.wait_for(lambda: service.ns.show("openarc@long", "ActiveState") == "inactive", HANG_S,
                        what="inactive")
    assert service.ns.show("openarc@long", "Result") == "success"
    assert not service.alive(worker_pid)


def test_install_script_gives_a_working_demo_out_of_the_box(boot_service):
    service = boot_service(with_config=False)  # install.sh installs the example config and builds the demo model
    service.ns.run(["env", f"PYTHONPATH={SRC}", OPENARC, "check-config", CONFIG])
    config_file = service.ns.path(CONFIG)
    config = yaml.safe_load(config_file.read_text())
    config["server"]["port"] = free_port()  # the example's 8000/8001 may be taken on this host
    for model in config["models"]:
        model["port"] = free_port()
    config_file.write_text(yaml.safe_dump(config))
    service.config = config
    service.start("openarc@demo")
    assert service.chat("demo")[0] == 200


def test_kernel_log_is_closed_by_default_and_opened_by_the_kmsg_dropin(boot_service):
    default = boot_service(devices=("kmsg",))
    default.start("openarc@demo")
    assert KMSG_OFF in default.ns.journal("openarc@demo")
    with_dropin = boot_service(devices=("kmsg",),
                               dropins={"60-kmsg.conf": (REPO / "units/openarc-kmsg.conf").read_text()})
    with_dropin.start("openarc@demo")
    main_pid = with_dropin.ns.main_pid("openarc@demo")
    open_files = with_dropin.ns.run(["ls", "-l", f"/proc/{main_pid}/fd"]).stdout
    assert "/dev/kmsg" in open_files
    assert KMSG_OFF not in with_dropin.ns.journal("openarc@demo")
    assert with_dropin.chat("demo")[0] == 200


def test_reload_applies_a_changed_model_without_restarting_the_unit(boot_service):
    service = boot_service()
    service.start("openarc.service")
    main_pid, port = service.ns.main_pid("openarc.service"), service.port()  # all models on server.port
    demo_pid, long_pid = service.status("demo", port=port)["pid"], service.status("long", port=port)["pid"]
    service.config["models"][0]["max_context"] = 256
    service.ns.path(CONFIG).write_text(yaml.safe_dump(service.config))
    service.ns.systemctl("reload", "openarc.service", timeout=HANG_S)
    new = service.wait_new_worker("demo", demo_pid, port)
    assert new["restarts"] == 0
    assert service.status("long", port=port)["pid"] == long_pid  # unchanged: untouched
    assert service.ns.main_pid("openarc.service") == main_pid and service.restarts("openarc.service") == 0
    assert service.ns.show("openarc.service", "ActiveState") == "active"
    assert service.chat("demo", port=port)[0] == 200
