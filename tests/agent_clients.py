"""The real coding agents (Codex, Claude Code, opencode) for the launch tests: the pinned releases of
bench.clients.catalog, from the cache `make install-clients` fills ($OPENARC_CLIENTS_DIR, default
/opt/openarc/clients), installed there from the npm registry if missing, never globally: the same installs
tests/test_real_clients.py runs."""

from __future__ import annotations

import os
from pathlib import Path

from bench.clients.catalog import CORE
from bench.clients.install import install

BINARIES = {client.package.executable: client.package for client in CORE.values()}


def client_path(binary: str) -> Path:
    """The pinned agent's executable (`claude`, `codex`, `opencode`), installed into the cache if it is not there."""
    return install(BINARIES[binary]).executable


def agent_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for an agent run: a fresh HOME (no user config of the machine leaks in), the clients' bin
    directory on PATH, the agents' own variables that would point them elsewhere removed, nothing fetched beyond
    loopback."""
    drop = ("CODEX_HOME", "CLAUDE_CONFIG_DIR", "XDG_CONFIG_HOME", "XDG_STATE_HOME", "OPENAI_API_KEY",
            "ANTHROPIC_API_KEY", "ANTHROPIC_BASE_URL", "OPENCODE_CONFIG")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    bins = os.pathsep.join(str(client_path(binary).parent) for binary in BINARIES)
    env.update(HOME=str(home), PATH=f"{bins}{os.pathsep}{env.get('PATH', '')}", **extra)
    # loopback only: opencode's model list from models.dev and its update check would wait on the network
    env.update(OPENCODE_DISABLE_MODELS_FETCH="1", OPENCODE_DISABLE_AUTOUPDATE="1")
    return env
