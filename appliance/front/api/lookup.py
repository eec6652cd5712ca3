"""The model a request names, for every route family: its metrics label, the configured model an alias reaches, the
model's supervisor once it is ready, and the one 404 a client gets for a model it may not see.

A module of its own because every route family asks the same questions the same way (a key learns no model names
beyond its own, a wrong kind is a 400 naming both, a draining server refuses); `appliance` in each function is
appliance.front.server.Appliance, read for its supervisor, its current config (aliases) and whether it drains.
"""

from __future__ import annotations

from typing import Any

from appliance.config import rules
from appliance.front.api.server_view import ServerView
from appliance.front.api.token_budget import budget_of
from appliance.front.request import RequestFailed, shutting_down


def model_label(appliance: ServerView, body: Any) -> str:
    """The metrics label of a request: a configured model's name, else "" (client input never mints labels)."""
    model = body.get("model") if isinstance(body, dict) else None
    return configured_name(appliance, model) or "" if isinstance(model, str) else ""


def configured_name(appliance: ServerView, name: str) -> str | None:
    """The configured model a request's name reaches: its own, a base model's through one of its LoRA adapters
    (BASE:ADAPTER), else through server.model_aliases."""
    if name in appliance.supervisor.models:
        return name
    base, adapter = adapter_name(name)
    if adapter and adapter in served_adapters(appliance.supervisor.get(base)):
        return base
    return appliance.config.server.alias_target(name)


def named_adapter(sup, name: str) -> str:
    """The LoRA adapter a request's model name picks on the model the lookup found for it (`sup`): ADAPTER of a
    name BASE:ADAPTER whose model serves it, as configured_name reads it; "" for any other name: the model's own,
    or an alias, a colon in it or not (Ollama's "llama3:8b" aliased to a model is no adapter "8b")."""
    base, adapter = adapter_name(name)
    return adapter if adapter and base == sup.model.name and adapter in served_adapters(sup) else ""


ADAPTER_SEPARATOR = rules.ADAPTER_SEPARATOR


def adapter_name(name: str) -> tuple[str, str]:
    """(base, adapter) of a served name: "demo:upper" -> ("demo", "upper"); a plain name -> (name, "")."""
    base, _, adapter = name.partition(ADAPTER_SEPARATOR)
    return base, adapter


def served_adapters(sup) -> dict[str, dict]:
    """The LoRA adapters a model's supervisor serves now (configured and loaded at runtime): its worker's spec's
    (appliance.config.launch_spec), which a restart of the worker loads again."""
    # (the spec's own dict even when empty: the admin routes write to it; a model without adapters has none)
    return sup.spec["adapters"] if sup is not None and "adapters" in sup.spec else {}


async def model_for(appliance: ServerView, name: str, call, kinds: tuple[str, ...]):
    """The supervisor of the model a request names (or reaches through an alias), if it exists for the
    request's key, is of a kind the route serves, the key's limits admit the request and the server is not
    draining, once the model is ready (Supervisor.ready_model waits out a load, a restart or a replacement, up
    to the model's ready_wait_s); else the RequestFailed the client gets. A background chat request for a model
    with a task_model goes to that. The answer keeps the name the client
    asked for. `call`: the request as the route wrapper counts it (appliance.front.api.route.Call)."""
    sup = model_served(appliance, name, call, kinds)
    target = sup.model.name
    task_model = sup.model.task_model
    adapter = named_adapter(sup, name)  # an adapter's answer is its own: never the task model's
    if call.is_background and task_model and not adapter and appliance.supervisor.get(task_model) \
            and call.may_use(task_model):
        target = task_model  # (a key kept off the task model is answered by the model it named)
    admit(call, sup)  # the key's limits: a 429 before any queue place is taken
    ready = await appliance.supervisor.ready_model(target, call.may_use, body=call.body)  # the body: which replica holds its prefix
    if ready is None:  # removed by a reload while the request waited
        raise not_found(appliance, name, call.api_key)
    return ready


def admit_early(appliance: ServerView, body: Any, call, kinds: tuple[str, ...]) -> None:
    """The key's allow-list and limits for the model a body names, checked before any costly work on the body
    (its grammars converted, its images fetched): a request its key may not make, or may not make now, costs
    nothing. A body naming no model is its route's parse to refuse; model_for checks again (the same slot)."""
    name = body.get("model") if isinstance(body, dict) else None
    if isinstance(name, str):
        admit(call, model_served(appliance, name, call, kinds))


def admit(call, sup) -> None:
    """The key's limits admit a request for this model, reserving the tokens its body may use (token_budget). A
    request is admitted once, by whichever check comes first: each must reserve the same budget (an early check
    that reserved nothing let concurrent requests all pass under an empty tokens_per_minute window)."""
    call.admit(budget_of(call.body, sup.model.kind, sup.spec.get("max_context")))


def model_served(appliance: ServerView, name: str, call, kinds: tuple[str, ...]):
    """The supervisor of the model a request names (or reaches through an alias), loaded or not, if the
    request's key may use it, it is of a kind the route serves and the server is not draining."""
    target = configured_name(appliance, name) or name
    sup = appliance.supervisor.get(target) if call.may_use(target) else None
    if sup is None:
        raise not_found(appliance, name, call.api_key)
    if sup.model.kind not in kinds:
        raise RequestFailed(400, "invalid_request", f"the model '{target}' is of kind {sup.model.kind}; /v1/{call.endpoint} "
                                                    f"needs a model of kind {' or '.join(kinds)}", "wrong_model_kind")
    if appliance.draining:
        raise shutting_down()
    return sup


def not_found(appliance: ServerView, name: str, key=None) -> RequestFailed:
    """A 404 for a model that does not exist, or that the request's key may not use (the same answer, so a
    key learns no names beyond its own models). `name` is the name the client sent, never what it reaches: an
    alias's target is a model name the key may not know. While the server stops, a 503 "shutting down" instead:
    the stop forgets each model's name as its drain ends (an unloaded one's at once), and a configured model must
    not read as unknown to a request that comes meanwhile (nor tell a key which names went)."""
    if appliance.draining:
        return shutting_down()
    have = [model for model in appliance.supervisor.models if key is None or key.may_use(model)]
    return RequestFailed(404, "model_not_found", f"the model '{name}' does not exist (have: {', '.join(have)})")
