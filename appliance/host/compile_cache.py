"""OpenVINO's compiled-model cache (CACHE_DIR), bounded.

A GPU load that finds its blob skips the compile (about 7x faster), but OpenVINO never deletes a blob: the cache grows
with every model ever served and every runtime ever installed. openarc lays it out so that what a blob is for can be
told from where it lies:

    <cache_dir>/openvino-<version>_runtime-<compute runtime>/<model name>/   (OpenVINO's blobs and kernel caches)

A worker puts its model's CACHE_DIR there (`place`), and touches LAST_USED after each load. A blob under another
runtime directory was written by another OpenVINO or compute runtime and is never read by this one (kept while there
is room: a rollback to that version finds it warm); one under a model no longer configured is dead until it is
configured again. Files of the old flat layout (blobs straight under the cache directory) count as stale.

`plan` is the policy, a pure function: nothing while the cache is within its bound; beyond it, stale entries go
first, then live ones, each least recently used first, never a model loaded now. `prune` carries it out (the front's
appliance.front.cache_keeper is its one caller in the server).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from appliance.host.doctor import build_info, runtime as compute_runtime
from appliance.host.doctor.box import Box

LAST_USED = ".last-used"  # touched by each load of the model: its mtime is when the entry was last used
RUNTIME_DIR = re.compile(r"openvino-[^/]+_runtime-[^/]+")
LEGACY_SUFFIXES = (".blob", ".cl_cache")  # files of the flat layout openarc used before (CACHE_DIR itself)
UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
MAX_VERSION_CHARS = 100  # two of them and the words around stay within a file name's 255 bytes


@dataclass(frozen=True)
class Entry:
    """One model's blobs under one runtime (or one file of the flat layout: runtime and model "")."""

    path: Path
    runtime: str
    model: str
    size: int
    last_used: float

    def stale(self, runtime: str, configured: Iterable[str]) -> bool:
        """Written by another runtime, or for a model no longer configured: no load of this server reads it."""
        return self.runtime != runtime or self.model not in dir_names(configured)


def runtime_name(openvino: str, compute_runtime: str) -> str:
    """The directory of the blobs one OpenVINO and compute runtime write (their versions, made path-safe): a name
    scan() knows as a runtime's for any versions the readers give (empty, odd characters, or longer than a file
    name may be: cut, with a digest of the whole so two versions still get two directories)."""
    return f"openvino-{_path_safe(openvino)}_runtime-{_path_safe(compute_runtime)}"


def _path_safe(version: str, limit: int = MAX_VERSION_CHARS) -> str:
    safe = UNSAFE.sub("_", version) or build_info.UNKNOWN
    if len(safe) <= limit:
        return safe
    return f"{safe[:limit - 17]}-{hashlib.sha256(version.encode('utf-8', 'surrogatepass')).hexdigest()[:16]}"


def current_runtime(root: str | Path = "/") -> str:
    """This box's runtime directory name, from the readers build info uses (so the two agree)."""
    installed = compute_runtime.installed_version(Box(root).packages()) or build_info.NONE
    return runtime_name(build_info.package_version("openvino"), installed)


def dir_names(models: Iterable[str]) -> set[str]:
    """Models' names as their cache directories are named (an Entry's `model`)."""
    return {UNSAFE.sub("_", model) for model in models}


def model_dir(cache_dir: str | Path, runtime: str, model: str) -> Path:
    (name,) = dir_names([model])
    return Path(cache_dir) / runtime / name


def place(spec: dict, runtime: str) -> Path | None:
    """Point the CACHE_DIR of a worker's spec (and its draft model's) at the model's own directory under this
    runtime, made; None when the spec sets no cache."""
    base = spec.get("properties", {}).get("CACHE_DIR")
    if not base:
        return None
    directory = model_dir(base, runtime, spec["name"])
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:  # the cache is a speed-up: a load goes on without its bookkeeping (OpenVINO says what it can)
        return None
    spec["properties"]["CACHE_DIR"] = str(directory)
    draft = spec.get("draft_model") or {}
    if draft.get("properties", {}).get("CACHE_DIR"):
        draft["properties"]["CACHE_DIR"] = str(directory)
    return directory


# --- a load: from the cache, or compiled ------------------------------------------------------------------------------

def snapshot(directory: Path | None) -> dict[str, tuple[int, int]]:
    """Every file under `directory` (but LAST_USED) with its size and mtime: what a load may add to or rewrite.
    The pruner (the front's thread) may delete any of it meanwhile: what is gone is left out, never an error."""
    if directory is None:
        return {}
    found = {}
    for path in _walk(directory):
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.name != LAST_USED and stat.S_ISREG(st.st_mode):
            found[str(path)] = (st.st_size, st.st_mtime_ns)
    return found


def load_source(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]]) -> str:
    """"cache" when the load found blobs and wrote none, else "compiled" (it wrote a blob, or there is no cache)."""
    return "cache" if before and after == before else "compiled"


def mark_used(directory: Path | None) -> None:
    """Touch the entry's LAST_USED; an entry pruned under the load is made again (its blobs are gone, the next load
    compiles), and a cache that cannot be written costs a load nothing."""
    if directory is not None:
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            (directory / LAST_USED).touch()


# --- what the cache holds ------------------------------------------------------------------------------------------

def _size_and_newest(path: Path) -> tuple[int, float]:
    """The bytes of the regular files at or under `path` and the newest mtime, never following a link: a link's
    target is not the cache's (it may be a user's directory), so it is neither counted nor pruned."""
    size, newest = 0, 0.0
    for item in _walk(path):
        try:
            st = item.lstat()
        except OSError:  # deleted under us
            continue
        if stat.S_ISREG(st.st_mode):
            size += st.st_size
        newest = max(newest, st.st_mtime)
    return size, newest


def _walk(path: Path) -> Iterable[Path]:
    """Everything under a real directory `path` (a file: itself); links are yielded, not followed."""
    if path.is_symlink() or not path.is_dir():
        yield path
        return
    for root, dirs, files in os.walk(path, followlinks=False):
        yield from (Path(root) / name for name in dirs + files)


def _own(path: Path) -> bool:
    """Whether `path` is the cache's own: a real file or directory, not a link to somewhere else."""
    return not path.is_symlink()


def scan(cache_dir: str | Path) -> list[Entry]:
    """The cache's entries; anything else in the directory (a demo model, a user's file, a link to anywhere) is not
    the cache's and is left out, so never pruned."""
    base = Path(cache_dir)
    entries = []
    for child in sorted(base.iterdir()) if base.is_dir() else []:
        if not _own(child):
            continue
        if child.is_dir() and RUNTIME_DIR.fullmatch(child.name):
            for model in sorted(child.iterdir()):
                if _own(model) and model.is_dir():
                    size, newest = _size_and_newest(model)
                    marker = model / LAST_USED
                    used = marker.stat().st_mtime if marker.exists() else newest
                    entries.append(Entry(model, child.name, model.name, size, used))
        elif child.is_file() and child.name.endswith(LEGACY_SUFFIXES):
            size, newest = _size_and_newest(child)
            entries.append(Entry(child, "", "", size, newest))
    return entries


def stale_bytes(entries: list[Entry], runtime: str, configured: Iterable[str]) -> int:
    configured = dir_names(configured)
    return sum(entry.size for entry in entries if entry.stale(runtime, configured))


# --- the policy ----------------------------------------------------------------------------------------------------

def plan(entries: list[Entry], bound: int, runtime: str, configured: Iterable[str],
         loaded: Iterable[str] = ()) -> list[Entry]:
    """The entries to delete so the cache fits `bound` bytes: none while it fits; else stale entries before live
    ones, each least recently used first, stopping as soon as it fits. A live entry of a model `loaded` now is never
    chosen (its next load would compile again at once): the cache may stay over its bound by those alone."""
    configured, loaded = dir_names(configured), dir_names(loaded)
    total = sum(entry.size for entry in entries)
    candidates = sorted((entry for entry in entries
                         if entry.stale(runtime, configured) or entry.model not in loaded),
                        key=lambda entry: (not entry.stale(runtime, configured), entry.last_used, str(entry.path)))
    chosen = []
    for entry in candidates:
        if total <= bound:
            break
        chosen.append(entry)
        total -= entry.size
    return chosen


def prune(cache_dir: str | Path, bound: int, runtime: str, configured: Iterable[str],
          loaded: Iterable[str] = ()) -> list[Entry]:
    """Carry out the plan on the cache directory; the entries deleted."""
    chosen = plan(scan(cache_dir), bound, runtime, configured, loaded)
    for entry in chosen:
        if not _own(entry.path):  # became a link since the scan: what it points at is not the cache's
            continue
        if entry.path.is_dir():  # rmtree unlinks the links inside, never what they point at
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            entry.path.unlink(missing_ok=True)
    for runtime_dir in {entry.path.parent for entry in chosen if entry.runtime}:
        try:
            runtime_dir.rmdir()  # the last model of an old runtime gone: its directory too
        except OSError:
            pass
    return chosen


# --- the bound -----------------------------------------------------------------------------------------------------

def nearest_existing(path: str | Path) -> Path:
    """`path`, or its nearest parent that exists (a directory the first load has not made yet lies on its disk)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def disk_bytes(path: str | Path) -> int:
    """The size of the filesystem `path` (or its nearest existing parent) lies on."""
    st = os.statvfs(nearest_existing(path))
    return st.f_blocks * st.f_frsize


def bound_bytes(share: float | None, size: int | None, cache_dir: str | Path) -> int:
    """server.cache_max_size in bytes: a size as given, or a share of the cache directory's disk."""
    return size if size is not None else int((share or 0) * disk_bytes(cache_dir))
