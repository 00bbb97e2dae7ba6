"""The lease thread on a real Redis (worker/leases.py): it renews the heartbeat key's TTL only
while something needs it, a held lease or a heartbeat that stopped reaching Redis (a stalled
loop), so that an idle worker sends nothing from it; and a lease whose reply a stalled loop reads
late is kept if it is still the worker's, and let go if it lapsed."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import redis
import redis.asyncio as aioredis

from shared import keys
from shared.redis_batch import BatchedRedis
from tests.procs import wait_for
from worker.leases import BEAT_TRUST_S, Leases


def test_the_lease_thread_leaves_a_beating_heartbeat_alone_and_keeps_a_silent_ones_key(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    key = f"llmfleet:test:heartbeat:{uuid.uuid4().hex}"
    leases = Leases(BatchedRedis(aioredis.Redis.from_url(redis_url)), "w")
    client.set(key, b"1", ex=keys.HEARTBEAT_TTL_S)
    leases.beaten()  # the heartbeat just wrote it
    leases.start_keeping(client, key)
    try:
        time.sleep(keys.HEARTBEAT_INTERVAL_S * 1.2)  # one interval: the beat is recent, nothing sent
        assert client.pttl(key) < keys.HEARTBEAT_TTL_S * 1000 - keys.HEARTBEAT_INTERVAL_S * 1000
        # No beat since: the thread renews the key before it lapses, and goes on renewing it.
        wait_for(lambda: client.pttl(key) > (keys.HEARTBEAT_TTL_S - 0.5) * 1000, BEAT_TRUST_S + 2,
                 "the lease thread to renew a silent heartbeat's key")
        time.sleep(keys.HEARTBEAT_TTL_S + 0.5)
        assert client.exists(key)
    finally:
        leases.stop_keeping()
        client.delete(key)
        client.close()


@contextlib.asynccontextmanager
async def leasing(redis_url: str, keeping: bool):
    """Leases on a real Redis, their batch sender running, and with `keeping` the renewing thread;
    a sync client to look at the keys."""
    client = redis.Redis.from_url(redis_url)
    batched = BatchedRedis(aioredis.Redis.from_url(redis_url))
    sender = asyncio.create_task(batched.run())
    leases = Leases(batched, f"w-{uuid.uuid4().hex[:6]}")
    heartbeat = f"llmfleet:test:heartbeat:{uuid.uuid4().hex}"
    warm_up = uuid.uuid4().hex  # connected and the script loaded: a take is written in the step that sends it
    await leases.take(warm_up)
    leases.forget(warm_up)
    client.delete(keys.lease_key(warm_up))
    if keeping:
        leases.start_keeping(client, heartbeat)
    try:
        yield leases, client
    finally:
        leases.stop_keeping()
        batched.stop()
        await asyncio.wait_for(sender, 10)
        client.delete(heartbeat)
        client.close()


async def reported_lost(leases: Leases, seconds: float = 0.3) -> list[str]:
    """What `watch` reports lost in its turns of the next `seconds`."""
    lost: list[str] = []
    stopping = asyncio.Event()
    watching = asyncio.create_task(leases.watch(stopping, lost.append))
    await asyncio.sleep(seconds)
    stopping.set()
    await watching
    return lost


async def test_a_lease_whose_reply_a_stalled_loop_reads_late_is_kept_through_the_stall(redis_url):
    """Asked for, then the loop held past the lease's TTL (another request's render) before the
    reply is read: the thread renews the lease meanwhile, and the worker keeps it."""
    async with leasing(redis_url, keeping=True) as (leases, client):
        request_id = uuid.uuid4().hex
        taking = leases.take(request_id)
        await leases._batched.sent()  # the ask is on the wire
        time.sleep(keys.LEASE_TTL_S + 1.5)  # the loop held: the reply waits unread
        assert client.get(keys.lease_key(request_id)) == leases.worker_id.encode()
        token, _stashed, _streamed = await taking
        assert token
        assert await reported_lost(leases) == []
        client.delete(keys.lease_key(request_id))


async def test_a_lease_asked_for_only_after_a_stall_is_held_from_when_it_was_taken(redis_url):
    """The loop held before the ask was even written (its batch waited for the loop): the reply
    says nothing of when the lease was taken, so it is confirmed, and held from then."""
    async with leasing(redis_url, keeping=False) as (leases, client):
        request_id = uuid.uuid4().hex
        taking = leases.take(request_id)
        time.sleep(keys.LEASE_TTL_S)  # before the batch's sender runs
        assert not client.exists(keys.lease_key(request_id))
        token, _stashed, _streamed = await taking
        assert token
        assert client.pttl(keys.lease_key(request_id)) > (keys.LEASE_TTL_S - 0.5) * 1000
        assert await reported_lost(leases) == []
        client.delete(keys.lease_key(request_id))


async def test_a_lease_that_lapsed_before_its_late_reply_was_read_is_not_taken(redis_url):
    """Nothing renewed it (no thread here): by the time its reply is read another worker could
    hold it, so the worker counts it another's and runs nothing of it; the cancel stashed for the
    request, which the take consumed, is put back for whoever takes it."""
    async with leasing(redis_url, keeping=False) as (leases, client):
        request_id = uuid.uuid4().hex
        client.set(keys.cancelled_key(request_id), b"disconnect", ex=60)
        taking = leases.take(request_id)
        await leases._batched.sent()
        time.sleep(keys.LEASE_TTL_S + 0.5)
        assert not client.exists(keys.lease_key(request_id))  # it was taken, and lapsed
        assert not client.exists(keys.cancelled_key(request_id))  # and its cancel consumed
        assert await taking == (0, None, None)
        assert client.get(keys.cancelled_key(request_id)) == b"disconnect"
        assert await reported_lost(leases) == []  # never held: nothing to lose
        client.delete(keys.cancelled_key(request_id))


async def test_a_held_lease_whose_key_is_gone_is_lost_though_the_thread_renews(redis_url):
    """Its key deleted (a gateway took the lease back from a worker it judged dead; a Redis that
    restarted empty): a renewal finds nothing, so the lease lapses and the worker stops the request."""
    async with leasing(redis_url, keeping=True) as (leases, client):
        request_id = uuid.uuid4().hex
        token, _stashed, _streamed = await leases.take(request_id)
        assert token
        client.delete(keys.lease_key(request_id))
        assert await reported_lost(leases, keys.LEASE_TTL_S) == [request_id]
