"""`openarc launch claude|codex|opencode`: each agent's setup as a pure function of the served model (its window,
the key's variable), the files merged into a user's own config and taken out again byte for byte, the CLI with
and without the agent installed, and the real agents run with the setup `--config-only` wrote."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent_clients import agent_env, client_path
from appliance.launch import files
from appliance.launch.clients import CLAUDE_MIN_WINDOW, NO_KEY, Homes, claude, codex, opencode
from appliance.launch.served import LaunchError, ServedModel, Target, choose, from_listing
from conftest import REPO, model_entry

HOMES = Homes(codex=Path("/h/.codex"), claude=Path("/h/.claude"), opencode=Path("/h/.config/opencode"))
windows = st.integers(min_value=512, max_value=2_000_000)


def target(window: int = 65536, key_env: str | None = "OPENARC_API_KEY", kind: str = "llm") -> Target:
    return Target("http://127.0.0.1:8000", ServedModel("coder", kind, window, "test"), key_env)


# --- each agent's setup, pure ---------------------------------------------------------------------------------

@given(windows)
def test_claude_code_gets_the_window_the_served_name_and_no_attribution_line(window):
    setup = claude(target(window), HOMES)
    (settings_file,) = setup.files
    env = {keys[1]: value for keys, value in settings_file.values.items()}
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == str(window)
    assert env["ANTHROPIC_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "coder"  # not claude-*: the window holds
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8000"
    assert env["CLAUDE_CODE_ATTRIBUTION_HEADER"] == "0" and env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert 0 < int(env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"]) <= window // 4
    assert "ANTHROPIC_AUTH_TOKEN" not in env  # the key is never written to a file ...
    assert setup.env_from == {"ANTHROPIC_AUTH_TOKEN": "OPENARC_API_KEY"}  # ... it comes from its variable
    assert bool(setup.warnings) == (window < CLAUDE_MIN_WINDOW)
    assert setup.command == ("claude", "--settings", "/h/.claude/openarc-settings.json")


def test_claude_code_without_a_server_key_sends_a_placeholder():
    (settings_file,) = claude(target(key_env=None), HOMES).files
    assert settings_file.values[("env", "ANTHROPIC_AUTH_TOKEN")] == NO_KEY


@given(windows, st.sampled_from(["llm", "vlm"]))
def test_codex_gets_a_profile_and_a_catalog_entry_with_the_window_and_apply_patch(window, kind):
    setup = codex(target(window, kind=kind), HOMES)
    profile, catalog = setup.files
    assert profile.path == Path("/h/.codex/openarc.config.toml") and setup.command == ("codex", "--profile", "openarc")
    assert profile.values[("model",)] == "coder" and profile.values[("model_provider",)] == "openarc"
    assert profile.values[("model_catalog_json",)] == str(catalog.path)
    provider = profile.values[("model_providers", "openarc")]
    assert provider["wire_api"] == "responses" and provider["base_url"] == "http://127.0.0.1:8000/v1"
    assert provider["stream_idle_timeout_ms"] > 300_000 and provider["env_key"] == "OPENARC_API_KEY"
    (entry,) = catalog.values[("models",)]
    assert entry["slug"] == "coder" and entry["context_window"] == entry["max_context_window"] == window
    assert entry["apply_patch_tool_type"] == "freeform" and entry["supports_search_tool"] is False
    assert entry["truncation_policy"]["limit"] <= max(1000, window // 8)
    assert ("image" in entry["input_modalities"]) == (kind == "vlm") and entry["base_instructions"]


def test_codex_without_a_server_key_names_no_key_variable():
    profile, _ = codex(target(key_env=None), HOMES).files
    assert "env_key" not in profile.values[("model_providers", "openarc")]


@given(windows)
def test_opencode_gets_a_provider_with_the_context_and_output_limits(window):
    (config,) = opencode(target(window), HOMES).files
    provider = config.values[("provider", "openarc")]
    limit = provider["models"]["coder"]["limit"]
    assert limit["context"] == window and 0 < limit["output"] <= window // 4
    assert provider["options"] == {"baseURL": "http://127.0.0.1:8000/v1", "apiKey": "{env:OPENARC_API_KEY}"}
    assert config.values[("model",)] == "openarc/coder"


# --- which model -----------------------------------------------------------------------------------------------

LISTING = {"data": [{"id": "coder", "kind": "llm", "context_length": 32768},
                    {"id": "eyes", "kind": "vlm", "max_model_len": 8192},
                    {"id": "emb", "kind": "embedding"}, {"id": "voice", "kind": "tts"}]}


def test_the_chat_models_of_a_listing_and_the_one_to_use():
    served = from_listing(LISTING, "http://x")
    assert [(m.name, m.window) for m in served] == [("coder", 32768), ("eyes", 8192)]
    assert choose(served, "eyes", "http://x").window == 8192
    assert choose(served[:1], None, "http://x").name == "coder"
    with pytest.raises(LaunchError, match=r"pick one with --model NAME:\n  coder .*\n  eyes"):
        choose(served, None, "http://x")
    with pytest.raises(LaunchError, match="no chat model 'emb'; its chat models: coder, eyes"):
        choose(served, "emb", "http://x")


def test_a_listing_without_a_window_names_the_fix():
    with pytest.raises(LaunchError, match="no context_length for 'old'.*--config FILE"):
        from_listing({"data": [{"id": "old", "kind": "llm"}]}, "http://x")


# --- the files: merged, kept, restored ---------------------------------------------------------------------------

USER_TOML = '# my own profile\nmodel = "gpt-5.5"  # keep this comment\n\n[model_providers.mine]\nname = "mine"\n'


def test_a_users_toml_is_merged_kept_and_restored_byte_for_byte(tmp_path):
    homes = Homes(codex=tmp_path / "codex", claude=tmp_path / "claude", opencode=tmp_path / "oc")
    homes.codex.mkdir()
    (homes.codex / "openarc.config.toml").write_text(USER_TOML)
    setup = codex(target(), homes)
    lines = files.apply(setup, tmp_path / "state")
    assert "merged into" in lines[0] and "previous file kept as" in lines[0] and lines[1].startswith("wrote")
    merged = (homes.codex / "openarc.config.toml").read_text()
    assert "# keep this comment" in merged and "[model_providers.mine]" in merged
    parsed = tomllib.loads(merged)
    assert parsed["model"] == "coder" and parsed["model_providers"]["mine"] == {"name": "mine"}
    assert (homes.codex / "openarc.config.toml.openarc-backup").read_text() == USER_TOML
    files.apply(setup, tmp_path / "state")  # twice: the first launch's "before" is what restore returns to
    files.restore("codex", tmp_path / "state")
    assert (homes.codex / "openarc.config.toml").read_text() == USER_TOML
    assert sorted(p.name for p in homes.codex.iterdir()) == ["openarc.config.toml"]


def test_restore_leaves_a_value_the_user_changed_since(tmp_path):
    homes = Homes(codex=tmp_path, claude=tmp_path, opencode=tmp_path / "oc")
    files.apply(opencode(target(), homes), tmp_path / "state")
    path = homes.opencode / "opencode.json"
    config = json.loads(path.read_text())
    config["model"] = "other/model"
    path.write_text(json.dumps(config))
    (line,) = files.restore("opencode", tmp_path / "state")
    assert "left as you changed them: model" in line
    assert json.loads(path.read_text()) == {"model": "other/model"}


def test_a_file_that_does_not_parse_is_named_and_left_alone(tmp_path):
    homes = Homes(codex=tmp_path, claude=tmp_path, opencode=tmp_path)
    (tmp_path / "opencode.json").write_text('{"provider": {  // a comment\n}')
    with pytest.raises(LaunchError, match=r"opencode.json: not valid JSON .* changes nothing it cannot read"):
        files.apply(opencode(target(), homes), tmp_path / "state")
    assert (tmp_path / "opencode.json").read_text() == '{"provider": {  // a comment\n}'
    assert not (tmp_path / "state").exists()


def test_a_symlinked_config_stays_a_link_and_its_target_gets_the_keys(tmp_path):
    """Dotfile managers keep the real file elsewhere and link it in: launch and restore write through the link."""
    homes = Homes(codex=tmp_path, claude=tmp_path, opencode=tmp_path / "oc")
    homes.opencode.mkdir()
    real = tmp_path / "dotfiles" / "opencode.json"
    real.parent.mkdir()
    real.write_text('{"theme": "mine"}\n')
    link = homes.opencode / "opencode.json"
    link.symlink_to(real)
    files.apply(opencode(target(), homes), tmp_path / "state")
    assert link.is_symlink() and json.loads(real.read_text())["model"] == "openarc/coder"
    files.restore("opencode", tmp_path / "state")
    assert link.is_symlink() and real.read_text() == '{"theme": "mine"}\n'


def test_a_read_only_config_is_named_and_left_alone(tmp_path):
    homes = Homes(codex=tmp_path, claude=tmp_path, opencode=tmp_path)
    path = tmp_path / "opencode.json"
    path.write_text('{"theme": "mine"}')
    path.chmod(0o444)
    with pytest.raises(LaunchError, match=r"opencode.json: read-only"):
        files.apply(opencode(target(), homes), tmp_path / "state")
    assert path.read_text() == '{"theme": "mine"}' and not (tmp_path / "state").exists()


def test_restore_changes_nothing_when_one_of_its_files_does_not_parse(tmp_path):
    homes = Homes(codex=tmp_path / "codex", claude=tmp_path, opencode=tmp_path)
    files.apply(codex(target(), homes), tmp_path / "state")
    profile = (homes.codex / "openarc.config.toml").read_text()
    (homes.codex / "openarc-models.json").write_text("{broken")
    with pytest.raises(LaunchError, match=r"openarc-models.json: not valid JSON"):
        files.restore("codex", tmp_path / "state")
    assert (homes.codex / "openarc.config.toml").read_text() == profile  # nothing half-restored
    (tmp_path / "state" / "codex.json").write_text("garbage")
    with pytest.raises(LaunchError, match=r"codex.json: not valid JSON"):
        files.restore("codex", tmp_path / "state")


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                         max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None,  # file I/O on a loaded machine
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(user=st.dictionaries(st.sampled_from(["model", "provider", "theme", "$schema", "agent"]), json_values,
                            max_size=4), indent=st.sampled_from([None, 2, 4]))
def test_any_users_json_comes_back_byte_for_byte(tmp_path, user, indent):
    homes = Homes(codex=tmp_path, claude=tmp_path, opencode=tmp_path / "any")
    homes.opencode.mkdir(exist_ok=True)
    path = homes.opencode / "opencode.json"
    original = json.dumps(user, indent=indent)
    path.write_text(original)
    files.apply(opencode(target(), homes), tmp_path / "state")
    merged = json.loads(path.read_text())
    assert merged["model"] == "openarc/coder" and "openarc" in merged["provider"]
    assert {k: v for k, v in merged.items() if k not in ("model", "provider")} == \
        {k: v for k, v in user.items() if k not in ("model", "provider")}
    files.restore("opencode", tmp_path / "state")
    assert path.read_text() == original
    assert not path.with_name("opencode.json.openarc-backup").exists()


toml_values = st.recursive(st.booleans() | st.integers(-5, 5) | st.text("abc ", max_size=5),
                           lambda inner: st.dictionaries(st.sampled_from(["name", "openarc", "x", "y"]), inner,
                                                         max_size=3), max_leaves=6)


@settings(max_examples=60, deadline=None,  # file I/O on a loaded machine
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(user=st.dictionaries(st.sampled_from(["model", "model_provider", "model_providers", "approval_policy",
                                             "model_catalog_json", "tui"]), toml_values, max_size=4))
def test_any_users_toml_comes_back_byte_for_byte(tmp_path, user):
    import tomlkit
    homes = Homes(codex=tmp_path / "codex", claude=tmp_path, opencode=tmp_path)
    homes.codex.mkdir(exist_ok=True)
    path = homes.codex / "openarc.config.toml"
    original = "# the user's own\n" + tomlkit.dumps(user)
    path.write_text(original)
    files.apply(codex(target(), homes), tmp_path / "state")
    merged = tomllib.loads(path.read_text())
    assert merged["model"] == "coder" and merged["model_providers"]["openarc"]["wire_api"] == "responses"
    files.restore("codex", tmp_path / "state")
    assert path.read_text() == original
    assert sorted(p.name for p in homes.codex.iterdir()) == ["openarc.config.toml"]


# --- the CLI ------------------------------------------------------------------------------------------------------

def write_config(tmp_path: Path, models: list[dict], **server) -> Path:
    path = tmp_path / "openarc.yaml"
    path.write_text(yaml.safe_dump({"server": {"port": 8931, **server}, "models": models}))
    return path


def openarc(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "appliance", "launch", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**env, "PYTHONPATH": str(REPO)})


def test_without_the_agent_config_only_prints_the_files_and_writes_nothing(tmp_path):
    config = write_config(tmp_path, [model_entry("coder", tmp_path, max_context=32768)], api_key_env="MY_KEY")
    home = tmp_path / "home"
    env = {**agent_env(home), "PATH": "/usr/bin:/bin"}
    done = openarc("codex", "--config", str(config), "--config-only", env=env)
    assert done.returncode == 0, done.stderr
    assert "codex is not on PATH" in done.stdout and "nothing written" in done.stdout
    assert '"context_window": 32768' in done.stdout and 'env_key = "MY_KEY"' in done.stdout
    assert "codex --profile openarc" in done.stdout and "MY_KEY is not set here" in done.stderr
    assert not home.exists()


def test_several_chat_models_and_no_model_named_is_a_list_to_pick_from(tmp_path):
    config = write_config(tmp_path, [model_entry("big", tmp_path, max_context=65536),
                                     model_entry("small", tmp_path, max_context=8192),
                                     model_entry("emb", tmp_path, kind="embedding")])
    done = openarc("claude", "--config", str(config), "--config-only", env=agent_env(tmp_path / "home"))
    assert done.returncode == 2
    assert "serves 2 chat models; pick one with --model NAME" in done.stderr
    assert "big  (llm, window 65536)" in done.stderr and "small  (llm, window 8192)" in done.stderr
    done = openarc("claude", "--config", str(config), "--model", "small", "--config-only",
                   env={**agent_env(tmp_path / "home"), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0 and '"CLAUDE_CODE_MAX_CONTEXT_TOKENS": "8192"' in done.stdout
    assert "Claude Code needs 65536 or more" in done.stderr


def test_restore_of_a_file_that_does_not_parse_is_a_message_not_a_traceback(tmp_path):
    home = tmp_path / "home"
    files.apply(opencode(target(), Homes.of({}, home)), files.state_dir({}, home))
    (home / ".config" / "opencode" / "opencode.json").write_text("{oops")
    done = openarc("opencode", "--restore", env={**os.environ, "HOME": str(home), "XDG_STATE_HOME": "",
                                                          "XDG_CONFIG_HOME": ""})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "opencode.json: not valid JSON" in done.stderr


def test_no_server_and_no_config_says_what_to_pass(tmp_path):
    from conftest import free_port
    done = openarc("opencode", "--url", f"http://127.0.0.1:{free_port()}", "--config-only",
                   env=agent_env(tmp_path / "home"))
    assert done.returncode == 1 and "Connection refused" in done.stderr
    assert "--config FILE" in done.stderr and "--url URL" in done.stderr


# --- the real agents, with what --config-only wrote -------------------------------------------------------------

AGENT_WINDOW = 131072  # the demo model's: real agents' prompts are 2-3 times longer in its tokens


@pytest.fixture
def served_demo(appliance_factory, demo_model):
    return appliance_factory({"models": [model_entry("demo", demo_model, max_context=AGENT_WINDOW)]})


def requests_for(app, model: str) -> float:
    return sum(float(value) for value in re.findall(
        rf'^openarc_requests_total{{[^}}]*model="{model}"[^}}]*}} (\S+)$', app.metrics(), re.M))


def config_only(app, client: str, home: Path) -> subprocess.CompletedProcess:
    done = openarc(client, "--config", str(app.config_path), "--config-only", env=agent_env(home))
    assert done.returncode == 0, done.stderr
    assert f"window {AGENT_WINDOW} tokens" in done.stdout
    return done


def run_agent(argv: list, home: Path, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], cwd=cwd, env=agent_env(home), capture_output=True, text=True,
                          timeout=300, stdin=subprocess.DEVNULL)


def test_codex_runs_with_the_profile_and_catalog_launch_wrote(served_demo, tmp_path):
    codex_bin = client_path("codex")
    home = tmp_path / "home"
    config_only(served_demo, "codex", home)
    entry = json.loads((home / ".codex" / "openarc-models.json").read_text())["models"][0]
    assert entry["slug"] == "demo" and entry["context_window"] == AGENT_WINDOW
    done = run_agent([codex_bin, "--profile", "openarc", "exec", "--skip-git-repo-check", "say hi"], home, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "model: demo" in done.stdout + done.stderr and "provider: openarc" in done.stdout + done.stderr
    assert requests_for(served_demo, "demo") >= 1


def test_claude_code_runs_with_the_settings_launch_wrote(served_demo, tmp_path):
    claude_bin = client_path("claude")
    home = tmp_path / "home"
    config_only(served_demo, "claude", home)
    settings_file = home / ".claude" / "openarc-settings.json"
    assert json.loads(settings_file.read_text())["env"]["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(AGENT_WINDOW)
    done = run_agent([claude_bin, "--settings", settings_file, "-p", "say hi"], home, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert requests_for(served_demo, "demo") >= 1


def test_opencode_runs_with_the_provider_launch_wrote_and_restore_removes_it(served_demo, tmp_path):
    opencode_bin = client_path("opencode")
    home = tmp_path / "home"
    config_only(served_demo, "opencode", home)
    done = run_agent([opencode_bin, "run", "say hi"], home, tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "demo" in done.stdout + done.stderr and requests_for(served_demo, "demo") >= 1
    done = openarc("opencode", "--restore", env=agent_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    path = home / ".config" / "opencode" / "opencode.json"
    left = json.loads(path.read_text()) if path.exists() else {}  # what opencode itself added ($schema) stays
    assert "model" not in left and "openarc" not in left.get("provider", {}), left


def test_launch_runs_the_agent_with_the_arguments_after_the_separator(served_demo, tmp_path):
    client_path("opencode")
    done = openarc("opencode", "--config", str(served_demo.config_path), "--", "--version",
                   env=agent_env(tmp_path / "home"))
    assert done.returncode == 0, done.stderr
    assert re.search(r"^\d+\.\d+\.\d+$", done.stdout.strip().splitlines()[-1]), done.stdout


def test_url_reads_the_window_the_server_reports(served_demo, tmp_path):
    """--url: the model and its window from the running server's /v1/models (`context_length`)."""
    env = {**agent_env(tmp_path / "home"), "PATH": "/usr/bin:/bin"}
    done = openarc("codex", "--url", served_demo.base, "--config-only", env=env)
    assert done.returncode == 0, done.stderr
    assert f"window {AGENT_WINDOW} tokens (/v1/models context_length)" in done.stdout
    assert f'"context_window": {AGENT_WINDOW}' in done.stdout
    # the base URL an OpenAI client is given (ending /v1) names the same server
    done = openarc("codex", "--url", served_demo.base + "/v1/", "--config-only", env=env)
    assert done.returncode == 0, done.stderr
    assert f'base_url = "{served_demo.base}/v1"' in done.stdout
