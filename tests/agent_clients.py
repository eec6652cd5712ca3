"""Where the real coding agents (Codex, Claude Code, opencode) are installed for the tests: the pinned releases
`make` installs into a cache, never globally. $OPENARC_CLIENTS_BIN names their bin directory (default
.cache/clients/node_modules/.bin in the checkout). A test that needs one and finds none skips, naming the path."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from conftest import REPO

CLIENTS_BIN = Path(os.environ.get("OPENARC_CLIENTS_BIN") or REPO / ".cache" / "clients" / "node_modules" / ".bin")


def client_path(binary: str) -> Path:
    """The installed agent's executable, or skip saying where it was looked for."""
    path = CLIENTS_BIN / binary
    if not os.access(path, os.X_OK):
        pytest.skip(f"{binary} is not installed in {CLIENTS_BIN} (set OPENARC_CLIENTS_BIN, or install the pinned "
                    f"clients)")
    return path


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for an agent run: a fresh HOME (no user config of the machine leaks in), the clients' bin
    directory on PATH, the agents' own variables that would point them elsewhere removed, nothing fetched beyond
    loopback."""
    drop = ("CODEX_HOME", "CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENCODE_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(HOME=str(home), PATH=f"{CLIENTS_BIN}{os.pathsep}{env.get('PATH', '')}", **extra)
    # loopback only: opencode's model list from models.dev and its update check would wait on the network
    env.update(OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1")
    return env
