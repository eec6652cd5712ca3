"""The chat models a server serves, each with its context window, as `openarc launch` reads them: from a running
server's `/v1/models` (`context_length`, else vLLM's `max_model_len`) or from its config (the window the server
computes from it: `max_context`, else the model's trained window fitted to its KV cache).
Pure functions: the CLI fetches and reads, these decide."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.config import Config, ModelConfig
from appliance.config.window import model_window

# The kinds an agent can talk to: text in, text (and tool calls) out.
CHAT_KINDS = ("llm", "vlm")


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


def config_window(model: ModelConfig, source: str) -> tuple[int, str]:
    """A configured model's window as the server computes it (appliance.config.window: max_context, else the
    trained window fitted to the KV cache), and where it comes from."""
    window = model_window(model)
    where = {"max_context": f"max_context in {source}",
             "trained": f"the model's trained window ({model.path}/config.json)",
             "kv_cache": f"what the model's KV cache holds for one sequence (its trained window is {window.trained})",
             }.get(window.source)
    if where is None:
        raise LaunchError(f"{source}: models[{model.name}]: no max_context, and {model.path}/config.json names no "
                          f"trained window; set max_context, or run `openarc launch --url URL` against the server")
    return window.tokens, where


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
