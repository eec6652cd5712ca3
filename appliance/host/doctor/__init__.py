"""`openarc doctor`: read-only checks of the box before the first request, each `ok | warn | fail | skip` with a
one-line detail and, for warn and fail, the exact fix (a command or a config line).

One module per concern, each a set of pure functions of a `Box` (the machine's files under one root) and what the
caller passes in: `gpu_access` (render nodes and who may open them), `runtime` (the GPU compute runtime and known-bad
versions), `openvino_devices` (what OpenVINO lists, from a child process), `cards` (per card: driver, generation and
kernel, Resizable BAR, GuC/HuC firmware; the running server's /openarc/status shows the same facts), `config_checks`
(the config, its memory arithmetic, the model directories), `service_unit` (the systemd unit or quadlet and the user
it runs as), `disk` (room for models and the compiled-model cache, the cache's size against its bound and its stale share), and
`build_info` (what the box runs: the same line as the server's openarc_build_info).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

STATUSES = ("ok", "warn", "fail", "skip")


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # ok | warn | fail | skip
    detail: str
    fix: str | None = None  # for warn and fail: the command or config line that fixes it


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def skip(name: str, detail: str) -> Check:
    return Check(name, "skip", detail)


def warn(name: str, detail: str, fix: str) -> Check:
    return Check(name, "warn", detail, fix)


def fail(name: str, detail: str, fix: str) -> Check:
    return Check(name, "fail", detail, fix)


def diagnose(root: str | Path = "/", config_path: str | None = None, unit: str | None = None,
             openvino: dict[str, Any] | None = None) -> list[Check]:
    """Every check, in the order a user fixes things: the unit and its user, the GPU's nodes, the runtime, what
    OpenVINO sees, each card, then the config and its models, then disk. `openvino` is the device listing
    (openvino_devices.query's result); None asks a child process (or reads a recorded root's)."""
    from appliance.host.doctor import (box, build_info, cards, config_checks, disk, gpu_access, openvino_devices,
                                       runtime, service_unit)
    machine = box.Box(root)
    found_unit = service_unit.find_unit(machine, unit)
    user = service_unit.service_user(machine, found_unit)
    listing = openvino if openvino is not None else openvino_devices.query(machine)
    card_facts = cards.card_facts(machine, listing)
    checks = [*service_unit.checks(machine, found_unit, unit, user),
              *gpu_access.checks(machine, user, card_facts),
              *runtime.checks(machine),
              *openvino_devices.checks(listing),
              *cards.checks(machine, card_facts),
              ok("build", build_info.describe(build_info.read(machine, card_facts)))]
    config = None
    if config_path:
        config, problems = config_checks.load(config_path, machine)
        checks += problems
        if config is not None:
            checks += config_checks.memory_checks(config, card_facts)
            checks += config_checks.window_checks(config)
            checks += config_checks.model_dir_checks(machine, config, user)
    checks += disk.checks(machine, config)
    return checks


def exit_status(checks: list[Check]) -> int:
    """0 when nothing fails (warnings and skips pass), 1 otherwise."""
    return 1 if any(check.status == "fail" for check in checks) else 0


def to_json(checks: list[Check]) -> str:
    """The stable machine form: {"checks": [{"name", "status", "detail", "fix"}]}."""
    return json.dumps({"checks": [asdict(check) for check in checks]}, indent=2)


def to_text(checks: list[Check]) -> str:
    lines = []
    for check in checks:
        lines.append(f"{check.status.upper():4}  {check.name}: {check.detail}")
        if check.fix:
            lines.append(f"      fix: {check.fix}")
    failed = sum(check.status == "fail" for check in checks)
    warned = sum(check.status == "warn" for check in checks)
    lines.append(f"\n{failed} failed, {warned} warnings, {len(checks)} checks")
    return "\n".join(lines)
