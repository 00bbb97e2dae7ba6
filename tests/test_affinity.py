"""Cache affinity in the pull queue (shared/affinity.py), with real gateways, Redis and scripted
workers that simulate a prefix cache: a conversation's turns go to the worker that cached it; a
stopped preferred worker's requests are taken by another after a few milliseconds; a dead one's
running requests are reclaimed; a stopped one's stream is deleted."""

from __future__ import annotations

import concurrent.futures
import os
import time

import httpx
import pytest
from redis.cluster import RedisCluster

from shared import affinity, keys, redis_pool
from shared.codec import decode
from shared.envelopes import RequestEnvelope, WorkerInfo
from tests.conftest import leftover_keys
from tests.procs import (
    metric_value,
    start_gateway,
    start_redis,
    start_redis_cluster,
    start_worker,
    wait_for,
    wait_until_served,
)

pytestmark = pytest.mark.integration

MODEL = "affinity-model"
SYSTEM = " ".join(f"rule{i}" for i in range(400))  # about 3 kB: worth a worker's cache
CACHED = ("--scripted-prefill-per-token", "0.0001", "--max-concurrency", "4")


@pytest.fixture(scope="module")
def redis_url():
    """A Redis of its own (the tests stop workers and look at every key left); a cluster with
    LLMFLEET_TEST_REDIS=cluster."""
    proc = start_redis_cluster() if os.environ.get("LLMFLEET_TEST_REDIS") == "cluster" else start_redis()
    yield proc.url
    proc.stop()


@pytest.fixture(scope="module")
def fleet(redis_url):
    started = []
    try:
        # Stealing held off for a second: a turn the preferred worker is slow to claim (a stall of
        # this busy machine) must not go to the other worker and miss the cache.
        workers = [start_worker(redis_url, MODEL, *CACHED, "--steal-after-ms", "1000") for _ in range(2)]
        started += workers
        gateway = start_gateway(redis_url)
        started.append(gateway)
        wait_until_served(gateway, MODEL)
        yield gateway, workers
    finally:
        for proc in started:
            proc.stop()


def _messages(conversation: int, turns: int) -> list[dict]:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"conversation {conversation} question {turn} " * 8})
        if turn < turns - 1:
            messages.append({"role": "assistant", "content": f"answer {turn} " * 8})
    return messages


def _chat(gateway, messages: list[dict], **extra) -> dict:
    response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                          json={"model": MODEL, "messages": messages, "max_tokens": 4, **extra})
    assert response.status_code == 200, response.text
    return response.json()


def _infos(redis_url: str, model: str) -> list[WorkerInfo]:
    """The heartbeats of `model`'s live workers."""
    client = redis_pool.connect_sync(redis_url)
    infos = [decode(WorkerInfo, value) for value in client.mget(list(client.scan_iter(match="llmfleet:worker:*")))
             if value is not None]
    return [info for info in infos if info.model == model]


def _preferring(worker: WorkerInfo, workers: list[WorkerInfo], count: int, model: str = MODEL) -> list[int]:
    """Conversations whose first choice is `worker`."""
    chosen = []
    conversation = 0
    while len(chosen) < count:
        envelope = RequestEnvelope("r", model, "chat", "", 0.0, body={"messages": _messages(conversation, 1)})
        if affinity.ranked(affinity.key_of(envelope), workers)[0].worker_id == worker.worker_id:
            chosen.append(conversation)
        conversation += 1
    return chosen


@pytest.mark.cluster
def test_a_conversation_stays_with_the_worker_that_cached_it(fleet):
    gateway, workers = fleet
    for conversation in range(4):
        for turns in range(1, 5):
            usage = _chat(gateway, _messages(conversation, turns))["usage"]
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            if turns == 1:
                assert cached < usage["prompt_tokens"]
            else:  # the whole of the previous turn's prompt, to its last full block of 16 words
                assert cached >= usage["prompt_tokens"] - 16 - 8 * 4 - 8 * 2, usage
    own = sum(metric_value(w.url, "llmfleet_worker_claims_total", model=MODEL, source="own") for w in workers)
    assert own >= 16
    assert metric_value(gateway.url, "llmfleet_gateway_affinity_total", model=MODEL, route="preferred") >= 16


def test_a_short_prompt_has_no_affinity(fleet):
    gateway, _workers = fleet
    before = metric_value(gateway.url, "llmfleet_gateway_affinity_total", model=MODEL)
    usage = _chat(gateway, [{"role": "user", "content": "hi"}])["usage"]
    assert usage["prompt_tokens"] == 1
    assert metric_value(gateway.url, "llmfleet_gateway_affinity_total", model=MODEL) == before


def test_the_load_of_an_unknown_model_is_a_404(fleet):
    gateway, _workers = fleet
    response = httpx.get(f"{gateway.url}/fleet/load", params={"model": "no-such-model"})
    assert response.status_code == 404 and response.json()["error"]["param"] == "model"
    assert httpx.get(f"{gateway.url}/fleet/load", params={"model": MODEL}).json()["workers"] == 2


@pytest.mark.cluster
def test_a_busy_preferred_worker_does_not_hold_its_requests(redis_url):
    """Two workers of one slot each: while the preferred worker runs a long request, the next one
    sent to it is taken by the idle worker after `--steal-after-ms`, and answered first."""
    # Stealing after a second, as below: under load a worker a few ms late to claim the long request
    # would lose it to the idle one, and the next request would find no busy worker (the likely
    # reading of a CI run where the long request never showed as claimed from its worker's stream).
    paced = ("--scripted-tokens-per-second", "20", "--max-concurrency", "1", "--steal-after-ms", "1000")
    workers = [start_worker(redis_url, "affinity-busy", *paced) for _ in range(2)]
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, "affinity-busy")
        infos = _infos(redis_url, "affinity-busy")
        busy, idle = (next(i for i in infos if f"-{w.pid}-" in i.worker_id) for w in workers)
        long_one, short_one = _preferring(busy, [busy, idle], 2, "affinity-busy")

        def ask(conversation: int, max_tokens: int) -> httpx.Response:
            return httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, json={
                "model": "affinity-busy", "messages": _messages(conversation, 1), "max_tokens": max_tokens})

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            long_answer = pool.submit(ask, long_one, 200)  # 10 s on the busy worker's only slot
            wait_for(lambda: metric_value(workers[0].url, "llmfleet_worker_claims_total", model="affinity-busy",
                                          source="own") == 1, 10, "the long request to start on its worker")
            short_answer = ask(short_one, 2)
            assert short_answer.status_code == 200, short_answer.text
            assert not long_answer.done()  # answered by the other worker, not after the long one
            assert long_answer.result().status_code == 200
        assert metric_value(workers[1].url, "llmfleet_worker_claims_total", model="affinity-busy", source="stolen") == 1
    finally:
        gateway.stop()
        for worker in workers:
            worker.stop()


@pytest.mark.cluster
def test_a_dead_workers_requests_are_reclaimed(redis_url):
    # No stealing within the test: a victim starved for a second (the compose tier's engines run beside the
    # cluster tier) would otherwise lose a request to the survivor before it claims it (a CI run here did).
    slow = ("--scripted-tokens-per-second", "20", "--claim-idle", "1", "--steal-after-ms", "60000")
    workers = [start_worker(redis_url, "affinity-dead", *CACHED, *slow) for _ in range(2)]
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, "affinity-dead")
        client = redis_pool.connect_sync(redis_url)
        infos = {int(i.worker_id.split("-")[-2]): i for i in
                 (decode(WorkerInfo, v) for v in client.mget(list(client.scan_iter(match="llmfleet:worker:*"))) if v)
                 if i.model == "affinity-dead"}
        victim, survivor = workers
        conversations = _preferring(infos[victim.pid], list(infos.values()), 2)
        with httpx.Client(timeout=60) as http:
            def ask(conversation: int) -> httpx.Response:
                return http.post(f"{gateway.url}/v1/chat/completions", json={
                    "model": "affinity-dead", "messages": _messages(conversation, 1), "max_tokens": 40})

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                answers = [pool.submit(ask, c) for c in conversations]
                victim_stream = keys.worker_stream("affinity-dead", infos[victim.pid].worker_id)
                wait_for(lambda: metric_value(victim.url, "llmfleet_worker_claims_total", model="affinity-dead",
                                              source="own") >= 2, 10, "the victim to claim its requests")
                # What KEDA scales on counts them, though the model's own stream holds none of them.
                assert client.xlen(keys.request_stream("affinity-dead")) == 0
                load = wait_for(lambda: (body := http.get(f"{gateway.url}/fleet/load",
                                                          params={"model": "affinity-dead"}).json())["running"] == 2
                                and body, 5, "the gateway to count the requests in the worker's stream")
                assert load == {"model": "affinity-dead", "requests": 2, "waiting": 0, "running": 2, "workers": 2,
                                "slots": 8}
                victim.kill()
                for answer in answers:  # non-streaming: the survivor runs them again from the start
                    response = answer.result()
                    assert response.status_code == 200, response.text
                    assert response.json()["choices"][0]["finish_reason"] == "length"
        assert metric_value(survivor.url, "llmfleet_worker_claims_total", model="affinity-dead",
                            source="reclaimed") >= 2
        assert client.xlen(victim_stream) == 0  # deleted once its worker has been silent for FORGET_AFTER_S
        # A worker that stops says so (its heartbeat's expiry at 0): the others delete its stream at once.
        workers.append(start_worker(redis_url, "affinity-dead", *CACHED, *slow))
        survivor_stream = keys.worker_stream("affinity-dead", infos[survivor.pid].worker_id)
        assert client.exists(survivor_stream)
        survivor.stop()
        wait_for(lambda: not client.exists(survivor_stream), 10, "the stopped worker's stream to be deleted")
    finally:
        gateway.stop()
        for worker in workers:
            worker.stop()
    assert not leftover_keys(redis_pool.connect_sync(redis_url))


def _script_calls(client, command: str = "evalsha") -> int:
    """The calls of `command` Redis has served (EVALSHA, or a command scripts run), on every node of a cluster."""
    if isinstance(client, RedisCluster):
        stats = client.info("commandstats", target_nodes=RedisCluster.ALL_NODES).values()
    else:
        stats = [client.info("commandstats")]
    return sum(node.get(f"cmdstat_{command}", {}).get("calls", 0) for node in stats)


def test_requests_one_at_a_time_are_claimed_by_the_blocking_read_alone(redis_url):
    """A worker whose last claim took fewer requests than it had room for goes straight back to its
    blocking read: with requests coming one at a time, none runs the claiming script (`CLAIM`,
    which reads both streams' waiting entries with XRANGE), where it ran once per request."""
    model = "affinity-one-at-a-time"
    started = [start_worker(redis_url, model)]
    try:
        started.append(gateway := start_gateway(redis_url))
        wait_until_served(gateway, model)
        for _ in range(3):  # the first claims after start-up may run it
            _chat(gateway, [{"role": "user", "content": "hello"}], model=model)
        client = redis_pool.connect_sync(redis_url)
        before = _script_calls(client, "xrange")
        for _ in range(20):
            _chat(gateway, [{"role": "user", "content": "hello"}], model=model)
        assert _script_calls(client, "xrange") - before <= 2  # a claim cut short by a stall of this machine, say
    finally:
        for proc in reversed(started):
            proc.stop()


def test_idle_workers_wait_on_the_doorbell_instead_of_polling(redis_url):
    """Idle workers, stealing after the default 10 ms, ask Redis for waiting requests when a
    request is routed to a worker's stream or once a second, not every 10 ms (~200 scripts a
    second for two workers)."""
    workers = [start_worker(redis_url, "affinity-idle") for _ in range(2)]
    try:
        client = redis_pool.connect_sync(redis_url)
        wait_for(lambda: len(_infos(redis_url, "affinity-idle")) == 2, 30, "both workers to register")
        before = _script_calls(client)
        time.sleep(3)
        calls = _script_calls(client) - before
        # Each idle worker's claim loop and steal loop run a script about once a second each.
        assert calls < 60, f"{calls} scripts in 3 s from two idle workers"
    finally:
        for worker in workers:
            worker.stop()



@pytest.mark.cluster
def test_requests_claimed_past_the_free_slots_wait_in_the_own_stream_and_ring(redis_url):
    """`MOVE`, on a real Redis: the entries leave the model's stream for the worker's own, which
    joins the waiting set, and the doorbell rings (one element, with a TTL) so an idle worker
    takes them when they are due; `RING` rings it again."""
    client = redis_pool.connect_sync(redis_url)
    model = "affinity-move"
    shared, own = keys.request_stream(model), keys.worker_stream(model, "w1")
    waiting, doorbell = keys.affinity_waiting(model), keys.affinity_doorbell(model)
    try:
        for stream in (shared, own):
            client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
        ids = [client.xadd(shared, {keys.ENVELOPE_FIELD: f"envelope {i}"}) for i in range(2)]
        client.xreadgroup(keys.WORKER_GROUP, "w1", {shared: ">"}, count=2)
        client.rpush(doorbell, 1)  # an older ring: the doorbell keeps the last one only
        client.register_script(affinity.MOVE)(
            keys=[shared, own, waiting, doorbell],
            args=[keys.WORKER_GROUP, 1000, 60, 100, keys.ENVELOPE_FIELD, ids[0], b"envelope 0", ids[1], b"envelope 1"])
        assert [fields[keys.ENVELOPE_FIELD] for _id, fields in client.xrange(own)] == [b"envelope 0", b"envelope 1"]
        assert client.xlen(shared) == 0 and client.xpending(shared, keys.WORKER_GROUP)["pending"] == 0
        assert client.zscore(waiting, own) == 1000
        assert client.lrange(doorbell, 0, -1) == [b"1000"] and 0 < client.ttl(doorbell) <= 60
        client.register_script(affinity.RING)(keys=[doorbell], args=[2000, 60])  # a worker passing a ring on
        assert client.lrange(doorbell, 0, -1) == [b"2000"]
    finally:
        client.delete(shared, own, waiting, doorbell)


@pytest.mark.cluster
def test_a_preferred_worker_past_the_bounded_load_spills_to_the_next(redis_url):
    """`ROUTE`, on a real Redis: a candidate takes a request only while its stream holds fewer than
    LOAD_FACTOR times the candidates' mean, the request included (consistent hashing with bounded
    loads); the waiting allowance still holds below that bound."""
    client = redis_pool.connect_sync(redis_url)
    model = "affinity-bound"
    first, second = keys.worker_stream(model, "w1"), keys.worker_stream(model, "w2")
    route = client.register_script(affinity.ROUTE)
    streams = affinity.route_keys(model, [first, second])
    try:
        for stream in (first, second):
            client.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)

        def routed(allowances=(100, 100)) -> int:
            chosen, *_depth_and_entry = route(keys=streams, args=affinity.route_args(1000, b"envelope", 1000,
                                                                                  list(allowances)))
            return chosen

        # Mean of 0.5, 1, 1.5, 2 with each request: bounds 1, 2, 3, 3 (x 1.5, rounded up).
        assert [routed() for _ in range(4)] == [1, 1, 1, 2]
        assert (client.xlen(first), client.xlen(second)) == (3, 1)
        for _ in range(12):
            routed()
        # Of 16, the preferred worker holds the most the bound lets it: 1.5 x 16 / 2.
        assert (client.xlen(first), client.xlen(second)) == (12, 4)
        client.xreadgroup(keys.WORKER_GROUP, "w1", {first: ">"})  # the first's entries run: none waits there
        assert routed(allowances=(0, 100)) == 2  # no waiting room on the first: the second, though under the bound
    finally:
        client.delete(*streams[1:])
