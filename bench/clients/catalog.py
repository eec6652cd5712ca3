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
from functools import partial
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
    executable: str             # its command; "node" or "python" for a library run by bench/clients/drivers/
    companions: tuple[str, ...] = ()  # installed beside it, pinned ("name@version"), as a library's users do


@dataclass(frozen=True)
class Turn:
    """One headless run: the prompt, and the model name the client is configured with (None: its own default,
    as Claude Code without --model)."""

    prompt: str
    model: str | None
    tool: bool = False  # a tool round trip: a client whose tools are given per run (llm) gets its reader


@dataclass(frozen=True)
class Invocation:
    argv: list[str]
    env: dict[str, str]


@dataclass(frozen=True)
class ToolProbe:
    """The tool a round trip calls: its name as the client offers it, and the arguments that read `path`, given
    the tool's parameter schema as offered (`reads` and `runs` fill the parameter each release names)."""

    name: str
    arguments: Callable[[Path, dict], dict]


def _parameter(schema: dict, hints: tuple[str, ...], default: str) -> str:
    """The first required parameter (else any) whose name holds one of `hints`."""
    names = list(schema.get("required") or schema.get("properties") or {})
    return next((name for name in names if any(hint in name.lower() for hint in hints)), default)


def reads(path: Path, schema: dict) -> dict:
    """A file reader's arguments: the path, in the parameter that names a path or file."""
    return {_parameter(schema, ("path", "file"), "path"): str(path)}


def runs(path: Path, schema: dict) -> dict:
    """A shell tool's arguments: `cat` of the file, in the parameter that names a command."""
    return {_parameter(schema, ("cmd", "command"), "command"): f"cat {shlex.quote(str(path))}"}


@dataclass(frozen=True)
class Client:
    name: str
    package: Package
    dialect: str                                  # the API it speaks: "messages", "responses" or "chat"
    invoke: Callable[[Path, str, Turn, Path], Invocation]  # (executable, proxy base URL, turn, home) -> command
    tool: ToolProbe | None                        # None: no tool round trip (`note` says why)
    model: str | None = DEMO                      # the model it is configured with (None: its own default)
    also_as: str | None = None                    # another name it is run under once more
    note: str = ""                                # how its install was checked, or why it has no round trip


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
        ToolProbe("Read", reads), model=None,
        note="postinstall copies the native binary from its optional dependency (npm registry only)"),
    "codex": Client(
        "codex", Package("npm", "@openai/codex", "0.171.0", "codex"), "responses", codex,
        ToolProbe("exec_command", runs), also_as=CODEX_CATALOG_NAME,
        note="native binary in an optional dependency; no install script"),
    "opencode": Client(
        "opencode", Package("npm", "opencode-ai", "1.18.33", "opencode"), "chat", opencode,
        ToolProbe("read", reads), model=DEMO_32K,
        note="postinstall copies the native binary from its optional dependency (falls back to `npm install`)"),
}


# --- pi: a provider of ~/.pi/agent/models.json, in each of the three APIs it speaks --------------------------------

def pi(api: str, executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    root = base if api == "anthropic-messages" else base + "/v1"  # the Anthropic SDK adds /v1/messages itself
    agent = home / ".pi" / "agent"
    agent.mkdir(parents=True, exist_ok=True)
    (agent / "models.json").write_text(json.dumps({"providers": {"openarc": {
        "baseUrl": root, "api": api, "apiKey": API_KEY, "models": [{"id": turn.model}]}}}))
    env = {**base_env(home), "PI_SKIP_VERSION_CHECK": "1", "PI_OFFLINE": "1", "PI_TELEMETRY": "0"}
    return Invocation([str(executable), "-p", "--provider", "openarc", "--model", turn.model, turn.prompt], env)


# --- Qwen Code: its OpenAI auth type, from the environment --------------------------------------------------------

def qwen_code(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    settings = home / ".qwen"
    settings.mkdir(parents=True, exist_ok=True)
    (settings / "settings.json").write_text(json.dumps({
        "security": {"auth": {"selectedType": "openai"}}, "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True}, "telemetry": {"enabled": False}}))
    env = {**base_env(home), "OPENAI_BASE_URL": base + "/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": turn.model}
    return Invocation([str(executable), "-p", turn.prompt, "--model", turn.model], env)


# --- Continue's cn CLI: a local config.yaml with one OpenAI-provider model -----------------------------------------

def continue_cli(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    config = home / "continue.yaml"
    config.write_text(json.dumps({  # YAML is a superset of JSON
        "name": "openarc", "version": "1.0.0", "schema": "v1",
        "models": [{"name": turn.model, "provider": "openai", "model": turn.model, "apiBase": base + "/v1",
                    "apiKey": API_KEY, "roles": ["chat", "edit", "apply"]}]}))
    env = {**base_env(home), "CONTINUE_GLOBAL_DIR": str(home / ".continue"), "CONTINUE_TELEMETRY_ENABLED": "0",
           "CONTINUE_ALLOW_ANONYMOUS_TELEMETRY": "false"}
    return Invocation([str(executable), "-p", turn.prompt, "--config", str(config)], env)


# --- Kilo: the opencode-based CLI, an @ai-sdk/openai-compatible provider ------------------------------------------
# Its settings are opencode's, under both prefixes: not yet seen working here (7.8.1's platform packages are not in
# the registry, so it installs nowhere; the bench lists it as not run with npm's words).

def kilo(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    invocation = opencode(executable, base, turn, home)
    config = invocation.env["OPENCODE_CONFIG_CONTENT"]
    env = {**invocation.env, "KILO_CONFIG_CONTENT": config, "KILO_DISABLE_AUTOUPDATE": "1",
           "KILO_DISABLE_MODELS_FETCH": "1", "KILO_DISABLE_LSP_DOWNLOAD": "1", "KILO_DISABLE_SHARE": "1",
           "KILO_TELEMETRY_DISABLED": "1"}
    return Invocation(invocation.argv, env)


# --- aider: litellm's openai/ prefix at --openai-api-base; it edits by text, calling no tools ---------------------

def aider(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    return Invocation([str(executable), "--message", turn.prompt, "--model", f"openai/{turn.model}",
                       "--openai-api-base", base + "/v1", "--openai-api-key", API_KEY, "--no-git", "--yes-always",
                       "--no-check-update", "--analytics-disable", "--no-show-model-warnings", "--no-pretty",
                       "--no-fancy-input", "--no-detect-urls", "--map-tokens", "0"], base_env(home))


# --- llm: extra-openai-models.yaml, a Python function as its tool -------------------------------------------------

LLM_TOOL = "def read_file(path: str) -> str:\n    'Read a text file.'\n    return open(path).read()\n"


def llm(executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    user = home / "llm"
    user.mkdir(parents=True, exist_ok=True)
    (user / "extra-openai-models.yaml").write_text(json.dumps([{
        "model_id": turn.model, "model_name": turn.model, "api_base": base + "/v1", "supports_tools": True}]))
    env = {**base_env(home), "LLM_USER_PATH": str(user), "OPENAI_API_KEY": API_KEY}
    tools = ["--functions", LLM_TOOL] if turn.tool else []
    return Invocation([str(executable), "-m", turn.model, "--no-stream", *tools, turn.prompt], env)


# --- libraries: a program of their users' kind (bench/clients/drivers/), in the release's own venv or prefix -------

DRIVERS = Path(__file__).resolve().parent / "drivers"


def library_program(script: str, executable: Path, base: str, turn: Turn, home: Path) -> Invocation:
    """Run `script` (bench/clients/drivers/) with the release's own interpreter. A node script runs from a copy in
    the release's prefix: ES modules resolve their imports from the script's own directory."""
    path = DRIVERS / script
    if script.endswith(".mjs"):
        path = executable.parent / script
        path.write_text((DRIVERS / script).read_text())
    env = {**base_env(home), "OPENAI_BASE_URL": base + "/v1", "MODEL": turn.model,
           **({"WITH_TOOL": "1"} if turn.tool else {})}
    return Invocation([str(executable), str(path), turn.prompt], env)


MORE = {
    **{f"pi ({api})": Client(f"pi ({api})", Package("npm", "@mariozechner/pi-coding-agent", "0.73.1", "pi"),
                             dialect, partial(pi, api), ToolProbe("read", reads))
       for api, dialect in (("openai-completions", "chat"), ("openai-responses", "responses"),
                            ("anthropic-messages", "messages"))},
    "qwen-code": Client("qwen-code", Package("npm", "@qwen-code/qwen-code", "0.24.4", "qwen"), "chat", qwen_code,
                        ToolProbe("read_file", reads)),
    "continue": Client("continue", Package("npm", "@continuedev/cli", "1.5.47", "cn"), "chat", continue_cli,
                       ToolProbe("Read", reads)),
    "kilo": Client("kilo", Package("npm", "@kilocode/cli", "7.8.1", "kilo"), "chat", kilo, ToolProbe("read", reads),
                   model=DEMO_32K),
    "aider": Client("aider", Package("pypi", "aider-chat", "0.86.2", "aider"), "chat", aider, None,
                    note="it edits by text, calling no tools"),
    "llm": Client("llm", Package("pypi", "llm", "0.36", "llm"), "chat", llm, ToolProbe("read_file", reads)),
    "langchain-openai": Client("langchain-openai", Package("pypi", "langchain-openai", "1.8.1", "python"), "chat",
                               partial(library_program, "langchain_openai_chat.py"), ToolProbe("read_file", reads)),
    "smolagents": Client("smolagents", Package("pypi", "smolagents", "1.26.0", "python", ("openai@3.57.0",)), "chat",
                         partial(library_program, "smolagents_agent.py"), None,
                         note="its ToolCallingAgent forces a tool call every step (tool_choice: required), which a "
                              "demo model never closes"),
    "ai-sdk": Client("ai-sdk", Package("npm", "ai", "7.0.173", "node", ("@ai-sdk/openai-compatible@3.0.92",)),
                     "chat", partial(library_program, "ai_sdk_chat.mjs"), ToolProbe("read_file", reads)),
}
ALL = {**CORE, **MORE}
