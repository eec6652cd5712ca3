"""The real clients: which package each is, which release is pinned, and how it is run headless against a server.

Every client runs unmodified, as a user would set it up from docs/coding-agents.md: its own configuration
(written into a private home directory for the run), its own command line, one prompt, no terminal. What a run
needs from outside is the package registries (at install time, bench.clients.install) and the server on loopback:
telemetry, update checks and model catalogs are switched off with each client's own settings, and every run's
environment points HTTP(S)_PROXY at a closed loopback port so that anything else a client tries fails at once
instead of reaching the network (loopback is exempt through NO_PROXY).

`tool` names the tool of a client's tool round trip: the recording proxy answers the first turn with one call to
it (arguments from the path of a file the run's work directory holds), the client runs it and sends the result.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.clients.server import CODEX_CATALOG_NAME, DEMO, DEMO_32K

# A closed port on loopback: a client that ignores its settings and reaches for the network is refused at once.
DEAD_PROXY = "http://127.0.0.1:9"
API_KEY = "unused"  # the test servers need none; clients insist on having one


@dataclass(frozen=True)
class Package:
    """A client's package: registry ("npm" or "pypi"), name, the release the suite pins, and the executable."""

    registry: str
    name: str
    pinned: str
    executable: str


@dataclass(frozen=True)
class Turn:
    """One headless run: the prompt, and the model name the client is configured with (None: its own default,
    as Claude Code without --model)."""

    prompt: str
    model: str | None


@dataclass(frozen=True)
class Invocation:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class ToolProbe:
    """The tool a round trip calls: its name as the client offers it, and the arguments that read `path`."""

    name: str
    arguments: Callable[[Path], dict]


@dataclass(frozen=True)
class Client:
    name: str
    package: Package
    dialect: str                                  # the API it speaks: "messages", "responses" or "chat"
    invoke: Callable[[Path, str, Turn, Path], Invocation]  # (executable, proxy base URL, turn, home) -> command
    tool: ToolProbe
    model: str | None = DEMO                      # the model it is configured with (None: its own default)
    also_as: str | None = None                    # another name it is run under once more
    note: str = ""                                # how its install was checked, or why it cannot run here


def base_env(home: Path) -> dict[str, str]:
    """What every client run starts from: a private home (and XDG dirs in it), PATH with node, no network."""
    return {"HOME": str(home), "PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "TERM": "dumb",
            "NO_COLOR": "1", "CI": "1",
            "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
            "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state"),
            "HTTP_PROXY": DEAD_PROXY, "HTTPS_PROXY": DEAD_PROXY, "ALL_PROXY": DEAD_PROXY,
            "http_proxy": DEAD_PROXY, "https_proxy": DEAD_PROXY, "all_proxy": DEAD_PROXY,
            "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}


# --- Claude Code: Messages at ANTHROPIC_BASE_URL, its default model unless --model ------------------------------

def claude_code(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    env = {**base_env(home), "ANTHROPIC_BASE_URL": base, "ANTHROPIC_AUTH_TOKEN": API_KEY,
           "CLAUDE_CONFIG_DIR": str(home / ".claude"),
           # docs/coding-agents.md's setting, and the switches it stands for, each by its own name
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_UPDATES": "1",
           "DISABLE_TELEMETRY": "1", "DISABLE_ERROR_REPORTING": "1", "DISABLE_GROWTHBOOK": "1",
           "CLAUDE_CODE_DISABLE_FEEDBACK_SURVEY": "1"}
    model = ["--model", turn.model] if turn.model else []
    return Invocation([str(executable), "-p", turn.prompt, *model], env)


# --- Codex CLI: Responses through a provider of ~/.codex/config.toml -------------------------------------------

def codex(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    codex_home = home / ".codex"
    codex_home.mkdir(parents=True, exist_ok=True)
    (codex_home / "config.toml").write_text("\n".join([
        f"model = {json.dumps(turn.model)}",
        'model_provider = "openarc"',
        "check_for_update_on_startup = false",
        "[model_providers.openarc]",
        'name = "openarc"',
        f"base_url = {json.dumps(base + '/v1')}",
        'wire_api = "responses"',
        'env_key = "OPENARC_API_KEY"',
        "[analytics]",
        "enabled = false",
        "[feedback]",
        "enabled = false",
        ""]))
    env = {**base_env(home), "CODEX_HOME": str(codex_home), "OPENARC_API_KEY": API_KEY}
    return Invocation([str(executable), "exec", "--skip-git-repo-check", "--color", "never", turn.prompt], env)


# --- opencode: an @ai-sdk/openai-compatible provider (chat completions) -----------------------------------------

def opencode(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    config = {"$schema": "https://opencode.ai/config.json", "autoupdate": False, "share": "disabled",
              "model": f"openarc/{turn.model}",
              "provider": {"openarc": {"npm": "@ai-sdk/openai-compatible", "name": "openarc",
                                       "options": {"baseURL": base + "/v1", "apiKey": API_KEY},
                                       "models": {turn.model: {"name": turn.model}}}}}
    env = {**base_env(home), "OPENCODE_CONFIG_CONTENT": json.dumps(config), "OPENCODE_DISABLE_AUTOUPDATE": "1",
           "OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_SHARE": "1",
           "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
    return Invocation([str(executable), "run", turn.prompt], env)


CORE = {
    "claude-code": Client(
        "claude-code", Package("npm", "@anthropic-ai/claude-code", "2.1.332", "claude"), "messages", claude_code,
        ToolProbe("Read", lambda path: {"file_path": str(path)}), model=None,
        note="postinstall copies the native binary from its optional dependency (npm registry only)"),
    "codex": Client(
        "codex", Package("npm", "@openai/codex", "0.171.0", "codex"), "responses", codex,
        ToolProbe("exec_command", lambda path: {"cmd": f"cat {shlex.quote(path.name)}"}), also_as=CODEX_CATALOG_NAME,
        note="native binary in an optional dependency; no install script"),
    "opencode": Client(
        "opencode", Package("npm", "opencode-ai", "1.18.33", "opencode"), "chat", opencode,
        ToolProbe("read", lambda path: {"filePath": str(path)}), model=DEMO_32K,
        note="postinstall copies the native binary from its optional dependency (falls back to `npm install`)"),
}

ALL = {**CORE}
