"""Where the real coding agents (Codex, Claude Code, opencode) are installed for the tests: the pinned releases
`make` installs into a cache, never globally, each in its own prefix ($OPENARC_CLIENTS_DIR, default
/opt/openarc/clients: npm/PACKAGE-VERSION/node_modules/.bin/BINARY), or one bin directory named by
$OPENARC_CLIENTS_BIN. A test that needs an agent and finds none skips, naming where it looked."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CLIENTS_DIR = Path(os.environ.get("OPENARC_CLIENTS_DIR") or "/opt/openarc/clients")
CLIENTS_BIN = os.environ.get("OPENARC_CLIENTS_BIN")


def installed(binary: str) -> Path | None:
    """The installed agent's executable (the newest install in the cache), None if there is none."""
    found = [Path(CLIENTS_BIN) / binary] if CLIENTS_BIN else sorted(
        CLIENTS_DIR.glob(f"npm/*/node_modules/.bin/{binary}"), key=lambda p: p.stat().st_mtime)
    found = [path for path in found if os.access(path, os.X_OK)]
    return found[-1] if found else None


def client_path(binary: str) -> Path:
    """The installed agent's executable, or skip saying where it was looked for."""
    path = installed(binary)
    if path is None:
        pytest.skip(f"{binary} is not installed in {CLIENTS_BIN or CLIENTS_DIR} (make install-clients, or set "
                    f"OPENARC_CLIENTS_DIR or OPENARC_CLIENTS_BIN)")
    return path


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for an agent run: a fresh HOME (no user config of the machine leaks in), the clients' bin
    directory on PATH, the agents' own variables that would point them elsewhere removed, nothing fetched beyond
    loopback."""
    drop = ("CODEX_HOME", "CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENCODE_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    bins = os.pathsep.join(str(path.parent) for path in map(installed, ("codex", "claude", "opencode")) if path)
    env.update(HOME=str(home), PATH=f"{bins}{os.pathsep}{env.get('PATH', '')}", **extra)
    # loopback only: opencode's model list from models.dev and its update check would wait on the network
    env.update(OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1")
    return env
