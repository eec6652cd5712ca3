"""SIGHUP (systemctl reload): the config is read again and applied model by model, without dropping the others."""

from __future__ import annotations

import signal
import time

import pytest
import yaml

from conftest import http, model_entry, pid_alive, wait_until
from load_client import Load

CHAT = [{"role": "user", "content": "hi"}]


def rewrite(app, config: dict) -> None:
    app.config_path.write_text(yaml.safe_dump(config))
    app.proc.send_signal(signal.SIGHUP)


def wait_for(predicate, what: str, timeout: float = 30):
    return wait_until(predicate, timeout, what)


def test_reload_adds_restarts_and_removes_only_what_changed(appliance_factory, demo_model):
    config = {"models": [model_entry("keep", demo_model), model_entry("change", demo_model, max_context=1024),
                         model_entry("drop", demo_model)]}
    app = appliance_factory(config)
    port = app.port
    keep, change = app.worker_pid("keep"), app.worker_pid("change")
    config["models"] = [model_entry("keep", demo_model), model_entry("change", demo_model, max_context=512),
                        model_entry("new", demo_model)]
    config["server"]["port"] = port
    rewrite(app, config)
    wait_for(lambda: "reloaded" in app.logs(), "reload")
    names = wait_for(lambda: [m["name"] for m in app.status()["models"]] == ["keep", "change", "new"] or None,
                     "new model list")
    assert names
    app.wait_model("new", "ready")
    changed = app.wait_model("change", "ready", new_pid_not=change)
    assert changed["restarts"] == 0  # a fresh supervisor, not a crash
    assert app.worker_pid("keep") == keep
    # the new window is the one enforced: 702 tokens of prompt fit the old 1024, not the new 512
    status, _, body = http("POST", app.base + "/v1/completions", {"model": "change", "prompt": "word " * 350})
    assert status == 400 and "512" in body["error"]["message"]
    assert http("POST", app.base + "/v1/completions", {"model": "drop", "prompt": "x"})[0] == 404
    assert app.client().chat.completions.create(model="new", messages=CHAT, max_tokens=3).usage.completion_tokens == 3


def test_an_invalid_config_on_reload_changes_nothing(appliance_factory, demo_model):
    app = appliance_factory({"models": [model_entry("demo", demo_model)]})
    pid = app.worker_pid("demo")
    app.config_path.write_text("models: [{name: demo, path: /x, devise: GPU}]\n")
    app.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "reload refused" in app.logs(), "refusal in the log")
    assert "models[0].devise: unknown key" in app.logs()
    assert app.worker_pid("demo") == pid
    assert app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=2).usage.completion_tokens == 2


@pytest.mark.parametrize("mode", ["side_by_side", "restart"])
def test_a_model_changed_under_load_is_replaced_without_a_failed_request(appliance_factory, demo_model, mode):
    config = {"models": [model_entry("demo", demo_model, max_context=1024, reload=mode)]}
    app = appliance_factory(config)
    old = app.worker_pid("demo")
    with Load(app.port, "demo") as load:
        load.wait_for_answers(10)
        config["models"][0]["max_context"] = 512
        rewrite(app, config)
        app.wait_model("demo", "ready", new_pid_not=old)
        load.wait_for_answers(10)
    summary = load.summary()
    print(f"reload ({mode}) of a changed model under load: {summary}")
    assert summary["failed"] == {} and summary["refused"] == 0, summary  # no 503, no 404, no cut connection
    wait_for(lambda: not pid_alive(old), "the old worker to leave")
    status, _, body = http("POST", app.base + "/v1/completions", {"model": "demo", "prompt": "word " * 350})
    assert status == 400 and "512" in body["error"]["message"]


def test_new_settings_that_do_not_load_leave_the_old_worker_serving(appliance_factory, demo_model, tmp_path):
    config = {"models": [model_entry("demo", demo_model)]}
    app = appliance_factory(config)
    old = app.worker_pid("demo")
    config["models"][0].update(path=str(tmp_path / "no-such-model"),
                               restart={"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 2, "window_s": 60})
    rewrite(app, config)
    wait_for(lambda: "do not load" in app.logs(), "the refusal in the log")
    assert "no-such-model" in app.logs()
    assert app.model_status("demo")["pid"] == old and app.model_status("demo")["state"] == "ready"
    assert app.client().chat.completions.create(model="demo", messages=CHAT, max_tokens=2).usage.completion_tokens == 2


def test_a_reload_with_the_same_config_loads_a_failed_model_again(appliance_factory, demo_model, tmp_path):
    """A model whose restart budget ran out stays failed until a reload: fix what failed it (here its files
    appear), `systemctl reload` with the same file, and it serves; the other model's worker is left alone."""
    import shutil
    later = tmp_path / "later-model"
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 2, "window_s": 60}
    config = {"models": [model_entry("keep", demo_model), model_entry("later", later, restart=budget)]}
    app = appliance_factory(config, wait_ready=False)
    app.wait_model("later", "failed")
    keep = app.wait_model("keep", "ready")["pid"]
    shutil.copytree(demo_model, later)
    app.proc.send_signal(signal.SIGHUP)  # the same file
    app.wait_model("later", "ready")
    assert app.client().chat.completions.create(model="later", messages=CHAT, max_tokens=2).usage.completion_tokens == 2
    assert app.worker_pid("keep") == keep


def test_a_reload_queued_when_shutdown_begins_starts_nothing(appliance_factory, demo_model):
    """SIGHUP, SIGHUP, SIGTERM: the first reload is replacing a model when the stop comes; the second, queued
    behind it, must not start the model it adds once the server is shutting down."""
    config = {"models": [model_entry("a", demo_model)]}
    app = appliance_factory(config)
    config["models"] = [model_entry("a", demo_model, max_context=1024)]
    rewrite(app, config)  # "a" changed: its replacement loads beside it
    wait_for(lambda: app.logs().count("model a: stopped -> loading") == 2, "the replacement loading")
    config["models"].append(model_entry("late", demo_model))
    rewrite(app, config)
    time.sleep(0.3)  # the second reload waits for the first
    app.proc.send_signal(signal.SIGTERM)
    assert app.proc.wait(60) == 0
    logs = app.logs()
    after_stop = logs[logs.index("stopping: draining"):]
    assert "model late: stopped -> loading" not in after_stop, after_stop


def test_a_reload_that_fails_of_anything_but_a_config_error_still_tells_systemd_ready(tmp_path, monkeypatch):
    """systemd leaves "reloading" only on READY=1: a reload that raises (here the config reader itself) must send
    it too, or `systemctl reload` hangs and the unit shows reloading for good. A real notify socket listens."""
    import asyncio
    import socket

    from appliance.config import parse_config
    from appliance.front.server import Appliance

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(tmp_path / "notify"))
    listener.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))

    def unreadable():
        raise RuntimeError("the reader broke")

    async def reload() -> None:
        await Appliance(parse_config({"models": []}, "o.yaml"), reload_config=unreadable).reload()

    asyncio.run(reload())
    try:
        messages = [listener.recv(4096).decode() for _ in range(2)]
    finally:
        listener.close()
    assert messages[0].startswith("RELOADING=1") and messages[1].startswith("READY=1"), messages
