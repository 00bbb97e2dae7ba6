"""`DirectConnection` on a real redis-server: its socket read by `_Replies` in place of redis-py's
stream reader, through every way a connection ends."""

from __future__ import annotations

import asyncio
import contextlib
import uuid

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from shared.redis_direct import DirectConnection, _Replies


@contextlib.asynccontextmanager
async def direct(url: str):
    client = aioredis.Redis.from_url(url, socket_connect_timeout=1)
    connection = DirectConnection(client)
    try:
        yield client, connection
    finally:
        await connection.close()
        await client.aclose()


def _key(name: str) -> str:
    return f"test:direct:{uuid.uuid4().hex[:8]}:{name}"


async def test_replies_come_in_order_with_errors_in_their_place(redis_url: str) -> None:
    text = _key("text")
    async with direct(redis_url) as (_client, connection):
        replies = await connection.execute([("SET", text, "a", "EX", 60), ("INCR", text), ("GET", text)],
                                           raise_on_error=False)
        assert replies[0] in (b"OK", "OK") and replies[2] == b"a"
        assert isinstance(replies[1], ResponseError)
        with pytest.raises(ResponseError):
            await connection.execute([("INCR", text)])
        assert isinstance(connection._replies, _Replies)  # read past redis-py's stream reader


async def test_a_reply_larger_than_a_read_arrives_whole(redis_url: str) -> None:
    stream = _key("stream")
    value = b"x" * 200_000
    async with direct(redis_url) as (client, connection):
        await connection.execute([("XADD", stream, "*", "v", value) for _ in range(20)] + [("EXPIRE", stream, 60)])
        [reply] = await connection.execute([("XRANGE", stream, "-", "+")])
        assert len(reply) == 20 and all(fields == [b"v", value] for _id, fields in reply)
        await client.delete(stream)


async def test_a_connection_closed_while_idle_is_connected_again_before_the_next_round_trip(redis_url: str) -> None:
    async with direct(redis_url) as (client, connection):
        [first] = await connection.execute([("CLIENT", "ID")])
        await client.client_kill_filter(_id=first)
        for _ in range(100):
            if connection._replies.closed:
                break
            await asyncio.sleep(0.01)
        [second] = await connection.execute([("CLIENT", "ID")])  # nothing was sent on the closed one
        assert second != first


async def test_a_pooled_connection_the_server_closed_while_idle_is_not_taken_over_dead(redis_url: str) -> None:
    """The pool may hand out a connection whose server closed it while it sat there: its stream
    reader took the end of the stream, and the transport no longer reads (asyncio and uvloop stop
    reading a half-closed socket whose protocol keeps it open). Taken over as it was, a round trip
    on it waited forever (a worker's replies, after a Redis restart under load: the soak test's hangs)."""
    async with direct(redis_url) as (client, connection), aioredis.Redis.from_url(redis_url) as other:
        first = await client.client_id()  # its connection goes back to the pool, idle
        await other.client_kill_filter(_id=first)
        idle = client.connection_pool._available_connections[0]
        for _ in range(100):
            if idle._reader.at_eof():
                break
            await asyncio.sleep(0.01)
        assert idle._reader.at_eof() and not idle._writer.transport.is_closing()  # half-closed, in the pool
        [second] = await asyncio.wait_for(connection.execute([("CLIENT", "ID")]), 5)
        assert second != first


async def test_a_connection_closed_during_a_round_trip_fails_it_and_the_next_one_connects(redis_url: str) -> None:
    stream = _key("stream")
    async with direct(redis_url) as (client, connection):
        [first] = await connection.execute([("CLIENT", "ID")])
        blocked = asyncio.create_task(connection.execute([("XREAD", "BLOCK", 5000, "STREAMS", stream, "$")]))
        await asyncio.sleep(0.1)
        await client.client_kill_filter(_id=first)
        with pytest.raises(RedisConnectionError):
            await asyncio.wait_for(blocked, 5)
        [second] = await connection.execute([("CLIENT", "ID")])
        assert second != first


async def test_a_cancelled_round_trip_leaves_the_next_one_whole(redis_url: str) -> None:
    stream = _key("stream")
    async with direct(redis_url) as (client, connection):
        blocked = asyncio.create_task(connection.execute([("XREAD", "BLOCK", 5000, "STREAMS", stream, "$")]))
        await asyncio.sleep(0.1)
        blocked.cancel()
        with pytest.raises(asyncio.CancelledError):
            await blocked
        # Its reply would have come on the connection it held; the next round trip is on a new one.
        await client.xadd(stream, {"v": "1"})
        await client.expire(stream, 60)
        [reply] = await connection.execute([("XRANGE", stream, "-", "+")])
        assert [fields for _id, fields in reply] == [[b"v", b"1"]]
        await client.delete(stream)


async def test_a_closed_connection_goes_back_to_the_pool_fit_for_redis_py(redis_url: str) -> None:
    key = _key("plain")
    async with direct(redis_url) as (client, connection):
        await connection.execute([("SET", key, "1", "EX", 60)])
        await connection.close()
        # The pool's connections are read by redis-py's own reader again.
        assert await asyncio.wait_for(client.get(key), 5) == b"1"
        assert await asyncio.wait_for(connection.execute([("GET", key)]), 5) == [b"1"]
        await client.delete(key)


async def test_a_command_named_in_two_words_goes_as_redis_py_sends_it(redis_url: str) -> None:
    async with direct(redis_url) as (_client, connection):
        [by_name] = await connection.execute([("CLIENT ID",)])  # as redis-py's methods name it
        [by_words] = await connection.execute([("CLIENT", "ID")])
        assert isinstance(by_name, int) and by_name == by_words
