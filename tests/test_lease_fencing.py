"""Lease fencing on a real Redis: a worker that lost a request's lease publishes nothing more for
it, and a gateway drops what such a worker still had on the wire (`ChunkEnvelope.lease`).

The partition itself, with real processes in network namespaces, is `tests/faults/test_partition.py`;
these tests place the stale writes exactly where a partition can put them.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis.asyncio as aioredis

from gateway import metrics
from gateway.fleet.runs import Fleet, Run
from shared import keys
from shared.codec import decode
from shared.envelopes import ChunkEnvelope, GenerationChunk, RequestEnvelope
from shared.errors import WorkerLost
from tests.procs import free_port, in_process_fleet
from tests.test_reply_path import running
from worker.publisher import ReplyPublisher

OLD_LEASE, NEW_LEASE = 1_000, 2_000


def _request(fleet: Fleet) -> RequestEnvelope:
    return RequestEnvelope(request_id=uuid.uuid4().hex, model="m", kind="chat", reply_to=fleet.router.stream,
                           arrival=0.0, stream=True, batch_replies=True)


def _run(fleet: Fleet, request: RequestEnvelope) -> Run:
    """A run followed on the fleet's reply stream, outside `Fleet.submit` (nothing is queued:
    the tests publish its replies themselves), with nothing to do at its end."""
    return Run(request, fleet.router.open(request.request_id), fleet.registry)


def _publisher(redis: aioredis.Redis, worker_id: str, request: RequestEnvelope, lease: int) -> ReplyPublisher:
    publisher = ReplyPublisher(redis, worker_id)
    publisher.hold(request.request_id, lease)
    return publisher


def _text(text: str) -> GenerationChunk:
    return GenerationChunk(text=text, token_count=1)


def _stop() -> GenerationChunk:
    return GenerationChunk(done=True, finish_reason="stop")


async def _next_text(chunks) -> str:
    return (await asyncio.wait_for(anext(chunks), 5)).text


async def test_chunks_of_the_lease_a_worker_lost_are_dropped_after_the_takeover(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    async with in_process_fleet(redis_url) as fleet:
        request = _request(fleet)
        run = _run(fleet, request)
        victim = _publisher(redis, "victim", request, OLD_LEASE)
        rescuer = _publisher(redis, "rescuer", request, NEW_LEASE)
        stale_before = metrics.STALE_REPLIES._value.get()
        async with running(victim, rescuer):
            chunks = run.chunks()
            rescuer.publish(request, _text("a"))
            assert await _next_text(chunks) == "a"
            # What the victim had on the wire lands now: a chunk, and even its ending.
            victim.publish(request, _text("stale"))
            await victim.finish(request, _stop(), None)
            rescuer.publish(request, _text("b"))
            await rescuer.finish(request, _stop(), None)
            rest = [chunk async for chunk in chunks]
    assert [chunk.text for chunk in rest] == ["b", ""] and rest[-1].finish_reason == "stop"
    assert metrics.STALE_REPLIES._value.get() - stale_before == 1
    await redis.aclose()


async def test_a_takeover_after_the_first_output_ends_the_response_with_an_error(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    async with in_process_fleet(redis_url) as fleet:
        request = _request(fleet)
        run = _run(fleet, request)
        victim = _publisher(redis, "victim", request, OLD_LEASE)
        rescuer = _publisher(redis, "rescuer", request, NEW_LEASE)
        async with running(victim, rescuer):
            chunks = run.chunks()
            victim.publish(request, _text("a"))  # reached the client before the victim was cut off
            assert await _next_text(chunks) == "a"
            rescuer.publish(request, _text("a"))  # the rescuer starts the request over
            with pytest.raises(WorkerLost):
                await asyncio.wait_for(anext(chunks), 5)
    assert run.closed
    await redis.aclose()


async def test_a_worker_that_lost_the_lease_publishes_nothing_more_even_on_retry(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    gateway_id = uuid.uuid4().hex
    stream = keys.reply_stream(gateway_id)
    await redis.xadd(stream, {b"hello": b"1"})
    lost, kept = (RequestEnvelope(request_id=uuid.uuid4().hex, model="m", kind="chat", reply_to=stream, arrival=0.0,
                                  stream=True) for _ in range(2))
    # Redis is unreachable (nothing listens on the port): the write fails and is retried.
    unreachable = aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=1)
    publisher = _publisher(unreachable, "victim", lost, OLD_LEASE)
    async with running(publisher):
        publisher.publish(lost, _text("stale"))
        publisher.publish(kept, _text("fine"))
        await asyncio.sleep(0.2)  # some retries fail
        publisher.drop(lost.request_id)  # the lease lapsed: the retry must leave it out
        publisher.publish(lost, _text("later"))
        publisher.finish(lost, _stop(), None)
        publisher.redis = redis  # Redis is back
        await asyncio.wait_for(publisher.finish(kept, _stop(), None), 10)
    written = [fields for _id, fields in await redis.xrange(stream) if b"hello" not in fields]
    envelopes = [decode(ChunkEnvelope, fields[keys.ENVELOPE_FIELD]) for fields in written]
    assert {envelope.request_id for envelope in envelopes} == {kept.request_id}
    assert not await redis.exists(keys.streamed_key(lost.request_id))
    await redis.delete(stream, keys.streamed_key(kept.request_id))
    await unreachable.aclose()
    await redis.aclose()
