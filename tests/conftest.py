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
from tests.parity.encoders import CLASSIFIER, CLASSIFIER_OPTIONS, EncoderPair
from tests.parity.harness import ENGINE_ENV, ENGINE_OPTIONS, ParserWorkers, VllmServes
from tests import procs
from tests.procs import (
    Proc,
    Script,
    start_gateway,
    start_redis,
    start_redis_cluster,
    start_worker,
    wait_until_served,
)

SCRIPTED_MODEL = "scripted-model"


def pytest_configure(config: pytest.Config) -> None:
    """Gateways and scripted workers fork from the zygote, unless LLMFLEET_TEST_ZYGOTE=0."""
    procs.USE_ZYGOTE = os.environ.get("LLMFLEET_TEST_ZYGOTE", "1") != "0"


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




class VLLMStack:
    def __init__(self, gateway: Proc, worker: Proc, model: str, model_dir: str):
        self.gateway, self.worker, self.model, self.model_dir = gateway, worker, model, model_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    from worker.tiny_model import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="session")
def vllm_stack(parser_workers: ParserWorkers, tiny_model_dir: str):
    """A gateway and a vLLM worker on the tiny model: the parser workers' tool profile (started
    with the session, shared by every test that needs no engine of its own)."""
    model = parser_workers.serve("tools")
    return VLLMStack(parser_workers.gateway, parser_workers.workers["tools"], model, tiny_model_dir)


@pytest.fixture(scope="session")
def vllm_serves(tiny_model_dir: str):
    """`vllm serve` for each parser profile, for the parity battery (started, not yet waited for)."""
    serves = VllmServes(tiny_model_dir)
    yield serves
    serves.stop()


@pytest.fixture(scope="session")
def encoder_pair(redis_url: str, tiny_model_dir: str):
    """The tiny model as an embedding model: llmfleet's vLLM encoder worker and `vllm serve --runner
    pooling` with the same options (tests/parity/encoders.py), started with the session's other engines.
    The worker encodes requests together (`--encode-together`, tested by test_vllm_encoders.py); a
    request that reaches it alone, as the parity battery sends them, is one call of the handler, as
    with the option off."""
    pair = EncoderPair(redis_url, tiny_model_dir, worker_options=("--encode-together",))
    yield pair
    pair.stop()


@pytest.fixture(scope="session")
def classifier_pair(redis_url: str, tiny_model_dir: str):
    """The tiny model as a classifier, on llmfleet's vLLM encoder worker and on `vllm serve --runner
    pooling --convert classify`: not started with the session's other engines (nine engines at once,
    beside the compose tier's images, ran out of memory here), but as soon as the parity battery has
    stopped its `vllm serve`s (`start_if_the_session_needs`), or when first used."""
    pair = EncoderPair(redis_url, tiny_model_dir, CLASSIFIER, CLASSIFIER_OPTIONS)
    yield pair
    pair.stop()


def _engine_script(name: str, module: str, model_dir: str):
    script = Script(name, module, [model_dir], ENGINE_ENV)
    yield script
    script.stop()


@pytest.fixture(scope="session")
def plain_streams_run(tiny_model_dir: str):
    """tests/plain_streams.py on an engine of its own (read by test_vllm_plain_streams.py): like
    `classifier_pair`, started in the place of the parity battery's `vllm serve`s, or when first used."""
    yield from _engine_script("plain-streams", "tests.plain_streams", tiny_model_dir)


@pytest.fixture(scope="session")
def tool_call_continuation_run(tiny_model_dir: str):
    """tests/tool_call_continuation.py on an engine of its own (read by
    test_vllm_token_continuation.py), started as `plain_streams_run` is."""
    yield from _engine_script("tool-call-continuation", "tests.tool_call_continuation", tiny_model_dir)


# Where the parity battery's `vllm serve`s were: the engines that wait for their room.
AFTER_THE_PARITY_BATTERY = ("classifier_pair", "plain_streams_run", "tool_call_continuation_run")


MORTAL_MODEL = "tiny-mortal"  # served by the workers tests/faults/test_vllm_worker_deaths.py kills


def mortal_vllm_worker(redis_url: str, model_dir: str, *args: str) -> Proc:
    """A vLLM worker of MORTAL_MODEL, started (not waited for): with a reasoning and a tool parser,
    whose state a stream's takeover rebuilds from the engine's tokens."""
    return start_worker(redis_url, model_dir, *ENGINE_OPTIONS, "--reasoning-parser", "deepseek_r1",
                        "--enable-auto-tool-choice", "--tool-call-parser", "hermes", *args,
                        engine="vllm", served_name=MORTAL_MODEL, env=ENGINE_ENV, wait=False)


@pytest.fixture(scope="session")
def mortal_worker(redis_url: str, tiny_model_dir: str):
    """The first worker the death tests kill, started with the session's other engines."""
    worker = mortal_vllm_worker(redis_url, tiny_model_dir)
    yield worker
    worker.stop(timeout=60)  # killed by its test, unless that did not run


@pytest.fixture(scope="session")
def mortal_drainer(redis_url: str, tiny_model_dir: str):
    """The worker the drain test stops (`--drain-timeout 0.2`): started by the first death test as
    soon as its victim is dead, in that one's room, or when first used."""
    worker = mortal_vllm_worker(redis_url, tiny_model_dir, "--drain-timeout", "0.2")
    yield worker
    worker.stop(timeout=60)  # stopped by its test, unless that did not run


@pytest.fixture(scope="session")
def mortal_spare(redis_url: str, tiny_model_dir: str):
    """A second worker of MORTAL_MODEL, started with the session's other engines: it takes over
    the first one's requests when that one is killed (`--claim-idle 1`), then is the next victim."""
    worker = mortal_vllm_worker(redis_url, tiny_model_dir, "--claim-idle", "1")
    yield worker
    worker.stop(timeout=60)


def start_if_the_session_needs(request: pytest.FixtureRequest, *fixtures: str) -> None:
    """Make these session fixtures now, those a test of the session uses: a test that has stopped its
    engines starts, in their place, the ones that wait for their room (not waited for here)."""
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for fixture in fixtures:
        if fixture in needed:
            request.getfixturevalue(fixture)


# The session fixtures that start vLLM engines, and which one starts each without waiting for it.
ENGINES = {"vllm_stack": "parser_workers", "parser_workers": "parser_workers", "vllm_serves": "vllm_serves",
           "mortal_worker": "mortal_worker", "mortal_spare": "mortal_spare", "encoder_pair": "encoder_pair"}


@pytest.fixture(scope="session", autouse=True)
def _engines_started_together(request: pytest.FixtureRequest):
    """A session that will need vLLM engines starts them all at its beginning, side by side,
    each fixture then waiting only for its own (one engine takes ~30 s of start-up, mostly three
    processes importing torch and vLLM one after another: several overlap)."""
    needed = {name for item in request.session.items for name in getattr(item, "fixturenames", ())}
    for starter in dict.fromkeys(starter for user, starter in ENGINES.items() if user in needed):
        engines = request.getfixturevalue(starter)
        if isinstance(engines, ParserWorkers):
            engines.spawn_all()
