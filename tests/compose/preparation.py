"""The compose tier's images, made before its tests need them.

The builds take minutes, mostly inside dockerd and pip, so they start in a thread as soon as the
suite is collected (tests/conftest.py, when a test of the stack was selected) and the rest of the
suite runs meanwhile; the stack's tests are ordered last, and the `stack` fixture waits for this.
Where Docker cannot be had the tier skips and says why; with LLMFLEET_COMPOSE_REQUIRED=1 (CI)
that is a failure instead.
"""

from __future__ import annotations

import os
import threading
import time

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
from tests.procs import LOG_DIR

# Everything the test override file needs, and no published port fixed on the host.
SERVICES = ["redis", "gateway", "lb", "scripted", "scripted-embed", "model-init", "worker", "prometheus",
            "alertmanager"]
TIMINGS: dict[str, float] = {}


def _unavailable(reason: str):
    if os.environ.get("LLMFLEET_COMPOSE_REQUIRED"):
        pytest.fail(f"the compose tier cannot run: {reason}")
    pytest.skip(reason)


class Preparation:
    """Docker, the wheels and the images, made in a thread; `wait` hands over the stack to bring up."""

    def __init__(self):
        self.daemon = DockerDaemon()
        self.log = LOG_DIR / "compose-tier.log"
        self.wheels: WheelServer | None = None
        self.stack: ComposeStack | None = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._started = 0.0

    def start(self) -> None:
        if self._thread is None:
            self._started = time.monotonic()
            self._thread = threading.Thread(target=self._prepare, name="compose-images", daemon=True)
            self._thread.start()

    def _prepare(self) -> None:
        try:
            LOG_DIR.mkdir(parents=True, exist_ok=True)
            self.log.write_text("")
            self.daemon.ensure()
            started = time.monotonic()
            self.wheels = WheelServer(self.log).__enter__()
            TIMINGS["wheels_s"] = elapsed(started)
            env = _stack_env(self.wheels)
            stack = ComposeStack(env, self.log)
            stack("down", "-v", "--remove-orphans", "-t", "5")  # what a crashed run of this project left
            _build(stack, env, self.log)
            self.stack = stack
        except BaseException as exc:  # noqa: BLE001 - raised again by `wait`, in the tests' thread
            self.error = exc

    def wait(self) -> ComposeStack:
        self.start()
        self._thread.join()
        TIMINGS["prepared_after_s"] = elapsed(self._started)
        if isinstance(self.error, Unavailable):
            _unavailable(str(self.error))
        if self.error is not None:
            raise self.error
        return self.stack

    def stop(self) -> None:
        """Once the builds are over (they cannot be cut short): the wheel server, and dockerd if started here."""
        if self._thread is not None:
            self._thread.join()
        if self.wheels is not None:
            self.wheels.__exit__(None, None, None)
            self.wheels = None
        self.daemon.stop()


PREPARATION = Preparation()


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
    ensure_base_image(log)
    TIMINGS["base_image_s"] = elapsed(started)
    started = time.monotonic()
    run("docker", "build", "-q", "-t", INFRA_IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", str(HERE / "infra"),
        env=env, log=log)
    TIMINGS["infra_image_s"] = elapsed(started)
    for service, target in (("gateway", "gateway"), ("worker", "worker-cpu")):
        started = time.monotonic()
        stack("build", service, timeout=1800)
        TIMINGS[f"build_{target}_s"] = elapsed(started)


def main() -> int:
    """Build the images now (`make test` does it beside the vLLM tier, and runs the tier after it): the compose tier, run
    later, then finds every layer cached. Where Docker cannot be had, say why and leave it to the
    tier (which skips, or fails under LLMFLEET_COMPOSE_REQUIRED=1)."""
    preparation = Preparation()
    preparation.start()
    preparation._thread.join()
    preparation.stop()
    if isinstance(preparation.error, Unavailable):
        print(f"compose images: not built: {preparation.error}")
        return 0
    if preparation.error is not None:
        print(f"compose images: the build failed: {preparation.error!r} (log: {preparation.log})")
        return 1
    print("compose images built: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in TIMINGS.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
