"""The shipped monitoring config: Prometheus alerts and scrape config, Grafana dashboard.

Everything PromQL is checked by the real promtool (Debian package `prometheus`),
which CI installs; without it these tests fail rather than skip.
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PROMETHEUS_DIR = REPO / "config" / "prometheus"
ALERTS = PROMETHEUS_DIR / "openarc-alerts.yml"
ALERT_TESTS = PROMETHEUS_DIR / "openarc-alerts.test.yml"
SCRAPE_CONFIG = PROMETHEUS_DIR / "prometheus.yml"
DASHBOARD = REPO / "config" / "grafana" / "openarc-dashboard.json"

# The metrics openarc exports (the contract with appliance/front/metrics.py):
# name -> (type, label names).
OPENARC_METRICS = {
    "openarc_requests_total": ("counter", ("model", "endpoint", "status", "key", "priority")),
    "openarc_rate_limited_total": ("counter", ("key", "reason")),
    "openarc_request_errors_total": ("counter", ("model", "kind", "endpoint")),
    "openarc_worker_crashes_total": ("counter", ("model", "signal", "reason")),
    "openarc_worker_exits_total": ("counter", ("model", "reason")),
    "openarc_worker_restarts_total": ("counter", ("model",)),
    "openarc_worker_up": ("gauge", ("model",)),
    "openarc_model_state": ("gauge", ("model", "state")),
    "openarc_gpu_resets_total": ("counter", ("device",)),
    "openarc_device_memory_used_bytes": ("gauge", ("device",)),
    "openarc_device_memory_total_bytes": ("gauge", ("device",)),
    "openarc_worker_resident_memory_bytes": ("gauge", ("model",)),
    "openarc_model_device_memory_bytes": ("gauge", ("model", "region")),
    "openarc_gpu_mitigations_total": ("counter", ("card", "mitigation")),
    "openarc_requests_running": ("gauge", ("model",)),
    "openarc_requests_waiting": ("gauge", ("model",)),
    "openarc_kv_cache_usage_ratio": ("gauge", ("model",)),
    "openarc_prompt_tokens_total": ("counter", ("model", "source", "key", "priority")),
    "openarc_generation_tokens_total": ("counter", ("model", "key", "priority")),
    "openarc_time_to_first_token_seconds": ("histogram", ("model", "source")),
    "openarc_inter_token_latency_seconds": ("histogram", ("model",)),
    "openarc_request_duration_seconds": ("histogram", ("model", "endpoint")),
    "openarc_queue_time_seconds": ("histogram", ("model", "priority")),
    "openarc_model_load_seconds": ("histogram", ("model", "source")),
    "openarc_event_loop_lag_seconds": ("gauge", ()),
    "openarc_spool_bytes": ("gauge", ()),
    "openarc_model_info": ("gauge", ("model", "kind")),
    "openarc_tool_calls_total": ("counter", ("model",)),
    "openarc_answers_cut_total": ("counter", ("model", "reason")),
    "openarc_structured_requests_total": ("counter", ("model", "kind")),
    "openarc_ignored_tools_total": ("counter", ("type",)),
    "openarc_ignored_inputs_total": ("counter", ("endpoint", "type")),
    "openarc_embedding_inputs_total": ("counter", ("model",)),
    "openarc_audio_seconds_total": ("counter", ("model",)),
    "openarc_speech_audio_seconds_total": ("counter", ("model",)),
    "openarc_speech_characters_total": ("counter", ("model",)),
    "openarc_time_to_first_audio_seconds": ("histogram", ("model",)),
    "openarc_model_loaded": ("gauge", ("model",)),
    "openarc_model_loads_total": ("counter", ("model", "reason")),
    "openarc_model_unloads_total": ("counter", ("model", "reason")),
    "openarc_model_load_wait_seconds": ("histogram", ("model",)),
    "openarc_model_switch_seconds": ("histogram", ("model", "stage")),
    "openarc_images_total": ("counter", ("model",)),
    "openarc_image_rejections_total": ("counter", ("model", "reason")),
    "openarc_draft_tokens_total": ("counter", ("model", "outcome")),
    "openarc_canary_failures_total": ("counter", ("model", "reason")),
    "openarc_build_info": ("gauge", ("version", "openvino", "genai", "kernel", "gpu_driver", "compute_runtime", "card")),
    "openarc_lora_requests_info": ("gauge", ("model", "running_lora_adapters", "waiting_lora_adapters", "max_lora")),
    "openarc_adapter_requests_total": ("counter", ("model", "adapter")),
    "openarc_adapter_prompt_tokens_total": ("counter", ("model", "adapter")),
    "openarc_adapter_generation_tokens_total": ("counter", ("model", "adapter")),
    "openarc_images_generated_total": ("counter", ("model",)),
    "openarc_replica_up": ("gauge", ("model", "device")),
    "openarc_replica_state": ("gauge", ("model", "device", "state")),
    "openarc_replica_requests_running": ("gauge", ("model", "device")),
    "openarc_replica_requests_waiting": ("gauge", ("model", "device")),
    "openarc_replica_kv_cache_usage_ratio": ("gauge", ("model", "device")),
    "openarc_replica_resident_memory_bytes": ("gauge", ("model", "device")),
    "openarc_image_seconds": ("histogram", ("model",)),
    "openarc_image_step_seconds": ("histogram", ("model",)),
}
MODEL_STATES = ("loading", "ready", "restarting", "draining", "failed", "stopped", "unloaded")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def series_names():
    """Every series name a scrape of openarc yields (histograms as their parts)."""
    names = set()
    for name, (kind, _labels) in OPENARC_METRICS.items():
        if kind == "histogram":
            names.update(name + suffix for suffix in HISTOGRAM_SUFFIXES)
        else:
            names.add(name)
    return names


def test_exporter_declares_exactly_these_metrics():
    """The alerts and dashboard are written against OPENARC_METRICS; the server must export the same."""
    from appliance.front.metrics import Metrics

    declared = {}
    for family in Metrics().registry.collect():
        # prometheus_client names a counter's family without the _total its samples carry.
        name = family.name + "_total" if family.type == "counter" else family.name
        declared[name] = family.type
    assert declared == {name: kind for name, (kind, _labels) in OPENARC_METRICS.items()}


# --- promtool ----------------------------------------------------------------

@pytest.fixture(scope="module")
def promtool():
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool is not installed: `apt-get install prometheus` (Debian) provides it")
    return path


def run_promtool(promtool, *args, cwd=PROMETHEUS_DIR):
    result = subprocess.run([promtool, *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=60)
    return result, result.stdout + result.stderr


def write_yaml(path, document):
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# --- PromQL metric names --------------------------------------------------------

# Clauses whose parentheses hold label names, not expressions.
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right",
             "and", "or", "unless", "bool", "offset", "inf", "nan"}
# An identifier not glued to a number (so 5m, 1e3 and 0.95 are not names).
_IDENTIFIER = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr):
    """The metric names a PromQL expression selects (functions, keywords and labels dropped)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _LABEL_LIST.sub(" ", text)
    names = set()
    for match in _IDENTIFIER.finditer(text):
        is_call = text[match.end():].lstrip().startswith("(")
        if not is_call and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def test_metric_name_extraction_sees_through_functions_labels_and_strings():
    expr = ('histogram_quantile(0.95, sum by (model, le) (rate(a_bucket{model=~"x|y", le!="+Inf"}[5m] offset 1h)))'
            ' > 5 and on (model) b or absent(c{job="d"}) * 1e3')
    assert metric_names(expr) == {"a_bucket", "b", "c"}


# --- alert rules -------------------------------------------------------------------

def alert_rules():
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_alert_rules_pass_promtool_check(promtool):
    result, output = run_promtool(promtool, "check", "rules", ALERTS.name)
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(alert_rules())} rules found" in output, output
    # Lint findings (duplicate rules) are printed but do not change the exit code.
    assert "FAILED" not in output, output


def test_alert_unit_tests_pass(promtool):
    result, output = run_promtool(promtool, "test", "rules", ALERT_TESTS.name)
    assert result.returncode == 0, output
    assert re.search(r"^\s*SUCCESS\s*$", output, re.MULTILINE), output


def test_every_alert_is_tested_firing_and_silent():
    alerts = {rule["alert"] for rule in alert_rules()}
    fired, silent = set(), set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else silent).add(check["alertname"])
    assert alerts - fired == set(), "alerts never tested firing"
    assert alerts - silent == set(), "alerts never tested staying silent"
    assert (fired | silent) - alerts == set(), "tests name alerts that do not exist"


def test_alert_rules_use_only_exported_metrics():
    known = {name for name, (kind, _) in OPENARC_METRICS.items() if kind != "histogram"}
    known |= {name + "_bucket" for name, (kind, _) in OPENARC_METRICS.items() if kind == "histogram"}
    known.add("up")
    for rule in alert_rules():
        used = metric_names(rule["expr"])
        assert used, f"{rule['alert']}: no metric found in {rule['expr']!r}"
        assert used <= known, f"{rule['alert']} uses unknown metrics {sorted(used - known)}"


def test_every_alert_has_severity_and_explains_itself():
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("critical", "warning"), rule["alert"]
        for annotation in ("summary", "description", "runbook"):
            assert rule["annotations"].get(annotation), f"{rule['alert']} lacks {annotation}"


def test_gpu_reset_runbook_names_the_known_a770_fix():
    (gpu_reset,) = [rule for rule in alert_rules() if rule["alert"] == "OpenarcGpuReset"]
    assert "sdpa_optimization: false" in gpu_reset["annotations"]["runbook"]


# --- scrape config --------------------------------------------------------------------

def test_scrape_config_passes_promtool_check(promtool):
    result, output = run_promtool(promtool, "check", "config", SCRAPE_CONFIG.name)
    assert result.returncode == 0, output
    assert "is valid prometheus config file syntax" in output, output
    # check config also checks the rule files it names: the alerts must be among them.
    assert f"SUCCESS: {len(alert_rules())} rules found" in output, output


def test_scrape_config_scrapes_openarc_under_the_job_name_the_alerts_expect():
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    (job,) = [job for job in config["scrape_configs"] if job["job_name"] == "openarc"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert ALERTS.name in config["rule_files"]
    assert any('job="openarc"' in rule["expr"] for rule in alert_rules())


def uncomment_bearer_token(config_text, key_file):
    """The scrape config with its commented-out `authorization:` block switched on."""
    block = re.compile(r"^(\s*)# ((?:authorization:|  type: Bearer|  credentials_file: ).*)$", re.MULTILINE)
    text, count = block.subn(r"\1\2", config_text)
    assert count == 3, "expected a commented authorization block of three lines in prometheus.yml"
    return re.sub(r"(credentials_file: ).*", rf"\g<1>{key_file}", text)


def test_commented_bearer_token_option_is_valid_when_enabled(promtool, tmp_path):
    key_file = tmp_path / "openarc-api-key"
    key_file.write_text("sk-test\n")
    shutil.copy(ALERTS, tmp_path / ALERTS.name)
    config = tmp_path / "prometheus.yml"
    config.write_text(uncomment_bearer_token(SCRAPE_CONFIG.read_text(), key_file))
    scrape_job = yaml.safe_load(config.read_text())["scrape_configs"][0]
    assert scrape_job["authorization"] == {"type": "Bearer", "credentials_file": str(key_file)}
    result, output = run_promtool(promtool, "check", "config", config.name, cwd=tmp_path)
    assert result.returncode == 0, output


# --- dashboard structure ---------------------------------------------------------------

GRID_COLUMNS = 24
DATASOURCE_REF = "${datasource}"


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def all_panels(dashboard):
    """Top-level panels and those nested in collapsed rows."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def dashboard_queries(dashboard):
    """(where, query object) for every PromQL query: panel targets and annotations."""
    for panel in all_panels(dashboard):
        for target in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {target['refId']}", target
    for annotation in dashboard["annotations"]["list"]:
        if "expr" in annotation:
            yield f"annotation {annotation['name']!r}", annotation


def test_dashboard_has_datasource_and_multi_model_variables(dashboard):
    assert dashboard["schemaVersion"] >= 36
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query"
    assert model["datasource"]["uid"] == DATASOURCE_REF
    assert model["definition"] == "label_values(openarc_model_state, model)"
    assert model["query"]["query"] == model["definition"]
    assert model["multi"] is True and model["includeAll"] is True


def test_panel_ids_are_unique(dashboard):
    ids = [panel["id"] for panel in all_panels(dashboard)]
    assert len(ids) == len(set(ids)), sorted(ids)


def test_panels_fit_the_grid_without_overlapping(dashboard):
    boxes = []
    for panel in all_panels(dashboard):
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["y"] >= 0, panel["title"]
        assert pos["x"] + pos["w"] <= GRID_COLUMNS, f"{panel['title']} is wider than the grid"
        boxes.append((panel["title"], pos))
    for i, (title_a, a) in enumerate(boxes):
        for title_b, b in boxes[i + 1:]:
            apart = (a["x"] + a["w"] <= b["x"] or b["x"] + b["w"] <= a["x"]
                     or a["y"] + a["h"] <= b["y"] or b["y"] + b["h"] <= a["y"])
            assert apart, f"panels {title_a!r} and {title_b!r} overlap"


def test_every_panel_queries_the_selected_datasource(dashboard):
    for panel in all_panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"{panel['title']} has no query"
        assert panel["datasource"]["uid"] == DATASOURCE_REF, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
    for where, query in dashboard_queries(dashboard):
        assert query["datasource"] == {"type": "prometheus", "uid": DATASOURCE_REF}, where


def test_model_variable_is_only_used_as_a_regex(dashboard):
    # A multi-value variable expands to a|b, which only a =~ matcher understands.
    for where, query in dashboard_queries(dashboard):
        uses = len(re.findall(r"\$\{?model\b", query["expr"]))
        assert uses == query["expr"].count('model=~"$model"'), where


def test_dashboard_shows_who_uses_the_gpu_by_key_name(dashboard):
    """docs/sharing.md: a row of requests, tokens and refusals by API key name, and queue time by class."""
    titles = [panel["title"] for panel in dashboard["panels"]]
    row = titles.index("Who uses the GPU")
    exprs = " ".join(target["expr"] for panel in dashboard["panels"][row + 1:row + 5] for target in panel["targets"])
    for wanted in ("sum by (key, priority) (rate(openarc_requests_total", "sum by (key) (rate(openarc_generation_tokens",
                   "sum by (key, reason) (rate(openarc_rate_limited_total", "sum by (priority, le)"):
        assert wanted in exprs, wanted


def test_dashboard_covers_every_metric_and_latency_quantile(dashboard):
    exprs = " ".join(query["expr"] for _, query in dashboard_queries(dashboard))
    shown = {name for name in OPENARC_METRICS if name in exprs}
    assert shown == set(OPENARC_METRICS), f"metrics not on the dashboard: {sorted(set(OPENARC_METRICS) - shown)}"
    for histogram in ("openarc_time_to_first_token_seconds", "openarc_inter_token_latency_seconds"):
        for quantile in ("0.5", "0.95", "0.99"):
            assert f"histogram_quantile({quantile}, sum by (model, le) (rate({histogram}_bucket" in exprs


def test_dashboard_header_shows_the_build_every_server_runs(dashboard):
    """Issue 38: the build info sits in the dashboard's header, every label of it, so a regression lines up with the
    update that brought it; and the load-time panel tells a load from the cache from a compile."""
    overview, header = dashboard["panels"][:2]
    assert overview["title"] == "Overview" and header["title"] == "Build" and header["gridPos"]["y"] == 1
    (target,) = header["targets"]
    assert "openarc_build_info" in target["expr"]
    for label in OPENARC_METRICS["openarc_build_info"][1]:
        assert f"{{{{{label}}}}}" in target["legendFormat"] and label in target["expr"], label
    (load,) = [panel for panel in all_panels(dashboard) if panel["title"] == "Model load time"]
    assert "sum by (model, source)" in load["targets"][0]["expr"] and "{{source}}" in load["targets"][0]["legendFormat"]


# --- dashboard PromQL, checked and evaluated by promtool ----------------------------------

# What Grafana puts in place of its variables; `$model` as "All" is `.*`.
GRAFANA_VARIABLES = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h", "model": ".*"}


def substitute_variables(expr):
    def value(match):
        name = match.group(1) or match.group(2)
        assert name in GRAFANA_VARIABLES, f"unknown dashboard variable ${name} in {expr!r}"
        return GRAFANA_VARIABLES[name]
    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def dashboard_promql(dashboard):
    return [(where, substitute_variables(query["expr"])) for where, query in dashboard_queries(dashboard)]


def test_dashboard_uses_only_exported_metrics(dashboard):
    known = series_names()
    for where, expr in dashboard_promql(dashboard):
        used = metric_names(expr)
        assert used, f"{where}: no metric found in {expr!r}"
        assert used <= known, f"{where} uses unknown metrics {sorted(used - known)}"


def test_dashboard_queries_pass_promtool_as_recording_rules(promtool, dashboard, tmp_path):
    queries = dashboard_promql(dashboard)
    rules = [{"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]
    write_yaml(tmp_path / "dashboard-rules.yml", {"groups": [{"name": "dashboard", "rules": rules}]})
    result, output = run_promtool(promtool, "check", "rules", "dashboard-rules.yml", cwd=tmp_path)
    assert result.returncode == 0, output
    assert f"SUCCESS: {len(rules)} rules found" in output, output


# A healthy, busy server: every metric exported once, one model ready, no 5xx.
SAMPLE_LABELS = {"model": "demo", "endpoint": "/v1/chat/completions", "status": "200", "kind": "device_oom",
                 "signal": "SIGSEGV", "reason": "crash", "device": "GPU.0", "outcome": "accepted",
                 "source": "cache", "type": "web_search",
                 "region": "vram", "card": "0000:03:00.0", "mitigation": "sdpa_off", "key": "alice",
                 "priority": "interactive", "stage": "total", "version": "0.1.0", "openvino": "2026.4.1",
                 "genai": "2026.4.1.0", "kernel": "6.8.0-51-generic", "gpu_driver": "i915",
                 "compute_runtime": "25.35.35096.9-1~24.04~ppa3",
                 "adapter": "sql", "running_lora_adapters": "demo:sql",
                 "waiting_lora_adapters": "", "max_lora": "4"}
SCRAPE_LABELS = {"job": "openarc", "instance": "127.0.0.1:8000"}
SAMPLE_MINUTES = 90
HISTOGRAM_BUCKETS = ("0.1", "1", "+Inf")


def series(name, labels, values):
    selector = ", ".join(f'{key}="{value}"' for key, value in {**SCRAPE_LABELS, **labels}.items())
    return {"series": f"{name}{{{selector}}}", "values": values}


def sample_series():
    rising, steady = f"0+1x{SAMPLE_MINUTES}", f"1x{SAMPLE_MINUTES}"
    out = []
    for name, (kind, label_names) in OPENARC_METRICS.items():
        labels = {key: SAMPLE_LABELS[key] for key in label_names if key != "state"}
        if kind == "histogram":
            out += [series(f"{name}_bucket", {**labels, "le": le}, rising) for le in HISTOGRAM_BUCKETS]
            out += [series(f"{name}_sum", labels, f"0+0.5x{SAMPLE_MINUTES}"), series(f"{name}_count", labels, rising)]
        elif name == "openarc_model_state":
            out += [series(name, {**labels, "state": state}, steady if state == "ready" else f"0x{SAMPLE_MINUTES}")
                    for state in MODEL_STATES]
        else:
            out.append(series(name, labels, rising if kind == "counter" else steady))
    return out


def test_every_dashboard_query_returns_data_from_a_healthy_server(promtool, dashboard, tmp_path):
    """No panel says "No data" on a server that exports all its metrics (and has had no errors)."""
    queries = dashboard_promql(dashboard)
    # An alert on count(query) fires exactly when the query returns at least one series.
    alerts = [{"alert": f"query_{i}", "expr": f"count({expr})"} for i, (_, expr) in enumerate(queries)]
    write_yaml(tmp_path / "queries.yml", {"groups": [{"name": "dashboard", "rules": alerts}]})
    write_yaml(tmp_path / "queries.test.yml", {
        "rule_files": ["queries.yml"],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": sample_series(),
            "alert_rule_test": [{"eval_time": f"{SAMPLE_MINUTES}m", "alertname": alert["alert"],
                                 "exp_alerts": [{"exp_labels": {}}]} for alert in alerts],
        }],
    })
    result, output = run_promtool(promtool, "test", "rules", "queries.test.yml", cwd=tmp_path)
    empty = [where for i, (where, _) in enumerate(queries) if re.search(rf"alertname: query_{i},", output)]
    assert result.returncode == 0, f"queries without data: {empty}\n{output}"
