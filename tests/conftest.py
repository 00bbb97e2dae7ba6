"""Shared fixtures: a real redis-server for the session, and fleets of real processes.

Tiers (pytest markers): unmarked tests run in-process; `integration` tests start gateways and
scripted workers; `vllm` tests run a real vLLM worker on the tiny model. All run in CI.
"""

from __future__ import annotations

import os
import shutil

import pytest
import redis

from shared import redis_pool
from tests.parity.harness import ParserWorkers
from tests.procs import Proc, start_gateway, start_redis, start_redis_cluster, start_worker, wait_until_served

SCRIPTED_MODEL = "scripted-model"


def _needs_the_stack(item: pytest.Item) -> bool:
    return "stack" in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The compose stack's tests last (stable otherwise): its images build meanwhile."""
    items.sort(key=_needs_the_stack)


def pytest_collection_finish(session: pytest.Session) -> None:
    if not session.config.option.collectonly and any(map(_needs_the_stack, session.items)):
        from tests.compose.preparation import PREPARATION

        PREPARATION.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    """Stop a dockerd started for the stack even when its tests never ran (-x, a deselection)."""
    from tests.compose.preparation import PREPARATION

    PREPARATION.stop()


@pytest.fixture(scope="session")
def redis_proc():
    """One redis-server; with LLMFLEET_TEST_REDIS=cluster, a Redis Cluster of three primaries."""
    cluster = os.environ.get("LLMFLEET_TEST_REDIS") == "cluster"
    if cluster and shutil.which("redis-cli") is None:
        pytest.skip("LLMFLEET_TEST_REDIS=cluster: no redis-cli to create the cluster (Debian: redis-tools)")
    proc = start_redis_cluster() if cluster else start_redis()
    yield proc
    proc.stop()


@pytest.fixture(scope="session")
def redis_url(redis_proc: Proc) -> str:
    return redis_proc.url


@pytest.fixture(scope="session")
def redis_client(redis_url: str) -> redis.Redis | redis.RedisCluster:
    return redis_pool.connect_sync(redis_url)


@pytest.fixture(scope="session")
def scripted_fleet(redis_url: str):
    """Two gateways and two scripted workers of one model (paced so both workers get work)."""
    started = []
    try:
        for _ in range(2):
            started.append(start_worker(redis_url, SCRIPTED_MODEL, "--scripted-tokens-per-second", "400",
                                        "--max-concurrency", "64"))
        for _ in range(2):
            started.append(start_gateway(redis_url))
        workers, gateways = started[:2], started[2:]
        for gateway in gateways:
            wait_until_served(gateway, SCRIPTED_MODEL)
        yield gateways, workers
    finally:  # also when one of them fails to start: none is left running
        for proc in started:
            proc.stop()


def leftover_keys(client: redis.Redis) -> list[str]:
    """Keys that would outlive the fleet: no TTL, or a request stream still holding entries."""
    leftovers = []
    for key in client.scan_iter(match="llmfleet:*"):
        name = key.decode()
        if name.startswith("llmfleet:requests:"):
            if client.xlen(key) > 0:
                leftovers.append(f"{name} holds {client.xlen(key)} entries")
        elif name.startswith("llmfleet:dead-letter:"):
            continue  # kept on purpose, for inspection; bounded by MAXLEN
        elif client.ttl(key) < 0:
            leftovers.append(f"{name} has no TTL")
    return leftovers


@pytest.fixture(scope="session")
def parser_workers(redis_url: str, tiny_model_dir: str):
    """A vLLM worker per parser profile of the tiny model, started on first use and shared by every
    test that needs one, the parity battery's included (a vLLM worker takes ~30 s to start)."""
    workers = ParserWorkers(redis_url, tiny_model_dir)
    yield workers
    workers.stop()


VLLM_SLOTS = 4  # small, so that tests can fill the worker and queue a request behind it


class VLLMStack:
    def __init__(self, gateway: Proc, worker: Proc, model: str, model_dir: str):
        self.gateway, self.worker, self.model, self.model_dir = gateway, worker, model, model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from worker.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def vllm_stack(redis_url: str, tiny_model_dir: str):
    """One gateway and one vLLM worker on the tiny model (starting it takes ~30 s)."""
    engine_options = ["--max-model-len", "2048", "--enforce-eager", "--dtype", "float32"]
    worker = start_worker(redis_url, tiny_model_dir, *engine_options, "--max-concurrency", str(VLLM_SLOTS),
                          engine="vllm", served_name="tiny", env={"VLLM_CPU_KVCACHE_SPACE": "1"}, timeout=240)
    # A vLLM worker that replaces a dead one takes ~30 s to start, far more on a loaded machine:
    # leave its queued requests time to wait for it.
    gateway = start_gateway(redis_url, "--queue-timeout", "300")
    wait_until_served(gateway, "tiny")
    yield VLLMStack(gateway, worker, "tiny", tiny_model_dir)
    gateway.stop()
    assert worker.stop(timeout=60) == 0, worker.log()[-3000:]
