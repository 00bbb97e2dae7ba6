"""The compose tier's stack: images built and the stack brought up once, for tests/compose/test_stack.py.

Where Docker cannot be had the tier skips and says why; with LLMFLEET_COMPOSE_REQUIRED=1 (CI)
that is a failure instead. How long each step took goes to the log directory
(compose-tier-timings.json), with the builds' and the stack's logs.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import pytest

from tests.compose.harness import (
    BASE_IMAGE,
    HERE,
    INFRA_IMAGE,
    ComposeStack,
    DockerDaemon,
    Unavailable,
    WheelServer,
    alert_rules_for_tests,
    elapsed,
    ensure_base_image,
    run,
)
from tests.procs import LOG_DIR, wait_for

# Everything the test override file needs, and no published port fixed on the host.
SERVICES = ["redis", "gateway", "lb", "scripted", "model-init", "worker", "prometheus", "alertmanager"]
TIMINGS: dict[str, float] = {}


def _unavailable(reason: str):
    if os.environ.get("LLMFLEET_COMPOSE_REQUIRED"):
        pytest.fail(f"the compose tier cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="session")
def docker_daemon():
    daemon = DockerDaemon()
    try:
        daemon.ensure()
    except Unavailable as exc:
        _unavailable(str(exc))
    yield daemon
    daemon.stop()


def _stack_env(wheels: WheelServer) -> dict[str, str]:
    return {
        **os.environ,
        "DOCKER_BUILDKIT": "0", "COMPOSE_DOCKER_CLI_BUILD": "0",  # the legacy builder, as docker-compose 1.29 has
        "LLMFLEET_BASE_IMAGE": BASE_IMAGE,
        "LLMFLEET_PIP_INSTALL_ARGS": wheels.pip_args,
        "LLMFLEET_REDIS_IMAGE": INFRA_IMAGE, "LLMFLEET_NGINX_IMAGE": INFRA_IMAGE,
        "LLMFLEET_PROMETHEUS_IMAGE": INFRA_IMAGE, "LLMFLEET_ALERTMANAGER_IMAGE": INFRA_IMAGE,
        # Random host ports on 127.0.0.1: nothing else on the machine is in the way.
        "LLMFLEET_HTTP_ADDR": "127.0.0.1:", "LLMFLEET_PROMETHEUS_ADDR": "127.0.0.1:",
        "LLMFLEET_ALERTMANAGER_ADDR": "127.0.0.1:", "LLMFLEET_GRAFANA_ADDR": "127.0.0.1:",
        "GRAFANA_ADMIN_PASSWORD": "unused-grafana-is-not-started",
        "LLMFLEET_TEST_ALERTS": str(alert_rules_for_tests(LOG_DIR / "compose-tier-alerts.yml")),
    }


def _build(stack: ComposeStack, env: dict[str, str], log) -> None:
    started = time.monotonic()
    try:
        ensure_base_image(log)
    except Unavailable as exc:
        _unavailable(str(exc))
    TIMINGS["base_image_s"] = elapsed(started)
    started = time.monotonic()
    run("docker", "build", "-q", "-t", INFRA_IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", str(HERE / "infra"),
        env=env, log=log)
    TIMINGS["infra_image_s"] = elapsed(started)
    for service, target in (("gateway", "gateway"), ("worker", "worker-cpu")):
        started = time.monotonic()
        stack("build", service, timeout=1800)
        TIMINGS[f"build_{target}_s"] = elapsed(started)


@pytest.fixture(scope="module")  # down before the rest of the suite runs
def stack(docker_daemon):
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log = LOG_DIR / "compose-tier.log"
    log.write_text("")
    session_start = time.monotonic()
    with WheelServer(log) as wheels:
        TIMINGS["wheels_s"] = elapsed(session_start)
        env = _stack_env(wheels)
        stack = ComposeStack(env, log)
        stack("down", "-v", "--remove-orphans", "-t", "5")  # what a crashed run of this project left
        _build(stack, env, log)
    started = time.monotonic()
    stack.started_at = time.time()
    try:
        stack("up", "-d", "--no-build", "--scale", "scripted=2", *SERVICES)
        stack.wait_healthy("lb", 1, 120)
        stack.wait_healthy("scripted", 2, 60)
        stack.api = stack.url("lb", 8000)
        wait_for(lambda: "scripted" in models(stack.api), 30, "the scripted model to be served")
        TIMINGS["up_s"] = elapsed(started)
        yield stack
    finally:
        stack.save_logs()
        started = time.monotonic()
        stack("down", "-v", "--remove-orphans", "-t", "10")
        TIMINGS["down_s"] = elapsed(started)
        TIMINGS["session_s"] = elapsed(session_start)
        (LOG_DIR / "compose-tier-timings.json").write_text(json.dumps(TIMINGS, indent=2))


def models(api: str) -> list[str]:
    try:
        return [m["id"] for m in httpx.get(f"{api}/v1/models", timeout=5).json()["data"]]
    except (httpx.HTTPError, KeyError, ValueError):
        return []
