"""The chat models a server serves, each with its context window, as `openarc launch` reads them: from a running
server's `/v1/models` (`context_length`, else vLLM's `max_model_len`) or from its config (`max_context`, else the
model's own trained window from its config.json, an upper bound the server may fit lower to its KV cache).
Pure functions: the CLI fetches and reads, these decide."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from appliance.config import Config, ModelConfig

# The kinds an agent can talk to: text in, text (and tool calls) out.
CHAT_KINDS = ("llm", "vlm")
# config.json keys naming a model's trained window, most trusted first.
TRAINED_WINDOW_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


class LaunchError(Exception):
    """Something the user must change before an agent can be set up; the message says what."""


@dataclass(frozen=True)
class ServedModel:
    name: str
    kind: str
    window: int          # prompt plus answer, in the model's tokens
    window_source: str   # where the window was read, for the user ("/v1/models context_length", ...)


@dataclass(frozen=True)
class Target:
    """What an agent is pointed at: the server's root URL, one model, and the variable holding the key (None:
    the server checks no key)."""
    base_url: str
    model: ServedModel
    key_env: str | None


def from_listing(body: dict, url: str) -> list[ServedModel]:
    """The chat models of a `/v1/models` answer. A chat model without a window is an error naming the fix: an
    older server does not report it."""
    found = []
    for entry in body.get("data") or []:
        kind = entry.get("kind", "llm")
        if kind not in CHAT_KINDS:
            continue
        window = entry.get("context_length") or entry.get("max_model_len")
        if not isinstance(window, int) or window <= 0:
            raise LaunchError(f"{url}/v1/models gives no context_length for {entry.get('id')!r} (a server older "
                              f"than this CLI): run `openarc launch` with --config FILE, the server's config, "
                              f"to read the window there")
        source = "/v1/models context_length" if entry.get("context_length") else "/v1/models max_model_len"
        found.append(ServedModel(entry["id"], kind, window, source))
    return found


def trained_window(path: str) -> int | None:
    """The model's own window from its config.json (its text config for a VLM), None if it names none."""
    try:
        hf = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for config in (hf.get("text_config") or {}, hf):
        for key in TRAINED_WINDOW_KEYS:
            if isinstance(config.get(key), int) and config[key] > 0:
                return config[key]
    return None


def config_window(model: ModelConfig, source: str) -> tuple[int, str]:
    """A configured model's window: its max_context, else its trained window (an upper bound: a server with
    max_context unset may fit it lower to what its KV cache holds; --url reads the window it really serves)."""
    if model.max_context:
        return model.max_context, f"max_context in {source}"
    trained = trained_window(model.path)
    if trained is None:
        raise LaunchError(f"{source}: models[{model.name}]: no max_context, and {model.path}/config.json names no "
                          f"trained window; set max_context, or run `openarc launch --url URL` against the server")
    return trained, (f"the model's trained window ({model.path}/config.json; the server may fit it lower to its "
                     f"KV cache: --url reads the window it serves)")


def from_config(config: Config) -> list[ServedModel]:
    return [ServedModel(m.name, m.kind, *config_window(m, config.source)) for m in config.models
            if m.kind in CHAT_KINDS]


def server_root(config: Config) -> str:
    """The URL a client on this machine reaches the config's server at."""
    host = config.server.host
    host = "127.0.0.1" if host in ("0.0.0.0", "", None) else ("[::1]" if host == "::" else host)
    return f"http://{host}:{config.server.port}"


def choose(models: list[ServedModel], name: str | None, where: str) -> ServedModel:
    """The model named, else the only chat model; with several and none named, a clear list to pick from."""
    if name is not None:
        for model in models:
            if model.name == name:
                return model
        raise LaunchError(f"{where} serves no chat model {name!r}; its chat models: "
                          f"{', '.join(m.name for m in models) or 'none'}")
    if not models:
        raise LaunchError(f"{where} serves no chat model (kind llm or vlm)")
    if len(models) > 1:
        listed = "\n".join(f"  {m.name}  ({m.kind}, window {m.window})" for m in models)
        raise LaunchError(f"{where} serves {len(models)} chat models; pick one with --model NAME:\n{listed}")
    return models[0]
