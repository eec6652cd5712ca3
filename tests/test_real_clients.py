"""The real clients, unmodified, at their pinned releases (bench.clients.catalog): Claude Code, Codex CLI and opencode
run headless against a live server on demo models, through the recording proxy of bench.clients.proxy.

What a user sees is what is asserted: the client exits 0 and prints the answer the server sent; no request of
theirs was refused. The tool round trips have their first turn answered by the proxy with one well-formed call
(a random demo model never closes a JSON string); the client runs the tool and replays call and result to the
server, which answers the second turn. `make test` installs the clients into $(PREFIX)/clients first
(`make install-clients`); run alone, this file installs what is missing (npm registry only).

The demo model here answers every request with 256 phrase tokens and EOS: every answer is longer than the old
hidden cap of 256 tokens, so an answer cut short anywhere fails the run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.clients.catalog import CORE, Turn
from bench.clients.install import install
from bench.clients import verdicts
from bench.clients.reading import asked_limit, ending
from bench.clients.runs import TEXT_PROMPT, ClientRun, run_client, tool_round_trip
from bench.clients.server import ALIASES, CODEX_CATALOG_NAME, DEMO, DEMO_32K, build_model, models
from conftest import Appliance


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the file (bench.clients.server): `demo` with the model's own window, `demo-32k`, and the
    aliases of Claude Code's and Codex's own model names."""
    tmp = tmp_path_factory.mktemp("real-clients")
    app = Appliance({"server": {"model_aliases": ALIASES}, "models": models(build_model(tmp / "demo"))}, tmp)
    app.start()
    yield app
    app.stop()


@pytest.fixture(scope="module")
def installed():
    """The pinned releases by client name, from the cache `make install-clients` filled (installed if missing)."""
    return {name: install(client.package) for name, client in CORE.items()}


@pytest.fixture(scope="module")
def run(server, installed, tmp_path_factory):
    """run(client, model, tool=False): one headless run of a core client, remembered for the module, so the
    tests that read the same run from different sides cost one run. A client's runs share its home and work
    directory, as one user's would: Claude Code's system prompt names both (its memory directory), and the same
    prompt prefix lets the server's prefix cache skip most of the second run's prefill."""
    done: dict[tuple, ClientRun] = {}
    roots: dict[str, Path] = {}

    def start(name: str, model: str | None, tool: bool = False) -> ClientRun:
        key = (name, model, tool)
        if key not in done:
            root = roots.setdefault(name, tmp_path_factory.mktemp(name))
            client, inst = CORE[name], installed[name]
            done[key] = tool_round_trip(inst, client, server.base, model, root) if tool \
                else run_client(inst, client, server.base, Turn(TEXT_PROMPT, model), root)
        return done[key]
    return start


def served_answer(run: ClientRun):
    """The run exited 0, nothing it sent was refused, it printed the server's answer: that exchange."""
    assert verdicts.answered(run) is None, f"{verdicts.answered(run)}\n{run.report()}"
    return verdicts.shown(run)


def assert_round_trip(run: ClientRun) -> None:
    assert verdicts.round_trip(run) is None, f"{verdicts.round_trip(run)}\n{run.report()}"


# --- Claude Code --------------------------------------------------------------------------------------------------

def test_claude_code_answers_a_text_turn_with_its_default_model(run):
    """No --model: Claude Code asks for its own default (a claude-* name) and server.model_aliases serves it."""
    result = run("claude-code", None)
    last = served_answer(result)
    assert last.request["model"].startswith("claude-"), result.report()
    assert ending(last) == "end_turn", result.report()


def test_claude_code_tool_round_trip(run):
    assert_round_trip(run("claude-code", None, tool=True))


# --- Codex CLI ----------------------------------------------------------------------------------------------------

def test_codex_answers_a_text_turn_with_a_configured_model(run):
    last = served_answer(run("codex", DEMO))
    assert last.request["model"] == DEMO


def test_codex_gets_an_answer_longer_than_256_tokens_without_sending_a_limit(run):
    """Codex never sends max_output_tokens: the answer may use what the window leaves, and ends completed."""
    result = run("codex", DEMO)
    served_answer(result)
    assert verdicts.long_answer(result) is None, f"{verdicts.long_answer(result)}\n{result.report()}"


def test_codex_answers_under_a_name_from_its_own_catalog(run):
    """A catalog name (mapped by server.model_aliases) makes Codex send tool_search and its apply_patch grammar."""
    result = run("codex", CODEX_CATALOG_NAME)
    last = served_answer(result)
    assert last.request["model"] == CODEX_CATALOG_NAME
    assert {"tool_search", "custom"} <= {t.get("type") for t in last.request.get("tools") or ()}, result.report()


def test_codex_tool_round_trip(run):
    assert_round_trip(run("codex", DEMO, tool=True))


# --- opencode -----------------------------------------------------------------------------------------------------

def test_opencode_answers_a_text_turn_on_a_32k_model(run):
    """opencode asks for 32000 tokens of answer on a model it does not know: on a 32k window that is fitted to what
    the prompt leaves, never refused."""
    result = run("opencode", DEMO_32K)
    last = served_answer(result)
    assert asked_limit(last) == 32000, result.report()
    assert ending(last) == "stop", result.report()


def test_opencode_tool_round_trip(run):
    assert_round_trip(run("opencode", DEMO_32K, tool=True))
