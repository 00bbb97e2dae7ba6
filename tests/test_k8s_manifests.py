"""The Kubernetes manifests (deploy/k8s), rendered and validated offline, then checked for the
properties the deployment relies on.

Every overlay is rendered with `kubectl kustomize`, plus the gpu overlay with the monitoring
component. Built-in kinds are validated with kubernetes-validate (strict: unknown fields are
errors) for the oldest and the newest Kubernetes the manifests claim; KEDA's ScaledObject and
TriggerAuthentication and the Prometheus Operator's PrometheusRule against their CRD schemas,
vendored in tests/schemas (made strict the same way). ServiceMonitors are checked for shape.

The PrometheusRule is generated from deploy/alerts.yml:
    python -m tests.test_k8s_manifests --sync-alerts
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from gateway.settings import GatewaySettings
from shared import keys

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
ALERTS = ROOT / "deploy" / "alerts.yml"
PROMETHEUS_RULE = K8S / "components" / "monitoring" / "prometheusrule.yaml"
SCHEMAS = Path(__file__).resolve().parent / "schemas"

# The oldest Kubernetes the manifests claim (KEDA 2.16 supports 1.29 to 1.31) and the newest
# kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_SCHEMAS = {
    ("keda.sh/v1alpha1", "ScaledObject"): "keda-2.16.1-scaledobject.yaml",
    ("keda.sh/v1alpha1", "TriggerAuthentication"): "keda-triggerauthentication.yaml",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheus-operator-0.82.2-prometheusrule.yaml",
}
SHAPE_CHECKED = {("monitoring.coreos.com/v1", "ServiceMonitor")}
IMAGES = {
    "cpu-dev": {"llmfleet-gateway:dev", "llmfleet-worker-cpu:dev", "redis:7-alpine"},
    "gpu": {"llmfleet-gateway:0.1.0", "llmfleet-worker-cuda:0.1.0", "redis:7-alpine"},
}
# Overlays that leave the Redis Secret to the operator (kubectl create secret ...).
EXTERNAL_SECRETS = {"gpu": {"llmfleet-redis"}}
WORKER_DRAIN_MARGIN_S = 30  # after the request timeout: the last replies and the engine's shutdown
UVICORN_SHUTDOWN_S = 5  # gateway/main.py: timeout_graceful_shutdown
REDIS_URL = "redis://:$(REDIS_PASSWORD)@$(REDIS_ADDRESS)/0"
BUILDS = {"cpu-dev": ["overlays/cpu-dev"], "gpu": ["overlays/gpu"],
          "gpu+monitoring": ["overlays/gpu", "components/monitoring"]}


def kustomize(parts: list[str], tmp_path: Path) -> list[dict]:
    """Render an overlay, with components added through a wrapping kustomization if any."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (with kustomize v5) is not installed: `make system-deps` installs it")
    target = K8S / parts[0]
    if len(parts) > 1:  # kustomize accepts only relative paths to other kustomizations
        target = tmp_path
        relative = [os.path.relpath(K8S / part, tmp_path) for part in parts]
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(
            {"resources": relative[:1], "components": relative[1:]}))
    out = subprocess.run([kubectl, "kustomize", str(target)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@pytest.fixture(scope="module", params=sorted(BUILDS))
def build(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return request.param, kustomize(BUILDS[request.param], tmp_path_factory.mktemp("kustomize"))


def one(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{len(found)} {kind}/{name}"
    return found[0]


def kinds(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def container(deployment: dict, name: str) -> dict:
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name)


def env(container_spec: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container_spec.get("env", [])}


def config(docs: list[dict]) -> dict[str, str]:
    return one(docs, "ConfigMap", "llmfleet-config")["data"]


def selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector["matchLabels"].items())


def workers(docs: list[dict]) -> list[tuple[dict, str]]:
    """The Deployments whose pods pull work from Redis, each with its container's name: the
    generation workers, and the embedding workers where components/embedder is (cpu-dev)."""
    found = [(one(docs, "Deployment", "llmfleet-worker"), "worker")]
    if any(d["kind"] == "Deployment" and d["metadata"]["name"] == "llmfleet-embedder" for d in docs):
        found.append((one(docs, "Deployment", "llmfleet-embedder"), "embedder"))
    return found


def served_model(docs: list[dict], deployment: dict, role: str) -> str:
    """The model a worker Deployment serves: its own LLMFLEET_SERVED_MODEL_NAME, else the ConfigMap's."""
    own = env(container(deployment, role)).get("LLMFLEET_SERVED_MODEL_NAME")
    return own["value"] if own else config(docs)["LLMFLEET_SERVED_MODEL_NAME"]


# --- schemas ----------------------------------------------------------------------------


def _builtin(doc: dict) -> bool:
    key = (doc["apiVersion"], doc["kind"])
    return key not in CRD_SCHEMAS and key not in SHAPE_CHECKED


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_builtin_kinds_validate_strictly(build, version):
    import kubernetes_validate

    _, docs = build
    for doc in filter(_builtin, docs):
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: {exc.message}")


def _strict(schema):
    """The schema with unknown fields rejected, as the API server does with field validation
    Strict (kubectl's default), unless the schema preserves unknown fields."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    strict = {k: _strict(v) for k, v in schema.items()}
    if "properties" in strict and "additionalProperties" not in strict \
            and not strict.get("x-kubernetes-preserve-unknown-fields"):
        strict["additionalProperties"] = False
    return strict


def test_custom_resources_validate_against_their_crd_schemas(build):
    _, docs = build
    for doc in docs:
        source = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
        if source is None:
            continue
        crd = yaml.safe_load((SCHEMAS / source).read_text())
        assert (f"{crd['group']}/{crd['version']}", crd["kind"]) == (doc["apiVersion"], doc["kind"])
        errors = sorted(jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"])).iter_errors(doc), key=str)
        assert not errors, f"{doc['kind']}/{doc['metadata']['name']}: " + "; ".join(
            f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)


def test_a_schema_rejects_what_the_api_server_would():
    """The vendored schemas made strict do fail: a misspelt field and a wrong type."""
    crd = yaml.safe_load((SCHEMAS / CRD_SCHEMAS[("keda.sh/v1alpha1", "ScaledObject")]).read_text())
    validator = jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"]))
    good = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "x"},
            "spec": {"scaleTargetRef": {"name": "x"}, "triggers": [{"type": "redis-streams", "metadata": {}}]}}
    assert validator.is_valid(good)
    assert not validator.is_valid({**good, "spec": {**good["spec"], "minReplicas": 0}})
    assert not validator.is_valid({**good, "spec": {**good["spec"], "triggers": [
        {"type": "redis-streams", "metadata": {"streamLength": 64}}]}})


def test_every_custom_kind_has_a_check(build):
    """Built-in kinds unknown to Kubernetes fail kubernetes-validate; custom ones must be listed."""
    _, docs = build
    custom = {(d["apiVersion"], d["kind"]) for d in docs if "." in d["apiVersion"].split("/")[0]}
    assert custom <= set(CRD_SCHEMAS) | SHAPE_CHECKED | {
        (v, k) for v, k in custom if v.split("/")[0].endswith(".k8s.io")}


# --- what the deployment relies on ------------------------------------------------------


def test_autoscalers_own_the_replica_counts(build):
    _, docs = build
    gateway = one(docs, "Deployment", "llmfleet-gateway")
    assert "replicas" not in gateway["spec"]
    hpas = kinds(docs, "HorizontalPodAutoscaler")
    assert [h["spec"]["scaleTargetRef"]["name"] for h in hpas] == ["llmfleet-gateway"]
    assert hpas[0]["spec"]["minReplicas"] >= 2
    for worker, _role in workers(docs):
        name = worker["metadata"]["name"]
        assert "replicas" not in worker["spec"], name
        scaled = one(docs, "ScaledObject", name)
        assert scaled["spec"]["scaleTargetRef"]["name"] == name
        assert scaled["spec"]["minReplicaCount"] == 0
    assert len(kinds(docs, "ScaledObject")) == len(workers(docs))


def test_disruption_budgets_cover_gateways_and_workers(build):
    _, docs = build
    budgets = kinds(docs, "PodDisruptionBudget")
    for deployment in [one(docs, "Deployment", "llmfleet-gateway"), *(w for w, _ in workers(docs))]:
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        covering = [b for b in budgets if selects(b["spec"]["selector"], labels)]
        assert len(covering) == 1 and covering[0]["spec"]["maxUnavailable"] == 1, deployment["metadata"]["name"]


def test_termination_grace_covers_what_the_timeouts_allow(build):
    _, docs = build
    settings = config(docs)
    request_timeout = float(settings["LLMFLEET_REQUEST_TIMEOUT"])
    for worker, _role in workers(docs):
        grace = worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= request_timeout + WORKER_DRAIN_MARGIN_S, worker["metadata"]["name"]
    assert float(settings["LLMFLEET_QUEUE_TIMEOUT"]) <= request_timeout
    gateway = one(docs, "Deployment", "llmfleet-gateway")
    pre_stop = container(gateway, "gateway")["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    needed = float(pre_stop[1]) + float(settings["LLMFLEET_DRAIN_GRACE"]) + UVICORN_SHUTDOWN_S
    assert gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > needed


def test_a_draining_gateway_leaves_the_service_before_it_refuses(build):
    _, docs = build
    gateway = container(one(docs, "Deployment", "llmfleet-gateway"), "gateway")
    assert float(gateway["lifecycle"]["preStop"]["exec"]["command"][1]) >= 5
    probe = gateway["readinessProbe"]
    assert probe["httpGet"] == {"path": "/ready", "port": "http"}
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 10  # a drain shows within the preStop
    service = one(docs, "Service", "llmfleet-gateway")
    assert service["spec"]["ports"][0]["targetPort"] in {p["name"] for p in gateway["ports"]}


def test_the_redis_password_comes_only_from_the_secret(build):
    name, docs = build
    redis_container = container(one(docs, "Deployment", "llmfleet-redis"), "redis")
    secret_ref = {"secretKeyRef": {"name": "llmfleet-redis", "key": "password"}}
    assert env(redis_container)["REDIS_PASSWORD"]["valueFrom"] == secret_ref
    assert env(redis_container)["REDISCLI_AUTH"]["valueFrom"] == secret_ref
    args = redis_container["args"]
    assert args[args.index("--requirepass") + 1] == "$(REDIS_PASSWORD)"
    settings = config(docs)
    for deployment, role in [(one(docs, "Deployment", "llmfleet-gateway"), "gateway"), *workers(docs)]:
        variables = env(container(deployment, role))
        assert variables["REDIS_PASSWORD"]["valueFrom"] == secret_ref
        assert variables["LLMFLEET_REDIS_URL"]["value"] == REDIS_URL
        names = list(variables)  # the kubelet expands only variables defined before (envFrom first)
        assert names.index("REDIS_PASSWORD") < names.index("LLMFLEET_REDIS_URL") and "REDIS_ADDRESS" in settings
    assert "LLMFLEET_REDIS_URL" not in settings
    auth = one(docs, "TriggerAuthentication", "llmfleet-redis")["spec"]["secretTargetRef"]
    assert auth == [{"parameter": "password", "name": "llmfleet-redis", "key": "password"}]
    secrets = {s["metadata"]["name"]: s for s in kinds(docs, "Secret")}
    if name.split("+")[0] in EXTERNAL_SECRETS:
        assert "llmfleet-redis" not in secrets
        overlay = (K8S / "overlays" / name.split("+")[0] / "kustomization.yaml").read_text()
        assert "create secret generic llmfleet-redis" in overlay, "the overlay must say how to create it"
    else:
        import base64

        password = base64.b64decode(secrets["llmfleet-redis"]["data"]["password"]).decode()
        assert re.fullmatch(r"[0-9a-f]{16,}", password), "a URL-safe (hex) password"


def test_only_gateways_workers_and_keda_reach_redis(build):
    _, docs = build
    policies = kinds(docs, "NetworkPolicy")
    redis_pod = one(docs, "Deployment", "llmfleet-redis")["spec"]["template"]["metadata"]["labels"]
    [policy] = [p for p in policies if selects(p["spec"]["podSelector"], redis_pod)]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]
    redis_port = container(one(docs, "Deployment", "llmfleet-redis"), "redis")["ports"][0]["containerPort"]
    assert rule["ports"] == [{"protocol": "TCP", "port": redis_port}]
    allowed = [(peer.get("namespaceSelector"), peer["podSelector"]) for peer in rule["from"]]
    fleet = [d["spec"]["template"]["metadata"]["labels"]
             for d in [one(docs, "Deployment", "llmfleet-gateway"), *(w for w, _ in workers(docs))]]
    same_namespace = [pods for namespaces, pods in allowed if namespaces is None]
    assert len(same_namespace) == len(fleet)
    assert all(any(selects(p, labels) for p in same_namespace) for labels in fleet)
    assert not any(selects(p, redis_pod) for p in same_namespace)
    assert [(n, p) for n, p in allowed if n is not None] == [
        ({"matchLabels": {"kubernetes.io/metadata.name": "keda"}},
         {"matchLabels": {"app.kubernetes.io/name": "keda-operator"}})]


def test_workers_scale_on_the_served_models_stream(build):
    _, docs = build
    for worker, role in workers(docs):
        _scales_on_its_models_stream(docs, worker, role)


def _scales_on_its_models_stream(docs: list[dict], worker: dict, role: str) -> None:
    settings = config(docs)
    scaled = one(docs, "ScaledObject", worker["metadata"]["name"])
    trigger, total = scaled["spec"]["triggers"]
    assert trigger["type"] == "redis-streams"
    metadata = trigger["metadata"]
    served = served_model(docs, worker, role)
    assert metadata["stream"] == keys.request_stream(served)
    assert "consumerGroup" not in metadata, "with a consumer group KEDA counts pending entries, not the length"
    assert metadata["streamLength"] == settings["LLMFLEET_MAX_CONCURRENCY"]
    assert served in settings["LLMFLEET_MODELS"].split(","), "gateways must queue the model while it has no worker"
    assert metadata["addressFromEnv"] == "REDIS_ADDRESS"
    namespace = one(docs, "Service", "llmfleet-redis")["metadata"]["namespace"]
    redis_port = one(docs, "Service", "llmfleet-redis")["spec"]["ports"][0]["port"]
    assert settings["REDIS_ADDRESS"] == f"llmfleet-redis.{namespace}.svc:{redis_port}"
    assert one(docs, "TriggerAuthentication", trigger["authenticationRef"]["name"])
    # The requests in the fleet, worker streams included (cache affinity), as the gateways count them.
    assert total["type"] == "metrics-api" and total["metadata"]["valueLocation"] == "requests"
    assert total["metadata"]["targetValue"] == settings["LLMFLEET_MAX_CONCURRENCY"]
    gateway = one(docs, "Service", "llmfleet-gateway")
    url = httpx.URL(total["metadata"]["url"])
    assert url.host == f"llmfleet-gateway.{gateway['metadata']['namespace']}.svc"
    assert url.port == gateway["spec"]["ports"][0]["port"] and url.path == "/fleet/load"
    assert url.params["model"] == served
    assert url.path in GatewaySettings().open_paths, "KEDA presents no API key"


def test_images_are_named_and_tagged_by_the_overlay(build):
    name, docs = build
    images = {c["image"] for d in kinds(docs, "Deployment") for spec in [d["spec"]["template"]["spec"]]
              for c in spec["containers"] + spec.get("initContainers", [])}
    assert images == IMAGES[name.split("+")[0]]


def test_services_target_named_container_ports(build):
    _, docs = build
    pods = [d["spec"]["template"] for d in kinds(docs, "Deployment")]
    for service in kinds(docs, "Service"):
        targets = [p for p in pods if selects({"matchLabels": service["spec"]["selector"]}, p["metadata"]["labels"])]
        assert len(targets) == 1, service["metadata"]["name"]
        names = {port["name"] for c in targets[0]["spec"]["containers"] for port in c.get("ports", [])}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names, service["metadata"]["name"]


def test_the_dev_overlay_serves_an_embedding_model_beside_the_generation_model():
    docs = kustomize(BUILDS["cpu-dev"], Path("."))
    [(worker, _), (embedder, role)] = workers(docs)
    variables = env(container(embedder, role))
    assert variables["LLMFLEET_RUNNER"]["value"] == "pooling" and variables["LLMFLEET_CONVERT"]["value"] == "embed"
    assert served_model(docs, embedder, role) != served_model(docs, worker, "worker")
    # Neither Deployment's selector takes the other's pods.
    labels = [d["spec"]["template"]["metadata"]["labels"] for d in (worker, embedder)]
    assert not selects(worker["spec"]["selector"], labels[1]) and not selects(embedder["spec"]["selector"], labels[0])


# --- monitoring -------------------------------------------------------------------------


def test_prometheus_rule_carries_the_alerts_of_deploy_alerts_yml():
    rule = yaml.safe_load(PROMETHEUS_RULE.read_text())
    assert rule["spec"]["groups"] == yaml.safe_load(ALERTS.read_text())["groups"], (
        "the PrometheusRule differs from deploy/alerts.yml: python -m tests.test_k8s_manifests --sync-alerts")


def test_service_monitors_scrape_the_jobs_the_alerts_name(build):
    name, docs = build
    monitors = kinds(docs, "ServiceMonitor")
    if "monitoring" not in name:
        assert not monitors
        return
    services = kinds(docs, "Service")
    jobs = set()
    for monitor in monitors:
        spec = monitor["spec"]
        assert set(spec) == {"selector", "endpoints"} and spec["endpoints"]
        selected = [s for s in services if selects(spec["selector"], s["metadata"]["labels"])]
        assert len(selected) == 1, monitor["metadata"]["name"]
        ports = {p["name"] for p in selected[0]["spec"]["ports"]}
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "metricRelabelings"} and endpoint["port"] in ports
            assert endpoint["path"] == "/metrics" and re.fullmatch(r"\d+s", endpoint["interval"])
            for rule in endpoint.get("metricRelabelings", []):
                assert set(rule) <= {"sourceLabels", "regex", "targetLabel", "replacement", "action"}
        if selected[0]["metadata"]["labels"].get("app.kubernetes.io/component") == "worker":
            # vLLM's vllm:* series escaped by a 2.x Prometheus come back under their own names
            assert {"sourceLabels": ["__name__"], "regex": "vllm_(.+)", "targetLabel": "__name__",
                    "replacement": "vllm:$1"} in spec["endpoints"][0].get("metricRelabelings", [])
        jobs.add(selected[0]["metadata"]["name"])  # the operator's default job label: the Service name
    assert set(re.findall(r'job="([^"]+)"', ALERTS.read_text())) == jobs
    assert one(docs, "PrometheusRule", "llmfleet")


# --- the generated PrometheusRule ---------------------------------------------------------


class _BlockStrings(yaml.SafeDumper):
    pass


_BlockStrings.add_representer(str, lambda dumper, value: dumper.represent_scalar(
    "tag:yaml.org,2002:str", value, style="|" if "\n" in value else None))


def prometheus_rule_yaml() -> str:
    alerts = yaml.safe_load(ALERTS.read_text())
    rule = {"apiVersion": "monitoring.coreos.com/v1", "kind": "PrometheusRule",
            "metadata": {"name": "llmfleet", "labels": {"app.kubernetes.io/name": "llmfleet"}},
            "spec": {"groups": alerts["groups"]}}
    return ("# Generated from deploy/alerts.yml by `python -m tests.test_k8s_manifests --sync-alerts`;\n"
            "# edit the alerts there. tests/test_k8s_manifests.py checks the two agree.\n"
            + yaml.dump(rule, Dumper=_BlockStrings, sort_keys=False, width=110))


if __name__ == "__main__":
    if sys.argv[1:] != ["--sync-alerts"]:
        sys.exit("usage: python -m tests.test_k8s_manifests --sync-alerts")
    PROMETHEUS_RULE.write_text(prometheus_rule_yaml())
    print(f"wrote {PROMETHEUS_RULE.relative_to(ROOT)}")
