"""Client releases installed into a cache directory, each in its own prefix, never globally.

npm packages go to `<cache>/npm/<name>-<version>` (`npm install --prefix`), Python packages to a venv of their own
at `<cache>/pypi/<name>-<version>`. A finished install leaves a marker, so a second call is a lookup; a failed
one leaves nothing that looks finished, and its error says what the package manager said (a client whose
install needs more than the registry, say a download from GitHub, fails here and is reported as not run).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from bench.clients.catalog import Package

DEFAULT_CACHE = Path(os.environ.get("OPENARC_CLIENTS_DIR", "/opt/openarc/clients"))
MARKER = ".openarc-installed"
INSTALL_TIMEOUT_S = 900


class InstallError(RuntimeError):
    """The package manager failed: the message is its last words."""


@dataclass(frozen=True)
class Installed:
    package: Package
    version: str
    executable: Path


def prefix_of(package: Package, version: str, cache: Path) -> Path:
    safe = package.name.replace("@", "").replace("/", "+")
    return cache / package.registry / f"{safe}-{version}"


def executable_in(package: Package, prefix: Path) -> Path:
    if package.executable == "node":  # a library: the machine's node, linked into the prefix its driver runs from
        return prefix / "node"
    if package.registry == "npm":
        return prefix / "node_modules" / ".bin" / package.executable
    return prefix / "bin" / package.executable


def install(package: Package, cache: Path = DEFAULT_CACHE, version: str | None = None) -> Installed:
    """`package` at `version` (default: its pinned release) in the cache, installed unless it is there already."""
    version = version or package.pinned
    prefix = prefix_of(package, version, cache)
    if not (prefix / MARKER).exists():
        shutil.rmtree(prefix, ignore_errors=True)
        prefix.mkdir(parents=True)
        try:
            (_install_npm if package.registry == "npm" else _install_pypi)(package, version, prefix)
        except InstallError:
            shutil.rmtree(prefix, ignore_errors=True)
            raise
        (prefix / MARKER).write_text(version + "\n")
    executable = executable_in(package, prefix)
    if not executable.exists():
        raise InstallError(f"{package.name}@{version} installed but has no executable {executable.name}")
    return Installed(package, version, executable)


def _run(argv: list[str], cwd: Path) -> str:
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S,
                              env={**os.environ, "npm_config_update_notifier": "false", "npm_config_fund": "false",
                                   "npm_config_audit": "false", "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    except subprocess.TimeoutExpired:
        raise InstallError(f"`{' '.join(argv[:3])} ...` took over {INSTALL_TIMEOUT_S} s") from None
    if done.returncode != 0:
        raise InstallError(f"{' '.join(argv[:2])} exited {done.returncode}: {reason(done.stderr or done.stdout)}")
    return done.stdout


# What a failed install's output says when the cause is outside the package itself: a missing release or platform
# package, or a download from a host other than the registry (refused here: no network but the registries).
CAUSES = ("no matching version", "notarget", "404", "enotfound", "econnrefused", "eai_again", "etimedout",
          "no matching distribution", "could not find a version", "failed to download", "requires node")


def reason(output: str) -> str:
    """The line of a package manager's failure that says why: one naming a known cause, else the first naming an
    error (never its log file's name)."""
    lines = [line.strip() for line in output.splitlines() if line.strip() and "complete log" not in line.lower()]
    causes = [line for line in lines if any(cause in line.lower() for cause in CAUSES)]
    errors = [line for line in lines if "error" in line.lower()]
    return (causes or errors or lines or ["no output"])[0][:300]


def _install_npm(package: Package, version: str, prefix: Path) -> None:
    # A package.json of its own, so npm installs here and not into a project above the cache.
    (prefix / "package.json").write_text(json.dumps({"private": True}) + "\n")
    _run(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
          f"{package.name}@{version}", *package.companions], prefix)
    if package.executable == "node":
        (prefix / "node").symlink_to(shutil.which("node"))


def _install_pypi(package: Package, version: str, prefix: Path) -> None:
    _run([sys.executable, "-m", "venv", str(prefix)], prefix)
    _run([str(prefix / "bin" / "python"), "-m", "pip", "install", "-q", f"{package.name}=={version}",
          *(spec.replace("@", "==") for spec in package.companions)], prefix)


def latest_version(package: Package) -> str:
    """The newest release the registry offers."""
    if package.registry == "npm":
        return json.loads(_run(["npm", "view", "--json", package.name, "version"], Path.cwd()))
    out = _run([sys.executable, "-m", "pip", "index", "versions", package.name], Path.cwd())
    return out.split("(", 1)[1].split(")", 1)[0]  # "name (1.2.3)"


def release_date(package: Package, version: str) -> str:
    """The day `version` was published (YYYY-MM-DD), or "" where the registry does not say."""
    try:
        if package.registry == "npm":
            times = json.loads(_run(["npm", "view", "--json", package.name, "time"], Path.cwd()))
            return str(times.get(version, ""))[:10]
        # the index's JSON form (PEP 691), whose files carry their upload time (PEP 700)
        request = urllib.request.Request(f"https://pypi.org/simple/{package.name}/",
                                         headers={"Accept": "application/vnd.pypi.simple.v1+json"})
        with urllib.request.urlopen(request, timeout=30) as answer:
            files = json.load(answer).get("files") or []
        times = [f.get("upload-time") or "" for f in files if f"-{version}." in f.get("filename", "").replace("_", "-")
                 or f"-{version}-" in f.get("filename", "")]
        return min(times, default="")[:10]
    except (InstallError, OSError, ValueError):
        return ""
