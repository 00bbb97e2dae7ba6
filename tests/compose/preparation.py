"""The compose tier's images, made before its tests need them.

The builds take minutes, mostly inside dockerd and pip, so they start in a thread as soon as the
suite is collected (tests/conftest.py, when a test of the stack was selected) and the rest of the
suite runs meanwhile; the stack's tests are ordered last, and the `stack` fixture waits for this.

Each image is built as docker-compose.yml (with the tier's override) says: its context, Dockerfile,
target, arguments and network, read from `docker-compose config`, and its tag. They are built with
BuildKit where a docker client here has it, the three at once (BuildKit builds their shared stages
once). Measured here, alone, from an empty cache: the CPU worker's image took 127 s that way against
174 s with the legacy builder (docker-compose 1.29's), which copies each layer as it commits it.
Elsewhere the legacy builder builds them one after another.
Where Docker cannot be had the tier skips and says why; with LLMFLEET_COMPOSE_REQUIRED=1 (CI)
that is a failure instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import yaml

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

    def __init__(self, daemon: DockerDaemon | None = None):
        self.daemon = daemon or DockerDaemon()
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
    builds = {"infra_image_s": ["-t", INFRA_IMAGE, "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", str(HERE / "infra")]}
    config = yaml.safe_load(stack("config", log=False).stdout)["services"]
    for service in ("gateway", "worker"):
        build, image = config[service]["build"], config[service]["image"]
        builds[f"build_{build['target']}_s"] = _build_arguments(build, image)
    docker = buildkit_docker()
    started = time.monotonic()
    if docker is None:
        for name, arguments in builds.items():
            run("docker", "build", "-q", *arguments, env={**env, "DOCKER_BUILDKIT": "0"}, log=log)
            TIMINGS[name] = elapsed(started)
            started = time.monotonic()
        return
    logs = {name: LOG_DIR / f"compose-tier-{name.removesuffix('_s')}.log" for name in builds}
    procs = {}
    for name, arguments in builds.items():
        with logs[name].open("a") as out:  # after an earlier preparation's (`make test` has two)
            out.write(f"\n$ docker build {' '.join(arguments)}\n")
            out.flush()
            procs[name] = subprocess.Popen([docker, "build", "--progress", "plain", *arguments], stdout=out,
                                           stderr=subprocess.STDOUT, env={**env, "DOCKER_BUILDKIT": "1"})
    failed = []
    while procs:  # each build's time is how long after the three began it ended
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                TIMINGS[name] = elapsed(started)
                del procs[name]
                if proc.returncode:
                    failed.append(f"{name.removesuffix('_s')} exited {proc.returncode} (see {logs[name]})")
        time.sleep(0.5)
    if failed:
        raise RuntimeError("docker build failed: " + "; ".join(failed))


def _build_arguments(build: dict, image: str) -> list[str]:
    """`docker build`'s arguments for a service's `build:` section as `docker-compose config` resolves it."""
    arguments = ["-f", os.path.join(build["context"], build.get("dockerfile", "Dockerfile")), "-t", image]
    if build.get("target"):
        arguments += ["--target", build["target"]]
    for name, value in (build.get("args") or {}).items():
        arguments += ["--build-arg", f"{name}={value}"]
    if build.get("network"):
        arguments += ["--network", build["network"]]
    return [*arguments, build["context"]]


def buildkit_docker() -> str | None:
    """A docker client that builds with BuildKit: one with the buildx plugin, or one older than 23.0,
    which has BuildKit built in (Debian bookworm's docker.io is 20.10, and /usr/bin/docker even where
    a newer client without buildx comes first on PATH). None where there is neither."""
    for client in dict.fromkeys(filter(None, (shutil.which("docker"), "/usr/bin/docker"))):
        if not os.access(client, os.X_OK):
            continue
        if run(client, "buildx", "version", check=False).returncode == 0:
            return client
        version = run(client, "version", "--format", "{{.Client.Version}}", check=False).stdout.strip()
        if version.split(".")[0].isdigit() and int(version.split(".")[0]) < 23:
            return client
    return None


class IdleCgroup:
    """A CPU cgroup at idle priority (`cpu.idle`: its processes run only on CPU nothing else wants),
    this process moved into it, so that what it starts runs there too: dockerd, and through its
    --cgroup-parent the containers of its builds. Two groups under it: `tools` (this process and its
    children) and `containers`. cgroup v1 only (the test machines'), where dockerd's cgroupfs driver
    takes any parent path; raises OSError where it cannot be had (not root, cgroup v2, a kernel
    before 5.15 without cpu.idle)."""

    ROOT = Path("/sys/fs/cgroup/cpu")

    def __init__(self, name: str = "llmfleet-compose-images"):
        self.name = name
        self.group = self.ROOT / name
        self.containers = f"/{name}/containers"

    def __enter__(self) -> IdleCgroup:
        if not (self.ROOT / "cgroup.procs").exists():
            raise OSError(f"no cgroup v1 cpu hierarchy at {self.ROOT}")
        self.previous = self.ROOT / _cpu_cgroup().lstrip("/")  # where this process goes back to
        try:
            self.group.mkdir(exist_ok=True)
            (self.group / "cpu.idle").write_text("1")
            (self.group / "tools").mkdir(exist_ok=True)
            (self.group / "tools" / "cgroup.procs").write_text(str(os.getpid()))
        except OSError:
            self._remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        (self.previous / "cgroup.procs").write_text(str(os.getpid()))
        self._remove()

    def _remove(self) -> None:
        """The groups, deepest first, in every hierarchy dockerd made them in (one per controller)."""
        for tree in Path("/sys/fs/cgroup").glob(f"*/{self.name}"):
            for directory in sorted((d for d in tree.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
                with contextlib.suppress(OSError):
                    directory.rmdir()
            with contextlib.suppress(OSError):
                tree.rmdir()


def _cpu_cgroup() -> str:
    """This process's group in the cgroup v1 cpu hierarchy (`/` at its root)."""
    return next(line.split(":", 2)[2] for line in Path("/proc/self/cgroup").read_text().splitlines()
                if "cpu" in line.split(":")[1].split(","))


def main(argv: list[str] | None = None) -> int:
    """Build the images now: the compose tier, run later, then finds every layer cached. Where Docker
    cannot be had, say why and leave it to the tier (which skips, or fails under
    LLMFLEET_COMPOSE_REQUIRED=1).

    `make test` runs this twice. With --idle, beside the first pass: at idle CPU priority
    (`IdleCgroup`), with a dockerd of its own, so that the builds take only the CPU the tests leave
    (run beside them at the same priority, they made timing-sensitive tests fail); where that cannot
    be had, it builds nothing. Then without, beside the vLLM tier: what is left to build."""
    parser = argparse.ArgumentParser(prog="python -m tests.compose.preparation")
    parser.add_argument("--idle", action="store_true", help="build at idle CPU priority, or not at all")
    idle = parser.parse_args(argv).idle
    with contextlib.ExitStack() as stack:
        daemon = DockerDaemon()
        if idle:
            if os.geteuid() != 0 or not all(map(shutil.which, ("docker", "dockerd", "docker-compose"))):
                print("compose images: not built at idle priority: that needs root, docker, dockerd and docker-compose")
                return 0
            if DockerDaemon._answers():
                print("compose images: not built at idle priority: a Docker daemon already runs here")
                return 0
            try:
                group = stack.enter_context(IdleCgroup())
            except OSError as exc:
                print(f"compose images: not built at idle priority: no idle CPU cgroup here ({exc})")
                return 0
            daemon = DockerDaemon(cgroup_parent=group.containers)
        preparation = Preparation(daemon)
        preparation.start()
        preparation._thread.join()
        preparation.stop()
    if isinstance(preparation.error, Unavailable):
        print(f"compose images: not built: {preparation.error}")
        return 0
    if preparation.error is not None:
        print(f"compose images: the build failed: {preparation.error!r} (log: {preparation.log})")
        return 1
    print(f"compose images built{' at idle priority' if idle else ''}: "
          + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in TIMINGS.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
