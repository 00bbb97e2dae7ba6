"""The processes' Redis pool: a Redis that closes a connection under a write is a ConnectionError."""

from __future__ import annotations

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import redis_pool

PING = b"*1\r\n$4\r\nPING\r\n"
# What a write to a socket closed under it raises: the pool's ConnectionError for uvloop's RuntimeError,
# or redis-py's own (8.2 and later), which finds the transport closing before it writes.
CLOSED_UNDER_A_WRITE = "handler is closed|closed by the server before write"


def test_a_write_to_a_socket_closed_under_it_is_a_connection_error_on_uvloop(redis_url):
    """On uvloop, redis-py's own connection raises RuntimeError here, past every `except RedisError`
    (the pool's connections turn it into a ConnectionError); from 8.2 on, redis-py looks at the
    transport before it writes and raises its own ConnectionError."""
    async def scenario():
        client = redis_pool.connect(redis_url, max_connections=2, wait_s=1, client_name="test-pool")
        connection = await client.connection_pool.get_connection()
        try:
            assert await client.client_getname() == "test-pool"
            connection._writer.transport.abort()  # the socket is gone, as when Redis restarts
            with pytest.raises(RedisConnectionError, match=CLOSED_UNDER_A_WRITE):
                await connection.send_packed_command(PING, check_health=False)
        finally:
            await client.connection_pool.release(connection)
            await client.aclose()

    uvloop.run(scenario())
