"""What must hold after every step of the residency owner (appliance.front.placement), in one place.

`violations(owner)` reads the owner (its phases, supervisors, ledger and limits) and the front's own children in
/proc, changes nothing, and says what does not hold: the tests run every appliance with the check on
(OPENARC_DEBUG_INVARIANTS=1, logged as "BUG: residency invariant"), and so can production, at the price of a /proc
read per step.

- Every live worker child of the front is in the ledger (but for spawns under way), and every ledger entry belongs
  to a supervisor the owner holds (serving, replacement or leaving) or is a parked spare: no worker nobody can stop.
- A name holds at most one serving supervisor and one replacement, the replacement only while the name is being
  replaced, and a name's phase agrees with its serving supervisor (an absent name's was never started).
- The loaded and loading count stays within max_loaded, and the declared footprints on a device within its budget,
  replacements included; beyond them only by what the docs allow: a side-by-side reload's second copy (until the
  old one is gone), and what was loaded when a reload lowered the limits (until it has left).
- No counter below zero: a model's reserved places and requests waiting for its load.
- Replicas (appliance.config.replicas): no two serving replicas of a model share a card (a reset of one card must
  take one replica only).
- Every request handle opened is closed once, and no spool file outlives its request (the front's request ledger,
  appliance.front.request_ledger: each is said once, at the first check after it went wrong).
"""

from __future__ import annotations

import glob
import os

from appliance.config.devices import budget_device
from appliance.config.replicas import KEY_SEPARATOR
from appliance.front.lifecycle import ModelState
from appliance.front.request_ledger import DEBUG_INVARIANTS_ENV, LEDGER  # noqa: F401 (the switch, read by the owner)
from appliance.front.residency import OCCUPYING
from appliance.front.residency_states import Phase

# The leaving reasons of a side-by-side reload's second copy (the documented excess): the old supervisor whose
# replacement took its name, and a replacement dropped before it served (the owner leaves them with these words).
REPLACED = "replaced by its new settings"
DROPPED = "a replacement dropped"


def live_worker_children(pid: int | None = None) -> set[int]:
    """The front's children that are model workers (`python -m appliance.worker`) and not zombies, from /proc."""
    found = set()
    for children in glob.glob(f"/proc/{pid or os.getpid()}/task/*/children"):
        try:
            pids = open(children).read().split()
        except OSError:
            continue
        for child in pids:
            try:
                cmdline = open(f"/proc/{child}/cmdline", "rb").read()
                state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[-1].split()[0]
            except OSError:
                continue
            if b"\0appliance.worker\0" in cmdline and state != "Z":
                found.add(int(child))
    return found


def violations(owner, limits_lowered: bool = False) -> tuple[list[str], bool]:
    """Every invariant that does not hold now, in words (empty: all hold), and whether the limits hold.
    `limits_lowered`: a reload lowered max_loaded or a budget and what was loaded has not left yet: over the limits
    is no violation until the models are within them once more. The request ledger's findings are said once (it
    forgets what it reported): the one change this makes."""
    over = _limits(owner)
    return [*_processes(owner), *_names(owner), *([] if limits_lowered else over), *_counters(owner),
            *_replicas(owner), *LEDGER.check()], not over


def _processes(owner) -> list[str]:
    found = []
    unknown = live_worker_children() - set(owner.ledger.entries)
    if len(unknown) > owner.ledger.spawning:
        found.append(f"worker processes {sorted(unknown)} are not in the ledger")
    lives = {sup.life for sup in owner.supervisors()} | {owner.parked}
    for entry in owner.ledger.entries.values():
        if entry.owner not in lives:
            found.append(f"worker {entry.pid} of model {entry.model} belongs to a supervisor the owner does not "
                         "hold: nothing will stop it")
    return found


def _names(owner) -> list[str]:
    found = []
    for name, sup in owner.replacements.items():
        if owner.phases.get(name) is not Phase.REPLACING:
            found.append(f"model {name} has a replacement in phase {owner.phases.get(name)}")
        if sup is owner.models.get(name) or sup in owner.leaving:
            found.append(f"model {name}'s replacement holds a second role")
    for name, phase in owner.phases.items():
        sup = owner.models.get(name)
        if sup is None:
            found.append(f"model {name} in phase {phase.value} has no supervisor")
        elif phase is Phase.ABSENT and sup.life.task is not None:
            found.append(f"model {name} is absent but its supervisor was started ({sup.state.value})")
    for name in owner.models:
        if name not in owner.phases:
            found.append(f"model {name} is served but has no phase")
    return found


def _limits(owner) -> list[str]:
    """max_loaded and the declared budgets, beyond which only the documented excess goes."""
    # a supervisor holds a slot while its life runs (a worker starting, serving or draining): one the server's stop
    # drains that never started a worker (an unloaded model) holds nothing
    held = [sup for sup in owner.supervisors() if sup in owner.replacements.values()
            or ((sup.state in OCCUPYING or sup.state is ModelState.UNLOADED) and sup.life.task)]
    # a side-by-side reload's second copy: the replacement, the old one it replaced, or one dropped, until gone
    excess = [sup for sup in held if (owner.leaving.get(sup) or "").startswith((REPLACED, DROPPED))]
    excess += list(owner.replacements.values())
    counted = [sup for sup in held if sup not in excess]
    limits, found = owner.limits(), []
    if limits.max_loaded and len(counted) > limits.max_loaded:
        found.append(f"{len(counted)} models hold a slot ({', '.join(s.name for s in counted)}) beyond max_loaded "
                     f"{limits.max_loaded}")
    for device, budget in limits.memory_budget.items():
        declared = [(sup, sup.model.memory_bytes) for sup in counted
                    if sup.model.memory_bytes is not None and budget_device(sup.model.device) == device]
        if sum(size for _, size in declared) > budget:
            found.append(f"declared footprints on {device} ({', '.join(s.name for s, _ in declared)}) exceed its "
                         f"budget of {budget} bytes")
    return found


def _counters(owner) -> list[str]:
    found = []
    for sup in owner.supervisors():
        router = sup.router
        for counter in ("reserved", "awaiting_ready"):
            if getattr(router, counter) < 0:
                found.append(f"model {sup.name}: {counter} is {getattr(router, counter)}")
    return found


def _replicas(owner) -> list[str]:
    found = []
    cards: dict[tuple[str, str], str] = {}
    for key, sup in owner.models.items():
        if KEY_SEPARATOR in key and sup.model.device != "CPU":
            other = cards.setdefault((sup.model.name, budget_device(sup.model.device)), key)
            if other != key:
                found.append(f"replicas {other} and {key} of model {sup.model.name} share a card")
    return found
