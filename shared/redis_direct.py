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

Once connected, the connection's socket is read by `_Replies`, not by asyncio's stream reader under
redis-py: its bytes go straight to the connection's own hiredis reader and the replies to the
waiting round trip, a write and a wake-up per round trip. Through the stream reader and
`read_response` a round trip cost 25-30 µs of CPU more here (measured: an XREAD of 20 entries 77-82
µs against 47-54, an XADD 64-67 against 43-47). redis-py still connects, authenticates, finds a
Sentinel's primary and disconnects it; a connection whose redis-py keeps these elsewhere is read
through `read_response`, as before.

`Subscription` holds one channel the same way: a connection of the pool, subscribed, whose socket
is read by hiredis alone and whose messages go to a callback as they come, in the loop's own read
of the socket: no task and no command per message (a gateway's reply channel, gateway/fleet/relay.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import hiredis
import redis.asyncio as aioredis
from redis._parsers.hiredis import NOT_ENOUGH_DATA  # what redis-py's hiredis reader gives for a partial reply
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import BasicKeyCommands, HashCommands, PubSubCommands, StreamCommands
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError


class Commands(StreamCommands, BasicKeyCommands, HashCommands, PubSubCommands):
    """Commands queued for one round trip, built by redis-py's command methods (`xadd`, `set`,
    `delete`, `xack`, `xdel`, `hdel`, `publish`, ...) as a pipeline would queue them; their replies are not
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
        self._replies: _Replies | None = None  # the reader of the connection's socket, once connected

    async def execute(self, commands: list[tuple], raise_on_error: bool = True) -> list[Any]:
        """Send `commands` at once and read their replies, raw (RESP as the connection reads it).
        An error reply is raised, the first once every reply is read; or, without `raise_on_error`,
        given in its place. A lost connection is retried as redis-py's client retries it (the
        connection's own `retry`)."""
        connection = self._connection
        if connection is None:
            connection = self._connection = await self.pool.get_connection()
        try:
            replies = await connection.retry.call_with_retry(lambda: self._round_trip(connection, commands),
                                                             lambda _error: connection.disconnect())
        except BaseException:
            self._connection = self._replies = None
            await connection.disconnect()
            await self.pool.release(connection)
            raise
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, ResponseError):
                    raise reply
        return replies

    async def close(self) -> None:
        connection, self._connection, self._replies = self._connection, None, None
        if connection is not None:  # its socket read here, it goes back to the pool unconnected
            await connection.disconnect()
            await self.pool.release(connection)

    async def _round_trip(self, connection, commands: list[tuple]) -> list[Any]:
        packed = b"".join(hiredis.pack_command(_words(command)) for command in commands)
        replies = self._replies
        taken = replies is not None and replies.reads(connection)
        ended = replies.closed if taken else connection.is_connected and _ended(connection)
        if ended:  # closed while idle (a restart, a timeout), here or in the pool: nothing sent yet
            await connection.disconnect()
        if not connection.is_connected:  # new, closed while idle, or disconnected by a retried failure
            await connection.connect()
        if replies is None or not replies.reads(connection):
            replies = self._replies = _Replies.take_over(connection)
        if replies is None:  # this redis-py reads its sockets otherwise: through its own reader
            return await _read_through(connection, packed, len(commands))
        return await replies.round_trip(packed, len(commands))


class _Replies(asyncio.Protocol):
    """The reader of a connected redis-py connection's socket, put in place of asyncio's stream
    reader (`transport.set_protocol`): what arrives goes to the connection's hiredis reader, and
    the replies, once all are read, to the round trip waiting for them. The stream reader's
    protocol is told when the socket closes, for redis-py's `disconnect` to end as it does."""

    def __init__(self, connection, transport: asyncio.Transport, reader) -> None:
        self.writer = connection._writer
        self.transport = transport
        self.stream_protocol = transport.get_protocol()
        self.reader = reader
        self.waiter: asyncio.Future | None = None
        self.wanted = 0
        self.replies: list[Any] = []
        self.lost: Exception | None = None

    @classmethod
    def take_over(cls, connection) -> _Replies | None:
        """The reader of `connection`'s socket from now on; None where its redis-py keeps the
        socket's writer and its hiredis reader elsewhere than these (private) attributes, where
        redis-py 8 keeps them."""
        writer = getattr(connection, "_writer", None)
        reader = getattr(getattr(connection, "_parser", None), "_reader", None)
        if writer is None or not isinstance(reader, hiredis.Reader):
            return None
        replies = cls(connection, writer.transport, reader)
        writer.transport.set_protocol(replies)
        return replies

    def reads(self, connection) -> bool:
        """Whether this reads `connection`'s socket (not one it was connected with since)."""
        return self.writer is connection._writer

    @property
    def closed(self) -> bool:
        return self.lost is not None or self.transport.is_closing()

    def round_trip(self, packed: bytes, count: int) -> asyncio.Future:
        """The replies of `count` commands, sent packed in `packed`."""
        self.replies, self.wanted = [], count
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(packed)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        self.reader.feed(data)
        try:
            while self.wanted:
                reply = self.reader.gets()
                if reply is NOT_ENOUGH_DATA:
                    return
                self.replies.append(reply)
                self.wanted -= 1
        except Exception as exc:  # noqa: BLE001 - a protocol error fails the round trip, which disconnects
            self._fail(exc)
            return
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(self.replies)

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(RedisConnectionError(f"Connection to Redis lost: {exc}" if exc else "Connection closed by server."))
        self.stream_protocol.connection_lost(exc)

    def _fail(self, error: Exception) -> None:
        self.lost = self.lost or error
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)


class Subscription(asyncio.Protocol):
    """One channel's messages, each handed to `on_message` as its bytes are read: a connection of a
    client's pool, held and subscribed (`open`), whose socket this reads with a hiredis reader of its
    own. `lost` resolves when the subscription ends: the connection lost, or `close`. A link that
    goes quiet without closing (a partitioned network) is found by `check`: a PING once nothing has
    come for `quiet_s`, and the subscription closed if nothing answers it within `timeout_s`.

    Only on one server (see the module's docstring); a Redis that refuses the subscription (an ACL
    without the channel) raises its error from `open`."""

    def __init__(self, pool, connection, transport: asyncio.Transport,
                 on_message: Callable[[bytes], None]) -> None:
        self.pool = pool
        self.connection = connection
        self.transport = transport
        self.stream_protocol = transport.get_protocol()  # told of the socket's end, for `disconnect`
        self.on_message = on_message
        self.reader = hiredis.Reader(replyError=ResponseError)
        self.loop = asyncio.get_running_loop()
        self.subscribed: asyncio.Future[None] = self.loop.create_future()
        self.lost: asyncio.Future[Exception] = self.loop.create_future()  # why it ended
        self.heard_at = self.loop.time()
        self.pinged_at = 0.0  # when the PING now unanswered went out; 0: none is

    @classmethod
    async def open(cls, client: aioredis.Redis, channel: str, on_message: Callable[[bytes], None],
                   timeout_s: float = 5.0) -> Subscription:
        pool = client.connection_pool
        connection = await pool.get_connection()
        subscription = None
        try:
            if not connection.is_connected:
                await connection.connect()
            writer = getattr(connection, "_writer", None)
            if writer is None:
                raise RedisConnectionError("this redis-py keeps its connection's socket where llmfleet cannot read it")
            subscription = cls(pool, connection, writer.transport, on_message)
            writer.transport.set_protocol(subscription)
            writer.transport.write(hiredis.pack_command(("SUBSCRIBE", channel)))
            await asyncio.wait_for(asyncio.shield(subscription.subscribed), timeout_s)
        except BaseException:
            if subscription is not None:
                subscription.transport.abort()
            await connection.disconnect()
            await pool.release(connection)
            raise
        return subscription

    async def close(self) -> None:
        """End the subscription; its connection goes back to the pool unconnected."""
        self.transport.close()
        await self.connection.disconnect()
        await self.pool.release(self.connection)

    def check(self, quiet_s: float, timeout_s: float) -> None:
        """Ping a link that has been quiet for `quiet_s`; close one whose ping went unanswered for `timeout_s`."""
        now = self.loop.time()
        if self.pinged_at and now - self.pinged_at > timeout_s:
            self._end(RedisConnectionError(f"Redis did not answer a PING in {timeout_s:.0f}s"))
            self.transport.abort()
        elif not self.pinged_at and now - self.heard_at > quiet_s:
            self.pinged_at = now
            self.transport.write(_PING)

    def data_received(self, data: bytes) -> None:
        self.heard_at = self.loop.time()
        self.pinged_at = 0.0
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                if isinstance(reply, ResponseError):  # the subscription refused
                    self._end(reply)
                elif not isinstance(reply, list):  # a PING's answer in RESP3 (in RESP2: [b"pong", b""])
                    continue
                elif reply[0] == b"message":
                    self.on_message(reply[2])
                elif reply[0] == b"subscribe" and not self.subscribed.done():
                    self.subscribed.set_result(None)
        except Exception as exc:  # noqa: BLE001 - unreadable, or the callback failed: the subscription ends
            self._end(exc)
            self.transport.abort()

    def eof_received(self) -> bool:
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._end(RedisConnectionError(f"Connection to Redis lost: {exc}" if exc else "Connection closed by server."))
        self.stream_protocol.connection_lost(exc)

    def _end(self, error: Exception) -> None:
        if not self.subscribed.done():
            self.subscribed.set_exception(error)
            self.subscribed.exception()  # retrieved: `open` raises it, if it still waits
        if not self.lost.done():
            self.lost.set_result(error)


_PING = hiredis.pack_command(("PING",))


def _ended(connection) -> bool:
    """Whether a connected redis-py connection's socket has ended under its own reader: the server
    closed it while it sat in the pool, and redis-py's health check on handing it out did not see
    it. Its stream reader then holds the end of the stream, and the transport no longer reads (the
    stream's protocol keeps a half-closed socket open), so a round trip taken over on it would wait
    forever for replies and for the loss alike."""
    reader, writer = getattr(connection, "_reader", None), getattr(connection, "_writer", None)
    if not isinstance(reader, asyncio.StreamReader) or writer is None:  # a redis-py that keeps them elsewhere
        return False
    transport = writer.transport
    return reader.at_eof() or reader.exception() is not None or transport.is_closing() or not transport.is_reading()


def _words(command: tuple) -> tuple:
    """A command as Redis reads it: a name of two words (redis-py's "XINFO GROUPS", "CLIENT ID") as two."""
    name = command[0]
    if isinstance(name, str) and " " in name:
        return (*name.split(), *command[1:])
    return command


async def _read_through(connection, packed: bytes, count: int) -> list[Any]:
    await connection.send_packed_command(packed)
    replies: list[Any] = []
    for _ in range(count):
        try:
            replies.append(await connection.read_response())
        except ResponseError as exc:
            replies.append(exc)
    return replies


def direct_connection(client: aioredis.Redis | RedisCluster) -> DirectConnection | None:
    """A `DirectConnection` on `client`'s pool, or None on a cluster (its client routes each command)."""
    return None if isinstance(client, RedisCluster) else DirectConnection(client)
