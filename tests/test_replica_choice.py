"""The replica policy (appliance.front.replica_choice), replicas in the config (appliance.config.replicas), one card per
GPU worker (appliance.config.card_env) and the replicas' invariant, as pure functions: no process runs here."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, strategies as st

from appliance.config import ConfigError, parse_config
from appliance.config.card_env import card_env
from appliance.config.replicas import all_units
from appliance.front import invariants
from appliance.front.metrics import Metrics
from appliance.front.placement import Placement
from test_metrics import samples, value
from appliance.front.replica_choice import AffinityMemory, ReplicaView, choose, prefix_chain

views = st.lists(st.builds(ReplicaView, key=st.text(min_size=1, max_size=4), ready=st.booleans(),
                           running=st.integers(0, 8), waiting=st.integers(0, 12), matched=st.integers(0, 5000)),
                 min_size=1, max_size=4, unique_by=lambda v: v.key)


@given(views, st.integers(0, 8), st.integers(0, 100), st.booleans())
def test_a_replica_not_ready_gets_nothing(replicas, bound, turn, round_robin):
    chosen = choose(replicas, bound, turn, round_robin)
    ready = {v.key for v in replicas if v.ready}
    assert (chosen in ready) if ready else chosen is None


@given(views, st.integers(0, 8), st.integers(0, 100))
def test_the_longest_prefix_wins_unless_its_queue_or_its_lead_is_over_the_bound(replicas, bound, turn):
    chosen = choose(replicas, bound, turn)
    ready = [v for v in replicas if v.ready]
    if not ready:
        return
    by_key = {v.key: v for v in ready}
    longest = max(v.matched for v in ready)
    holders = [v for v in ready if v.matched == longest]
    least_holder = min(v.load for v in holders)
    least = min(v.load for v in ready)
    if longest > 0 and all(v.waiting <= bound and v.load - least <= bound for v in holders if v.load == least_holder):
        assert by_key[chosen].matched == longest  # affinity: the conversation stays where its cache is
    else:
        assert by_key[chosen].load == min(v.load for v in ready)  # nobody holds it, or its holder is busy


@given(st.integers(1, 4), st.integers(0, 50))
def test_round_robin_takes_the_ready_replicas_in_turn(count, start):
    replicas = [ReplicaView(str(i), True) for i in range(count)]
    assert [choose(replicas, 0, turn, True) for turn in range(start, start + count)] == \
        [str(turn % count) for turn in range(start, start + count)]


@given(views, st.integers(0, 8), st.integers(0, 100))
def test_no_replica_takes_more_than_the_bound_beyond_the_least_loaded(replicas, bound, turn):
    """Affinity never piles load on one replica: the chosen one's load is at most `bound` over the least loaded
    ready one's (else a prefix all requests share, such as a chat UI's system prompt, left the others idle)."""
    chosen = choose(replicas, bound, turn)
    ready = {v.key: v for v in replicas if v.ready}
    if ready:
        assert ready[chosen].load <= min(v.load for v in ready.values()) + bound


@given(st.integers(2, 4), st.integers(4, 24), st.integers(1, 4), st.text(min_size=1, max_size=200))
def test_new_conversations_sharing_a_system_prompt_use_every_replica(count, clients, bound, system):
    """Clients open conversations at once with one system prompt (Open WebUI's, an agent's) and none ends: the
    first replica holds that prefix first, and still each replica takes requests and no replica runs more than
    `bound` over another."""
    memories = [AffinityMemory() for _ in range(count)]
    loads = [0] * count
    for client in range(clients):
        chain = prefix_chain({"messages": [{"role": "system", "content": system},
                                           {"role": "user", "content": f"question {client}"}]})
        views = [ReplicaView(str(i), True, running=loads[i], matched=memories[i].matched(chain)) for i in range(count)]
        chosen = int(choose(views, bound, client))
        memories[chosen].remember(chain)
        loads[chosen] += 1
    assert max(loads) - min(loads) <= bound + 1, loads
    if clients >= count * (bound + 1):
        assert min(loads) > 0, loads


messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]),
                                           "content": st.text(max_size=30)}), min_size=1, max_size=6)


@given(messages, messages, st.text(max_size=20))
def test_a_conversation_next_turn_matches_all_it_was_sent_before(earlier, later, system):
    memory = AffinityMemory()
    first = {"system": system, "messages": earlier}
    memory.remember(prefix_chain(first))
    following = {"system": system, "messages": earlier + later}
    assert memory.matched(prefix_chain(following)) == prefix_chain(first)[-1][1]
    # another conversation (different first message) matches nothing past what it shares
    other = {"system": system + "!", "messages": earlier}
    assert memory.matched(prefix_chain(other)) == 0


def test_a_memory_forgets_its_least_recently_used_prefixes():
    memory = AffinityMemory(size=4)
    old, new = prefix_chain({"prompt": "a" * 3000}), prefix_chain({"prompt": "b" * 4000})
    memory.remember(old)
    memory.remember(new)
    assert memory.matched(new) == 4000 and memory.matched(old) == 0


def model(device) -> dict:
    return {"models": [{"name": "m", "path": "/nowhere", "device": device}]}


def test_a_device_list_is_one_unit_per_replica():
    config = parse_config(model(["CPU", "CPU"]), "f.yaml")
    assert [(u.key, u.model.device, u.replica) for u in all_units(config.models)] == \
        [("m@CPU#0", "CPU", "CPU#0"), ("m@CPU#1", "CPU", "CPU#1")]
    gpus = parse_config(model(["GPU.0", "GPU.1"]), "f.yaml")
    assert [(u.key, u.replica) for u in all_units(gpus.models)] == [("m@GPU.0", "GPU.0"), ("m@GPU.1", "GPU.1")]
    assert [u.key for u in all_units(parse_config(model("GPU.1"), "f.yaml").models)] == ["m"]  # a string: as before
    assert [u.key for u in all_units(parse_config(model(["GPU.1"]), "f.yaml").models)] == ["m"]  # one: no replicas


@pytest.mark.parametrize("device, says", [
    ([], "models[0].device: expected a device name, or a list of at least one"),
    (["GPU.0", "GPU"], "models[0].device: expected each card once (GPU.0 listed twice; bare GPU is GPU.0)"),
    (["GPU.1", "GPU.1"], "models[0].device: expected each card once (GPU.1 listed twice"),
    (["HETERO:GPU.0,GPU.1", "CPU"], "models[0].device: expected one device per replica; 'HETERO:GPU.0,GPU.1' is a "
                                    "composite device"),
    (["gpu.0"], "models[0].device: expected a list of OpenVINO device names such as GPU.0, GPU.1 or CPU; 'gpu.0'"),
    (5, "models[0].device: expected a string or a list, got 5"),
])
def test_a_bad_device_list_names_the_file_and_key(device, says):
    with pytest.raises(ConfigError) as error:
        parse_config(model(device), "/etc/openarc/openarc.yaml")
    assert any(line.startswith(f"/etc/openarc/openarc.yaml: {says}") for line in error.value.lines), str(error.value)


def test_each_replica_counts_against_max_loaded_and_its_device_budget():
    config = {"server": {"max_loaded": 1},
              "models": [{"name": "m", "path": "/nowhere", "device": ["CPU", "CPU"]}]}
    with pytest.raises(ConfigError, match=r"max_loaded: 1 is fewer than the 2 models with load: at_start \(m, m\).*; each replica counts"):
        parse_config(config, "f.yaml")
    budget = {"server": {"memory_budget": {"GPU.0": "4GiB", "GPU.1": "4GiB"}},
              "models": [{"name": "m", "path": "/nowhere", "device": ["GPU.0", "GPU.1"], "memory": "3GiB"}]}
    parse_config(budget, "f.yaml")  # 3 GiB on each card: fits each
    budget["models"].append({"name": "n", "path": "/nowhere", "device": "GPU.1", "memory": "2GiB"})
    with pytest.raises(ConfigError, match=r"server.memory_budget.GPU.1: 4GiB is less than"):
        parse_config(budget, "f.yaml")


A770, B580 = "0000:03:00.0", "0000:08:00.0"
IGPU = "0000:00:02.0"


@pytest.mark.parametrize("device, pci, mask, seen", [
    ("GPU.1", [A770, B580], "1", "GPU.0"),           # two cards: the second in PCI order
    ("GPU.0", [A770, B580], "0", "GPU.0"),
    ("GPU", [A770, B580], "0", "GPU.0"),             # bare GPU is GPU.0
    ("GPU.1", [IGPU, B580, A770], "2", "GPU.0"),     # OpenVINO's order is not the driver's: the mask follows PCI
    ("GPU.0", [IGPU, B580, A770], "0", "GPU.0"),
])
def test_a_gpu_worker_sees_its_own_card_only(device, pci, mask, seen):
    env, spec = card_env({"device": device, "name": "m"}, pci, {})
    assert env == {"ZE_AFFINITY_MASK": mask} and spec == {"device": seen, "name": "m"}


@pytest.mark.parametrize("spec, pci, environ", [
    ({"device": "CPU"}, [A770], {}),
    ({"device": "HETERO:GPU.0,GPU.1"}, [A770, B580], {}),                              # several cards
    ({"device": "GPU.1", "draft_model": {"device": "GPU.0"}}, [A770, B580], {}),       # its draft on the other
    ({"device": "GPU.2"}, [A770, B580], {}),                                           # OpenVINO lacks that card
    ({"device": "GPU.1"}, [], {}),                                                     # addresses unknown
    ({"device": "GPU.1"}, [A770, B580], {"ZE_AFFINITY_MASK": "1"}),                    # the operator's mask stands
])
def test_a_worker_that_needs_more_or_cannot_be_placed_is_left_as_it_is(spec, pci, environ):
    assert card_env(spec, pci, environ) == ({}, spec)


def test_a_draft_on_the_same_card_moves_with_it():
    env, spec = card_env({"device": "GPU.1", "draft_model": {"device": "GPU.1", "path": "d"}}, [A770, B580], {})
    assert env == {"ZE_AFFINITY_MASK": "1"} and spec["draft_model"] == {"device": "GPU.0", "path": "d"}


def test_the_invariants_name_two_replicas_on_one_card():
    owner = Placement(parse_config(model(["GPU.0", "GPU.1"]), "f.yaml"), Metrics())
    assert invariants._replicas(owner) == []
    moved = owner.models["m@GPU.1"]
    moved.model = dataclasses.replace(moved.model, device="GPU.0")
    assert invariants._replicas(owner) == ["replicas m@GPU.0 and m@GPU.1 of model m share a card"]


def test_the_model_series_add_its_replicas_up_and_follow_the_configs_shape():
    metrics = Metrics()
    for key, device in (("m@CPU#0", "CPU#0"), ("m@CPU#1", "CPU#1")):
        metrics.add_replica(key, "m", device)
    first, second = metrics.for_model("m@CPU#0"), metrics.for_model("m@CPU#1")
    first.requests_running.set(3)
    second.requests_running.set(2)
    metrics.set_state("m@CPU#0", "restarting")
    metrics.set_state("m@CPU#1", "ready")
    scrape = samples(metrics.exposition()[0].decode())
    assert value(scrape, "openarc_requests_running", model="m") == 5
    assert value(scrape, "openarc_replica_requests_running", model="m", device="CPU#1") == 2
    assert value(scrape, "openarc_model_state", model="m", state="ready") == 1  # its best replica serves
    assert value(scrape, "openarc_replica_up", model="m", device="CPU#0") == 0
    assert not [k for k in scrape if dict(k[1]).get("model", "m") != "m"]  # no label value minted from a unit key
    metrics.add_model("m")  # a reload to one device: the new worker's states are the model's
    metrics.for_model("m").requests_running.set(1)
    metrics.set_state("m", "loading")
    metrics.set_state("m@CPU#1", "stopped")  # a leaving replica's last state and queue
    second.requests_running.set(0)
    scrape = samples(metrics.exposition()[0].decode())
    assert value(scrape, "openarc_model_state", model="m", state="loading") == 1
    assert value(scrape, "openarc_requests_running", model="m") == 1
