"""Placement across cards without a process: which cards a box has (recorded two-card sysfs roots: two B580s; an
A770 beside a B580), each card's budget, the card the placer chooses for `device: auto` (or bare GPU on several
cards), evictions that stay on the chosen card, and a draft on another card counted there."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from appliance.config import parse_config
from appliance.front.cards import Card, cards_of, placeable
from appliance.front.lifecycle import ModelState
from appliance.front.residency import Limits, ModelView, plan
from appliance.host.gpus import list_gpus
from doctor_roots import build_cards_root

GIB = 1 << 30
S = ModelState
B580_VRAM = 12 * GIB  # xe backport tile0/physical_vram_size_bytes of a 12 GB card


@pytest.fixture
def two_b580(tmp_path):
    return list_gpus(build_cards_root(tmp_path / "root", "b580.uevent", "b580-second.uevent") / "sys")


@pytest.fixture
def a770_b580(tmp_path):
    return list_gpus(build_cards_root(tmp_path / "root", "a770-le.uevent", "b580.uevent", vram={1: B580_VRAM}) / "sys")


def test_the_cards_of_two_b580s_are_named_in_pci_order_with_their_configured_budgets(two_b580):
    cards = cards_of(two_b580, {"GPU.0": 11 * GIB, "GPU.1": 10 * GIB})
    assert cards == (Card("GPU.0", 11 * GIB, "Intel Arc B580 at 0000:07:00.0", "0000:07:00.0"),
                     Card("GPU.1", 10 * GIB, "Intel Arc B580 at 0000:0a:00.0", "0000:0a:00.0"))


def test_a_card_without_a_configured_budget_falls_back_to_the_vram_sysfs_shows_else_has_none(a770_b580):
    cards = cards_of(a770_b580, {})
    assert [(c.name, c.budget, c.label) for c in cards] == [
        ("GPU.0", None, "Intel Arc A770 at 0000:03:00.0"),  # i915 shows no VRAM total
        ("GPU.1", B580_VRAM, "Intel Arc B580 at 0000:07:00.0")]
    assert cards_of(a770_b580, {"GPU.1": 10 * GIB})[1].budget == 10 * GIB  # the config's budget wins


def test_which_devices_the_placer_places(two_b580):
    two = cards_of(two_b580, {})
    one = two[:1]
    assert placeable("auto", two) == ("GPU.0", "GPU.1")
    assert placeable("GPU", two) == ("GPU.0", "GPU.1")       # bare GPU on several cards: any of them
    assert placeable("GPU", one) == ()                        # on one card: that card, as always
    assert placeable("GPU.1", two) == placeable("HETERO:GPU.0,GPU.1", two) == ()  # the user's choice stands
    assert placeable("auto", ()) == ("CPU",)                  # a box without a GPU


def limits_of(gpus, **budgets) -> Limits:
    from appliance.front.cards import budgets as merged
    return Limits(0, merged(cards_of(gpus, {}), {k.replace("_", "."): v for k, v in budgets.items()}))


@pytest.mark.parametrize("root", ["two_b580", "a770_b580"])
def test_two_models_that_do_not_fit_one_card_go_on_both_cards(root, request):
    gpus = request.getfixturevalue(root)
    cards = tuple(c.name for c in cards_of(gpus, {}))
    limits = limits_of(gpus, GPU_0=12 * GIB, GPU_1=12 * GIB)
    a = ModelView("a", S.UNLOADED, "auto", 9 * GIB, wanted_since=1, cards=cards)
    b = ModelView("b", S.UNLOADED, "auto", 9 * GIB, wanted_since=2, cards=cards)
    first = plan([a, b], limits, now=10)
    assert (first.load, first.evict) == ("a", ())
    loaded = ModelView("a", S.READY, first.device, 9 * GIB, busy=1)
    second = plan([loaded, b], limits, now=10)
    assert (second.load, second.evict) == ("b", ())
    assert {first.device, second.device} == {"GPU.0", "GPU.1"}
    assert second.placed.startswith(f"placed on {second.device} (footprint 9.0 GiB); ")
    assert f"{first.device}: 3.0 GiB free of 12.0 GiB" in second.placed


def test_the_card_with_the_most_room_left_is_chosen_and_status_says_why(a770_b580):
    limits = limits_of(a770_b580, GPU_0=15 * GIB)  # the A770's budget set; the B580's from its sysfs VRAM
    head = ModelView("m", S.UNLOADED, "auto", 4 * GIB, wanted_since=1, cards=("GPU.0", "GPU.1"))
    p = plan([head, ModelView("x", S.READY, "GPU.0", 8 * GIB)], limits, now=10)
    assert (p.load, p.device) == ("m", "GPU.1")  # 8 GiB left there against 3 GiB on the A770
    assert p.placed == ("placed on GPU.1 (footprint 4.0 GiB); GPU.0: 7.0 GiB free of 15.0 GiB, "
                        "GPU.1: 12.0 GiB free of 12.0 GiB")


def test_a_placed_model_evicts_on_one_card_only_and_prefers_the_card_needing_fewer_evictions():
    limits = Limits(0, {"GPU.0": 12 * GIB, "GPU.1": 12 * GIB})
    models = [ModelView("a", S.READY, "GPU.0", 4 * GIB, last_used=1), ModelView("b", S.READY, "GPU.0", 4 * GIB,
              last_used=2), ModelView("x", S.READY, "GPU.0", 3 * GIB, last_used=2.5),
              ModelView("c", S.READY, "GPU.1", 8 * GIB, last_used=3),
              ModelView("m", S.UNLOADED, "auto", 6 * GIB, wanted_since=5, cards=("GPU.0", "GPU.1"))]
    p = plan(models, limits, now=10)
    assert (p.load, p.evict, p.waits_for_room) == (None, ("c",), "m")  # one eviction on GPU.1, not two on GPU.0


def test_between_cards_needing_one_eviction_each_the_least_recently_used_model_goes():
    limits = Limits(0, {"GPU.0": 1 * GIB, "GPU.1": 1 * GIB})
    models = [ModelView("a", S.READY, "GPU.0", 700 << 20, last_used=8), ModelView("b", S.READY, "GPU.1", 700 << 20,
              last_used=3), ModelView("c", S.UNLOADED, "auto", 700 << 20, wanted_since=9, cards=("GPU.0", "GPU.1"))]
    assert plan(models, limits, now=10).evict == ("b",)


def test_a_model_that_fits_no_card_is_impossible_one_that_fits_one_card_is_not():
    limits = Limits(0, {"GPU.0": 8 * GIB, "GPU.1": 12 * GIB})
    big = ModelView("big", S.UNLOADED, "auto", 14 * GIB, wanted_since=1, cards=("GPU.0", "GPU.1"))
    assert plan([big], limits, now=10).impossible == {
        "big": "its footprint (14.0 GiB) exceeds server.memory_budget GPU.0: 8.0 GiB and server.memory_budget "
               "GPU.1: 12.0 GiB"}
    mid = ModelView("mid", S.UNLOADED, "auto", 10 * GIB, wanted_since=1, cards=("GPU.0", "GPU.1"))
    p = plan([mid], limits, now=10)
    assert (p.impossible, p.load, p.device) == ({}, "mid", "GPU.1")


def test_a_draft_on_another_card_counts_there():
    limits = Limits(0, {"GPU.0": 12 * GIB, "GPU.1": 12 * GIB})
    main = ModelView("main", S.READY, "GPU.0", 8 * GIB, last_used=1, elsewhere=(("GPU.1", 4 * GIB),))
    other = ModelView("other", S.UNLOADED, "GPU.1", 9 * GIB, wanted_since=5)
    p = plan([main, other], limits, now=10)
    assert (p.load, p.evict) == (None, ("main",))  # 4 + 9 GiB > 12 GiB on GPU.1: the draft's card is short
    small = ModelView("small", S.UNLOADED, "GPU.1", 7 * GIB, wanted_since=5)
    assert plan([main, small], limits, now=10).load == "small"  # 4 + 7 GiB fit
    no_draft = ModelView("main", S.READY, "GPU.0", 8 * GIB, last_used=1)
    assert plan([no_draft, other], limits, now=10).load == "other"


CARDS = ("GPU.0", "GPU.1")
models_on_cards = st.lists(st.builds(
    lambda i, card, size, busy, pinned, used: ModelView(f"m{i}", S.READY, card, size * GIB, busy=busy, pinned=pinned,
                                                        last_used=used),
    st.integers(0, 10**6), st.sampled_from(CARDS), st.integers(0, 12), st.integers(0, 1), st.booleans(),
    st.floats(0, 9)), max_size=8, unique_by=lambda m: m.name)


@settings(max_examples=300, deadline=None)
@given(models_on_cards, st.integers(1, 14), st.sampled_from([CARDS, ("GPU.0",), ("GPU.1",)]),
       st.integers(6, 16), st.integers(6, 16))
def test_an_eviction_for_a_load_stays_on_one_card_and_makes_room_there(loaded, size, cards, budget0, budget1):
    limits = Limits(0, {"GPU.0": budget0 * GIB, "GPU.1": budget1 * GIB})
    head = ModelView("head", S.UNLOADED, "auto", size * GIB, wanted_since=9.5, cards=cards)
    p = plan([*loaded, head], limits, now=10)
    by_name = {m.name: m for m in loaded}
    evicted_cards = {by_name[name].device for name in p.evict}
    assert len(evicted_cards) <= 1 and evicted_cards <= set(cards)
    assert not any(by_name[name].busy or by_name[name].pinned for name in p.evict)
    if p.evict:  # what stays on that card leaves room for the head
        card = evicted_cards.pop()
        kept = sum(m.footprint for m in loaded if m.device == card and m.name not in p.evict)
        assert kept + head.footprint <= limits.memory_budget[card]
    if p.load:
        used = sum(m.footprint for m in loaded if m.device == p.device)
        assert p.device in cards and used + head.footprint <= limits.memory_budget[p.device]


def test_the_owner_places_a_model_at_start_and_status_says_where_and_why(two_b580):
    """Placement with the recorded two-B580 box: each card's budget from server.memory_budget, an `auto` model's
    card chosen before its worker exists, and status's placement field."""
    from appliance.front.metrics import Metrics
    from appliance.front.placement import Placement

    config = parse_config({"server": {"memory_budget": {"GPU.0": "12GiB", "GPU.1": "12GiB"}}, "models": [
        {"name": "a", "path": "/a", "device": "auto", "memory": "9GiB", "load": "on_demand"},
        {"name": "b", "path": "/b", "device": "GPU.1", "memory": "2GiB", "load": "on_demand"}]}, "o.yaml")

    async def scenario():
        placement = Placement(config, Metrics(), host_gpus=two_b580)
        assert placement.placement_status("b") == {"device": "GPU.1", "why": "device: GPU.1 as configured"}
        assert placement.placement_status("a") == {
            "device": None, "why": "device: auto: the placer picks one of GPU.0, GPU.1 at its next load"}
        assert placement.card_now(config.model("a")) == (
            "GPU.0", "placed on GPU.0 (footprint 9.0 GiB); GPU.0: 12.0 GiB free of 12.0 GiB, "
                     "GPU.1: 12.0 GiB free of 12.0 GiB")
        assert placement.limits().memory_budget == {"GPU.0": 12 * GIB, "GPU.1": 12 * GIB}

    asyncio.run(scenario())


def test_an_auto_model_is_placed_and_served_end_to_end_on_a_box_without_a_gpu(appliance_factory, demo_model):
    """This box has no GPU: `device: auto` places on the CPU, through the same path as a card (the unloaded
    supervisor replaced by one on the chosen device before its worker starts), at start and on demand; status says
    where and why, and the owner's invariants hold throughout (the factory fails on a logged BUG)."""
    from conftest import http, model_entry
    app = appliance_factory({"models": [model_entry("first", demo_model, device="auto"),
                                        model_entry("later", demo_model, device="auto", load="on_demand")]})
    first = app.model_status("first")
    assert (first["state"], first["device"]) == ("ready", "CPU")
    assert first["placement"] == {"device": "CPU", "why": "placed on CPU (footprint unknown); CPU: no budget"}
    assert app.model_status("later")["placement"] == {
        "device": None, "why": "device: auto: the placer picks one of CPU at its next load"}
    reply = app.client().chat.completions.create(model="later", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=3)
    assert reply.usage.completion_tokens == 3
    later = app.model_status("later")
    assert (later["device"], later["placement"]["device"]) == ("CPU", "CPU")
    assert later["placement"]["why"].startswith("placed on CPU (footprint ")
    status, _, _ = http("POST", app.base + "/openarc/models/later/unload", headers=app.auth)
    assert status == 200
    assert app.wait_model("later", "unloaded")["placement"] == {
        "device": None, "why": "device: auto: the placer picks one of CPU at its next load (last on CPU)"}


def test_a_draft_on_the_other_card_is_measured_apart_from_the_worker_fdinfo(tmp_path):
    """A worker with its model on the A770 (0000:03:00.0) and its draft on the B580 (0000:07:00.0, the recorded
    xe client moved to that card's address): its fdinfo splits into the main model's bytes and the draft's."""
    from appliance.front.residency_book import split_by_card
    from appliance.host.device_memory import device_memory_used
    from doctor_roots import FIXTURES

    fdinfo = tmp_path / "proc" / "4242" / "fdinfo"
    fdinfo.mkdir(parents=True)
    (fdinfo / "7").write_text((FIXTURES / "gpu/fdinfo/i915-a770-compute.txt").read_text())
    (fdinfo / "9").write_text((FIXTURES / "gpu/fdinfo/xe-b580-llm.txt").read_text()
                              .replace("drm-pdev:\t0000:03:00.0", "drm-pdev:\t0000:07:00.0"))
    used = device_memory_used([4242], tmp_path / "proc")
    names = {"0000:03:00.0": "GPU.0", "0000:07:00.0": "GPU.1"}  # the A770 + B580 root's cards
    assert split_by_card(used, "0000:03:00.0", names) == (7342084 << 10, {"GPU.1": 8388612 << 10})
    assert split_by_card(used, "0000:03:00.0", {}, "GPU.1") == (7342084 << 10, {"GPU.1": 8388612 << 10})
    assert split_by_card(used, "0000:03:00.0", {}) == ((7342084 + 8388612) << 10, {})  # unnamed: on its own card
    assert split_by_card(used, None, names) == ((7342084 + 8388612) << 10, {})  # its own card unknown: all there


def test_the_owner_counts_what_a_model_holds_on_its_other_cards_there(two_b580):
    """Placement's view of a model whose draft_model.device is the other card, and of a split: their measured
    shares on the other card count there; a share measured on a card the model does not name counts nowhere."""
    from appliance.front.metrics import Metrics
    from appliance.front.placement import Placement

    draft = {"name": "m", "path": "/main", "device": "GPU.0", "load": "on_demand",
             "draft_model": {"path": "/draft", "device": "GPU.1"}}
    split = {"name": "m", "path": "/main", "device": "HETERO:GPU.0,GPU.1", "load": "on_demand"}
    alone = {"name": "m", "path": "/main", "device": "GPU.0", "load": "on_demand"}

    async def needs(model):
        config = parse_config({"server": {"memory_budget": {"GPU.0": "12GiB", "GPU.1": "12GiB"}},
                               "models": [model]}, "o.yaml")
        placement = Placement(config, Metrics(), host_gpus=two_b580)
        placement.usage["m"].measured, placement.usage["m"].measured_elsewhere = 8 * GIB, {"GPU.1": 3 * GIB}
        (view,) = placement.views(now=1.0)
        return view.needs()

    assert asyncio.run(needs(draft)) == asyncio.run(needs(split)) == {"GPU.0": 8 * GIB, "GPU.1": 3 * GIB}
    assert asyncio.run(needs(alone)) == {"GPU.0": 8 * GIB}


def test_a_replica_listed_as_bare_gpu_stays_on_gpu0_and_never_joins_its_sibling(two_b580):
    """`device: [GPU, GPU.1]` is one replica per card (bare GPU is GPU.0, as the config check says): its bare-GPU
    replica is not placed by the placer like a bare-GPU model on a two-card box, so however full GPU.0 is, it never
    goes on GPU.1 beside its sibling (two copies of the weights and KV cache on one card)."""
    from dataclasses import replace

    from appliance.front.metrics import Metrics
    from appliance.front.placement import Placement

    config = parse_config({"server": {"memory_budget": {"GPU.0": "12GiB", "GPU.1": "12GiB"}}, "models": [
        {"name": "big", "path": "/a", "device": "GPU.0", "memory": "9GiB", "load": "on_demand"},
        {"name": "rep", "path": "/b", "device": ["GPU", "GPU.1"], "memory": "2GiB", "load": "on_demand"}]}, "o.yaml")

    async def scenario():
        placement = Placement(config, Metrics(), host_gpus=two_b580)
        assert placement.placement_status("rep@GPU")["device"] in ("GPU", "GPU.0")
        loaded = {"big", "rep@GPU.1"}  # GPU.0: 3 GiB free; GPU.1: 10 GiB free
        views = [replace(v, state=S.READY, last_used=1.0) if v.name in loaded else
                 replace(v, wanted_since=1.0) if v.name == "rep@GPU" else v for v in placement.views(2.0)]
        decided = plan(views, placement.limits(), 2.0)
        assert decided.load == "rep@GPU" and decided.device in (None, "GPU.0"), decided

    asyncio.run(scenario())
