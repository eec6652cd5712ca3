"""What each coding agent needs to use one served model, as pure functions of (the target, where the agent keeps
its config): the files and the keys in them that `openarc launch` sets, the environment it runs the agent with,
and the command. No file is read or written here (appliance.launch.files does that) and no process started.

The numbers and why (docs/coding-agents.md says the same for users):
- Claude Code assumes a 200k window for a model it does not know and compacts only near it. It takes the real
  window from CLAUDE_CODE_MAX_CONTEXT_TOKENS (for a model name not starting `claude-`: we name the served model
  itself). CLAUDE_CODE_AUTO_COMPACT_WINDOW is also set, as the issue tracker's launchers do, but the client
  clamps it between 100k and the window it assumes (anthropics/claude-code #57964, unslothai/unsloth PR #9940):
  below 100k it alone would raise the threshold past a small window. Its own reserve (about 13k for the answer
  and compaction, 20k of system overhead) leaves too little below 64k: a smaller window is set up with a warning.
- Codex knows a model's window and its apply_patch tool only from its model catalog; for a name it does not know
  it assumes neither. A profile (Codex >= 0.134 reads `--profile NAME` from $CODEX_HOME/NAME.config.toml, layered
  over config.toml) points at a catalog file holding one entry for the served model.
- opencode takes a provider's models with their `limit.context` and `limit.output`.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from appliance.launch.served import Target

PROFILE = "openarc"  # the Codex profile, the opencode provider, the Claude Code settings file's name
DEFAULT_KEY_ENV = "OPENARC_API_KEY"
NO_KEY = "openarc-no-key"  # what a client that insists on a key sends to a server that checks none
# Claude Code's own floor: below this its reserve for the answer and compaction leaves too little to work in.
CLAUDE_MIN_WINDOW = 65536
# Codex drops a stream silent this long; its default (300 s) is shorter than a long prefill on a busy card.
CODEX_STREAM_IDLE_TIMEOUT_MS = 1_200_000
# The most an agent asks one answer for: a quarter of the window, so that compaction keeps room, at most this.
MAX_ANSWER_TOKENS = 32000
# What Codex truncates one tool output to, at most (tokens); less on a small window.
CODEX_TOOL_OUTPUT_TOKENS = 10000

# Our own base instructions for Codex's catalog entry (Codex requires some); short, for small local windows.
CODEX_INSTRUCTIONS = """\
You are a coding agent working in the user's terminal and workspace, through the tools you are given.
- Read before you change: inspect files and run commands with the shell tools to learn the code.
- Change files with the apply_patch tool (its input is a patch in the grammar the tool describes), never by
  echoing whole files through the shell.
- Keep changes small and to the point; follow the code's existing style; do not add what was not asked for.
- After a change, run the tests or the command that shows it works, when there is one.
- When you are done, say briefly what you changed and what you checked. Ask when the request is unclear."""


@dataclass(frozen=True)
class Homes:
    """Where each agent keeps its config (the agents' own variables, else their defaults under the home)."""
    codex: Path
    claude: Path
    opencode: Path

    @classmethod
    def of(cls, environ: dict[str, str], home: Path) -> Homes:
        xdg = Path(environ.get("XDG_CONFIG_HOME") or home / ".config")
        return cls(codex=Path(environ.get("CODEX_HOME") or home / ".codex"),
                   claude=Path(environ.get("CLAUDE_CONFIG_DIR") or home / ".claude"),
                   opencode=xdg / "opencode")


@dataclass(frozen=True)
class FileEdit:
    """Keys launch sets in one file (a key path -> its value); the file's other keys are the user's and stay."""
    path: Path
    format: str  # "json" or "toml"
    values: dict[tuple[str, ...], Any]


@dataclass(frozen=True)
class Setup:
    client: str
    binary: str
    files: tuple[FileEdit, ...]
    command: tuple[str, ...]                 # argv before the user's arguments (those after `--`)
    env: dict[str, str] = field(default_factory=dict)     # set for the agent
    env_from: dict[str, str] = field(default_factory=dict)  # NAME <- the variable holding the key
    unset: tuple[str, ...] = ()              # removed from the agent's environment
    warnings: tuple[str, ...] = ()
    install: str = ""                        # how to install the agent


def answer_tokens(window: int) -> int:
    return max(1, min(MAX_ANSWER_TOKENS, window // 4))


def claude(target: Target, homes: Homes) -> Setup:
    model, window = target.model.name, target.model.window
    env = {"ANTHROPIC_BASE_URL": target.base_url,
           "ANTHROPIC_MODEL": model,  # every role on the served model: its own name, so the window below applies
           "ANTHROPIC_DEFAULT_OPUS_MODEL": model, "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": model, "CLAUDE_CODE_SUBAGENT_MODEL": model,
           "CLAUDE_CODE_MAX_CONTEXT_TOKENS": str(window),
           "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window),
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(answer_tokens(window)),
           # the per-request billing line off at the source: the prompt's prefix stays the same turn to turn
           "CLAUDE_CODE_ATTRIBUTION_HEADER": "0",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    if target.key_env is None:
        env["ANTHROPIC_AUTH_TOKEN"] = NO_KEY
    settings = homes.claude / f"{PROFILE}-settings.json"
    warnings = () if window >= CLAUDE_MIN_WINDOW else (
        f"{model}'s window is {window} tokens: Claude Code needs {CLAUDE_MIN_WINDOW} or more (its prompt alone is "
        f"about 30-40k tokens, and it keeps a reserve for answers and compaction); raise the model's max_context",)
    return Setup("claude", "claude", (FileEdit(settings, "json", {("env", k): v for k, v in env.items()}),),
                 ("claude", "--settings", str(settings)),
                 env_from={"ANTHROPIC_AUTH_TOKEN": target.key_env} if target.key_env else {},
                 # these would send the requests elsewhere, or a key meant for Anthropic to this server
                 unset=("ANTHROPIC_API_KEY", "CLAUDE_CODE_USE_BEDROCK", "CLAUDE_CODE_USE_VERTEX",
                        "CLAUDE_CODE_USE_FOUNDRY", "CLAUDE_CODE_OAUTH_TOKEN"),
                 warnings=warnings, install="npm install -g @anthropic-ai/claude-code")


def codex_catalog_entry(target: Target) -> dict[str, Any]:
    """The served model as a Codex catalog entry (codex-rs ModelInfo): its real window, the apply_patch tool as
    a grammar (`freeform`) tool, the exec_command shell; no reasoning levels, search tool or multi-agent tools,
    which Codex would otherwise offer a model it knows."""
    model, window = target.model, target.model.window
    return {"slug": model.name, "display_name": model.name, "description": f"{model.kind} model served by openarc",
            "context_window": window, "max_context_window": window,
            "effective_context_window_percent": 95,
            "apply_patch_tool_type": "freeform", "shell_type": "unified_exec",
            "truncation_policy": {"mode": "tokens", "limit": min(CODEX_TOOL_OUTPUT_TOKENS, max(1000, window // 8))},
            "visibility": "list", "supported_in_api": True, "priority": 1,
            "supported_reasoning_levels": [], "default_reasoning_level": None,
            "supports_reasoning_summaries": False, "support_verbosity": False, "default_verbosity": None,
            "supports_parallel_tool_calls": False, "supports_search_tool": False,
            "experimental_supported_tools": [],
            "input_modalities": ["text", "image"] if model.kind == "vlm" else ["text"],
            "base_instructions": CODEX_INSTRUCTIONS}


def codex(target: Target, homes: Homes) -> Setup:
    catalog = homes.codex / f"{PROFILE}-models.json"
    provider = {"name": "openarc", "base_url": target.base_url + "/v1", "wire_api": "responses",
                "stream_idle_timeout_ms": CODEX_STREAM_IDLE_TIMEOUT_MS}
    if target.key_env:
        provider["env_key"] = target.key_env
    profile = {("model",): target.model.name, ("model_provider",): PROFILE, ("model_catalog_json",): str(catalog),
               ("model_providers", PROFILE): provider}
    return Setup("codex", "codex",
                 (FileEdit(homes.codex / f"{PROFILE}.config.toml", "toml", profile),
                  FileEdit(catalog, "json", {("models",): [codex_catalog_entry(target)]})),
                 ("codex", "--profile", PROFILE), install="npm install -g @openai/codex")


def opencode(target: Target, homes: Homes) -> Setup:
    model, window = target.model, target.model.window
    options: dict[str, Any] = {"baseURL": target.base_url + "/v1"}
    # opencode reads the key from the variable itself ({env:NAME}): no secret is written to its config
    options["apiKey"] = f"{{env:{target.key_env}}}" if target.key_env else NO_KEY
    provider = {"npm": "@ai-sdk/openai-compatible", "name": "openarc", "options": options,
                "models": {model.name: {"name": model.name, "tool_call": True,
                                        "attachment": model.kind == "vlm",
                                        "limit": {"context": window, "output": answer_tokens(window)}}}}
    return Setup("opencode", "opencode",
                 (FileEdit(homes.opencode / "opencode.json", "json",
                           {("provider", PROFILE): provider, ("model",): f"{PROFILE}/{model.name}"}),),
                 ("opencode",), install="npm install -g opencode-ai")


CLIENTS: dict[str, Callable[[Target, Homes], Setup]] = {"claude": claude, "codex": codex, "opencode": opencode}


def agent_environment(setup: Setup, environ: dict[str, str]) -> dict[str, str]:
    """The environment the agent runs with: the caller's, less what would misdirect it, plus the setup's."""
    env = {k: v for k, v in environ.items() if k not in setup.unset}
    env.update(setup.env)
    for name, source in setup.env_from.items():
        if environ.get(source):
            env[name] = environ[source]
    return env


def shell_command(setup: Setup, args: tuple[str, ...] = ()) -> str:
    """The command a user runs by hand for this setup (variables named, never a key's value)."""
    prefix = [f'{name}="${source}"' for name, source in setup.env_from.items()]
    prefix += [f"{k}={shlex.quote(v)}" for k, v in setup.env.items()]
    return " ".join(prefix + [shlex.quote(part) for part in (*setup.command, *args)])
