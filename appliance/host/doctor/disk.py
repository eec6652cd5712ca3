"""Room on disk for the models and for OpenVINO's compiled-model cache (a first GPU compile writes it; a full disk
makes every later start compile again)."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.config import Config
from appliance.host.doctor import Check, fail, ok, warn
from appliance.host.doctor.box import Box

MODELS_DIR = "/var/lib/openarc/models"
CACHE_DIR = "/var/cache/openarc"
LOW = 2 << 30  # under this, a model pull or a cache write may not fit: warn
EMPTY = 200 << 20  # under this, a cache write fails: fail


def free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes for an unprivileged writer on the filesystem of `path`, or of its nearest existing parent."""
    while not path.exists() and path != path.parent:
        path = path.parent
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize, path


def checks(box: Box, config: Config | None) -> list[Check]:
    places = {"models": MODELS_DIR, "cache": (config.server.cache_dir if config and config.server.cache_dir
                                              else CACHE_DIR)}
    if config:
        model_dirs = [m.path for m in config.models if m.path]
        if model_dirs:
            places["models"] = os.path.dirname(model_dirs[0].rstrip("/"))
    found = []
    for what, path in places.items():
        free, measured = free_bytes(box.path(path))
        name = f"disk {what}"
        where = f"{_shown(box, measured)}: {free / (1 << 30):.1f} GiB free"
        if measured != box.path(path):  # the check names the directory it measured, never one that is not there
            where += f" ({path} does not exist yet)"
        fix = f"free space on the filesystem of {path} (`df -h {path}`; `du -sh {path}/*`)"
        if free < EMPTY:
            found.append(fail(name, where, fix))
        elif free < LOW:
            found.append(warn(name, where + f" (under {LOW >> 30} GiB)", fix))
        else:
            found.append(ok(name, where))
    return found


def _shown(box: Box, measured: Path) -> str:
    """A measured directory as the machine names it (a recorded root's path without the root)."""
    return "/" + str(measured.relative_to(box.root)).lstrip(".") if box.recorded else str(measured)
