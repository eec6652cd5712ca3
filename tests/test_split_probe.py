"""A split only after proof: the on-load probe's decision (appliance.worker.split_verdict) without a process, and a
composite device refused end to end on the CPU.

On this machine (no GPU) the only composite OpenVINO runs is HETERO:CPU: its answers are the CPU's own (one plugin
runs both), so an answer mismatch cannot be produced here honestly; what can is a real probe that loads both
pipelines, compares their answers, measures memory, and refuses the composite because it names one device. The
mismatch itself is the pure decision's, tested below; the marked GPU suite probes a real two-card split.
"""

from __future__ import annotations

from hypothesis import given, strategies as st

from appliance.worker.split_verdict import PROMPTS, ProbeResult, split_devices, verdict
from conftest import http, model_entry

GIB = 1 << 30
SPLIT = "HETERO:GPU.0,GPU.1"
ANSWERS = ("Paris, the city of light.", "6, 7, 8, 9, 10", "The sea is wide and grey under the rain.")


def test_the_devices_a_split_names():
    assert split_devices(SPLIT) == ("GPU.0", "GPU.1")
    assert split_devices("HETERO:CPU") == split_devices("HETERO:CPU,CPU") == ("CPU",)  # one device, named twice
    assert split_devices("GPU.1") == split_devices("AUTO:GPU.0,GPU.1") == split_devices("MULTI:GPU.0,GPU.1") == ()


def test_a_split_that_answers_as_one_card_and_holds_memory_on_both_passes():
    v = verdict(ProbeResult(SPLIT, ANSWERS, {"GPU.0": 3 * GIB, "GPU.1": 2 * GIB}, ANSWERS, "GPU.0"))
    assert v.ok
    assert v.evidence == ("split HETERO:GPU.0,GPU.1 passed its probe: greedy answers to 3 fixed prompts identical to "
                          "GPU.0's; memory grown: GPU.0 3.0 GiB, GPU.1 2.0 GiB")


def test_a_split_whose_answers_differ_is_refused_naming_the_mismatch():
    garbage = (ANSWERS[0], "6, 7, 8, 9, 10", "!!!!!!!!!!!!!!!!")
    v = verdict(ProbeResult(SPLIT, garbage, {"GPU.0": 3 * GIB, "GPU.1": 2 * GIB}, ANSWERS, "GPU.0"))
    assert not v.ok
    assert v.evidence == (
        "split HETERO:GPU.0,GPU.1 refused: prompt 3 'Write one sentence about the sea.': GPU.0 answered "
        "'The sea is wide and grey under the rain.', HETERO:GPU.0,GPU.1 answered '!!!!!!!!!!!!!!!!' (they differ "
        "from character 0)")


def test_a_split_that_holds_nothing_on_one_card_is_refused_naming_the_card():
    v = verdict(ProbeResult(SPLIT, ANSWERS, {"GPU.0": 6 * GIB, "GPU.1": 0}, ANSWERS, "GPU.0"))
    assert (v.ok, v.evidence) == (False, "split HETERO:GPU.0,GPU.1 refused: device memory did not grow on GPU.1 "
                                         "while it loaded (grown: GPU.0 6.0 GiB, GPU.1 0 B): the split does not use "
                                         "every device it names")


def test_without_a_single_card_reference_the_split_must_repeat_itself_and_not_babble():
    grown = {"GPU.0": 9 * GIB, "GPU.1": 8 * GIB}
    ok = verdict(ProbeResult(SPLIT, ANSWERS, grown, None, again=ANSWERS, reference_error="out of device memory"))
    assert ok.ok and "no single-device reference: out of device memory" in ok.evidence
    babble = ("the the the the the", *ANSWERS[1:])
    v = verdict(ProbeResult(SPLIT, babble, grown, None, again=babble))
    assert not v.ok and "prompt 1 'The capital of France is'" in v.evidence and "one word repeated" in v.evidence
    drift = verdict(ProbeResult(SPLIT, ANSWERS, grown, None, again=(ANSWERS[0], "6, 7, 8", ANSWERS[2])))
    assert not drift.ok and "greedy answers differ when asked twice" in drift.evidence


answers = st.tuples(*[st.text(min_size=1, max_size=12)] * len(PROMPTS))


@given(answers, answers, st.integers(0, 4 * GIB), st.integers(0, 4 * GIB))
def test_a_split_passes_exactly_when_it_matches_its_reference_and_grew_on_every_card(split, reference, g0, g1):
    v = verdict(ProbeResult(SPLIT, split, {"GPU.0": g0, "GPU.1": g1}, reference, "GPU.0"))
    assert v.ok == (split == reference and g0 > 0 and g1 > 0)
    if split != reference:  # the first prompt whose answers differ is named, with both answers
        i = next(i for i in range(len(PROMPTS)) if split[i] != reference[i])
        assert f"prompt {i + 1} {PROMPTS[i]!r}: GPU.0 answered {reference[i]!r}" in v.evidence


def test_a_composite_device_is_refused_end_to_end_with_the_probes_evidence(appliance_factory, demo_model):
    """HETERO:CPU on the demo model: the worker really loads the split and the CPU reference, compares their
    greedy answers (equal here) and measures memory; one device named is no split, so the model is refused: its
    status and the log carry the evidence, a request gets a 503 naming it, and the other model serves on."""
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 1, "window_s": 60}
    app = appliance_factory({"models": [model_entry("split", demo_model, device="HETERO:CPU", restart=budget),
                                        model_entry("demo", demo_model)]}, wait_ready=False)
    failed = app.wait_model("split", "failed")
    evidence = "split HETERO:CPU refused: HETERO:CPU names 1 device: nothing is split"
    assert failed["last_exit"] == "load_error" and f"split_refused: {evidence}" in failed["last_error"]
    assert "Two or more cards" in failed["hint"]
    assert evidence in app.logs()
    status, _, body = http("POST", app.base + "/v1/chat/completions",
                           {"model": "split", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert status == 503 and evidence in body["error"]["message"]
    app.wait_model("demo", "ready")
