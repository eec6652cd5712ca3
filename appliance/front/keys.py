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
from appliance.front.limits import KeyLimits, Reservation
from appliance.front.priority import INTERACTIVE

# The metrics label of requests while no key is configured (authentication off).
NO_KEY = "none"


@dataclass
class ApiKey:
    config: ApiKeyConfig
    secret: bytes
    limits: KeyLimits
    # The single server.api_key_env key (named `default`): the operator's, which /openarc/status shows every key
    # to. A named key sees only itself there (docs/sharing.md#what-a-key-can-see).
    operator: bool = False

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
            operator = config.server.api_key_env is not None and key.key_env == config.server.api_key_env
            self.keys.append(ApiKey(key, secrets[key.name].encode(), limits, operator))

    def __bool__(self) -> bool:
        return bool(self.keys)

    def named(self, name: str) -> ApiKey | None:
        return next((key for key in self.keys if key.name == name), None)

    def presented(self, headers: Mapping[str, str]) -> ApiKey | None:
        """The key a request's headers present (identify), or None."""
        return self.identify(headers.get("Authorization", ""), headers.get("x-api-key", ""))

    def identify(self, authorization: str, x_api_key: str) -> ApiKey | None:
        """The key a request presents (OpenAI's `Authorization: Bearer KEY`, the scheme in any case as RFC 7235
        has it; Anthropic's `x-api-key: KEY`), or None. Every key is compared, in constant time, whichever
        matches. A header of bytes that are not UTF-8 (aiohttp keeps them as surrogates) presents no key: its bytes
        are compared as they came and match none."""
        scheme, _, token = authorization.strip().partition(" ")
        bearer = _raw(token.strip()) if scheme.lower() == "bearer" else b""
        presented = _raw(x_api_key)
        found = None
        for key in self.keys:
            if hmac.compare_digest(bearer, key.secret) | hmac.compare_digest(presented, key.secret):
                found = found or key
        return found


def _raw(header: str) -> bytes:
    """A header's value as the bytes the client sent (b"" for a string no bytes decode to)."""
    try:
        return header.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return b""


@dataclass(eq=False)
class Ticket:
    """An HTTP request's key and class, as the route wrapper decided them; the router reads it when the request's
    generations are queued (CURRENT) to order them and to count their tokens against the key. One ticket for all
    of a request's generations (its `n` choices): its prompt is charged and counted once."""
    key: str = NO_KEY
    priority: str = INTERACTIVE
    limits: KeyLimits | None = None
    reservation: Reservation | None = None  # what it may use of its key's tokens_per_minute (KeyLimits.admit)
    prompt_estimate: int = 0  # charged at the end if it was dispatched and its prompt count never came
    dispatched: bool = False  # a generation of it reached the worker: the prompt's work began
    prompt_charged: bool = False  # its prompt was charged to its key's tokens_per_minute
    prompt_metered: bool = False  # its prompt is in openarc_prompt_tokens_total

    def count_tokens(self, n: int) -> None:
        if self.limits is not None:
            self.limits.add_tokens(n, self.reservation)

    def charge_prompt(self, n: int) -> None:
        """The prompt's tokens against the key, once per request whatever its number of choices."""
        if not self.prompt_charged:
            self.prompt_charged = True
            self.count_tokens(n)

    def refused(self) -> None:
        """Its worker refused it as the client's error (a prompt over the window, a grammar that does not compile),
        which it checks before any work on the prompt: there is nothing to charge for it."""
        self.dispatched = False

    def settle(self) -> None:
        """The request ended: a prompt the worker began on is charged even if its count never came (the client hung
        up during prefill, or the request failed after it), then the key's slot and reservation are given back."""
        if self.dispatched:
            self.charge_prompt(self.prompt_estimate)
        if self.limits is not None:
            self.limits.release(self.reservation)


# The ticket of the request this task is serving: set by the route wrapper once the request is admitted, read by
# RequestRouter.open (the routes between them need not pass it along). None: opened outside a route (a fresh
# ticket each time, never one shared by unrelated requests).
CURRENT: contextvars.ContextVar[Ticket | None] = contextvars.ContextVar("openarc_ticket", default=None)


def current_ticket() -> Ticket:
    return CURRENT.get() or Ticket()
