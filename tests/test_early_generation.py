"""A generation's first step runs while its lease is taken (`Runner._start_early`), on a real Redis.

Its prompt is rendered, its engine request added and its first output awaited meanwhile, so the
lease's round trip is off the first token's path; what the lease's reply says still holds: a
request whose lease another worker holds is not answered here and its engine request is aborted,
whether its first step was over or not; a cancel stashed while it was queued aborts it and answers
it as cancelled; nothing is published before the lease is held.
"""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis.asyncio as aioredis

from shared import keys
from shared.codec import decode
from shared.envelopes import ChunkEnvelope, GenerationChunk, RequestEnvelope, SamplingOptions
from tests.test_early_encode import ended, running
from worker.adapters.scripted import ScriptedAdapter

pytestmark = pytest.mark.integration

MODEL = "early-embed"  # the model `running` serves


class WatchedGenerator(ScriptedAdapter):
    """A scripted engine that says when a generation begins and when it is closed, and holds its
    first token until `go` is set."""

    def __init__(self) -> None:
        super().__init__(MODEL)
        self.began = asyncio.Event()
        self.first_out = asyncio.Event()
        self.go = asyncio.Event()
        self.closed = asyncio.Event()

    async def generate(self, request: RequestEnvelope, prefix_ids=None):
        self.began.set()
        try:
            await self.go.wait()
            async for chunk in super().generate(request, prefix_ids):
                self.first_out.set()
                yield chunk
        finally:
            self.closed.set()


async def chat(redis: aioredis.Redis, queued_for: float = 60) -> RequestEnvelope:
    """A streaming request, and its gateway's reply stream (a worker writes only into a stream that is there)."""
    now = time.time()
    request = RequestEnvelope(request_id=uuid.uuid4().hex, model=MODEL, kind="chat",
                              reply_to=f"{keys.PREFIX}:replies:{{early-{uuid.uuid4().hex[:8]}}}", arrival=now,
                              deadline=now + 60, queue_deadline=now + queued_for, stream=True,
                              body={"model": MODEL, "messages": [{"role": "user", "content": "calm sea"}]},
                              params=SamplingOptions(max_tokens=4))
    await redis.xadd(request.reply_to, {"opened": "1"})
    await redis.expire(request.reply_to, 60)
    return request


async def replies(redis: aioredis.Redis, request: RequestEnvelope) -> list[GenerationChunk]:
    """Every chunk published for the request, in order."""
    return [chunk for _id, fields in await redis.xrange(request.reply_to) if keys.ENVELOPE_FIELD in fields
            for chunk in decode(ChunkEnvelope, fields[keys.ENVELOPE_FIELD]).chunks]


async def test_a_generation_gives_its_first_output_before_its_lease_is_in(redis_url):
    adapter = WatchedGenerator()
    adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await chat(redis)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.wait_for(adapter.first_out.wait(), 5)  # the lease not yet asked for
        await asyncio.sleep(0.05)
        assert await replies(redis, request) == []  # nothing goes out before the lease is held
        leases.gate.set()
        await ended(runner, request)
        chunks = await replies(redis, request)
        assert "".join(chunk.text or "" for chunk in chunks) == "calm sea calm sea"
        assert chunks[-1].done and chunks[-1].finish_reason == "length"


@pytest.mark.parametrize("first_step", ["over", "under way"])
async def test_a_generation_whose_lease_another_worker_holds_is_not_answered_and_is_closed(redis_url, first_step):
    adapter = WatchedGenerator()
    if first_step == "over":
        adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await chat(redis)
        await redis.set(keys.lease_key(request.request_id), "another-worker", ex=30)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.wait_for((adapter.first_out if first_step == "over" else adapter.began).wait(), 5)
        leases.gate.set()
        await ended(runner, request)
        await asyncio.wait_for(adapter.closed.wait(), 5)  # its engine request is not left running
        assert await replies(redis, request) == []
        assert await redis.get(keys.lease_key(request.request_id)) == b"another-worker"


async def test_a_cancel_stashed_while_it_was_queued_closes_the_generation_and_answers_it_cancelled(redis_url):
    adapter = WatchedGenerator()
    adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await chat(redis)
        await redis.set(keys.cancelled_key(request.request_id), "disconnect", ex=30)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.wait_for(adapter.first_out.wait(), 5)
        leases.gate.set()
        await ended(runner, request)
        await asyncio.wait_for(adapter.closed.wait(), 5)
        [answer] = await replies(redis, request)
        assert answer.done and answer.finish_reason == "cancelled" and not answer.text


async def test_a_generation_past_its_queue_timeout_is_refused_without_reaching_the_engine(redis_url):
    adapter = WatchedGenerator()
    adapter.go.set()
    async with running(redis_url, adapter) as (runner, leases, redis):
        request = await chat(redis, queued_for=-1)
        runner.start(keys.request_stream(MODEL), "1-0", request)
        await asyncio.sleep(0.05)
        leases.gate.set()
        await ended(runner, request)
        assert not adapter.began.is_set()
        [answer] = await replies(redis, request)
        assert answer.finish_reason == "error" and answer.error.code == "queue_timeout"
