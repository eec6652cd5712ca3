"""Room on disk for the models and for OpenVINO's compiled-model cache (a first GPU compile writes it; a full disk
makes every later start compile again), and the cache itself: its size against server.cache_max_size and the share
of it no load of this box reads (appliance.host.compile_cache)."""

from __future__ import annotations

import os
from pathlib import Path

from appliance.config import Config, ServerConfig
from appliance.sizes import format_size
from appliance.host import compile_cache
from appliance.host.doctor import Check, fail, ok, warn
from appliance.host.doctor.box import Box

MODELS_DIR = "/var/lib/openarc/models"
CACHE_DIR = "/var/cache/openarc"
LOW = 2 << 30  # under this, a model pull or a cache write may not fit: warn
EMPTY = 200 << 20  # under this, a cache write fails: fail


def free_bytes(path: Path) -> tuple[int, Path]:
    """Free bytes for an unprivileged writer on the filesystem of `path`, or of its nearest existing parent."""
    path = compile_cache.nearest_existing(path)
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
    return found + [cache_check(box, config)]


def cache_check(box: Box, config: Config | None) -> Check:
    """The compiled-model cache's size, bound and stale share. Without a config, only blobs of another runtime
    count as stale (which models are configured is not known)."""
    name = "compiled-model cache"
    cache_dir = (config.ov_cache_dir() if config else None) or f"{CACHE_DIR}/ov"
    path = box.path(cache_dir)
    if not path.is_dir():
        return ok(name, f"{cache_dir} does not exist yet (the first load writes it)")
    entries = compile_cache.scan(path)
    runtime = compile_cache.current_runtime(box.root)
    configured = [m.name for m in config.models] if config else [entry.model for entry in entries]
    server = config.server if config else ServerConfig()
    bound = compile_cache.bound_bytes(*server.cache_bound, path)
    total = sum(entry.size for entry in entries)
    stale = compile_cache.stale_bytes(entries, runtime, configured)
    detail = (f"{cache_dir}: {format_size(total)} of its {format_size(bound)} bound (server.cache_max_size: "
              f"{server.cache_max_size}); {format_size(stale)} ({stale / total if total else 0:.0%}) stale: written by "
              f"another OpenVINO or compute runtime, or for a model no longer configured (this runtime: {runtime})")
    if total > bound:
        return warn(name, detail, "the server prunes it to its bound once no load is in progress (restart openarc, "
                    f"or `sudo systemctl reload openarc`); or raise server.cache_max_size")
    return ok(name, detail)


def _shown(box: Box, measured: Path) -> str:
    """A measured directory as the machine names it (a recorded root's path without the root)."""
    return "/" + str(measured.relative_to(box.root)).lstrip(".") if box.recorded else str(measured)
