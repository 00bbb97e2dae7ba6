"""`BatchedRedis` on a real redis-server: shared pipelines, each caller its own reply or error."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.redis_batch import BatchedRedis
from tests.procs import free_port


class CountingBatchedRedis(BatchedRedis):
    """Records the size of every pipeline it sends."""

    def __init__(self, redis: aioredis.Redis):
        super().__init__(redis)
        self.batches: list[int] = []

    async def _send(self, batch) -> None:
        self.batches.append(len(batch))
        await super()._send(batch)


@contextlib.asynccontextmanager
async def batched_client(url: str):
    redis = aioredis.Redis.from_url(url, socket_connect_timeout=1)
    batched = CountingBatchedRedis(redis)
    runner = asyncio.create_task(batched.run())
    try:
        yield batched
    finally:
        runner.cancel()
        await asyncio.gather(runner, return_exceptions=True)
        await redis.aclose()


def _key(name: str) -> str:
    return f"test:batch:{uuid.uuid4().hex[:8]}:{name}"


async def test_concurrent_commands_share_pipelines_and_get_their_own_replies(redis_url: str) -> None:
    async with batched_client(redis_url) as batched:
        keys = [_key(str(i)) for i in range(300)]
        await asyncio.gather(*(batched.set(key, i, ex=60) for i, key in enumerate(keys)))
        values = await asyncio.gather(*(batched.incrby(key, 1000) for key in keys))
        assert values == [1000 + i for i in range(300)]
        assert sum(batched.batches) == 600
        assert len(batched.batches) <= 4, batched.batches  # a burst is a handful of round trips, not 600
        await batched.delete(*keys)


async def test_an_error_fails_only_its_own_command(redis_url: str) -> None:
    async with batched_client(redis_url) as batched:
        text, number = _key("text"), _key("number")
        await batched.set(text, "not a number", ex=60)
        await batched.set(number, 1, ex=60)
        results = await asyncio.gather(batched.incr(text), batched.incr(number), batched.get(text),
                                       return_exceptions=True)
        assert isinstance(results[0], ResponseError)
        assert results[1:] == [2, b"not a number"]
        assert len(batched.batches) == 3  # the two sets, then all three together
        await batched.delete(text, number)


async def test_pipelines_join_the_batch_in_order(redis_url: str) -> None:
    async with batched_client(redis_url) as batched:
        key, bad = _key("p"), _key("bad")
        await batched.set(bad, "x", ex=60)
        first = batched.pipeline(transaction=False).set(key, 1, nx=True, ex=60).getdel(key).exists(key)
        second = batched.pipeline(transaction=False).incr(bad).get(bad)
        replies, failed = await asyncio.gather(first.execute(), second.execute(raise_on_error=False))
        assert replies == [True, b"1", 0]
        assert isinstance(failed[0], ResponseError) and failed[1] == b"x"
        assert batched.batches[-1] == 5  # both pipelines went out as one
        with pytest.raises(ResponseError):
            await batched.pipeline(transaction=False).incr(bad).execute()
        # A transaction is a real MULTI/EXEC on its own connection, not part of a batch.
        sent = sum(batched.batches)
        assert await batched.pipeline(transaction=True).set(key, 5, ex=60).incr(key).execute() == [True, 6]
        assert sum(batched.batches) == sent
        await batched.delete(key, bad)


async def test_a_cancelled_caller_does_not_stop_the_others(redis_url: str) -> None:
    async with batched_client(redis_url) as batched:
        key = _key("c")
        gone = asyncio.ensure_future(batched.set(key, "gone", ex=60))
        await asyncio.sleep(0)  # queued
        gone.cancel()
        assert await batched.set(key, "kept", ex=60) is True
        assert await batched.get(key) == b"kept"
        await batched.delete(key)


async def test_redis_unreachable_fails_each_batch_and_the_loop_keeps_sending() -> None:
    # (That commands succeed again once Redis is back is tests/faults/test_redis_restart.py, on real processes.)
    async with batched_client(f"redis://127.0.0.1:{free_port()}/0") as batched:
        for _ in range(2):
            results = await asyncio.gather(batched.get("k"), batched.incr("n"), return_exceptions=True)
            assert all(isinstance(r, RedisConnectionError) for r in results), results
        assert batched.batches == [2, 2]


async def test_stopping_fails_what_is_still_queued(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    batched = BatchedRedis(redis)
    runner = asyncio.create_task(batched.run())
    await asyncio.sleep(0)  # the loop waits for work
    waiting = asyncio.ensure_future(batched.get(_key("never")))
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    with pytest.raises(RedisConnectionError, match="stopping"):
        await waiting
    await redis.aclose()


async def test_sent_does_not_wait_on_a_stopped_client(redis_url: str) -> None:
    """A request ending while its gateway stops is not held by a batch nobody will send."""
    redis = aioredis.Redis.from_url(redis_url)
    batched = BatchedRedis(redis)
    runner = asyncio.create_task(batched.run())
    batched.stop()
    await runner
    late = batched.now("GET", _key("late"))
    await asyncio.wait_for(batched.sent(), 1)
    late.cancel()
    await redis.aclose()


async def test_replies_are_parsed_as_redis_py_parses_them(redis_url: str) -> None:
    stream = _key("stream")
    plain = aioredis.Redis.from_url(redis_url)
    try:
        await plain.xadd(stream, {"v": "1"})
        await plain.expire(stream, 60)
        await plain.xgroup_create(stream, "group", id="0")
        async with batched_client(redis_url) as batched:
            assert await batched.xinfo_groups(stream) == await plain.xinfo_groups(stream)  # "XINFO GROUPS"
            assert await batched.xlen(stream) == 1
            assert await batched.scan(0, match=stream) == await plain.scan(0, match=stream)
        await plain.delete(stream)
    finally:
        await plain.aclose()


async def test_now_queues_at_the_call_and_sent_waits_for_the_write_not_the_reply(redis_url: str) -> None:
    """How a gateway answers before its unregistering's replies: `now`/`call_now` put commands
    ahead of what the client is asked next; `sent()` is done once they are written, while Redis,
    paused here, has not answered them."""
    async with batched_client(redis_url) as batched, aioredis.Redis.from_url(redis_url) as other:
        key = _key("now")
        script = batched.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
        await script(keys=[key], args=[0])  # loaded
        await other.execute_command("CLIENT", "PAUSE", 1000, "ALL")
        later = batched.get(key)  # a coroutine: queued once awaited, so after the two below
        first = batched.now("SET", key, 5, "EX", 60)
        second = batched.call_now(script, [key], [2])
        await asyncio.wait_for(batched.sent(), 0.5)  # written, while paused: no reply yet
        assert not first.done() and not second.done()
        await other.execute_command("CLIENT", "UNPAUSE")
        assert await later == b"7"
        assert await first is True and await second == 7
        deleted = batched.now("DEL", key)
        waiting = [asyncio.ensure_future(batched.sent()) for _ in range(2)]
        waiting[0].cancel()  # one waiter gone leaves the other's wait
        await asyncio.wait_for(waiting[1], 1)
        assert await deleted == 1
