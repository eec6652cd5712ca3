"""Two or more cards, on a real box with two Intel Arc cards (run with `pytest -m gpu`; deselected elsewhere, and
each test needs two discrete cards): placement by footprint puts two models that do not fit one card on both, an
eviction on one card leaves the other's worker alone, and a HETERO split never loads without its probe's evidence.
"""

from __future__ import annotations

import pytest

from appliance.host.gpus import list_gpus
from conftest import http, model_entry

DISCRETE = [gpu for gpu in list_gpus() if gpu.family in ("DG2", "BMG")]
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(len(DISCRETE) < 2, reason=f"needs two Arc cards, this box has {len(DISCRETE)}")]

# The demo model is tiny: declared footprints and budgets make "does not fit one card" true by the config's numbers,
# the arithmetic the placer runs on whatever the real sizes are.
BUDGETS = {"GPU.0": "1GiB", "GPU.1": "1GiB"}


def chat(app, model: str) -> None:
    reply = app.client().chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_two_models_that_do_not_fit_one_card_are_placed_on_both(appliance_factory, demo_model):
    app = appliance_factory({"server": {"memory_budget": BUDGETS},
                             "models": [model_entry(name, demo_model, device="auto", memory="700MiB", load="on_demand")
                                        for name in ("a", "b")]})
    chat(app, "a")
    chat(app, "b")
    a, b = app.model_status("a"), app.model_status("b")
    assert {a["device"], b["device"]} == {"GPU.0", "GPU.1"}
    assert a["placement"]["device"] == a["device"] and a["placement"]["why"].startswith(f"placed on {a['device']}")
    assert a["state"] == b["state"] == "ready"


def test_an_eviction_on_one_card_never_touches_the_other(appliance_factory, demo_model):
    app = appliance_factory({"server": {"memory_budget": BUDGETS},
                             "models": [model_entry("a", demo_model, device="GPU.0", memory="700MiB", load="on_demand"),
                                        model_entry("b", demo_model, device="GPU.1", memory="700MiB", load="on_demand"),
                                        model_entry("c", demo_model, device="auto", memory="700MiB",
                                                    load="on_demand")]})
    chat(app, "b")
    chat(app, "a")
    a_pid = app.worker_pid("a")
    chat(app, "c")  # one eviction on either card makes room: the staler card's model goes, b on GPU.1
    assert app.model_status("c")["device"] == "GPU.1"
    assert app.model_status("b")["state"] == "unloaded"
    assert app.model_status("a")["state"] == "ready" and app.worker_pid("a") == a_pid


def test_a_split_never_loads_without_its_probes_evidence(appliance_factory, demo_model):
    budget = {"backoff_initial_s": 0.05, "backoff_max_s": 0.1, "max_failures": 1, "window_s": 60}
    app = appliance_factory({"models": [model_entry(
        "split", demo_model, device="HETERO:GPU.0,GPU.1", restart=budget,
        runtime_config={"MODEL_DISTRIBUTION_POLICY": "PIPELINE_PARALLEL"})]}, wait_ready=False)

    def settled():
        state = app.model_status("split")["state"]
        return state if state in ("ready", "failed") else None

    from conftest import wait_until
    state = wait_until(settled, 300, "the split's probe")
    if state == "ready":  # it proved itself: both cards hold memory, its answers are GPU.0's
        assert "split HETERO:GPU.0,GPU.1 passed its probe: greedy answers to 3 fixed prompts identical" in app.logs()
        chat(app, "split")
    else:
        status = app.model_status("split")
        assert "split_refused: split HETERO:GPU.0,GPU.1 refused: " in status["last_error"]
        code, _, body = http("POST", app.base + "/v1/chat/completions",
                             {"model": "split", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert code == 503 and "refused" in body["error"]["message"]
