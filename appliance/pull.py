"""`openarc pull REPO_ID`: download an OpenVINO model repository from the Hugging Face hub (or a mirror), check
what arrived, and print its config entry or add it to the config.

The download is huggingface_hub's snapshot_download (the maintained client: resumable downloads, HF_TOKEN for
gated and private repositories, HF_ENDPOINT for mirrors, HF_HUB_OFFLINE), pinned to the commit the hub named
first so every file comes from the same revision. The repository's file list is judged before any weights are
fetched (appliance.model_files): a PyTorch or GGUF repository is refused with the command that converts it.
"""

from __future__ import annotations

import errno
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from appliance import model_files
from appliance.config import ConfigError, parse_config
from appliance.config.rules import MODEL_NAME
from appliance.config.devices import available_devices

MODELS_DIR = Path("/var/lib/openarc/models")


class PullError(Exception):
    """Why a pull cannot go on: str() is the one line the user sees."""


@dataclass
class Pulled:
    name: str
    path: Path
    kind: str
    device: str

    def entry(self) -> dict[str, Any]:
        """The model's config entry: the keys a first config needs (everything else has its default)."""
        return {"name": self.name, "path": str(self.path), "kind": self.kind, "device": self.device}


def default_name(repo_id: str) -> str:
    """The model's name in the config and its directory's: the repository's name, lower case."""
    return repo_id.rsplit("/", 1)[-1].lower()


def say(text: str) -> None:
    print(f"openarc pull: {text}", file=sys.stderr, flush=True)


# --- the hub --------------------------------------------------------------------------------------------

def hub_error(exc: Exception, repo_id: str, revision: str) -> PullError:
    """huggingface_hub's exceptions as one line that says what to do."""
    from huggingface_hub import constants, errors
    endpoint = constants.ENDPOINT
    if isinstance(exc, errors.GatedRepoError):
        return PullError(f"{repo_id} is gated: accept its terms on {endpoint}/{repo_id} and set HF_TOKEN")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return PullError(f"no repository {repo_id} on {endpoint} (a private one needs HF_TOKEN)")
    if isinstance(exc, errors.RevisionNotFoundError):
        return PullError(f"{repo_id} has no revision {revision!r}")
    if isinstance(exc, errors.OfflineModeIsEnabled):
        return PullError(f"cannot download {repo_id}: HF_HUB_OFFLINE is set")
    if isinstance(exc, errors.HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return PullError(f"{endpoint} answered {status} for {repo_id}")
    if isinstance(exc, OSError) and exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
        # the disk's fault, not the network's: a full disk or a directory this user may not write
        return PullError(f"cannot write {exc.filename or 'the model directory'}: {exc.strerror}; run the same pull "
                         "again to resume once that is fixed")
    reason = " ".join(str(exc).split()) or type(exc).__name__
    return PullError(f"cannot reach the hub at {endpoint} ({reason}); check the network, or HF_ENDPOINT for a mirror")


def hub_call(call, repo_id: str, revision: str):
    """Run one huggingface_hub call; whatever the network or the hub does becomes a PullError."""
    from huggingface_hub import errors
    try:
        return call()
    except (errors.HfHubHTTPError, errors.OfflineModeIsEnabled, OSError) as exc:
        raise hub_error(exc, repo_id, revision) from None
    except Exception as exc:  # httpx's connection and timeout errors are not OSErrors
        if type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "huggingface_hub"):
            raise hub_error(exc, repo_id, revision) from None
        raise


def repo_listing(repo_id: str, revision: str) -> tuple[str, dict[str, int | None], dict[str, Any] | None]:
    """The commit `revision` is at, the repository's files with their sizes, and its config.json (None if none)."""
    from huggingface_hub import HfApi, hf_hub_download
    info = hub_call(lambda: HfApi().model_info(repo_id, revision=revision, files_metadata=True), repo_id, revision)
    files = {s.rfilename: s.size for s in info.siblings or ()}
    config = None
    if "config.json" in files:  # small, and tells what the model is before its weights are fetched
        path = hub_call(lambda: hf_hub_download(repo_id, "config.json", revision=info.sha), repo_id, revision)
        config = model_files.read_json(Path(path))
    return info.sha, files, config


def line_progress():
    """Progress as plain lines for a log or a pipe (a terminal gets huggingface_hub's own bars): a line per file
    fetched. A tqdm subclass, so snapshot_download drives it as it drives its bars; it draws nothing itself."""
    from tqdm.std import tqdm

    class FileLines(tqdm):
        def __init__(self, *args, **kwargs):
            kwargs.pop("name", None)
            self.counts_files = str(kwargs.get("desc", "")).startswith("Fetching")  # not the bytes bars
            super().__init__(*args, **{**kwargs, "file": io.StringIO()})

        def update(self, n=1):
            shown = super().update(n)
            if self.counts_files:
                say(f"{self.n}/{self.total} files")
            return shown

    return FileLines


def download(repo_id: str, commit: str, dest: Path) -> None:
    from huggingface_hub import snapshot_download
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PullError(f"cannot create {dest}: {exc.strerror or exc} (run as root, or choose another --dir)") from None
    progress = None if sys.stderr.isatty() else line_progress()
    hub_call(lambda: snapshot_download(repo_id, revision=commit, local_dir=dest, tqdm_class=progress), repo_id, commit)


# --- what arrived ------------------------------------------------------------------------------------------

def size_text(size: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable: the GB pass returns")


def refusal(repo_id: str, found: model_files.Detected, dest: Path) -> PullError:
    """Why a repository is not pulled, with the command that would make it servable."""
    if found.format == "gguf":
        command = model_files.export_command("<the original repository>", "llm", str(dest))
        return PullError(f"{repo_id} is {found.reason}, which OpenVINO does not serve; convert the original model it "
                         f"was made from (its model card names it): {command}")
    if found.format in ("pytorch", "unknown") and found.kind:
        return PullError(f"{repo_id} is not an OpenVINO model ({found.reason}); convert it with: "
                         f"{model_files.export_command(repo_id, found.kind, str(dest))}")
    return PullError(f"{repo_id} is not a model openarc can serve ({found.reason})")


def choose_device() -> str:
    """GPU when OpenVINO sees one here, else CPU: the entry works on this machine as printed."""
    try:
        return "GPU" if any(d.startswith("GPU") for d in available_devices()) else "CPU"
    except ConfigError:
        return "GPU"


# --- the config -------------------------------------------------------------------------------------------

def entry_text(entry: dict[str, Any], indent: str) -> str:
    dumped = yaml.safe_dump([entry], sort_keys=False, default_flow_style=False, allow_unicode=True)
    return "".join(indent + line for line in dumped.splitlines(keepends=True))


def appended_text(text: str, data: Any, entry: dict[str, Any]) -> str | None:
    """The config text with the entry added at the end of its `models:` list, comments and all; None when the list
    is not the file's last block in block style (then only a rewrite can add it)."""
    expected = dict(data or {})
    expected["models"] = list(expected.get("models") or []) + [entry]
    body = text if not text or text.endswith("\n") else text + "\n"
    if not data or "models" not in data:
        candidate = body + "models:\n" + entry_text(entry, "  ")
    else:
        after = re.search(r"^models:[ \t]*(#.*)?\n((?:.*\n)*)", body, re.MULTILINE)
        items = re.search(r"^([ \t]*)- ", after.group(2), re.MULTILINE) if after else None
        if not after or (data["models"] and not items):
            return None
        candidate = body + entry_text(entry, items.group(1) if items else "  ")
    try:
        return candidate if yaml.safe_load(candidate) == expected else None
    except yaml.YAMLError:
        return None


def write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text` in one rename: a reader (a reload) sees the old file or the new, never half."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if path.exists():  # keep the file's mode and owner (the service reads it)
            st = path.stat()
            os.chmod(tmp, st.st_mode & 0o7777)
            if os.geteuid() == 0:
                os.chown(tmp, st.st_uid, st.st_gid)
        else:
            os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def add_to_config(path: Path, entry: dict[str, Any]) -> str:
    """Add the entry to the config at `path` (created if missing), validated first; returns what was done."""
    text, data, new_data = planned_config(path, entry)
    new_text = appended_text(text, data, entry)
    how = "appended; its comments are kept"
    if new_text is None:
        # pyyaml keeps no comments: write the whole file anew, and keep the old one beside it.
        new_text = yaml.safe_dump(new_data, sort_keys=False, default_flow_style=False, allow_unicode=True)
        write_atomically(path.with_name(path.name + ".bak"), text)
        how = (f"rewritten, since its models list is not the file's last block in block style; pyyaml keeps no "
               f"comments, so the previous file is {path}.bak")
    try:
        write_atomically(path, new_text)
    except OSError as exc:
        raise PullError(f"cannot write {path}: {exc.strerror or exc}") from None
    return how


def planned_config(path: Path, entry: dict[str, Any]) -> tuple[str, Any, dict[str, Any]]:
    """The config at `path` as text and data, and its data with the entry added, validated: a PullError says why
    the entry cannot be added (checked before a download too, so a refusal costs no gigabytes)."""
    try:
        text = path.read_text() if path.exists() else ""
        data = yaml.safe_load(text) if text else None
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PullError(f"cannot read {path} to add the model: {exc}") from None
    if data is not None and not isinstance(data, dict):
        raise PullError(f"{path}: top level: expected a mapping with 'server' and 'models'; not changed")
    models = (data or {}).get("models") or []
    if any(isinstance(m, dict) and m.get("name") == entry["name"] for m in models if isinstance(models, list)):
        raise PullError(f"{path} already has a model named {entry['name']!r}; choose another with --name")
    new_data = dict(data or {})
    new_data["models"] = list(models) + [entry] if isinstance(models, list) else models
    try:
        parse_config(new_data, str(path))
    except ConfigError as exc:
        raise PullError(f"{path} would not be valid with the new model, so it is not changed: "
                        + "; ".join(line.split(": ", 1)[-1] for line in exc.lines)) from None
    return text, data, new_data


# --- the command -----------------------------------------------------------------------------------------

def check_repo_id(repo_id: str) -> None:
    """A repository id the hub could name (namespace/name), checked before any request: a malformed one is the
    user's typo, not a network that is down."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise PullError(f"{repo_id!r} is not a repository id such as OpenVINO/Qwen2.5-7B-Instruct-int4-ov: "
                        f"{str(exc).split(': ')[0]}") from None


def pull(repo_id: str, revision: str, dest: Path | None, name: str | None, add: Path | None) -> int:
    check_repo_id(repo_id)
    name = name or default_name(repo_id)
    if not MODEL_NAME.fullmatch(name):
        raise PullError(f"{name!r} cannot name a model (letters, digits, '.', '_' or '-', at most 64): pass --name")
    dest = (dest or MODELS_DIR / name).absolute()
    commit, files, config = repo_listing(repo_id, revision)
    found = model_files.detect(files, config)
    if not found.is_openvino or found.kind is None:
        raise refusal(repo_id, found, dest)
    pulled = Pulled(name, dest, found.kind, choose_device())
    if add is not None:
        planned_config(add, pulled.entry())  # a name the config has, or a config it would break: before the download
    total = sum(size or 0 for size in files.values())
    say(f"{repo_id}@{commit[:12]}: an OpenVINO {found.kind} model, {len(files)} files, {size_text(total)}, into {dest}")
    download(repo_id, commit, dest)
    arrived = model_files.detect(*model_files.read_dir(dest))
    if arrived.kind != found.kind:
        raise PullError(f"{dest} is not a complete {found.kind} model after the download ({arrived.reason}); "
                        "run the same pull again to resume")
    if add is None:
        print(f"# the model's entry under `models:` in your config (or run again with --add CONFIG):\n"
              f"{entry_text(pulled.entry(), '  ')}", end="")
        return 0
    how = add_to_config(add, pulled.entry())
    say(f"added model {name!r} to {add} ({how}); check it with: openarc check-config {add}")
    return 0
