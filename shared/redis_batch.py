"""Redis commands of many requests, sent together: one pipeline per round trip.

Each request costs a few small Redis commands: at the gateway, register the run, queue the
request, unregister it; at the worker, lease the request and take any cancel stashed for it.
Sent one at a time, every command takes a pooled connection, a write and a read system call
and a parse of its own: at a few hundred requests per second that was a quarter of the
gateway's CPU (py-spy, issue #6), and bursts ran out of redis-py's connection pool ("Too many
connections"). `BatchedRedis` is a Redis client whose commands are queued instead: one task
sends everything queued since its last write as a single pipeline and hands each caller its
own reply (or its own error). While one pipeline is on the wire the next one fills, so batches
grow with the load and a lone command waits for no timer.

Commands reach Redis in the order they were queued (one connection; on a cluster, each node's in
order). A command is queued when its call is awaited; `now` and `call_now` queue it at the call,
and `sent()` waits until what is queued is being written, not for its replies: for a caller that
must put commands ahead of whatever reaches Redis next, from this client or from another one
acting for someone who saw what the caller did next (a request's unregistering, before its
client reads the end of the answer).

Only for commands that answer at once: blocking reads (XREAD, XREADGROUP) and pub/sub keep
connections of their own. Transactions (MULTI/EXEC) are not batched.

The client under it may be a Redis Cluster's: its pipeline sends each node its share of a
batch, and a script is loaded on every primary (`script_load`), which a pipeline cannot do.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import EMPTY_RESPONSE, NEVER_DECODE, Pipeline
from redis.asyncio.cluster import RedisCluster
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

from shared.redis_direct import direct_connection

_Queued = tuple[tuple, dict, asyncio.Future]


class BatchedRedis(aioredis.Redis):
    """A client on `redis`'s connection pool whose commands go out in shared pipelines; `run()` sends them."""

    def __init__(self, redis: aioredis.Redis | RedisCluster):
        # A cluster client has no single pool: then this one gets an idle pool of its own, which
        # nothing uses, since every command is queued and transactions go to `redis`.
        super().__init__(connection_pool=getattr(redis, "connection_pool", None))
        self._client = redis
        self._connection = direct_connection(redis)  # None on a cluster: its pipeline sends each node its share
        self._queued: list[_Queued] = []
        self._taken: asyncio.Future | None = None  # `sent()`'s: set as the queued batch is taken to be written
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()

    def queue_command(self, args: tuple, options: dict) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._queued.append((args, options, future))
        self._wake.set()
        return future

    async def execute_command(self, *args, **options) -> Any:
        return await self.queue_command(args, options)

    def now(self, *args: Any) -> asyncio.Future:
        """A command queued at this call, not when awaited: what this client is asked after it
        reaches Redis after it. Awaited: its reply."""
        return self.queue_command(args, {})

    def sent(self) -> Awaitable[None]:
        """Done once every command queued so far is being written: on one server, once its batch
        is taken, which that same step of `run` writes, before anything this process does next;
        on a cluster, once the batch is answered. At once if nothing is queued, or the client is
        stopping (`run` may have ended)."""
        if not self._queued or self._stopping.is_set():
            return asyncio.sleep(0)
        if self._taken is None:
            self._taken = asyncio.get_running_loop().create_future()
        return asyncio.shield(self._taken)  # a waiter cancelled cancels not the others' wait

    def call_now(self, script: AsyncScript, keys: list, args: list) -> asyncio.Task:
        """`script(keys, args)` queued at this call, as `now` queues a command. A Redis that lost
        the script (it restarted) gets it loaded, then called again, out of that order."""
        return asyncio.ensure_future(self.script_now(script, keys, args))

    def script_now(self, script: AsyncScript, keys: list, args: list) -> Coroutine[Any, Any, Any]:
        """`call_now`'s call as a coroutine, for a caller that awaits it where it stands (no task)."""
        return _reloading(self.now("EVALSHA", script.sha, len(keys), *keys, *args), script, keys, args)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        if transaction:
            return self._client.pipeline(transaction, shard_hint)
        return _QueuedPipeline(self)

    async def script_load(self, script) -> str:
        """Load a script (after a NOSCRIPT reply), on every primary of a cluster. NOSCRIPT means a
        Redis that restarted, whose old connections may still wait in the pool: a load that meets
        one is tried once more (loading a script twice changes nothing), on a fresh connection."""
        try:
            return await self._client.script_load(script)
        except RedisConnectionError:
            return await self._client.script_load(script)

    def stop(self) -> None:
        """End `run` once what is queued has been sent."""
        self._stopping.set()
        self._wake.set()

    async def run(self) -> None:
        taken = None
        try:
            while not self._stopping.is_set() or self._queued:
                await self._wake.wait()
                self._wake.clear()
                batch, self._queued = self._queued, []
                taken, self._taken = self._taken, None
                if self._connection is not None or not batch:  # its waiters go on after this step, which writes it
                    _done(taken)
                if batch:  # empty when woken by `stop`
                    await self._send(batch)
                    _done(taken)  # a cluster's pipeline writes after awaits of its own: once answered
        finally:  # stopping: nobody will send what is still queued
            self._fail(self._queued, RedisConnectionError("the client is stopping"))
            _done(taken)
            _done(self._taken)
            if self._connection is not None:
                await self._connection.close()

    async def _send(self, batch: list[_Queued]) -> None:
        try:
            replies = await self._round_trip(batch)
        except Exception as exc:  # noqa: BLE001 - whatever failed the batch fails its callers, never this loop
            self._fail(batch, exc)
            return
        except asyncio.CancelledError:
            self._fail(batch, RedisConnectionError("the client is stopping"))
            raise
        for (_args, _options, future), reply in zip(batch, replies, strict=True):
            if future.done():  # its caller was cancelled meanwhile
                continue
            if isinstance(reply, Exception):
                future.set_exception(reply)
            else:
                future.set_result(reply)

    async def _round_trip(self, batch: list[_Queued]) -> list[Any]:
        """Each command's reply, parsed as redis-py's client parses it, or its error. On one server
        the batch goes on a connection this client holds (`shared.redis_direct`: about 9 µs of CPU
        less per command than a pipeline, measured here); on a cluster, as a pipeline."""
        if self._connection is None:
            pipe = self._client.pipeline(transaction=False)
            for args, options, _future in batch:
                pipe.execute_command(*args, **options)
            return await pipe.execute(raise_on_error=False)
        raw = await self._connection.execute([args for args, _options, _future in batch], raise_on_error=False)
        return [await self._parse(args[0], options, reply)
                for (args, options, _future), reply in zip(batch, raw, strict=True)]

    async def _parse(self, command: str, options: dict, reply: Any) -> Any:
        """A reply as `Redis.parse_response` makes it: its command's callback, an EMPTY_RESPONSE for an error."""
        if isinstance(reply, ResponseError):
            return options[EMPTY_RESPONSE] if EMPTY_RESPONSE in options else reply
        if command not in self.response_callbacks:
            return reply
        options = {name: value for name, value in options.items() if name not in (EMPTY_RESPONSE, NEVER_DECODE, "keys")}
        try:
            value = self.response_callbacks[command](reply, **options)
            return await value if inspect.isawaitable(value) else value
        except Exception as exc:  # noqa: BLE001 - a reply that fails its parse fails its caller alone
            return exc

    @staticmethod
    def _fail(batch: list[_Queued], error: Exception) -> None:
        for _args, _options, future in batch:
            if not future.done():
                future.set_exception(error)


def _done(taken: asyncio.Future | None) -> None:
    if taken is not None and not taken.done():
        taken.set_result(None)


async def _reloading(sent: asyncio.Future, script: AsyncScript, keys: list, args: list) -> Any:
    try:
        return await sent
    except NoScriptError:
        return await script(keys=keys, args=args)


class _QueuedPipeline(Pipeline):
    """A non-transactional pipeline whose commands join the shared batch when executed."""

    def __init__(self, batched: BatchedRedis):
        super().__init__(batched.connection_pool, batched.response_callbacks, transaction=False, shard_hint=None)
        self._batched = batched

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        stack, self.command_stack = self.command_stack, []
        futures = [self._batched.queue_command(args, options) for args, options in stack]
        replies = await asyncio.gather(*futures, return_exceptions=True)
        if raise_on_error:
            for reply in replies:
                if isinstance(reply, Exception):
                    raise reply
        return replies
