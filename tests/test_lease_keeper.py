"""The lease thread on a real Redis (worker/leases.py): it renews the heartbeat key's TTL only
while something needs it, a held lease or a heartbeat that stopped reaching Redis (a stalled
loop), so that an idle worker sends nothing from it."""

from __future__ import annotations

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
