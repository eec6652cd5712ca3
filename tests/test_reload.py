"""SIGHUP (systemctl reload): the config is read again and applied model by model, without dropping the others."""

from __future__ import annotations

import signal

import yaml

from conftest import http, model_entry, wait_until

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
    # the new limit is the one enforced
    status, _, body = http("POST", app.base + "/v1/completions", {"model": "change", "prompt": "x", "max_tokens": 600})
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
