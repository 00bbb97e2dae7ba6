"""What the compose tier needs from the machine, made the way deploy/README.md says:

- a Docker daemon: Debian's dockerd, started here (and stopped by its PID at the end) when
  `docker info` fails and we are root;
- the Debian base image (deploy/base-image.sh) when no image registry can be reached;
- the wheels of the image locks, fetched with this machine's pip configuration into a cache
  directory and served on 127.0.0.1 to `docker build --network host` (pip inside a build cannot
  use the host's wheel sources or its certificate store);
- the images, built with docker-compose 1.29 itself, and the stack it brings up.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import yaml
from packaging.utils import canonicalize_name

from llmfleet import CACHE_DIR
from tests.procs import LOG_DIR, ROOT, wait_for

HERE = Path(__file__).resolve().parent
PROJECT = "llmfleet-compose-tier"
BASE_IMAGE = "llmfleet-base:bookworm"
INFRA_IMAGE = "llmfleet-test-infra:bookworm"
# A fixed port: the wheel server's URL is a build argument, so a new port would rebuild the
# dependency layers.
WHEEL_PORT = 38765
LOCKS = [ROOT / "deploy/requirements-gateway.txt", ROOT / "deploy/requirements-worker-cpu.txt",
         ROOT / "deploy/requirements-build.txt"]


class Unavailable(Exception):
    """Something the tier needs cannot be had on this machine; the message says what and why."""


def run(*args: str, timeout: float = 1800, check: bool = True, env: dict[str, str] | None = None,
        log: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command; its output goes to `log` when given (builds are long), else is captured."""
    if log is None:
        done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)
    else:
        with log.open("a") as out:
            out.write(f"\n$ {' '.join(args)}\n")
            out.flush()
            done = subprocess.run(args, stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, env=env)
    if check and done.returncode != 0:
        detail = done.stderr or done.stdout if log is None else f"see {log}"
        raise RuntimeError(f"{' '.join(args[:4])} ... exited {done.returncode}: {detail}")
    return done


class DockerDaemon:
    """Docker as found, or Debian's dockerd started here; stop() stops only one started here."""

    def __init__(self, cgroup_parent: str = ""):
        self.started: subprocess.Popen | None = None
        self.cgroup_parent = cgroup_parent  # where the containers of a dockerd started here go (its --cgroup-parent)

    def ensure(self) -> None:
        for tool in ("docker", "docker-compose"):
            if shutil.which(tool) is None:
                raise Unavailable(f"`{tool}` is not installed (`make system-deps` installs Debian's docker.io "
                                  "and docker-compose as root)")
        if self._answers():
            return
        if os.geteuid() != 0 or shutil.which("dockerd") is None:
            raise Unavailable("`docker info` fails and dockerd cannot be started here (needs root and dockerd)")
        LOG_DIR.mkdir(parents=True, exist_ok=True)
        with (LOG_DIR / "dockerd.log").open("ab") as log:
            options = ["--cgroup-parent", self.cgroup_parent] if self.cgroup_parent else []
            self.started = subprocess.Popen(["dockerd", *options], stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        try:
            wait_for(lambda: self.started.poll() is not None or self._answers(), 60, "dockerd to answer",
                     interval=0.5)
        except TimeoutError as exc:
            self.stop()
            raise Unavailable(f"dockerd did not answer within 60 s (see {LOG_DIR / 'dockerd.log'})") from exc
        if self.started.poll() is not None:
            raise Unavailable(f"dockerd exited with {self.started.returncode} (see {LOG_DIR / 'dockerd.log'})")

    @staticmethod
    def _answers() -> bool:
        return subprocess.run(["docker", "info"], capture_output=True).returncode == 0

    def stop(self) -> None:
        if self.started is None or self.started.poll() is not None:
            return
        os.kill(self.started.pid, signal.SIGTERM)
        try:
            self.started.wait(60)
        except subprocess.TimeoutExpired:
            os.kill(self.started.pid, signal.SIGKILL)
            self.started.wait()


def image_exists(tag: str) -> bool:
    return run("docker", "image", "inspect", tag, check=False).returncode == 0


# The base image's root filesystem, made ahead by `make compose-base` (used here when present).
BASE_ROOTFS = CACHE_DIR / "base-rootfs-bookworm.tar"


def can_debootstrap() -> bool:
    return os.geteuid() == 0 and shutil.which("debootstrap") is not None


def ensure_base_image(log: Path) -> None:
    if image_exists(BASE_IMAGE):
        return
    if BASE_ROOTFS.exists():
        run(str(ROOT / "deploy/base-image.sh"), "--from", str(BASE_ROOTFS), BASE_IMAGE, log=log)
        return
    if not can_debootstrap():
        raise Unavailable(f"no {BASE_IMAGE} image, and deploy/base-image.sh needs root and debootstrap")
    run(str(ROOT / "deploy/base-image.sh"), BASE_IMAGE, log=log)


class WheelServer:
    """The locks' wheels, fetched with this machine's pip configuration and served over HTTP."""

    def __init__(self, log: Path):
        self.directory = CACHE_DIR / "wheels"
        self.log = log
        self.server: ThreadingHTTPServer | None = None

    def fetch(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        for lock in LOCKS:
            if not self._has_every_wheel(lock):  # pip download would still ask the indexes (15 s)
                run(sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(self.directory), "-r",
                    str(lock), log=self.log)

    def __enter__(self) -> WheelServer:
        self.fetch()
        handler = partial(_QuietHandler, directory=str(self.directory))
        try:
            self.server = ThreadingHTTPServer(("127.0.0.1", WHEEL_PORT), handler)
        except OSError:  # the port is taken: any port works, the dependency layers just rebuild
            self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
            with self.log.open("a") as out:
                out.write(f"port {WHEEL_PORT} is taken: wheels served on {self.server.server_port}, so the "
                          "images' dependency layers are rebuilt\n")
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def _has_every_wheel(self, lock: Path) -> bool:
        present = {path.name.lower() for path in self.directory.glob("*.whl")}
        for line in lock.read_text().splitlines():
            if line and not line.startswith("#"):
                name, version = line.split("==")
                prefix = f"{canonicalize_name(name).replace('-', '_')}-{version}-".lower()
                if not any(file.startswith(prefix) for file in present):
                    return False
        return True

    @property
    def pip_args(self) -> str:
        return f"--no-index --find-links http://127.0.0.1:{self.server.server_port}/"

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's name
        pass


@dataclass
class Container:
    id: str
    name: str
    service: str
    ip: str
    started_at: str
    running: bool
    exit_code: int


class ComposeStack:
    """The compose project of the tier: docker-compose.yml plus tests/compose/docker-compose.test.yml."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env = env
        self.log = log
        self.empty_env_file = LOG_DIR / "compose-tier.env"  # a .env in the checkout must not leak in
        self.empty_env_file.write_text("")

    def command(self, *args: str) -> list[str]:
        return ["docker-compose", "-p", PROJECT, "--project-directory", str(ROOT), "--env-file",
                str(self.empty_env_file), "-f", str(ROOT / "docker-compose.yml"), "-f",
                str(HERE / "docker-compose.test.yml"), *args]

    def __call__(self, *args: str, timeout: float = 600, log: bool = True) -> subprocess.CompletedProcess:
        return run(*self.command(*args), timeout=timeout, env=self.env, log=self.log if log else None)

    def containers(self, service: str | None = None) -> list[Container]:
        ids = self("ps", "-q", *([service] if service else []), log=False).stdout.split()
        if not ids:
            return []
        found = []
        for info in json.loads(run("docker", "inspect", *ids).stdout):
            networks = info["NetworkSettings"]["Networks"]
            ip = next((n["IPAddress"] for n in networks.values() if n["IPAddress"]), "")
            found.append(Container(info["Id"], info["Name"].lstrip("/"),
                                   info["Config"]["Labels"]["com.docker.compose.service"], ip,
                                   info["State"]["StartedAt"], info["State"]["Running"], info["State"]["ExitCode"]))
        return sorted(found, key=lambda c: c.name)

    def running(self, service: str) -> list[Container]:
        return [c for c in self.containers(service) if c.running]

    def url(self, service: str, port: int) -> str:
        host_port = self("port", service, str(port), log=False).stdout.strip()
        return f"http://{host_port}"

    def healthy(self, service: str) -> int:
        """How many of the service's containers Docker reports healthy."""
        ids = [c.id for c in self.running(service)]
        if not ids:
            return 0
        states = json.loads(run("docker", "inspect", *ids).stdout)
        return sum(s["State"].get("Health", {}).get("Status") == "healthy" for s in states)

    def wait_healthy(self, service: str, count: int, timeout: float) -> None:
        wait_for(lambda: self.healthy(service) >= count, timeout, f"{count} healthy {service} container(s)",
                 interval=1)

    def save_logs(self) -> None:
        self("logs", "--no-color", "--timestamps", timeout=120, log=True)


def alert_rules_for_tests(path: Path) -> Path:
    """deploy/alerts.yml with `for: 10s` on the per-model rule, so the test waits seconds, not
    minutes. The expression is the real one."""
    rules = yaml.safe_load((ROOT / "deploy/alerts.yml").read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "LlmfleetModelWithoutWorkers":
                rule["for"] = "10s"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def metric_sum(container: Container, port: int, name: str, **labels: str) -> float:
    """Sum of a metric's samples on a container's /metrics, reached at its own address."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{container.ip}:{port}/metrics", timeout=5).text
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))


def elapsed(start: float) -> float:
    return round(time.monotonic() - start, 1)
