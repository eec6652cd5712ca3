"""The Kubernetes manifests of containers/kubernetes/, checked offline (no cluster runs here).

Every object of Kubernetes' own kinds is validated by the PyPI package kubernetes-validate in strict mode
(unknown fields rejected) against the oldest and the newest Kubernetes version the README claims; the
custom resources (PodMonitor, PrometheusRule, InferencePool) against their published CRD schemas
(tests/fixtures/crds/), made just as strict. Then the fields that matter are checked one by one: the pod's
security context, its probes, its GPU, its volumes, the grace period against the config's drain timeout,
and the PrometheusRule against config/prometheus/openarc-alerts.yml (equal, and promtool-tested).

    python tests/test_kubernetes.py    # rewrite containers/kubernetes/prometheusrule.yaml from the alerts
"""

from __future__ import annotations

import copy
import shlex
import shutil
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from appliance.config import parse_config  # noqa: E402
from appliance.front.metrics import Metrics  # noqa: E402
from appliance.worker import prefix_cache  # noqa: E402
from test_monitoring_config import promtool, run_promtool  # noqa: E402,F401 (a fixture and its runner)

KUBE_DIR = REPO / "containers" / "kubernetes"
GATEWAY_DIR = KUBE_DIR / "inference-gateway"
PROMETHEUS_RULE = KUBE_DIR / "prometheusrule.yaml"
ALERTS = REPO / "config" / "prometheus" / "openarc-alerts.yml"
ALERT_TESTS = REPO / "config" / "prometheus" / "openarc-alerts.test.yml"
CRD_DIR = Path(__file__).resolve().parent / "fixtures" / "crds"
NAMESPACE = "openarc"
# The Kubernetes versions the README claims: the oldest and the newest schema kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.25.0", "1.37.0")
IMAGE_UID = 990  # the image's user `openarc` (containers/Containerfile)
GPU_RESOURCE = "gpu.intel.com/i915"
CUSTOM_KINDS = {"PodMonitor", "PrometheusRule", "InferencePool"}


# --- reading the manifests --------------------------------------------------------------------------------

def documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def kustomization_files(directory: Path) -> list[Path]:
    return [directory / name for name in documents(directory / "kustomization.yaml")[0]["resources"]]


def objects(directory: Path = KUBE_DIR) -> list[dict]:
    """Every object `kubectl apply -k directory` applies (the kustomizations only list files)."""
    return [doc for path in kustomization_files(directory) for doc in documents(path)]


ALL_OBJECTS = objects() + objects(GATEWAY_DIR)


def the(kind: str, name: str | None = None) -> dict:
    found = [o for o in ALL_OBJECTS if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def deployments() -> list[dict]:
    return [o for o in ALL_OBJECTS if o["kind"] == "Deployment"]


def container(deployment: dict) -> dict:
    (only,) = deployment["spec"]["template"]["spec"]["containers"]
    return only


def served_model(deployment: dict) -> str:
    args = container(deployment)["args"]
    assert args[:2] == ["serve", "--model"], args
    return args[2]


def openarc_config():
    """The ConfigMap's openarc.yaml, parsed by the appliance's own validator."""
    text = the("ConfigMap", "openarc-config")["data"]["openarc.yaml"]
    return parse_config(yaml.safe_load(text), "configmap.yaml:openarc.yaml")


def object_id(obj: dict) -> str:
    return f"{obj['kind']}/{obj['metadata']['name']}"


# --- the kustomizations -----------------------------------------------------------------------------------

@pytest.mark.parametrize("directory", [KUBE_DIR, GATEWAY_DIR], ids=lambda d: d.name)
def test_kustomization_lists_every_manifest_of_its_directory(directory):
    listed = {path.name for path in kustomization_files(directory)}
    # epp-config.yaml is the endpoint picker's own config file, not an object of the cluster.
    manifests = {path.name for path in directory.glob("*.yaml")
                 if path.name not in ("kustomization.yaml", "epp-config.yaml")}
    assert listed == manifests
    kustomization = documents(directory / "kustomization.yaml")[0]
    assert (kustomization["apiVersion"], kustomization["kind"]) == ("kustomize.config.k8s.io/v1beta1", "Kustomization")
    # Plain YAML: no generators, patches or name prefixes, so `podman kube play` reads the same files.
    assert set(kustomization) == {"apiVersion", "kind", "resources"}


def test_every_object_lives_in_the_openarc_namespace_and_names_are_unique():
    the("Namespace", NAMESPACE)
    for obj in ALL_OBJECTS:
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == NAMESPACE, object_id(obj)
    ids = [object_id(o) for o in ALL_OBJECTS]
    assert len(ids) == len(set(ids))


# --- schemas ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("obj", [o for o in ALL_OBJECTS if o["kind"] not in CUSTOM_KINDS], ids=object_id)
def test_object_is_valid_for_kubernetes_in_strict_mode(obj, version):
    kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_strict_validation_rejects_a_misspelled_field(version):
    broken = copy.deepcopy(deployments()[0])
    container(broken)["readinesProbe"] = container(broken)["readinessProbe"]
    with pytest.raises(kubernetes_validate.ValidationError, match="readinesProbe"):
        kubernetes_validate.validate(broken, version, strict=True)


def strict(schema):
    """A CRD's structural schema with unknown fields rejected, as the API server prunes them (and as
    kubernetes-validate's strict mode does for built-in kinds)."""
    if isinstance(schema, dict):
        schema = {key: strict(value) for key, value in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    return schema


def crd_validator(kind: str, api_version: str) -> jsonschema.Draft7Validator:
    group, version = api_version.split("/")
    for path in CRD_DIR.glob("*.yaml"):
        crd = documents(path)[0]["spec"]
        if crd["names"]["kind"] == kind and crd["group"] == group:
            served = next(v for v in crd["versions"] if v["name"] == version and v["served"])
            return jsonschema.Draft7Validator(strict(served["schema"]["openAPIV3Schema"]))
    raise AssertionError(f"no CRD for {kind} {api_version} in {CRD_DIR}")


@pytest.mark.parametrize("obj", [o for o in ALL_OBJECTS if o["kind"] in CUSTOM_KINDS], ids=object_id)
def test_custom_resource_matches_its_published_crd_schema(obj):
    crd_validator(obj["kind"], obj["apiVersion"]).validate(obj)


def test_every_custom_kind_is_shipped_and_checked():
    assert {o["kind"] for o in ALL_OBJECTS} >= CUSTOM_KINDS


@pytest.mark.parametrize("kind,field", [("PodMonitor", "podMetricEndpoints"), ("InferencePool", "targetPort")])
def test_crd_validation_rejects_a_misspelled_field(kind, field):
    broken = copy.deepcopy(the(kind))
    broken["spec"][field] = []
    with pytest.raises(jsonschema.ValidationError, match=field):
        crd_validator(kind, broken["apiVersion"]).validate(broken)


# --- the pods: security, GPU, probes, volumes -------------------------------------------------------------

@pytest.fixture(params=[d["metadata"]["name"] for d in deployments()])
def deployment(request):
    return the("Deployment", request.param)


def test_pod_runs_unprivileged_as_the_image_user_with_the_render_group(deployment):
    pod = deployment["spec"]["template"]["spec"]
    security = pod["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["runAsUser"] == IMAGE_UID and security["runAsGroup"] == IMAGE_UID
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    # The render group's GID on the nodes: one number, not root's group.
    assert len(security["supplementalGroups"]) == 1 and security["supplementalGroups"][0] > 0
    assert pod["automountServiceAccountToken"] is False
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        assert not pod.get(key)
    ctr = container(deployment)
    assert ctr["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                      "capabilities": {"drop": ["ALL"]}}


def test_the_gpu_comes_from_the_device_plugin_never_from_the_host(deployment):
    ctr = container(deployment)
    assert ctr["resources"]["limits"][GPU_RESOURCE] == "1"
    assert ctr["resources"]["requests"][GPU_RESOURCE] == "1"
    assert not ctr["securityContext"].get("privileged")
    for volume in deployment["spec"]["template"]["spec"]["volumes"]:
        assert "hostPath" not in volume, volume
    # One GPU per pod: a rolling update's surge pod would wait for a second card.
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}


def test_deployment_serves_one_configured_model_on_port_8000(deployment):
    config = openarc_config()
    model = config.model(served_model(deployment))
    assert container(deployment)["args"] == ["serve", "--model", model.name, "--host", "0.0.0.0", "--port", "8000"]
    assert container(deployment)["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    assert deployment["metadata"]["name"] == f"openarc-{model.name}"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "openarc",
                                                             "app.kubernetes.io/instance": model.name}
    assert labels.items() >= deployment["spec"]["selector"]["matchLabels"].items()
    assert model.is_gpu


def test_probes_use_ready_and_health_with_room_for_a_cold_gpu_load(deployment):
    ctr = container(deployment)
    model = openarc_config().model(served_model(deployment))
    startup, readiness, liveness = ctr["startupProbe"], ctr["readinessProbe"], ctr["livenessProbe"]
    assert startup["httpGet"] == {"path": "/ready", "port": "http"}
    assert readiness["httpGet"] == {"path": "/ready", "port": "http"}
    assert liveness["httpGet"] == {"path": "/health", "port": "http"}
    # The startup probe covers the model's whole load timeout (a cold compile of a large model).
    assert startup["periodSeconds"] * startup["failureThreshold"] >= model.load_timeout_s
    for probe in (startup, readiness, liveness):
        assert probe["timeoutSeconds"] >= 1 and probe["periodSeconds"] >= probe["timeoutSeconds"]
    assert liveness["failureThreshold"] >= 3


def test_grace_period_outlasts_the_drain(deployment):
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > openarc_config().server.drain_timeout_s + 5


def test_volumes_config_models_read_only_and_a_writable_compile_cache(deployment):
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container(deployment)["volumeMounts"]}
    config = mounts["/etc/openarc"]
    assert config["readOnly"] is True and volumes[config["name"]]["configMap"] == {"name": "openarc-config"}
    models = mounts["/models"]
    assert models["readOnly"] is True
    assert volumes[models["name"]]["persistentVolumeClaim"] == {"claimName": "openarc-models", "readOnly": True}
    the("PersistentVolumeClaim", "openarc-models")
    # $CACHE_DIRECTORY of the image: OpenVINO's compiled-model cache, on a claim of this model's own.
    cache = mounts["/var/cache/openarc"]
    assert not cache.get("readOnly")
    claim = volumes[cache["name"]]["persistentVolumeClaim"]["claimName"]
    assert claim == f"openarc-cache-{served_model(deployment)}"
    assert the("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteOnce"]
    # The root file system is read-only: /tmp is a volume.
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    assert set(mounts) == {"/etc/openarc", "/models", "/var/cache/openarc", "/tmp"}


def test_config_keeps_the_load_defaults():
    """ENABLE_WEIGHTLESS on GPU and one load at a time: parallel loads OOM-killed a 32 GB host."""
    config = openarc_config()
    assert config.server.load_concurrency == 1
    for model in config.models:
        assert model.ov_properties(None)["ENABLE_WEIGHTLESS"] is True
    for deployment in deployments():
        assert "env" not in container(deployment)


def test_service_selects_the_model_pods_on_the_http_port(deployment):
    service = the("Service", deployment["metadata"]["name"])
    assert service["spec"]["selector"] == deployment["spec"]["selector"]["matchLabels"]
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http", "protocol": "TCP"}]


def test_every_configured_model_has_its_deployment():
    assert sorted(m.name for m in openarc_config().models) == sorted(served_model(d) for d in deployments())


# --- monitoring and routing -------------------------------------------------------------------------------

def test_podmonitor_scrapes_every_openarc_pod_as_job_openarc():
    monitor = the("PodMonitor")["spec"]
    pod_labels = [d["spec"]["template"]["metadata"]["labels"] for d in deployments()]
    assert all(labels.items() >= monitor["selector"]["matchLabels"].items() for labels in pod_labels)
    # The alerts (up{job="openarc"}) and the dashboard use job="openarc": take it from the pods' name label.
    assert monitor["jobLabel"] == "app.kubernetes.io/name"
    assert {labels[monitor["jobLabel"]] for labels in pod_labels} == {"openarc"}
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert (endpoint["port"], endpoint["path"]) == ("http", "/metrics")


def test_inference_pool_selects_the_model_pods_and_their_port():
    pool = the("InferencePool")["spec"]
    deployment = the("Deployment", "openarc-qwen")
    assert pool["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
    assert pool["targetPorts"] == [{"number": container(deployment)["ports"][0]["containerPort"]}]


def exported_metrics() -> set[str]:
    return {family.name for family in Metrics().registry.collect()}


def test_endpoint_picker_reads_metrics_openarc_exports():
    (config,) = documents(GATEWAY_DIR / "epp-config.yaml")
    assert (config["apiVersion"], config["kind"]) == ("llm-d.ai/v1alpha1", "EndpointPickerConfig")
    (extractor,) = [p for p in config["plugins"] if p["type"] == "core-metrics-extractor"]
    (engine,) = extractor["parameters"]["engineConfigs"]
    assert extractor["parameters"]["defaultEngine"] == engine["name"] == "openarc"
    assert {d["spec"]["template"]["metadata"]["labels"]["llm-d.ai/engine-type"] for d in deployments()} == {"openarc"}
    specs = {key: engine[key] for key in ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec")}
    assert specs == {"queuedRequestsSpec": "openarc_requests_waiting",
                     "runningRequestsSpec": "openarc_requests_running",
                     "kvUsageSpec": "openarc_kv_cache_usage_ratio",
                     "loraSpec": "openarc_lora_requests_info"}  # vLLM's lora_requests_info shape (test_lora.py)
    missing = set(specs.values()) - exported_metrics()
    assert not missing, f"the endpoint picker would read metrics openarc does not export: {missing}"
    scorers = {p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]}
    assert {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer", "lora-affinity-scorer"} <= scorers <= \
        {p["type"] for p in config["plugins"]}


def test_endpoint_picker_sends_a_conversation_back_to_the_pod_that_holds_its_prefix():
    """The Gateway API Inference Extension's prefix-cache-aware scorer, with the parameters its config struct
    reads (autoTune, blockSizeTokens, maxPrefixBlocksToMatch, lruCapacityPerServer), hashing in the GPU worker's
    own KV block size, and weighted above the load scorers."""
    (config,) = documents(GATEWAY_DIR / "epp-config.yaml")
    (prefix,) = [p for p in config["plugins"] if p["type"] == "prefix-cache-scorer"]
    params = prefix["parameters"]
    assert set(params) == {"autoTune", "blockSizeTokens", "maxPrefixBlocksToMatch", "lruCapacityPerServer"}
    assert params["autoTune"] is False  # it would read vLLM's cache-config metrics, which openarc does not export
    assert params["blockSizeTokens"] == prefix_cache.BLOCK_SIZES["GPU"]
    assert all(isinstance(params[k], int) and params[k] > 0
               for k in ("blockSizeTokens", "maxPrefixBlocksToMatch", "lruCapacityPerServer"))
    (profile,) = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight", 1) for p in profile["plugins"]}
    assert weights["prefix-cache-scorer"] > max(weights["queue-scorer"], weights["kv-cache-utilization-scorer"])


# --- the PrometheusRule is the alerts file ----------------------------------------------------------------

def prometheus_rule() -> dict:
    """The PrometheusRule that holds exactly config/prometheus/openarc-alerts.yml's groups."""
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "openarc", "namespace": NAMESPACE, "labels": {"app.kubernetes.io/name": "openarc"}},
        "spec": {"groups": documents(ALERTS)[0]["groups"]},
    }


PROMETHEUS_RULE_HEADER = """\
# Generated from config/prometheus/openarc-alerts.yml (its comments explain each
# alert): `python tests/test_kubernetes.py` rewrites this file, and
# tests/test_kubernetes.py fails when the two differ. Your Prometheus must select
# it (ruleSelector; with kube-prometheus-stack add `release: <its release name>`).
"""


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (PromQL, descriptions) as block literals, as in the alerts file."""


_LiteralDumper.add_representer(str, lambda dumper, text: dumper.represent_scalar(
    "tag:yaml.org,2002:str", text, style="|" if "\n" in text else None))


def write_prometheus_rule() -> None:
    body = yaml.dump(prometheus_rule(), Dumper=_LiteralDumper, sort_keys=False, width=1 << 16, allow_unicode=True)
    PROMETHEUS_RULE.write_text(PROMETHEUS_RULE_HEADER + body)


def test_prometheus_rule_holds_exactly_the_alert_rules():
    assert the("PrometheusRule") == prometheus_rule(), \
        "containers/kubernetes/prometheusrule.yaml differs from config/prometheus: run python tests/test_kubernetes.py"


def test_prometheus_rule_groups_pass_promtool(promtool, tmp_path):
    """The rules as the operator hands them to Prometheus: checked, and unit-tested with the alerts' own tests."""
    rules = tmp_path / ALERTS.name  # the name the alert tests' rule_files expects
    rules.write_text(yaml.safe_dump({"groups": the("PrometheusRule")["spec"]["groups"]}, sort_keys=False))
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    checked, output = run_promtool(promtool, "check", "rules", rules.name, cwd=tmp_path)
    assert checked.returncode == 0, output
    assert f"SUCCESS: {sum(len(group['rules']) for group in prometheus_rule()['spec']['groups'])} rules found" in output
    tested, output = run_promtool(promtool, "test", "rules", ALERT_TESTS.name, cwd=tmp_path)
    assert tested.returncode == 0, output


if __name__ == "__main__":
    write_prometheus_rule()
    print(f"wrote {PROMETHEUS_RULE.relative_to(REPO)}; check: {shlex.join(['pytest', __file__])}")
