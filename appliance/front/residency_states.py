"""A model name's residency as one state machine: every transition in one table, read by one pure function.

The Placement (appliance.front.placement) is the only owner of a name's supervisors: the one serving its name
(`current`), a side-by-side reload's new one loading beside it (`replacement`), and those leaving (draining, then
reaped). Every path that changes them (a request's load, the load and unload API, the idle timer, an eviction, a
reload of either kind, a load that failed, a removal, the server's stop) reaches the owner as one Event; `step()`
says which phase the name enters and which Acts the owner carries out, in order. An event the table does not list
for a phase changes nothing: the owner logs it as a bug, as appliance.front.lifecycle does an illegal transition.

Each event from a supervisor names the supervisor it is about, and the owner hands it to the table only while that
supervisor still holds the role the event is about (the replacement that became ready is still the name's
replacement): llama-swap's compare-and-swap of a process's state, for a name. That check is what keeps an unload
that overtook a side-by-side reload from being undone by the reload's late switch.

The phases are the name's, not a worker's: a ready model whose worker crashed and restarts is READY throughout (its
ModelSupervisor restarts it); a worker's own states are appliance.front.lifecycle's.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Phase(enum.Enum):
    ABSENT = "absent"          # its current supervisor was never started (no worker, no memory): every name starts
                               # here, and an at_start one is loaded (LOAD) as the server starts
    LOADING = "loading"        # its current supervisor was started and has not been ready yet
    READY = "ready"            # its current supervisor has served (a crash restart is its own business)
    REPLACING = "replacing"    # serving (or failed) while a side-by-side reload's replacement loads beside it
    FAILED = "failed"          # its current supervisor used up its restart budget
    LEAVING = "leaving"        # removed by a reload, or the server stops: draining under its name, then gone
    GONE = "gone"              # forgotten: no supervisor, no name


class Event(enum.Enum):
    LOAD = "load"                                  # the placer begins its load (a request, the API, a restart reload)
    LOADED = "loaded"                              # its current supervisor became ready
    GAVE_UP = "gave_up"                            # its current supervisor is failed (restart budget used up)
    REFUSED = "refused"                            # its on-demand load failed: unloaded until the backoff has passed
    UNLOAD = "unload"                              # the API, an eviction, the idle timer
    RELOAD_SIDE_BY_SIDE = "reload_side_by_side"    # new settings, `reload: side_by_side`
    RELOAD_RESTART = "reload_restart"              # new settings, `reload: restart`
    REPLACEMENT_READY = "replacement_ready"        # the side-by-side replacement is ready: switch to it
    REPLACEMENT_FAILED = "replacement_failed"      # the replacement did not load: the current one goes on
    REMOVE = "remove"                              # a reload dropped the model from the config
    STOP = "stop"                                  # the server stops (SIGTERM)
    DRAINED = "drained"                            # a LEAVING name's supervisor has stopped


class Act(enum.Enum):
    START = "start"                          # start the current (unloaded) supervisor: the load
    RETIRE = "retire"                        # the current one leaves (drains, is reaped); a fresh unloaded one,
                                             # with the newest settings, serves the name: requests wait for a load
    ADOPT = "adopt"                          # an unloaded name takes the new settings: the unstarted one is dropped
    SWAP_IN_NEW = "swap_in_new"              # restart reload: the current one leaves, the new one (unloaded) serves
    WANT = "want"                            # a standing want: the placer loads it as soon as there is room
    START_REPLACEMENT = "start_replacement"  # the new settings load beside the current one
    DROP_REPLACEMENT = "drop_replacement"    # the replacement leaves (never served)
    PROMOTE = "promote"                      # the replacement serves the name; the current one leaves
    STOP_IN_PLACE = "stop_in_place"          # the current one drains under its name (503 "shutting down", no 404)
    FORGET = "forget"                        # the name is gone


@dataclass(frozen=True)
class Step:
    phase: Phase
    acts: tuple[Act, ...] = ()


P, E, A = Phase, Event, Act
_RELOADS_OF_A_LOADED_NAME = {
    E.RELOAD_SIDE_BY_SIDE: Step(P.REPLACING, (A.START_REPLACEMENT,)),
    E.RELOAD_RESTART: Step(P.ABSENT, (A.SWAP_IN_NEW, A.WANT)),
}
_ENDS = {
    E.REMOVE: Step(P.LEAVING, (A.DROP_REPLACEMENT, A.STOP_IN_PLACE)),
    E.STOP: Step(P.LEAVING, (A.DROP_REPLACEMENT, A.STOP_IN_PLACE)),
}

# (phase, event) -> the phase entered and the acts, in order. A pair not listed is a bug of the owner.
TABLE: dict[tuple[Phase, Event], Step] = {
    **{(P.ABSENT, e): s for e, s in {
        E.LOAD: Step(P.LOADING, (A.START,)),
        E.UNLOAD: Step(P.ABSENT),  # nothing loaded: nothing to do
        E.RELOAD_SIDE_BY_SIDE: Step(P.ABSENT, (A.ADOPT,)),  # the new settings apply at its next load
        E.RELOAD_RESTART: Step(P.ABSENT, (A.ADOPT,)),
        E.REMOVE: Step(P.GONE, (A.FORGET,)),
        E.STOP: Step(P.LEAVING, (A.STOP_IN_PLACE,)),
    }.items()},
    **{(P.LOADING, e): s for e, s in {
        E.LOADED: Step(P.READY),
        E.GAVE_UP: Step(P.FAILED),
        E.REFUSED: Step(P.ABSENT, (A.RETIRE,)),
        E.UNLOAD: Step(P.ABSENT, (A.RETIRE,)),  # a worker still loading is killed at once (no request to lose)
        **_RELOADS_OF_A_LOADED_NAME, **_ENDS,
    }.items()},
    **{(P.READY, e): s for e, s in {
        E.LOADED: Step(P.READY),  # ready again after a crash restart
        E.GAVE_UP: Step(P.FAILED),
        E.UNLOAD: Step(P.ABSENT, (A.RETIRE,)),
        **_RELOADS_OF_A_LOADED_NAME, **_ENDS,
    }.items()},
    **{(P.FAILED, e): s for e, s in {
        E.UNLOAD: Step(P.ABSENT, (A.RETIRE,)),  # a manual reset
        **_RELOADS_OF_A_LOADED_NAME, **_ENDS,  # a reload is how an operator retries a failed model
    }.items()},
    **{(P.REPLACING, e): s for e, s in {
        E.LOADED: Step(P.REPLACING),  # the serving one restarted after a crash while the replacement loads
        E.GAVE_UP: Step(P.REPLACING),  # the serving one failed: the replacement may still load
        E.REPLACEMENT_READY: Step(P.READY, (A.PROMOTE,)),
        E.REPLACEMENT_FAILED: Step(P.READY, (A.DROP_REPLACEMENT,)),
        E.REFUSED: Step(P.ABSENT, (A.RETIRE, A.DROP_REPLACEMENT)),  # its load failed: as an unload
        # The unload wins over the reload: nothing stays loaded, and the next load has the newest settings.
        E.UNLOAD: Step(P.ABSENT, (A.RETIRE, A.DROP_REPLACEMENT)),
        E.RELOAD_SIDE_BY_SIDE: Step(P.REPLACING, (A.DROP_REPLACEMENT, A.START_REPLACEMENT)),
        E.RELOAD_RESTART: Step(P.ABSENT, (A.DROP_REPLACEMENT, A.SWAP_IN_NEW, A.WANT)),
        **_ENDS,
    }.items()},
    **{(P.LEAVING, e): s for e, s in {
        E.UNLOAD: Step(P.LEAVING),  # already going
        # a load that ended as the stop began
        E.LOADED: Step(P.LEAVING), E.GAVE_UP: Step(P.LEAVING), E.REFUSED: Step(P.LEAVING),
        E.STOP: Step(P.LEAVING),  # removed by a reload, and then the server stops
        # a reload that was reading its config (or bringing other models in line) as the stop began: the name is
        # going, so its new settings are moot (the replacement is never started: no worker, nothing to drain)
        E.RELOAD_SIDE_BY_SIDE: Step(P.LEAVING), E.RELOAD_RESTART: Step(P.LEAVING), E.REMOVE: Step(P.LEAVING),
        E.DRAINED: Step(P.GONE, (A.FORGET,)),
    }.items()},
}


def step(phase: Phase, event: Event) -> Step | None:
    """The phase a name in `phase` enters on `event`, and what its owner does, in order; None: not a transition
    (a bug of the owner's, logged; nothing changes)."""
    return TABLE.get((phase, event))


def table_rows() -> list[tuple[str, str, str, str]]:
    """The table as docs/on-demand.md shows it: (phase, event, next phase, acts)."""
    return [(p.value, e.value, s.phase.value, ", ".join(a.value for a in s.acts) or "-")
            for (p, e), s in TABLE.items()]
