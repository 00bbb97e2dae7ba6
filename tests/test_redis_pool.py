"""The processes' Redis pool: a Redis that closes a connection under a write is a ConnectionError."""

from __future__ import annotations

import pytest
import uvloop
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import redis_pool

PING = b"*1\r\n$4\r\nPING\r\n"


def test_a_write_to_a_socket_closed_under_it_is_a_connection_error_on_uvloop(redis_url):
    """On uvloop, redis-py's own connection raises RuntimeError here, past every `except RedisError`."""
    async def scenario():
        client = redis_pool.connect(redis_url, max_connections=2, wait_s=1, client_name="test-pool")
        connection = await client.connection_pool.get_connection()
        try:
            assert await client.client_getname() == "test-pool"
            connection._writer.transport.abort()  # the socket is gone, as when Redis restarts
            with pytest.raises(RedisConnectionError, match="handler is closed"):
                await connection.send_packed_command(PING, check_health=False)
        finally:
            await client.connection_pool.release(connection)
            await client.aclose()

    uvloop.run(scenario())
