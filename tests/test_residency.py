"""The residency policy (appliance.front.residency) without a process: which model loads, which is evicted, which
unloads for idleness; and the config keys of models on demand."""

from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from appliance.config import ConfigError, parse_config, parse_size
from appliance.sizes import MAX_BYTES, UNITS
from appliance.front.lifecycle import ModelState
from appliance.front.residency import Limits, ModelView, plan, why_waiting

GIB = 1 << 30
S = ModelState


def view(name, state=S.READY, **kw) -> ModelView:
    kw.setdefault("device", "GPU.0")
    return ModelView(name=name, state=state, **kw)


def test_an_unloaded_model_nobody_wants_stays_unloaded():
    assert plan([view("a", S.UNLOADED)], Limits(max_loaded=1), now=10) == plan([], Limits(), now=10)


def test_a_wanted_model_loads_at_once_when_there_is_room():
    p = plan([view("a"), view("b", S.UNLOADED, wanted_since=5)], Limits(max_loaded=2), now=10)
    assert (p.load, p.evict, p.waits_for_room) == ("b", (), None)


def test_the_least_recently_used_idle_model_is_evicted_never_a_busy_or_pinned_one():
    models = [view("busy", last_used=1, busy=1), view("pinned", last_used=2, pinned=True),
              view("old", last_used=3), view("recent", last_used=9), view("want", S.UNLOADED, wanted_since=9.5)]
    p = plan(models, Limits(max_loaded=4), now=10)
    assert (p.load, p.evict, p.waits_for_room) == (None, ("old",), "want")


def test_the_load_waits_until_the_evicted_model_has_drained():
    models = [view("a", last_used=9), view("old", S.DRAINING, last_used=3), view("want", S.UNLOADED, wanted_since=9)]
    p = plan(models, Limits(max_loaded=2), now=10)
    assert (p.load, p.evict, p.waits_for_room) == (None, (), "want")  # no second eviction for the same room
    models[1] = view("old", S.UNLOADED, last_used=3)
    assert plan(models, Limits(max_loaded=2), now=10).load == "want"


def test_when_every_loaded_model_is_busy_the_wanted_one_waits():
    models = [view("a", busy=1), view("b", S.LOADING), view("c", S.RESTARTING), view("want", S.UNLOADED, wanted_since=1)]
    p = plan(models, Limits(max_loaded=3), now=10)
    assert (p.load, p.evict, p.waits_for_room, p.blocked) == (None, (), "want", True)


def test_why_a_load_waits_names_the_bounds_and_what_holds_them():
    models = [view("a", busy=1), view("b", pinned=True), view("want", S.UNLOADED, wanted_since=1)]
    text = why_waiting(models[2], models, Limits(max_loaded=2, memory_budget={"GPU.0": 14 * GIB}), lambda name: True)
    assert text == ("no room to load model want (max_loaded 2, memory_budget GPU.0: 14.0 GiB): loaded a (ready, busy), "
                    "b (ready, pinned); none of them can be evicted (only an idle model that is not load: at_start can)")


def test_why_a_placed_model_waits_names_the_budgets_of_the_cards_it_may_go_on():
    """A `device: auto` (or list) model's view has device `auto` and the cards it may be placed on: its 503 said
    "(no limit)" beside a memory_budget that held it back (seen live: memory_budget {CPU: 3GiB}, a pinned model of
    2 GiB, and an auto one of 2 GiB)."""
    models = [view("a", pinned=True, device="CPU"), view("want", S.UNLOADED, wanted_since=1, device="auto",
                                                         cards=("GPU.0", "GPU.1"))]
    text = why_waiting(models[1], models, Limits(memory_budget={"GPU.0": 3 * GIB, "GPU.1": 2 * GIB, "CPU": GIB}),
                       lambda name: True)
    assert text.startswith("no room to load model want (memory_budget GPU.0: 3.0 GiB, memory_budget GPU.1: 2.0 GiB): "
                           "loaded a (ready, pinned)"), text


@given(st.lists(st.sampled_from(["a", "b", "c", "d"]), unique=True), st.sets(st.sampled_from(["a", "b", "c", "d"])))
def test_why_a_load_waits_names_only_the_models_the_callers_key_may_see(loaded, allowed):
    """A key kept off a model never learns its name from another model's 503 (the others are counted)."""
    models = [view(name, busy=1) for name in loaded] + [view("want", S.UNLOADED, wanted_since=1)]
    text = why_waiting(models[-1], models, Limits(max_loaded=len(loaded)), lambda name: name in allowed)
    held = text.split("loaded ", 1)[1].split(";")[0]
    assert all((f"{name} (" in held) == (name in allowed) for name in loaded), text
    hidden = len([name for name in loaded if name not in allowed])
    assert (f"{hidden} other model" in held) == bool(hidden), text


def test_a_model_is_never_evicted_for_itself_and_the_line_is_first_come_first_served():
    models = [view("a", S.UNLOADED, wanted_since=2, last_used=0), view("b", S.UNLOADED, wanted_since=1),
              view("c", last_used=5)]
    p = plan(models, Limits(max_loaded=1), now=10)
    assert (p.evict, p.waits_for_room) == (("c",), "b")


def test_memory_budget_evicts_as_few_as_needed_by_footprint():
    models = [view("small", footprint=1 * GIB, last_used=1), view("big", footprint=6 * GIB, last_used=2),
              view("cpu", device="CPU", footprint=20 * GIB, last_used=0),
              view("want", S.UNLOADED, footprint=5 * GIB, wanted_since=3)]
    p = plan(models, Limits(memory_budget={"GPU.0": 10 * GIB}), now=10)
    # small alone frees too little; small then big (LRU order) is what it takes. The CPU model counts elsewhere.
    assert p.evict == ("small", "big")
    assert plan(models, Limits(memory_budget={"GPU.0": 11 * GIB}), now=10).evict == ("small",)
    assert plan(models, Limits(memory_budget={"GPU.0": 12 * GIB}), now=10).load == "want"


def test_an_unknown_footprint_is_bounded_by_max_loaded_only():
    models = [view("a", footprint=None), view("want", S.UNLOADED, wanted_since=1)]
    assert plan(models, Limits(memory_budget={"GPU.0": 1}), now=10).load == "want"


def test_a_model_larger_than_its_budget_is_impossible_and_blocks_nobody():
    models = [view("huge", S.UNLOADED, footprint=20 * GIB, wanted_since=1), view("ok", S.UNLOADED, wanted_since=2)]
    p = plan(models, Limits(memory_budget={"GPU.0": 14 * GIB}), now=10)
    assert "exceeds server.memory_budget GPU.0: 14.0 GiB" in p.impossible["huge"] and p.load == "ok"


def test_idle_unload_after_idle_unload_s_of_no_request_and_the_next_deadline():
    models = [view("due", idle_unload_s=5, last_used=4), view("soon", idle_unload_s=5, last_used=8),
              view("busy", idle_unload_s=5, last_used=0, busy=2), view("never", last_used=0),
              view("loading", S.LOADING, idle_unload_s=5, last_used=0)]
    p = plan(models, Limits(), now=10)
    assert p.idle == ("due",) and p.recheck_s == pytest.approx(3)


def test_an_idle_unload_makes_room_without_a_second_eviction():
    models = [view("idle", idle_unload_s=1, last_used=0), view("other", last_used=1),
              view("want", S.UNLOADED, wanted_since=9)]
    p = plan(models, Limits(max_loaded=2), now=10)
    assert (p.idle, p.evict, p.load) == (("idle",), (), None)  # the load follows once its drain ends


# --- config ---------------------------------------------------------------------------------------------------

def config(server=None, **model):
    return parse_config({"server": server or {}, "models": [{"name": "a", "path": "/m", **model}]}, "/etc/o.yaml")


def test_the_keys_parse_with_their_defaults():
    c = config()
    assert (c.models[0].load, c.models[0].idle_unload_s, c.models[0].memory_bytes) == ("at_start", 0, None)
    assert (c.server.max_loaded, c.server.memory_budget_bytes) == (0, {})
    c = config({"max_loaded": 1, "memory_budget": {"GPU.0": "14GiB", "CPU": "32GB"}}, load="on_demand",
               idle_unload_s=300, memory="4.5GiB", device="GPU")
    assert c.server.memory_budget_bytes == {"GPU.0": 14 * GIB, "CPU": 32 * 10**9}
    assert c.models[0].memory_bytes == int(4.5 * GIB)
    assert [parse_size(s) for s in ("800MiB", "2 GB", 1024, "1.5G", "x", "-1GiB")] == [
        800 << 20, 2 * 10**9, 1024, 1_500_000_000, None, None]
    # not finite, or past any device: no size (int(inf) raised OverflowError out of check-config, serve and reload)
    for edge in ("inf", "1e400", "nan", "Infinity", "1e400GiB", "1e18TiB", 10**400, 1.5, True, "1e3", "9" * 5000):
        assert parse_size(edge) is None, edge


@given(st.integers(0, MAX_BYTES * 2), st.sampled_from(sorted(UNITS)), st.sampled_from(["", " "]))
def test_a_size_is_read_exactly_in_whole_bytes(number, unit, space):
    """A whole number with a unit is exactly that many bytes, however many digits (it went through a float: 2**53 + 1
    bytes read as 2**53, and 2**60 + 1, past the largest size, was accepted as 2**60)."""
    size = number * UNITS[unit]
    assert parse_size(f"{number}{space}{unit}") == (size if size <= MAX_BYTES else None)


@given(st.integers(0, 10**6), st.integers(0, 999), st.sampled_from(sorted(UNITS)))
def test_a_fractional_size_is_its_whole_bytes_rounded_down(whole, thousandths, unit):
    exact = (whole * 1000 + thousandths) * UNITS[unit] // 1000
    assert parse_size(f"{whole}.{thousandths:03d}{unit}") == (exact if exact <= MAX_BYTES else None)


@pytest.mark.parametrize("server, model, message", [
    ({}, {"load": "lazy"}, "models[0].load: expected one of 'at_start', 'on_demand'"),
    ({}, {"idle_unload_s": -1}, "models[0].idle_unload_s: expected a non-negative number"),
    ({}, {"memory": "lots"}, "models[0].memory: expected a size such as 4.5GiB"),
    ({"max_loaded": -1}, {}, "server.max_loaded: expected a non-negative integer"),
    ({"memory_budget": {"gpu0": "1GiB"}}, {}, "server.memory_budget.gpu0: expected a device name"),
    ({"memory_budget": {"GPU.0": "much"}}, {}, "server.memory_budget.GPU.0: expected a size"),
    ({"memory_budget": {"GPU.0": "4GiB"}}, {"memory": "5GiB", "device": "GPU"},
     "models[0].memory: 5GiB exceeds server.memory_budget.GPU.0 (4GiB); this model could never load"),
])
def test_bad_values_are_named_with_file_and_key(server, model, message):
    with pytest.raises(ConfigError) as info:
        config(server, **model)
    assert str(info.value).startswith("/etc/o.yaml: ") and message in str(info.value)


def test_max_loaded_and_budget_leave_room_for_the_at_start_models():
    models = [{"name": "a", "path": "/m"}, {"name": "b", "path": "/m"}, {"name": "c", "path": "/m", "load": "on_demand"}]
    with pytest.raises(ConfigError, match="server.max_loaded: 1 is fewer than the 2 models with load: at_start"):
        parse_config({"server": {"max_loaded": 1}, "models": models}, "o.yaml")
    assert parse_config({"server": {"max_loaded": 2}, "models": models}, "o.yaml").server.max_loaded == 2
    pinned = [{**m, "memory": "3GiB", "device": "GPU.0"} for m in models]
    with pytest.raises(ConfigError, match="server.memory_budget.GPU.0: 5GiB is less than the memory of the load: "
                                          "at_start models on it"):
        parse_config({"server": {"memory_budget": {"GPU.0": "5GiB"}}, "models": pinned}, "o.yaml")


def test_one_instance_is_one_model_always_loaded():
    c = config({"max_loaded": 1, "memory_budget": {"CPU": "1GiB"}}, load="on_demand", idle_unload_s=5).only("a")
    assert (c.models[0].load, c.models[0].idle_unload_s, c.server.max_loaded, c.server.memory_budget) == (
        "at_start", 0, 0, {})


# --- the Supervisor's view of its models (appliance.front.placement), without a process -------------------------

def test_the_views_the_plan_and_status_read_change_nothing():
    """A busy model reads as used now; reading it (for a plan, a status, a 503's text) must not write anything."""
    import asyncio
    import copy

    from appliance.front.metrics import Metrics
    from appliance.front.supervisor import Supervisor

    async def main() -> None:
        supervisor = Supervisor(parse_config({"server": {"max_loaded": 1}, "models": [
            {"name": "a", "path": "/m", "load": "on_demand"}, {"name": "b", "path": "/m", "load": "on_demand"}]},
            "o.yaml"), Metrics())
        placement = supervisor.placement
        supervisor.models["a"].router.reserved = 1  # an upload holds a place: busy
        before = copy.deepcopy(placement.usage)
        views = placement.views(now=100.0)
        assert [(v.name, v.busy, v.last_used) for v in views] == [("a", 1, 100.0), ("b", 0, 0.0)]
        placement.status("a"), placement.summary(), supervisor._unloaded_refusal("b", supervisor.models["b"], lambda name: True)
        assert placement.usage == before and placement.views(now=100.0) == views

    asyncio.run(main())


# --- a name's residency as one state machine (appliance.front.residency_states), without a process ------------------

from hypothesis import given, settings, strategies as st  # noqa: E402

from appliance.front.placement import Placement  # noqa: E402
from appliance.front.residency_states import TABLE, Act, Event, Phase, step  # noqa: E402

LOADED_PHASES = (Phase.LOADING, Phase.READY, Phase.FAILED, Phase.REPLACING)


def test_every_act_of_the_table_is_carried_out_by_the_owner():
    acts = {act for move in TABLE.values() for act in move.acts}
    assert acts == set(Act) and all(callable(getattr(Placement, f"_act_{act.value}", None)) for act in acts)


def test_every_message_from_outside_has_a_transition_in_every_phase_a_name_lives_in():
    """An unload, a reload or the stop can arrive whatever the name is doing, leaving included (a reload that read
    its config as the stop began: found by the model-based test, a reload after SIGTERM): none of them may be
    lost."""
    for phase in set(Phase) - {Phase.GONE}:
        for event in (Event.UNLOAD, Event.RELOAD_SIDE_BY_SIDE, Event.RELOAD_RESTART, Event.REMOVE, Event.STOP):
            assert step(phase, event) is not None, (phase, event)
    for phase in (Phase.LOADING, Phase.READY, Phase.REPLACING):  # a started one may become ready or give up any time
        assert step(phase, Event.LOADED) is not None and step(phase, Event.GAVE_UP) is not None, phase
    assert step(Phase.GONE, Event.LOAD) is None and all(step(Phase.GONE, e) is None for e in Event)


def test_an_unload_overtaking_a_side_by_side_reload_drops_the_replacement_and_its_late_ready_changes_nothing():
    """The reload-races-unload orphan (issue 35), as the table has it: the unload retires the serving supervisor and
    drops the replacement in the same step; the replacement's ready, if it comes, finds no replacement to switch to
    (the owner hands the table only events of a supervisor that still holds its role)."""
    replacing = step(Phase.READY, Event.RELOAD_SIDE_BY_SIDE)
    assert replacing.phase is Phase.REPLACING and replacing.acts == (Act.START_REPLACEMENT,)
    unloaded = step(Phase.REPLACING, Event.UNLOAD)
    assert unloaded.phase is Phase.ABSENT and set(unloaded.acts) == {Act.RETIRE, Act.DROP_REPLACEMENT}
    assert step(Phase.ABSENT, Event.REPLACEMENT_READY) is None
    assert step(Phase.ABSENT, Event.LOAD).phase is Phase.LOADING


class Roles:
    """What the acts do to a name's supervisors, counted: the serving one started or not, a replacement or not,
    how many leave."""

    def __init__(self):
        self.started, self.replacement, self.leaving, self.stopping, self.gone = False, False, 0, False, False

    def apply(self, act: Act) -> None:
        if act is Act.START:
            assert not self.started and not self.replacement
            self.started = True
        elif act in (Act.RETIRE, Act.SWAP_IN_NEW):
            assert self.started
            self.leaving, self.started = self.leaving + 1, False
        elif act is Act.ADOPT:
            assert not self.started
        elif act is Act.START_REPLACEMENT:
            assert self.started and not self.replacement
            self.replacement = True
        elif act is Act.DROP_REPLACEMENT:
            self.leaving += self.replacement
            self.replacement = False
        elif act is Act.PROMOTE:
            assert self.replacement
            self.leaving, self.replacement = self.leaving + 1, False
        elif act is Act.STOP_IN_PLACE:
            self.stopping = True
        elif act is Act.FORGET:
            self.gone = True


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list(Event)), max_size=40))
def test_any_sequence_of_events_keeps_every_supervisor_in_one_role(events):
    """Generated sequences through the table (events it does not list change nothing, as in the owner): a
    replacement exists exactly while the name is replacing, the serving supervisor is started exactly while the
    name is loaded, nothing is started twice, and a gone name holds nothing."""
    phase, roles = Phase.ABSENT, Roles()
    for event in events:
        move = step(phase, event)
        if move is None:
            continue
        for act in move.acts:
            roles.apply(act)
        phase = move.phase
        assert roles.replacement == (phase is Phase.REPLACING), (phase, event)
        if phase is not Phase.LEAVING and phase is not Phase.GONE:
            assert roles.started == (phase in LOADED_PHASES), (phase, event)
        assert roles.gone == (phase is Phase.GONE) and roles.stopping == (phase in (Phase.LEAVING, Phase.GONE)) \
            or phase is Phase.GONE
        if phase is Phase.GONE:
            break


def test_the_docs_show_the_table_as_it_is():
    from appliance.front.residency_states import table_rows
    from conftest import REPO
    page = (REPO / "docs" / "on-demand.md").read_text()
    rows = ["| " + " | ".join(f"`{c}`" if c != "-" else c for c in row) + " |" for row in table_rows()]
    lines = page.splitlines()
    header = lines.index("| Phase | Event | Next phase | What the owner does |")
    shown = lines[header + 2:]
    shown = shown[:next((i for i, line in enumerate(shown) if not line.startswith("|")), len(shown))]
    assert shown == rows  # every transition, in the table's order, and no row the table does not have


# --- the request ledger (appliance.front.request_ledger): handles closed once, no spool file left -------------------

def test_the_request_ledger_says_once_what_a_request_left_open_or_closed_twice(tmp_path):
    import asyncio

    from appliance.front.request_ledger import SCOPE, RequestLedger, Scope

    ledger = RequestLedger(enabled=True)
    left, gone = tmp_path / "left.f32", tmp_path / "gone.f32"

    async def request(route) -> Scope:
        """A route in its request's scope; a task it starts (the stream's first event) is in the same one."""
        scope = Scope()
        SCOPE.set(scope)
        await route()
        scope.ended = True
        return scope

    async def well_behaved():
        handle = object()

        async def first():  # opened in a task of its own, as a stream's first event is
            ledger.opened(handle, "m")
        await asyncio.create_task(first())
        ledger.spooled(str(gone))
        gone.write_bytes(b"x")
        assert ledger.check() == []  # its request runs: an open handle and a spool file are its business
        gone.unlink()
        ledger.closed(handle, "m")

    async def careless():
        ledger.opened(object(), "m")  # never closed
        ledger.spooled(str(left))
        left.write_bytes(b"x")  # never removed
        twice = object()
        ledger.opened(twice, "n")
        ledger.closed(twice, "n")
        ledger.closed(twice, "n")

    async def main():
        await asyncio.create_task(request(well_behaved))
        assert ledger.check() == []
        await asyncio.create_task(request(careless))
        return ledger.check()

    assert sorted(asyncio.run(main())) == sorted([
        "model n: a request handle was closed that was not open (closed twice)",
        "model m: a request handle was never closed (its request ended)",
        f"spool file {left} outlived its request"])
    assert ledger.check() == []  # each said once
    off = RequestLedger(enabled=False)  # without the debug switch nothing is kept
    off.opened(object(), "m")
    off.spooled(str(left))
    off.closed(object(), "m")
    assert (off.handles, off.spool, off.check()) == ({}, {}, [])
