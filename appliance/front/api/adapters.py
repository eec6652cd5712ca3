"""POST /openarc/models/{name}/adapters and DELETE /openarc/models/{name}/adapters/{adapter}: load a LoRA adapter into
a running model at runtime (served as NAME:ADAPTER from then on, until it is unloaded, the server restarts or a
reload replaces the model's worker with its config's adapters) and unload one (its name is a 404 from then on).

Behind the API key like the other admin routes (a key manages the adapters of its own models only); the path is
checked as a configured one is (appliance.config.model_checks.adapter_problem) and must lie under the directory
that holds the base model's own (for a model pulled to /var/lib/openarc/models/NAME: /var/lib/openarc/models), so
a key cannot make the worker read any file of the host. What genai needs is in docs/lora.md: the model must have
an adapter in its config (genai builds the LoRA into the model at load), and a runtime one must adapt the same
layers.
"""

from __future__ import annotations

import asyncio
import collections
import os
from pathlib import Path
from typing import Any

from aiohttp import web

from appliance.config import adapter_problem
from appliance.config.model_checks import (ADAPTER_FILE, TORCH_HINT, adapter_file, adapter_fit_problem,
                                          lora_pairs)
from appliance.config.replicas import shown
from appliance.config.rules import MODEL_NAME, adapter_weight_ok
from appliance.front.api import lookup
from appliance.front.lifecycle import ModelState
from appliance.front.api.errors import InvalidRequest
from appliance.front.api.fields import parse_json
from appliance.front.api.results import result_of
from appliance.front.api.route import Call, route
from appliance.front.api.server_view import ServerView
from appliance.front.api.token_budget import NO_TOKENS
from appliance.front.request import RequestFailed


def add_routes(app: web.Application, appliance: ServerView) -> None:
    # One change to a model's adapters at a time, the checks and the change as one step (racing loads cannot both
    # pass them): by the model's name, not on one of its supervisors, which its unload, next load or a reload
    # replace while a change waits or runs (two changes that each found another supervisor ran at once).
    changing: dict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)  # (configured models' names only)

    async def load(request: web.Request, call: Call) -> web.Response:
        sup = await admitted_model(request, call)
        model = sup.model.name  # (sup may be one replica's: NAME@DEVICE is no name a client knows)
        name, path, alpha = load_body(await request.read())
        async with changing[model]:
            units = await loads_ended(appliance.supervisor, model)  # every replica serves the same adapters
            now = units_or_404(units, model, call)
            served = lookup.served_adapters(now)
            if name in served:
                raise RequestFailed(409, "invalid_request", f"the model '{model}' already serves an adapter named "
                                    f"'{name}'; unload it first (DELETE /openarc/models/{model}/adapters/{name})",
                                    "adapter_exists")
            if len(served) >= now.model.max_adapters:
                raise RequestFailed(409, "invalid_request", f"the model '{model}' holds max_adapters "
                                    f"({now.model.max_adapters}) adapters; unload one first", "max_adapters")
            file = await asyncio.to_thread(checked_adapter, now, path)  # (file reads: off the event loop)
            entry = {"path": str(file), "alpha": alpha}
            await on_every_unit(units, name, entry)
            still_served_by(model, name, entry)
        return web.json_response({"model": f"{model}{lookup.ADAPTER_SEPARATOR}{name}", "parent": model,
                                  "root": name, "alpha": alpha}, status=201)  # root: as /v1/models lists it

    async def unload(request: web.Request, call: Call) -> web.Response:
        # no model is loaded for it: the workers running unload the adapter, the others start without it
        sup = await admitted_model(request, call, load=False)
        model, name = sup.model.name, request.match_info["adapter"]
        async with changing[model]:
            units = appliance.supervisor.units_of(model)
            now = units_or_404(units, model, call)
            served = lookup.served_adapters(now)
            if name not in served:
                raise RequestFailed(404, "model_not_found", f"the model '{model}' has no adapter named '{name}' "
                                    f"(have: {', '.join(served) or 'none'})")
            try:
                await on_every_unit(units, name, None)
            finally:  # (served no more once written, even where the client hung up before the workers answered)
                now.series.drop_adapter(name)
            still_served_by(model, name, None)
        return web.json_response({"model": f"{model}{lookup.ADAPTER_SEPARATOR}{name}", "unloaded": True})

    def units_or_404(units: list, model: str, call: Call):
        """The first of the model's units as the change's turn came, or the 404 of a model a reload removed."""
        if not units:
            raise lookup.not_found(appliance, model, call.api_key)
        return units[0]

    def still_served_by(model: str, name: str, entry: dict[str, Any] | None) -> None:
        """A reload that replaced the model while its adapters changed (its config changed: its new workers serve
        the config's adapters, docs/lora.md) may have undone the change: a 503 saying so, not a 2xx for a change no
        worker has. Known by what the model's units serve now, not by which units they are: a model unloaded
        meanwhile (or a worker's restart) has new supervisors that start from the same adapters, the change's, and
        an unload whose adapter the new config lacks too is done."""
        if any(lookup.served_adapters(unit).get(name) != entry for unit in appliance.supervisor.units_of(model)):
            raise RequestFailed(503, "model_unavailable", f"the model '{model}' was replaced by a reload while its "
                                "adapters changed; it serves its config's adapters now: change them again",
                                retry_after=1)

    async def admitted_model(request: web.Request, call: Call, load: bool = True):
        """The ready supervisor of the model the route names (loaded for it unless `load` is False: then its
        supervisor as it is), once the key may use it (a key learns no other names), it is an llm with adapters
        configured, and the key's limits admit the call as any request."""
        name = request.match_info["name"]
        if not call.may_use(name) or appliance.supervisor.get(name) is None:
            raise lookup.not_found(appliance, name, call.api_key)
        call.label({"model": name})
        call.admit(NO_TOKENS)
        sup = appliance.supervisor.get(name)
        if sup.model.kind != "llm" or not sup.model.adapters:
            raise RequestFailed(409, "invalid_request", f"the model '{name}' takes no adapters at runtime: only an llm "
                                "model with an adapter in its config does (OpenVINO GenAI builds LoRA into the model as "
                                "it loads; docs/lora.md)", "no_adapters")
        if not load:
            return sup
        ready = await appliance.supervisor.ready_model(name, call.may_use, reason="api")
        if ready is None:
            raise lookup.not_found(appliance, name, call.api_key)
        return ready

    app.router.add_post("/openarc/models/{name}/adapters", route(appliance, "openarc/models/adapters", load))
    app.router.add_delete("/openarc/models/{name}/adapters/{adapter}",
                          route(appliance, "openarc/models/adapters", unload))


def load_body(data: bytes) -> tuple[str, str, float]:
    """(name, path, alpha) of a load's JSON body {"name", "path", "alpha"?}, or a 400 naming the field."""
    body = parse_json(data)
    if not isinstance(body, dict):
        raise InvalidRequest("expected a JSON object with 'name' and 'path' (and 'alpha')", None)
    name, path, alpha = body.get("name"), body.get("path"), body.get("alpha", 1.0)
    if not isinstance(name, str) or MODEL_NAME.fullmatch(name) is None:
        raise InvalidRequest("'name' must be letters, digits, '.', '_' or '-' (served as MODEL:NAME)", "name")
    if not isinstance(path, str) or not path:
        raise InvalidRequest("'path' must be the adapter's path on the server", "path")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not adapter_weight_ok(alpha):
        raise InvalidRequest("'alpha' must be a positive finite number (1: as trained)", "alpha")
    return name, path, float(alpha)


def checked_adapter(sup, path: str) -> Path:
    """The adapter file a runtime load of `path` into the model of `sup` serves, resolved (symlinks, '..') as it was
    checked, so that the worker reads the file that was checked; else a 400 naming `path`. The path must lie under
    the directory holding the model's own, and be a file of LoRA tensors (or a PEFT directory holding one) that fits
    the layers the model's configured adapters adapt (genai would fail each generation it is applied to, not the
    load). Any path that holds no readable LoRA adapter (missing, another model's directory or file, a FIFO, an
    unreadable file, a symlink out of the directory) gets one answer: a key kept to its own models must not learn
    which files exist beside them."""
    if "\x00" in path:  # (no file's name holds one; the OS calls below would raise on it)
        raise InvalidRequest("the adapter's path must not contain a NUL character", "path")
    model_dir = Path(os.path.abspath(sup.model.path))
    roots = {model_dir.parent, Path(os.path.realpath(model_dir)).parent}  # (as configured, and as resolved)
    written = Path(os.path.normpath(path))  # the client's string alone: refusing it tells nothing of the disk
    if not os.path.isabs(path) or not roots & set(written.parents):
        raise InvalidRequest(f"the adapter's path must be absolute and under {str(model_dir.parent)!r} (the "
                             "directory holding the model's own)", "path")
    where = Path(os.path.realpath(path))
    file = Path(os.path.realpath(adapter_file(str(where))))  # (a directory's adapter file may be a symlink too)
    if not roots & set(file.parents) or not _holds_lora(file):
        raise InvalidRequest(f"no LoRA adapter at {path!r}: expected a .safetensors file of LoRA tensors, or a PEFT "
                             f"directory holding {ADAPTER_FILE}, that the server can read (a torch checkpoint "
                             f"must be converted first: {TORCH_HINT})", "path")
    problem = adapter_problem(str(where)) or next(
        (problem for entry in sup.configured_spec["adapters"].values()  # (what genai built the model's LoRA for)
         if (problem := adapter_fit_problem(file, entry["path"]))), None)
    if problem:
        raise InvalidRequest(problem, "path")
    return file


def _holds_lora(file: Path) -> bool:
    """A readable regular file (a FIFO is none: reading it would block the front) of safetensors with LoRA pairs."""
    try:
        return file.is_file() and os.access(file, os.R_OK) and bool(lora_pairs(file))
    except Exception:  # safetensors raises its own error types for a file that is not one
        return False


async def loads_ended(supervisor, model: str) -> list:
    """The model's units once none of them is loading or being replaced by a reload, waited for up to the model's
    ready_wait_s as a request waits for a load: a replica still loading when the first one serves (the start of a
    replicated model; /ready answers then) started with the adapters of before, and so did the new worker a reload
    loads beside a unit (replicas are replaced one by one: for a while the first one's new worker serves while the
    second one's loads), so a change waits for those loads to end; past the wait, it is refused with a 503 to retry
    (a replica loading: by on_every_unit)."""
    loop = asyncio.get_running_loop()
    units = supervisor.units_of(model)
    deadline = loop.time() + (units[0].model.ready_wait_s if units else 0)
    def settling() -> list:
        return [unit for unit in units if unit.state is ModelState.LOADING or supervisor.replacing(unit.name)]
    while settling() and deadline > loop.time():
        await supervisor.changes.wait(deadline - loop.time())
        units = supervisor.units_of(model)
    replaced = [shown(unit.name) for unit in units if supervisor.replacing(unit.name)]
    if replaced:
        raise RequestFailed(503, "model_unavailable", f"a reload is replacing the model ({', '.join(replaced)}); "
                            "change its adapters once it is done", retry_after=5)
    return units


async def on_every_unit(units: list, name: str, entry: dict[str, Any] | None) -> None:
    """Load the adapter `name` ({"path", "alpha"} `entry`), or unload it (None), in the model of `units` (its
    replicas): the adapters the model serves, which each of its workers is started with (its spec's), change first,
    before any await, then the worker of each unit that runs one is asked to do the same. A worker that starts while
    the others are asked so starts with the change (written after the asks, a replica restarting meanwhile came up
    without a loaded adapter); a request naming the adapter before its load answered may reach a worker that does not
    hold it yet: a 400, as for one naming it once its unload began. A refusal undoes the load: the caller's 400; an
    unload is not refused (a worker that fails to answer it restarts without it, or holds it unserved)."""
    loading = [shown(unit.name) for unit in units if unit.state is ModelState.LOADING]
    if loading and entry is not None:  # its worker started with the adapters of before this change, and would come
        # up without it (one started with an adapter since unloaded holds it unserved: no request names it)
        raise RequestFailed(503, "model_unavailable", f"a replica of the model is loading ({', '.join(loading)}); "
                            "change its adapters once it is ready", retry_after=5)
    for served in map(lookup.served_adapters, units):  # (the units share one: appliance.front.placement)
        if entry is None:
            served.pop(name, None)
        else:
            served[name] = entry
    action = {"action": "load", "name": name, **entry} if entry is not None else {"action": "unload", "name": name}
    done = []
    for unit in units:
        if not unit.life.admits():
            continue
        try:
            await ask_worker(unit, action)
        except RequestFailed:
            if entry is None:  # an unload is done once no longer served: a worker that did not answer it (it died,
                continue  # or drains) restarts without it, or holds it unserved (no request names it)
            for served in map(lookup.served_adapters, units):
                served.pop(name, None)
            for loaded in done:
                await ask_worker(loaded, {"action": "unload", "name": name})
            raise
        done.append(unit)


async def ask_worker(sup, adapter: dict[str, Any]) -> dict[str, Any]:
    """The worker loads or unloads the adapter (between two steps); its refusal is the caller's 400."""
    event = await result_of(sup, sup.open({"kind": sup.model.kind, "body": {"adapter": adapter}}, op="request"))
    return event.result
