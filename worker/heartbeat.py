"""A worker's heartbeat: what it serves and how busy it is, once a second.

Each beat writes the worker's `WorkerInfo` (`keys.worker_key`, TTL HEARTBEAT_TTL_S: a worker
that stops beating vanishes from every gateway's registry within it), keeps its model known
(`keys.model_key`) and its own stream listed (`keys.affinity_streams`), and reads the cancel
stashes of the requests it runs: a stash seen by two beats in
a row had a second for its notice to arrive, so the notice was lost and the stash cancels the run.
It also counts who holds the presence channels of their gateways: a gateway gone stops its
requests (worker/cancels.py). `deregister` removes the heartbeat at the end of a stop. The leases, and the
heartbeat key's TTL between beats, are renewed by a thread of their own (worker/leases.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import decode, encode
from shared.envelopes import WorkerInfo
from shared.errors import EnvelopeError
from shared.stopping import pause, within
from worker.cancels import CancelFollower

log = logging.getLogger(__name__)

DEREGISTER_S = 2.0  # the last write of a stop: removing the heartbeat, which expires anyway


class Heartbeat:
    def __init__(self, redis: aioredis.Redis, model: str, worker_id: str, info: Callable[[], WorkerInfo],
                 cancels: CancelFollower, batched: aioredis.Redis, beaten: Callable[[], None]):
        self.redis = redis
        self.beaten = beaten  # told of each beat that reached Redis (the lease thread renews the key otherwise)
        self.batched = batched  # the beats go in the worker's shared pipelines (`BatchedRedis`)
        self.model = model
        self.worker_id = worker_id
        self.info = info  # the worker's state now
        self.cancels = cancels
        self.own_stream = keys.worker_stream(model, worker_id)

    async def run(self, stopping: asyncio.Event) -> None:
        while not stopping.is_set():
            pipe = (self.batched.pipeline(transaction=False)
                    .set(keys.worker_key(self.worker_id), encode(self.info()), ex=keys.HEARTBEAT_TTL_S)
                    .set(keys.model_key(self.model), b"1", ex=keys.MODEL_MEMORY_TTL_S)
                    .zadd(keys.affinity_streams(self.model),
                          {self.own_stream: (time.time() + keys.HEARTBEAT_TTL_S) * 1000})
                    .expire(keys.affinity_streams(self.model), keys.AFFINITY_STREAM_TTL_S)
                    .expire(self.own_stream, keys.AFFINITY_STREAM_TTL_S))
            sent = time.monotonic()
            try:
                await self.cancels.beat(pipe)
                self.beaten()
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            # One beat per interval, counted from when this one was sent: a slow Redis delays the next
            # by no more than it has to.
            await pause(stopping, max(0.0, keys.HEARTBEAT_INTERVAL_S - (time.monotonic() - sent)))

    async def announce(self) -> None:
        """Write the heartbeat now, not at the next beat: a drain's start reaches gateways at once."""
        try:
            await within(DEREGISTER_S, self.redis.set(keys.worker_key(self.worker_id), encode(self.info()),
                                                      ex=keys.HEARTBEAT_TTL_S), "announcing the drain")
        except (TimeoutError, RedisError) as exc:
            log.warning("could not announce the drain (%s); the next heartbeat does", exc)

    async def peers_taking_work(self) -> int:
        """Other live workers of this model that are not stopping: those a drain can hand runs to."""
        names = [key async for key in self.redis.scan_iter(match=keys.WORKER_KEY_PATTERN, count=500)]
        count = 0
        for value in await self.redis.mget(names) if names else []:
            try:
                info = decode(WorkerInfo, value) if value is not None else None
            except EnvelopeError:
                continue
            if info is not None and info.model == self.model and info.worker_id != self.worker_id and not info.draining:
                count += 1
        return count

    async def deregister(self) -> None:
        """Remove the heartbeat, so gateways stop counting on this worker now rather than at its TTL."""
        try:
            # Our stream is left to the others as a dead worker's: its waiting requests are theirs now.
            await within(DEREGISTER_S, self.redis.pipeline(transaction=False).delete(keys.worker_key(self.worker_id))
                         .zadd(keys.affinity_streams(self.model), {self.own_stream: 0}, xx=True).execute(),
                         "deregistering")
        except (TimeoutError, RedisError) as exc:
            log.warning("could not remove the heartbeat (%s); it expires within %ds", exc, keys.HEARTBEAT_TTL_S)
