"""One connection of a client's pool held by a loop that sends a few commands at a time, over and over.

Two loops of the token path run once per engine step: a gateway's read of its reply stream and a
worker's publisher. Through redis-py's client and pipeline layers each of their round trips pays a
pool lease, a pipeline object, reply callbacks and observability hooks per command: an XREAD of
two entries took 111 µs of CPU here through the client, 63-79 µs without those layers.
`DirectConnection` sends the same commands on a connection of the pool that it holds, with
redis-py's connection API alone (`send_packed_command`, `read_response`), packed by hiredis (0.6 µs
for an XREAD, where redis-py's packer in Python takes 4.7). `Commands` builds them with redis-py's
own command methods, so a loop queues `xadd`, `set`, `xack` ... as it would on a pipeline.

Only on one server (a URL `redis://`, `rediss://`, `unix://`, or Sentinel's primary): on a cluster
each command goes to its slot's node, which its client finds (`direct_connection` gives None there).
"""

from __future__ import annotations

from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import BasicKeyCommands, HashCommands, StreamCommands
from redis.exceptions import ResponseError


class Commands(StreamCommands, BasicKeyCommands, HashCommands):
    """Commands queued for one round trip, built by redis-py's command methods (`xadd`, `set`,
    `delete`, `xack`, `xdel`, `hdel`, ...) as a pipeline would queue them; their replies are not
    parsed (a loop that sends them reads none)."""

    def __init__(self) -> None:
        self.args: list[tuple] = []

    def execute_command(self, *args: Any, **_options: Any) -> None:
        self.args.append(args)


class DirectConnection:
    """One connection of `client`'s pool, taken at the first command and held until `close`.

    Its commands go one round trip at a time, by one task. A failure or a cancel in the middle of
    one (what the connection would read next is unknown) disconnects it and gives it back to the
    pool; the next command takes one again, reconnecting as the pool does (Sentinel asks where the
    primary is)."""

    def __init__(self, client: aioredis.Redis):
        self.pool = client.connection_pool
        self._connection = None

    async def execute(self, commands: list[tuple], raise_on_error: bool = True) -> list[Any]:
        """Send `commands` at once and read their replies, raw (RESP as the connection reads it).
        An error reply is raised, the first once every reply is read; or, without `raise_on_error`,
        given in its place. A lost connection is retried as redis-py's client retries it (the
        connection's own `retry`)."""
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.pool.get_connection()
        try:
            replies = await connection.retry.call_with_retry(lambda: _round_trip(connection, commands),
                                                             lambda _error: connection.disconnect())
        except BaseException:
            self._connection = None
            await connection.disconnect()
            await self.pool.release(connection)
            raise
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            await self.pool.release(connection)


async def _round_trip(connection, commands: list[tuple]) -> list[Any]:
    await connection.send_packed_command(b"".join(map(hiredis.pack_command, commands)))
    replies: list[Any] = []
    for _ in commands:
        try:
            replies.append(await connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def direct_connection(client: aioredis.Redis | RedisCluster) -> DirectConnection | None:
    """A `DirectConnection` on `client`'s pool, or None on a cluster (its client routes each command)."""
    return None if isinstance(client, RedisCluster) else DirectConnection(client)
