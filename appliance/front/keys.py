"""Who a request is for: the API keys (server.api_keys and server.api_key_env, docs/sharing.md), which key a
request presents, what that key may use, and the `Ticket` a request carries through the front.

Secrets are compared in constant time with every configured key (hmac.compare_digest), and exist only here: logs,
metrics and status name a key by its `name`.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hmac
from dataclasses import dataclass
from typing import Mapping

from appliance.config import ApiKeyConfig, Config
from appliance.front.limits import KeyLimits
from appliance.front.priority import INTERACTIVE

# The metrics label of requests while no key is configured (authentication off).
NO_KEY = "none"


@dataclass
class ApiKey:
    config: ApiKeyConfig
    secret: bytes
    limits: KeyLimits

    @property
    def name(self) -> str:
        return self.config.name

    def status(self) -> dict:
        """The key as /openarc/status shows it: its name, class, limits and usage, never its value."""
        c = self.config
        return {"name": c.name, "priority": c.priority, "max_concurrent": c.max_concurrent,
                "requests_per_minute": c.requests_per_minute, "tokens_per_minute": c.tokens_per_minute,
                "models": c.models, **self.limits.usage()}

    def may_use(self, model: str) -> bool:
        """Whether the key's `models` (names or globs; unset: all) include this model."""
        return self.config.models is None or any(fnmatch.fnmatchcase(model, pattern) for pattern in self.config.models)


class KeyRing:
    """The configured keys; empty: authentication is off."""

    def __init__(self, config: Config, secrets: Mapping[str, str], previous: KeyRing | None = None):
        """`secrets`: name -> value (Config.key_secrets). A key kept across a reload keeps what it uses of its
        limits (its running requests and its last minute), with the limits of the new config."""
        self.keys: list[ApiKey] = []
        for key in config.api_keys():
            old = previous.named(key.name) if previous else None
            if old is not None:  # the same object: requests admitted before the reload release their slots in it
                limits = old.limits
                limits.configure(key.max_concurrent, key.requests_per_minute, key.tokens_per_minute)
            else:
                limits = KeyLimits(key.name, key.max_concurrent, key.requests_per_minute, key.tokens_per_minute)
            self.keys.append(ApiKey(key, secrets[key.name].encode(), limits))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def named(self, name: str) -> ApiKey | None:
        return next((key for key in self.keys if key.name == name), None)

    def identify(self, authorization: str, x_api_key: str) -> ApiKey | None:
        """The key a request presents (OpenAI's `Authorization: Bearer KEY`, Anthropic's `x-api-key: KEY`), or
        None. Every key is compared, in constant time, whichever matches."""
        bearer = authorization.encode()
        presented = x_api_key.encode()
        found = None
        for key in self.keys:
            if hmac.compare_digest(bearer, b"Bearer " + key.secret) | hmac.compare_digest(presented, key.secret):
                found = found or key
        return found


@dataclass
class Ticket:
    """A request's key and class, as the route wrapper decided them; the router reads it when the request is
    queued (CURRENT) to order it and to count its tokens against its key."""
    key: str = NO_KEY
    priority: str = INTERACTIVE
    limits: KeyLimits | None = None

    def count_tokens(self, n: int) -> None:
        if self.limits is not None:
            self.limits.add_tokens(n)


# The ticket of the request this task is serving: set by the route wrapper once the request is admitted, read by
# RequestRouter.open (the routes between them need not pass it along).
CURRENT: contextvars.ContextVar[Ticket] = contextvars.ContextVar("openarc_ticket", default=Ticket())
