"""Redis topologies of real processes for the topology tests: a server with options of the test's
choosing, a primary with a replica and three Sentinels, and TLS certificates made with openssl."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import redis

from llmfleet import find_redis_server
from shared import redis_pool
from tests.procs import Proc, free_port, spawn, wait_for


def require(*programs: str) -> None:
    """Skip the test, saying why, when a program it runs is not installed."""
    missing = [program for program in programs if shutil.which(program) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed (Debian: apt-get install redis-server redis-sentinel "
                    "redis-tools openssl; `make system-deps`)")


def answers(url: str) -> bool:
    try:
        return bool(redis_pool.connect_sync(url).ping())
    except (redis.RedisError, OSError):
        return False


def start_server(*options: str, port: int | None = None, url: str = "redis://127.0.0.1:{port}/0") -> Proc:
    """A redis-server on loopback with `options`; ready once `url` (formatted with the port) answers."""
    port = port or free_port()
    proc = spawn(f"redis-{port}", [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                   "--appendonly", "no", *options])
    proc.url = url.format(port=port)
    proc.extra["port"] = port
    wait_for(lambda: answers(proc.url) or _exited(proc), 10, f"redis-server on {port} to answer")
    return proc


def _exited(proc: Proc) -> bool:
    if not proc.alive():
        raise RuntimeError(f"redis-server exited:\n{proc.log()[-3000:]}")
    return False


@dataclass
class SentinelSet:
    """A primary, its replica and three Sentinels watching them as `service`."""
    primary: Proc
    replica: Proc
    sentinels: list[Proc]
    service: str

    @property
    def url(self) -> str:
        nodes = ",".join(f"127.0.0.1:{sentinel.extra['port']}" for sentinel in self.sentinels)
        return f"redis+sentinel://{nodes}/{self.service}"

    def sentinel_client(self, index: int = 0) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.sentinels[index].extra["port"])

    def stop(self) -> None:
        for proc in [*self.sentinels, self.replica, self.primary]:
            proc.stop()


def start_sentinel_set(directory: Path, service: str = "llmfleet", down_after_ms: int = 1000) -> SentinelSet:
    for name in ("primary", "replica"):  # where the replica keeps the copy it syncs
        (directory / name).mkdir()
    primary = start_server("--dir", str(directory / "primary"),
                           "--repl-diskless-sync-delay", "0")  # the replica syncs at once, not 5 s later
    replica = start_server("--dir", str(directory / "replica"), "--replicaof", "127.0.0.1", str(primary.extra["port"]))
    sentinels = []
    try:
        wait_for(lambda: _in_sync(replica), 30, "the replica to sync with the primary")
        for _ in range(3):
            port = free_port()
            config = directory / f"sentinel-{port}.conf"  # Sentinel rewrites its config: one each
            config.write_text(f"port {port}\nbind 127.0.0.1\ndir {directory}\n"
                              f"sentinel monitor {service} 127.0.0.1 {primary.extra['port']} 2\n"
                              f"sentinel down-after-milliseconds {service} {down_after_ms}\n"
                              f"sentinel failover-timeout {service} 10000\n")
            proc = spawn(f"sentinel-{port}", [shutil.which("redis-sentinel"), str(config)])
            proc.extra["port"] = port
            sentinels.append(proc)
        found = SentinelSet(primary, replica, sentinels, service)
        wait_for(lambda: _all_see_each_other(found), 30, "the Sentinels to find the replica and each other",
                 interval=0.2)
        return found
    except BaseException:
        for proc in [*sentinels, replica, primary]:
            proc.stop()
        raise


def _in_sync(replica: Proc) -> bool:
    info = redis.Redis(host="127.0.0.1", port=replica.extra["port"]).info("replication")
    return info["master_link_status"] == "up" and not info["master_sync_in_progress"]


def _all_see_each_other(found: SentinelSet) -> bool:
    try:
        for index in range(len(found.sentinels)):
            client = found.sentinel_client(index)
            replicas = client.execute_command("SENTINEL", "REPLICAS", found.service)
            if len(replicas) != 1 or len(client.execute_command("SENTINEL", "SENTINELS", found.service)) != 2:
                return False
        return True
    except (redis.RedisError, OSError):
        return False


@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path


def make_certificates(directory: Path) -> Certificates:
    """A self-signed CA and a server certificate it signed, for 127.0.0.1 and localhost."""
    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=llmfleet test CA",
            "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost", "-keyout", "server.key",
            "-out", "server.csr")
    (directory / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.ext", "-out", "server.crt")
    return Certificates(directory / "ca.crt", directory / "server.crt", directory / "server.key")


def chat(gateway: Proc, model: str, words: str, max_tokens: int, timeout: float = 30) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=timeout, json={
        "model": model, "messages": [{"role": "user", "content": words}], "max_tokens": max_tokens})


def expected_text(words: str, max_tokens: int) -> str:
    """The scripted engine repeats the last user message's words, one per token."""
    tokens = words.split()
    return " ".join(tokens[i % len(tokens)] for i in range(max_tokens))
