"""An encoding reaches its engine while its lease is taken (`Runner._encode_early`), on a real Redis.

The lease's round trip is then off the answer's path, and what the lease's reply says still
holds: a request whose lease another worker holds is not answered here and its encoding is
stopped; a cancel stashed while it was queued stops it and answers it as cancelled; nothing is
published before the lease is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode
from shared.envelopes import ChunkEnvelope, RequestEnvelope
from shared.redis_batch import BatchedRedis
from worker.adapters.scripted_encoder import ScriptedEncoder
from worker.leases import Leases
from worker.publisher import ReplyPublisher
from worker.runner import Runner

pytestmark = pytest.mark.integration

MODEL = "early-embed"


class WatchedEncoder(ScriptedEncoder):
    """A scripted encoder that says when an encoding begins, and holds it until `go` is set."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.began = asyncio.Event()
        self.go = asyncio.Event()
        self.cancelled = False

    async def encode(self, request: RequestEnvelope):
        self.began.set()
        try:
            await self.go.wait()
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return await super().encode(request)


class GatedLeases(Leases):
    """Leases whose `take` waits for `gate` before it asks Redis."""

    def __init__(self, batched: BatchedRedis, worker_id: str) -> None:
        super().__init__(batched, worker_id)
        self.gate = asyncio.Event()

    async def take(self, request_id: str):
        await self.gate.wait()
        return await super().take(request_id)


@contextlib.asynccontextmanager
async def running(redis_url: str, adapter: WatchedEncoder):
    redis = aioredis.Redis.from_url(redis_url)
    worker_id = f"early-{uuid.uuid4().hex[:8]}"
    batched = BatchedRedis(redis)
    publisher = ReplyPublisher(redis, worker_id)
    leases = GatedLeases(batched, worker_id)
    runner = Runner(adapter, MODEL, worker_id, adapter.kinds, batched, publisher, leases)
    loops = [asyncio.create_task(batched.run()), asyncio.create_task(publisher.run())]
    try:
        yield runner, leases, redis
    finally:
        publisher.stop()
        batched.stop()
        await asyncio.wait_for(asyncio.gather(*loops), 10)
        await redis.aclose()


async def embedding(redis: aioredis.Redis, queued_for: float = 60) -> RequestEnvelope:
    """A request, and its gateway's reply stream (a worker writes only into a stream that is there)."""
    now = time.time()
    request = RequestEnvelope(request_id=uuid.uuid4().hex, model=MODEL, kind="embed",
                              reply_to=f"{keys.PREFIX}:replies:{{early-{uuid.uuid4().hex[:8]}}}", arrival=now,
                              deadline=now + 60, queue_deadline=now + queued_for,
                              body={"model": MODEL, "input": "the sea"})
    await redis.xadd(request.reply_to, {"opened": "1"})
    await redis.expire(request.reply_to, 60)
    return request


async def ended(runner: Runner, request: RequestEnvelope) -> None:
    await asyncio.wait_for(runner.running[request.request_id], 10)


async def replies(redis: aioredis.Redis, request: RequestEnvelope) -> list:
    return [decode(ChunkEnvelope, fields[keys.ENVELOPE_FIELD]).chunks[-1]
            for _id, fields in await redis.xrange(request.reply_to) if keys.ENVELOPE_FIELD in fields]


async def test_an_encoding_reaches_its_engine_before_its_lease_is_in(redis_url):
    adapter = WatchedEncoder()
    adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await embedding(redis)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.wait_for(adapter.began.wait(), 5)  # the lease not yet asked for
        await asyncio.sleep(0.05)
        assert await replies(redis, request) == []  # nothing goes out before the lease is held
        leases.gate.set()
        await ended(runner, request)
        [answer] = await replies(redis, request)
        assert answer.done and answer.finish_reason == "stop" and len(answer.pooled) == 1


async def leased_once_begun(runner: Runner, leases: GatedLeases, adapter: WatchedEncoder,
                            request: RequestEnvelope) -> None:
    """Run the request, its lease's reply held back until its encoding has begun; until it ends."""
    runner.start(keys.request_stream(MODEL), "1-0", request)
    await asyncio.wait_for(adapter.began.wait(), 5)
    leases.gate.set()
    await ended(runner, request)


async def test_a_request_whose_lease_another_worker_holds_is_not_answered_and_its_encoding_stops(redis_url):
    adapter = WatchedEncoder()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await embedding(redis)
        await redis.set(keys.lease_key(request.request_id), "another-worker", ex=30)
        await leased_once_begun(runner, leases, adapter, request)
        await asyncio.sleep(0.05)
        assert adapter.cancelled
        assert await replies(redis, request) == []
        assert await redis.get(keys.lease_key(request.request_id)) == b"another-worker"


async def test_a_cancel_stashed_while_it_was_queued_stops_the_encoding_and_answers_it_cancelled(redis_url):
    adapter = WatchedEncoder()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await embedding(redis)
        await redis.set(keys.cancelled_key(request.request_id), "disconnect", ex=30)
        await leased_once_begun(runner, leases, adapter, request)
        assert adapter.cancelled
        [answer] = await replies(redis, request)
        assert answer.done and answer.finish_reason == "cancelled" and answer.pooled is None


async def test_a_request_past_its_queue_timeout_is_refused_without_reaching_the_engine(redis_url):
    """An overloaded engine does no work for what the lease's reply will refuse."""
    adapter = WatchedEncoder()
    adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await embedding(redis, queued_for=-1)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.sleep(0.05)
        leases.gate.set()
        await ended(runner, request)
        assert not adapter.began.is_set()
        [answer] = await replies(redis, request)
        assert answer.finish_reason == "error" and answer.error.code == "queue_timeout"
