"""`openarc golden record` and `check`: load each model of a config, one at a time, in this process's own supervisor
(no listener, no canary, no parked spare), and run its probes as the canary does (appliance.front.canary.observe).
One at a time: a box sized for its models loaded side by side must not need room for two of any of them.
"""

from __future__ import annotations

import dataclasses

from appliance.config import Config
from appliance.front.canary import observe
from appliance.front.lifecycle import ModelState
from appliance.front.metrics import Metrics
from appliance.front.supervisor import Supervisor
from appliance.golden.record import ModelRecord

STOP_DRAIN_S = 5.0


async def observe_model(config: Config, name: str) -> ModelRecord | str:
    """The model's answers to its probes, or why it could not answer (a load that failed: its error)."""
    alone = config.only(name)
    model = alone.models[0]  # a load that fails is reported, not retried
    model = dataclasses.replace(model, restart=dataclasses.replace(model.restart, max_failures=1))
    alone = dataclasses.replace(alone, models=[model],
                                server=dataclasses.replace(alone.server, canary="off", parked_workers=0,
                                                           log_level="warning"))
    supervisor = Supervisor(alone, Metrics())
    supervisor.start()
    try:
        while not supervisor.settled():
            await supervisor.changes.wait(None)
        sup = supervisor.models[name]
        if sup.state is not ModelState.READY:
            return f"model {name} did not load: {sup.life.last_error}"
        return await observe(sup.model, sup.router, sup.life.load_seconds)
    finally:
        await supervisor.stop(STOP_DRAIN_S)
