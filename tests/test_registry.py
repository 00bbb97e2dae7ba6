"""A gateway's worker registry refreshing on a real Redis: what it finds, and its round trips.

On one server a refresh reads every heartbeat in one script and the known streams' backlog in the
same batch: one round trip while no worker comes or goes (twice a second on every gateway, each
round trip a wake-up of the gateway and of Redis), a second one when the streams to read changed.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway.fleet.registry import Load, WorkerRegistry
from shared import keys
from shared.codec import encode
from shared.envelopes import WorkerInfo
from shared.redis_batch import BatchedRedis
from tests.procs import recorded_batches, start_redis

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def redis_url():
    """A Redis of this module's own: no other test's worker may come or go between two refreshes."""
    redis = start_redis()
    yield redis.url
    redis.stop()


async def test_a_refresh_is_one_round_trip_while_no_worker_comes_or_goes(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    batched = BatchedRedis(redis)
    sending = asyncio.create_task(batched.run())
    batches = recorded_batches(batched)
    registry = WorkerRegistry(batched)
    model, worker_id = f"m-{uuid.uuid4().hex[:8]}", uuid.uuid4().hex
    info = WorkerInfo(worker_id=worker_id, model=model, max_model_len=128, capacity=4)
    try:
        await registry.refresh()  # no worker yet (and Redis learns the script)
        await redis.set(keys.worker_key(worker_id), encode(info), ex=60)
        await redis.xadd(keys.request_stream(model), {b"x": b"1"})  # one request waiting
        batches.clear()
        await registry.refresh()  # a worker comes: its model's streams are read once it is found
        assert [w.worker_id for w in registry.models[model].workers] == [worker_id]
        assert registry.load[model] == Load(waiting=1, running=0)
        assert len(batches) == 2, batches

        await redis.xadd(keys.request_stream(model), {b"x": b"2"})
        batches.clear()
        await registry.refresh()  # nothing comes or goes
        assert len(batches) == 1, batches
        assert registry.load[model] == Load(waiting=2, running=0)

        await redis.delete(keys.worker_key(worker_id))
        batches.clear()
        await registry.refresh()  # the worker goes
        assert model not in registry.models and len(batches) == 2, batches
    finally:
        batched.stop()
        await sending
        await redis.delete(keys.request_stream(model), keys.worker_key(worker_id))
        await redis.aclose()


async def test_a_refresh_finds_every_worker_in_a_keyspace_that_takes_several_scan_steps(redis_url: str) -> None:
    """Each script call scans one step (as long as a SCAN's, never the whole keyspace while Redis waits):
    among 5,000 other keys, the refresh steps on until the scan ends and finds every worker."""
    redis = aioredis.Redis.from_url(redis_url)
    batched = BatchedRedis(redis)
    sending = asyncio.create_task(batched.run())
    model, others = f"m-{uuid.uuid4().hex[:8]}", f"other-{uuid.uuid4().hex[:8]}"
    worker_ids = [uuid.uuid4().hex for _ in range(3)]
    try:
        pipe = redis.pipeline(transaction=False)
        for i in range(5_000):
            pipe.set(f"{others}:{i}", b"x", ex=60)
        for worker_id in worker_ids:
            pipe.set(keys.worker_key(worker_id), encode(WorkerInfo(worker_id=worker_id, model=model,
                                                                   max_model_len=128, capacity=4)), ex=60)
        await pipe.execute()
        registry = WorkerRegistry(batched)
        await registry.refresh()  # Redis learns the script
        batches = recorded_batches(batched)
        await registry.refresh()
        assert sorted(w.worker_id for w in registry.models[model].workers) == sorted(worker_ids)
        assert sum(command[0] == "EVALSHA" for batch in batches for command in batch) > 1  # several steps
    finally:
        batched.stop()
        await sending
        await redis.delete(*(f"{others}:{i}" for i in range(5_000)), *(keys.worker_key(w) for w in worker_ids))
        await redis.aclose()
