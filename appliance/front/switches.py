"""What a load on demand (a switch between models) cost, stage by stage: the log line, the
openarc_model_switch_seconds{model, stage} histogram and /openarc/status's `last_switch`.

A switch's clock is marked by the residency owner (appliance.front.placement) and the model's worker life as it
goes: the oldest request wanting the model arrived, the eviction that makes room for it began, the load began (the
evicted worker gone), the worker was spawned or a parked one handed the model, it was ready (having built its
pipeline in `construction` seconds, its own measure), and its first output went out. `stages()` turns the marks
into consecutive stages; a mark never reached leaves its stage out.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("openarc.supervisor")

# The stages in order, as the histogram's `stage` label and status name them.
STAGES = ("eviction_wait", "old_exit", "spawn", "handover", "startup", "construction", "first_token", "total")


@dataclass
class SwitchClock:
    """The monotonic marks of one load on demand."""

    wanted: float                      # the oldest request (or API call) wanting the model arrived
    evicting: float | None = None      # the eviction that made room for it began (None: there was room)
    started: float = 0.0               # the load began: the evicted worker was gone
    spawned: float | None = None       # its worker existed: spawned fresh, or a parked one handed the model
    parked: bool = False               # it was a parked worker
    ready: float | None = None         # the worker said ready...
    construction: float | None = None  # ... having built its pipeline in this many seconds (its own measure)
    first_output: float | None = None  # the first tokens (or result) of a request on it went out

    def mark_ready(self, life) -> None:
        """The worker's marks, once it is ready: `life` is its appliance.front.worker_life.WorkerLife."""
        self.spawned, self.ready = life.spawned_at, life.current.ready_at
        self.parked, self.construction = life.parked, life.pipeline_load_seconds


def stages(clock: SwitchClock) -> dict[str, float]:
    """Seconds per stage, consecutive from `wanted`: eviction_wait (until an eviction began, or the load when there
    was room), old_exit (the evicted model's drain and its worker's exit), spawn or handover (the load gate, then a
    new process or a parked one handed the spec), startup (an interpreter's start and imports: about 0 for a parked
    worker) and construction (the pipeline), first_token; total from wanted to the last mark reached."""
    out = {"eviction_wait": (clock.evicting or clock.started) - clock.wanted}
    if clock.evicting is not None:
        out["old_exit"] = clock.started - clock.evicting
    if clock.spawned is not None:
        out["handover" if clock.parked else "spawn"] = clock.spawned - clock.started
        if clock.ready is not None:
            load = clock.ready - clock.spawned
            construction = min(load, clock.construction if clock.construction is not None else load)
            out["startup"], out["construction"] = load - construction, construction
            if clock.first_output is not None:
                out["first_token"] = clock.first_output - clock.ready
    last = clock.first_output or clock.ready or clock.spawned or clock.started
    out["total"] = last - clock.wanted
    return {stage: max(0.0, round(seconds, 4)) for stage, seconds in out.items()}


def finish(clock: SwitchClock, first_output: float | None, unit: str, model: str, histogram) -> dict:
    """A switch's last mark (its first output, or None: its ready): its stages logged under the unit's name,
    observed on `histogram` (openarc_model_switch_seconds) under its model's, and /openarc/status's view returned."""
    clock.first_output = first_output
    seconds = stages(clock)
    for stage, value in seconds.items():
        histogram.labels(model=model, stage=stage).observe(value)
    log.info("model %s: loaded on demand in %s", unit, log_text(seconds))
    return status_view(seconds, clock)


def log_text(stage_seconds: dict[str, float]) -> str:
    """`0.62s: eviction wait 0.00s, old worker exit 0.15s, ...` for the load's log line."""
    names = {"eviction_wait": "eviction wait", "old_exit": "old worker exit", "spawn": "spawn",
             "handover": "parked hand-over", "startup": "startup", "construction": "construction",
             "first_token": "first token"}
    parts = [f"{names[s]} {stage_seconds[s]:.2f}s" for s in STAGES if s in stage_seconds and s != "total"]
    return f"{stage_seconds['total']:.2f}s: " + ", ".join(parts)


def status_view(stage_seconds: dict[str, float], clock: SwitchClock) -> dict:
    """/openarc/status's `last_switch` of a model: when it ended (Unix time) and its stages."""
    ended = clock.first_output or clock.ready or clock.started
    return {"at": round(time.time() - (time.monotonic() - ended), 3), "parked": clock.parked, "stages": stage_seconds}
