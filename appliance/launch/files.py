"""Writing a launch setup into the user's own files, and taking it out again.

A file that exists is merged, never replaced: launch sets only its keys (FileEdit.values) and keeps the rest,
comments included for TOML (tomlkit). Before it first changes a file it keeps the file as it was (`FILE.openarc-
backup`), and a manifest ($XDG_STATE_HOME/openarc/launch/CLIENT.json) records, per key, what launch wrote and what
was there before. `--restore` puts back what was there (or removes the key) wherever the value is still the one
launch wrote, removes a file launch created once nothing of the user's is in it, and returns a merged file to
its kept copy byte for byte when nothing else changed. A value the user has since changed is left alone, and said.
A file that does not parse is an error naming it: launch never writes over what it cannot read.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import tomlkit
from tomlkit.exceptions import TOMLKitError

from appliance.launch.clients import FileEdit, Setup
from appliance.launch.served import LaunchError

BACKUP_SUFFIX = ".openarc-backup"
ABSENT = {"openarc-launch": "absent"}  # the manifest's mark for "no such key before launch"


def state_dir(environ: dict[str, str], home: Path) -> Path:
    return Path(environ.get("XDG_STATE_HOME") or home / ".local" / "state") / "openarc" / "launch"


# --- documents ----------------------------------------------------------------------------------------------------

def parse(path: Path, fmt: str, text: str) -> Any:
    try:
        if fmt == "toml":
            return tomlkit.parse(text)
        data = json.loads(text) if text.strip() else {}
    except (TOMLKitError, ValueError) as exc:
        raise LaunchError(f"{path}: not valid {fmt.upper()} ({exc}); openarc launch changes nothing it cannot "
                          f"read: fix the file or move it away") from None
    if not isinstance(data, dict):
        raise LaunchError(f"{path}: expected a {fmt.upper()} object at the top; changed nothing")
    return data


def dump(doc: Any, fmt: str) -> str:
    return tomlkit.dumps(doc) if fmt == "toml" else json.dumps(doc, indent=2) + "\n"


def empty(fmt: str) -> Any:
    return tomlkit.document() if fmt == "toml" else {}


def get(doc: Any, keys: tuple[str, ...]) -> Any:
    for key in keys:
        if not isinstance(doc, dict) or key not in doc:
            return ABSENT
        doc = doc[key]
    return _plain(doc)


def put(doc: Any, keys: tuple[str, ...], value: Any, fmt: str) -> None:
    for key in keys[:-1]:
        if key not in doc or not isinstance(doc[key], dict):
            doc[key] = tomlkit.table() if fmt == "toml" else {}
        doc = doc[key]
    doc[keys[-1]] = value


def delete(doc: Any, keys: tuple[str, ...], prune_from: int) -> None:
    """Remove a key, and each table above it, down to depth `prune_from`, that is left empty (the tables launch
    created: a user's own empty table stays)."""
    parents = [doc]
    for key in keys[:-1]:
        parents.append(parents[-1][key])
    del parents[-1][keys[-1]]
    for depth in range(len(keys) - 1, prune_from - 1, -1):
        if depth > 0 and len(parents[depth]) == 0:
            del parents[depth - 1][keys[depth - 1]]


def anchor(doc: Any, keys: tuple[str, ...]) -> list | None:
    """[depth, previous value] of the first table above a key that launch must create (or replace: a value that
    is not a table), None when all are the user's tables."""
    for depth in range(1, len(keys)):
        value = get(doc, keys[:depth])
        if value == ABSENT or not isinstance(value, dict):
            return [depth, value]
    return None


def _plain(value: Any) -> Any:
    """A tomlkit value as plain Python (what the manifest stores and compares)."""
    return value.unwrap() if hasattr(value, "unwrap") else value


def real(path: Path) -> Path:
    """Where a file's bytes live: a user's config linked in from a dotfiles folder is written there, through the
    link (replacing the link itself would cut the user's file off from their dotfiles)."""
    return Path(os.path.realpath(path))


def read_user_file(path: Path, fmt: str) -> tuple[bool, str, Any]:
    """(existed, text, document) of a file launch is about to change; a LaunchError for one it must not: one
    that does not parse, or one the user made read-only."""
    if not path.exists():
        return False, "", empty(fmt)
    text = path.read_text()
    doc = parse(path, fmt, text)
    # the mode bits too: root may write anything, but a file its owner made read-only is meant to stay as it is
    if not os.access(path, os.W_OK) or not real(path).stat().st_mode & 0o222:
        raise LaunchError(f"{path}: read-only; openarc launch changes nothing you made read-only: make it "
                          f"writable or move it away")
    return True, text, doc


def read_manifest(path: Path) -> dict:
    try:
        manifest = json.loads(path.read_text())
        if isinstance(manifest, dict) and isinstance(manifest.get("files"), dict):
            return manifest
        raise ValueError("no files record")
    except ValueError as exc:
        raise LaunchError(f"{path}: not valid JSON for openarc launch's record of what it wrote ({exc}); "
                          f"remove it, and take launch's keys out of the agent's files by hand") from None


def write_atomically(path: Path, text: str) -> None:
    path = real(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    with os.fdopen(fd, "w") as out:
        out.write(text)
    if path.exists():
        shutil.copymode(path, tmp)
    os.replace(tmp, path)


# --- what launch writes -------------------------------------------------------------------------------------------

def render(edit: FileEdit) -> str:
    """The keys an edit sets, as they would read in a new file (printed when the agent is not installed)."""
    doc = empty(edit.format)
    for keys, value in edit.values.items():
        put(doc, keys, value, edit.format)
    return dump(doc, edit.format)


def apply(setup: Setup, manifests: Path) -> list[str]:
    """Merge the setup's files; returns a line per file saying what was done. Every file is read and checked
    before any is written, and the manifest is written before them, so that --restore knows of every change."""
    manifest_path = manifests / f"{setup.client}.json"
    manifest = read_manifest(manifest_path) if manifest_path.exists() else {"files": {}}
    writes = []
    for edit in setup.files:
        existed, text, doc = read_user_file(edit.path, edit.format)
        record = manifest["files"].setdefault(str(edit.path), {"existed": existed, "format": edit.format,
                                                               "backup": None, "keys": {}})
        for keys, value in edit.values.items():
            entry = record["keys"].setdefault(json.dumps(keys), {"previous": get(doc, keys),
                                                                 "anchor": anchor(doc, keys)})
            entry["written"] = value
            put(doc, keys, value, edit.format)
        new = dump(doc, edit.format)
        backup = None
        if existed and record["backup"] is None and new != text:
            backup = edit.path.with_name(edit.path.name + BACKUP_SUFFIX)
            record["backup"] = str(backup)
        writes.append((edit.path, new, existed, backup))
    write_atomically(manifest_path, json.dumps(manifest, indent=2) + "\n")
    lines = []
    for path, new, existed, backup in writes:
        if backup:
            shutil.copy2(path, backup)
        write_atomically(path, new)
        kept = f" (the previous file kept as {backup})" if backup else ""
        lines.append(f"{'merged into' if existed else 'wrote'} {path}{kept}")
    return lines


def restore(client: str, manifests: Path) -> list[str]:
    """Take out what launch wrote for this client; returns a line per file."""
    manifest_path = manifests / f"{client}.json"
    if not manifest_path.exists():
        return [f"nothing to restore: openarc launch {client} has written nothing here ({manifest_path})"]
    manifest = read_manifest(manifest_path)
    # every file read and checked before any is changed: a file that does not parse leaves all of them as they are
    steps = [_restore_step(Path(name), record) for name, record in manifest["files"].items()]
    lines = [step() for step in steps]
    manifest_path.unlink()
    return lines


def _restore_step(path: Path, record: dict) -> Callable[[], str]:
    """What restoring one file does, decided now (the file read and parsed), done when called."""
    fmt = record["format"]
    if not path.exists():
        return lambda: f"{path}: already gone"
    _, _, doc = read_user_file(path, fmt)
    changed_by_user = []
    for key_json, entry in reversed(list(record["keys"].items())):
        keys = tuple(json.loads(key_json))
        if get(doc, keys) != entry["written"]:
            changed_by_user.append(".".join(keys))
            continue
        if entry["previous"] != ABSENT:
            put(doc, keys, entry["previous"], fmt)
            continue
        depth, before = entry["anchor"] or [len(keys), ABSENT]
        delete(doc, keys, depth)
        if before != ABSENT:  # a value that was not a table, where launch needed one
            put(doc, keys[:depth], before, fmt)
    backup = Path(record["backup"]) if record["backup"] else None
    if not record["existed"] and not changed_by_user and len(doc) == 0:
        return lambda: (path.unlink(), f"removed {path}")[1]
    if backup and backup.exists() and _plain(parse(backup, fmt, backup.read_text())) == _plain(doc):
        return lambda: (os.replace(backup, real(path)), f"restored {path} as it was")[1]  # byte for byte
    note = f"; left as you changed them: {', '.join(changed_by_user)}" if changed_by_user else ""
    kept = f"; the copy from before launch stays at {backup}" if backup and backup.exists() else ""
    text = dump(doc, fmt)
    return lambda: (write_atomically(path, text), f"took launch's keys out of {path}{note}{kept}")[1]
