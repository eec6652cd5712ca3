"""What the routes and middlewares may use of the front process: a Protocol that appliance.front.server.Appliance
satisfies, so that every route family's dependency on the front shows in its signature, and a route cannot reach
what it should not (the reload lock, the notifier, the lifecycle's own methods).

The routes read this state; only the Appliance's lifecycle changes it (a reload swaps `config` and `keys`
together, a stop sets `draining`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from appliance.config import Config
    from appliance.front.gpu_watch import GpuWatch
    from appliance.front.keys import KeyRing
    from appliance.front.metrics import Metrics
    from appliance.front.spool_budget import SpoolBudget
    from appliance.front.supervisor import Supervisor


class ServerView(Protocol):
    config: Config  # the current config: aliases, body limits, metrics_require_key, stored_responses
    keys: KeyRing  # the current API keys (empty: authentication off)
    supervisor: Supervisor  # the models: lookup, readiness, load and unload
    metrics: Metrics
    spool_budget: SpoolBudget  # the bytes of every route's spool files for requests in flight, one bound
    gpu: GpuWatch  # /openarc/status's GPU mitigations
    draining: bool  # the server is stopping: new requests are refused
    started: float  # Unix time the front started
    cards: list  # the Intel cards as `openarc doctor` sees them (appliance.host.doctor.cards.CardFacts), read once
    build: dict[str, str]  # openarc_build_info's labels (appliance.host.doctor.build_info)
    # the token counter process (appliance.front.api.count_tokens.PromptCounter, not imported here: that module's
    # route takes a ServerView): counts, and the window checks of waiting streams
    prompt_counter: Any

    def unhealthy_reason(self, names: bool = True) -> str | None:
        """Why /health fails (None: healthy); `names`: naming the models and their errors."""

    def not_ready_reason(self) -> str | None:
        """Why /ready fails beside the models' states: the canary (None: no such reason)."""
