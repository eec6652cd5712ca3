"""Zero downtime under the real systemd 252 (tests/systemd_ns.py): socket activation, and what a client sees
across a crash of the main process and across `systemctl reload`.

The units and the namespace are those of tests/test_systemd.py (boot_service). The load is one client sending
short chat requests back to back, each on a new connection, for a few seconds around the event; it counts what
a user would: refused connections, failed requests, the slowest answer.
"""

from __future__ import annotations

import pytest
import yaml

from load_client import Load
from test_systemd import CONFIG, HANG_S, OPENARC, RESTART_SEC, SHORT_WATCHDOG, boot_service  # noqa: F401 (a fixture)

pytestmark = pytest.mark.systemd

SOCKET_ACTIVATION = "(socket activation)"


def port_dropin(port: int) -> str:
    """The README's openarc@NAME.socket.d/port.conf."""
    return f"[Socket]\nListenStream=\nListenStream=127.0.0.1:{port}\n"


def listen_on_model_port(service, model: str) -> None:
    """Give openarc@MODEL.socket the model's port, as the README says, and start it."""
    dropin = service.ns.path(f"/etc/systemd/system/openarc@{model}.socket.d/port.conf")
    dropin.parent.mkdir(parents=True, exist_ok=True)
    dropin.write_text(port_dropin(service.port(model)))
    service.ns.systemctl("daemon-reload")
    service.ns.systemctl("start", f"openarc@{model}.socket")


def check_config(service) -> tuple[int, str]:
    done = service.ns.run(["env", "PYTHONPATH=/srv/openarc-src", OPENARC, "check-config", CONFIG], check=False)
    return done.returncode, done.stderr


# --- socket activation -----------------------------------------------------------------------------------

def test_socket_unit_starts_the_service_on_its_listener_and_without_it_the_service_binds_itself(boot_service):
    service = boot_service()
    listen_on_model_port(service, "demo")
    # Nothing started openarc@demo.service: the first connection does, and is answered by it (the request waits
    # for the model's first load: ready_wait_s).
    status, reply = service.chat("demo")
    assert status == 200, reply
    service.wait_ready("demo")
    assert service.chat("demo")[0] == 200
    main_pid = service.ns.main_pid("openarc@demo.service")
    assert main_pid and service.ns.show("openarc@demo.service", "ActiveState") == "active"
    assert SOCKET_ACTIVATION in service.ns.journal("openarc@demo.service")
    # The listener is systemd's: fd 3 of the main process, and the service bound nothing of its own.
    assert service.ns.run(["readlink", f"/proc/{main_pid}/fd/3"]).stdout.startswith("socket:")
    listeners = service.ns.run(["ss", "-Hltnp", f"sport = :{service.port('demo')}"]).stdout
    assert "systemd" in listeners and len(listeners.splitlines()) == 1, listeners
    assert check_config(service) == (0, "")

    # openarc@long without its socket unit: binds the model's port itself and serves.
    service.start("openarc@long.service")
    assert service.chat("long")[0] == 200
    assert SOCKET_ACTIVATION not in service.ns.journal("openarc@long.service")
    # An enabled socket unit still on its default address: check-config says the port differs.
    service.ns.systemctl("enable", "openarc@long.socket")
    returncode, warnings = check_config(service)
    assert returncode == 0
    assert (f"warning: openarc@long.socket listens on /run/openarc/long.sock, but models[1].port is "
            f"{service.port('long')}") in warnings


# --- whole-service restarts ------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", ["ABRT", "KILL", "STOP"])
def test_a_killed_main_process_refuses_no_connection_and_fails_only_the_request_in_flight(boot_service, sig):
    """SIGSTOP: the watchdog (WatchdogSec=3 here) kills the wedged process."""
    service = boot_service(dropins={"60-watchdog.conf": SHORT_WATCHDOG} if sig == "STOP" else None)
    listen_on_model_port(service, "demo")
    service.start("openarc@demo.service")
    with Load(service.port("demo"), "demo") as load:
        load.wait_for_answers(20)
        service.ns.kill(service.ns.main_pid("openarc@demo.service"), sig)
        service.ns.wait_for(lambda: service.restarts("openarc@demo.service") == 1, HANG_S, what="a unit restart")
        load.wait_for_answers(20)  # the requests that waited in the backlog, and some after
    summary = load.summary()
    print(f"SIG{sig} of the main process under load, behind openarc@demo.socket: {summary}")
    assert summary["refused"] == 0, summary
    assert sum(summary["failed"].values()) <= 1, summary  # only the request in flight when it died
    # Whatever arrived during the restart waited (RestartSec=2, then a start and a load) and was answered.
    assert summary["slowest_s"] >= RESTART_SEC, summary


# --- reloads ------------------------------------------------------------------------------------------------

def test_systemctl_reload_of_a_changed_model_under_load_fails_no_request(boot_service):
    service = boot_service()
    service.start("openarc.service")
    port = service.port()  # all models on server.port
    old = service.status("demo", port=port)["pid"]
    with Load(port, "demo") as load:
        load.wait_for_answers(20)
        service.config["models"][0]["max_context"] = 256
        service.ns.path(CONFIG).write_text(yaml.safe_dump(service.config))
        service.ns.systemctl("reload", "openarc.service", timeout=HANG_S)
        service.wait_new_worker("demo", old, port)
        load.wait_for_answers(20)
    summary = load.summary()
    print(f"systemctl reload of a changed model under load: {summary}")
    assert summary["failed"] == {} and summary["refused"] == 0, summary
    assert service.restarts("openarc.service") == 0
