"""Which LoRA adapter a continuous-batching worker runs, and when it switches: a pure policy, tested without genai.

Why a policy at all: OpenVINO GenAI 2026.4's ContinuousBatchingPipeline applies one adapter set to every request of a
step, and its only way to change that set is generate(), which it refuses while any request runs (add_request
ignores GenerationConfig.adapters). So a worker runs one *group* (the requests of one adapter, or of the base model)
at a time: new requests of the running group join it, others wait; when another group waits, the running group takes
at most `quantum` more requests, drains, and the next waiting group in a fixed cyclic order (by name) takes the card.
Each waiting group gets its turn within one pass of the cycle, so none starves, and a lone group never drains.
"""

from __future__ import annotations

from collections.abc import Iterable

BASE = ""  # the group of requests that name no adapter


def may_join(group: str, active: str | None, joined: int, others_waiting: bool, quantum: int) -> bool:
    """Whether a request of `group` may join the pipeline now: it is the active group's and that group has taken
    fewer than `quantum` requests since its turn began, or no other group waits (then its turn has no end)."""
    return group == active and (not others_waiting or joined < quantum)


def next_group(active: str | None, waiting: Iterable[str]) -> str | None:
    """The group whose turn comes once the pipeline has drained: the first group with waiting requests after
    `active` in the cyclic order of group names (the active group itself last), or None when nothing waits."""
    groups = sorted(set(waiting))
    if not groups:
        return None
    if active is None:
        return groups[0]
    later = [g for g in groups if g > active]
    return later[0] if later else groups[0]
