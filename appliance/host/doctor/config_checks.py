"""The config as `check-config` judges it (every problem), its memory arithmetic (server.memory_budget and
models[].memory against each card's VRAM), and the model directories (present, OpenVINO IR of their kind, readable
by the user the server runs as)."""

from __future__ import annotations

import os
from pathlib import Path

from appliance import model_files
from appliance.config import Config, ConfigError, load_config
from appliance.config import window
from appliance.config.devices import budget_device
from appliance.config.replicas import all_units
from appliance.config.kinds import GENERATIVE_KINDS
from appliance.config.model_checks import served_path_check
from appliance.host.doctor import Check, fail, ok, skip, warn
from appliance.host.doctor.box import Box, User
from appliance.host.doctor.cards import GiB, CardFacts

# After load, less VRAM free than this share leaves no room for a long prompt's transient buffers: the first one
# pushes the model's buffers to system memory (the xe eviction cliff, field notes: ~645 MiB free was too little).
HEADROOM = 0.10


def load(path: str, box: Box) -> tuple[Config | None, list[Check]]:
    """The config and its check; each problem check-config names is a failing check of its own: its checks of
    the model directories included (the same code, the paths read on `box`), so one run names every problem
    rather than the first kind of them."""
    def on_box(configured: str) -> str:
        return str(box.path(configured)) if box.recorded else configured

    try:
        config = load_config(path, [lambda model: served_path_check(model, locate=on_box)])
    except ConfigError as exc:
        return None, [fail("config", line, f"edit {path} as the line says; `openarc check-config {path}` "
                                           "re-checks it") for line in exc.lines]
    found = [ok("config", f"{path}: {len(config.models)} models")]
    found += [warn("config", line, "give each model its own card (device: GPU.0, GPU.1) or set memory_budget")
              for line in config.shared_gpu_warnings()]
    return config, found


def gpu_cards(cards: list[CardFacts]) -> dict[str, CardFacts]:
    """OpenVINO's device names (GPU.0, GPU.1, ...) for the Arc cards: the name OpenVINO gave the card's PCI address
    (bare GPU is GPU.0), else by PCI order (the order it enumerates discrete cards in)."""
    arc = [card for card in cards if card.generation]
    named = {budget_device(card.openvino_name): card for card in arc if card.openvino_name}
    return named or {f"GPU.{i}": card for i, card in enumerate(arc)}


def memory_checks(config: Config, cards: list[CardFacts]) -> list[Check]:
    by_device = gpu_cards(cards)
    budgets = config.server.memory_budget_bytes
    unit_models = [unit.model for unit in all_units(config.models)]  # a replica counts on its own card
    devices = sorted({d for d in budgets if d.startswith("GPU")}
                     | {budget_device(m.device) for m in unit_models if m.is_gpu and m.memory_bytes})
    if not devices:
        return [skip("memory", "no server.memory_budget or models[].memory on a GPU to check against VRAM")]
    found = []
    for device in devices:
        name = f"memory {device}"
        card = by_device.get(device)
        if card is None or card.vram_bytes is None:
            found.append(skip(name, f"VRAM of {device} unknown (no such card, or neither sysfs nor OpenVINO says)"))
            continue
        vram, budget = card.vram_bytes, budgets.get(device)
        suggest = f"{int(vram * (1 - HEADROOM) / GiB * 10) / 10:g}GiB"
        at_start = [m for m in unit_models if m.is_gpu and budget_device(m.device) == device and m.memory_bytes
                    and m.load == "at_start"]
        pinned = sum(m.memory_bytes for m in at_start)
        too_big = [m for m in unit_models if m.is_gpu and budget_device(m.device) == device
                   and (m.memory_bytes or 0) > vram]
        if budget is not None and budget > vram:
            found.append(fail(name, f"server.memory_budget.{device} {config.server.memory_budget[device]} is more "
                                    f"than the card's {vram / GiB:.1f} GiB of VRAM", f"server: {{memory_budget: "
                                    f"{{{device}: {suggest}}}}}"))
        elif too_big:
            m = too_big[0]
            found.append(fail(name, f"model {m.name!r} declares memory {m.memory}, more than the card's "
                                    f"{vram / GiB:.1f} GiB of VRAM", f"a smaller quantisation of {m.name} "
                                    "(int4), or device: CPU"))
        elif pinned > vram * (1 - HEADROOM):
            found.append(warn(name, f"the load: at_start models on {device} ({', '.join(m.name for m in at_start)}) "
                                    f"take {pinned / GiB:.1f} GiB of {vram / GiB:.1f} GiB: under "
                                    f"{HEADROOM:.0%} left for prompts (the eviction cliff)",
                              "load: on_demand for some of them, or server.memory_budget."
                              f"{device}: {suggest}"))
        else:
            found.append(ok(name, f"{pinned / GiB:.1f} GiB of at_start models"
                                  + (f", budget {config.server.memory_budget[device]}" if budget else "")
                                  + f" within {vram / GiB:.1f} GiB of VRAM"))
    return found


def _model_dir_problem(box: Box, path: str, kind: str, user: User) -> str | None:
    on_box = str(box.path(path)) if box.recorded else path
    problem = model_files.path_problem(on_box, kind, user_name=None)
    if problem or user.uid is None or user.uid == os.geteuid():
        return problem
    files = [Path(on_box) / f"{stem}.{ext}" for stem in model_files.IR_FILES.get(kind, ()) for ext in ("xml", "bin")]
    blocked = next((where for file in files if (where := model_files.unreadable_by(file, user.uid, set(user.gids),
                                                                              box.root.absolute() if box.recorded else None))),
                   None)
    return f"{user.name} ({user.source}) cannot read {blocked!r}" if blocked else None


def model_dir_checks(box: Box, config: Config, user: User) -> list[Check]:
    found = []
    for model in config.models:
        dirs = [(model.path, model.kind)] + ([(model.draft_model.path, "llm")] if model.draft_model else [])
        problems = [p for path, kind in dirs if path and (p := _model_dir_problem(box, path, kind, user))]
        name = f"model {model.name}"
        if not model.path:
            found.append(skip(name, "the built-in demo model (built on first start)"))
        elif problems:
            fix = (f"sudo chmod -R o+rX {model.path} (or chgrp -R the service's group)" if "cannot read" in problems[0]
                   else f"fix models[].path of {model.name} in {config.source} (`openarc pull` fetches OpenVINO IR)")
            found.append(fail(name, problems[0], fix))
        else:
            found.append(ok(name, f"{model.path}: OpenVINO IR ({model.kind}), readable by {user.name}"))
    return found


def window_checks(config: Config) -> list[Check]:
    """Each generative model's window and what an explicit max_context costs in KV memory (appliance.config.window);
    a warning where it passes what the KV cache holds for one sequence or what the model was trained for."""
    checks = []
    for model in config.models:
        if model.kind in GENERATIVE_KINDS:
            line, problem = window.report(model)
            checks.append(warn("window", problem, "lower max_context, or leave it unset: the model's own window "
                                                  "fitted to its KV cache") if problem else ok("window", line))
    return checks
