"""How cancels reach a worker's running requests.

Cancels arrive on the pub/sub channel. Pub/sub is at most once: a notice sent while the
subscription is down (Redis restarted, a network blip) is lost. The gateway also stashes every
cancel as `cancelled:{request_id}`, so the worker checks its running requests' stashes after
each (re)subscription and with every heartbeat: a lost notice still stops its run within two
seconds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Container

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import decode
from shared.envelopes import CancelNotice
from shared.errors import EnvelopeError
from shared.stopping import pause
from worker import metrics

log = logging.getLogger(__name__)

Cancel = Callable[[str, str, float], None]  # request id, cause, when the gateway sent it (0: unknown)


class CancelFollower:
    """Follows the cancel channel; on the same connection it holds the worker's presence channel
    (keys.presence_channel), whose subscription Redis drops the moment the process dies."""

    def __init__(self, redis: aioredis.Redis, model: str, running: Collection[str], requested: Container[str],
                 cancel: Cancel, worker_id: str = ""):
        self.redis = redis
        self.model = model
        self.running = running  # the worker's running request ids (a live view)
        self.requested = requested  # those a cancel has reached already
        self.cancel = cancel
        # Not on a cluster, whose nodes count a channel's subscribers each for itself.
        self._channels = [keys.CANCEL_CHANNEL.encode()]
        if worker_id and not isinstance(redis, aioredis.RedisCluster):
            self._channels.append(keys.presence_channel(worker_id).encode())

    @property
    def presence(self) -> bool:
        """Whether this worker holds its presence channel (WorkerInfo.presence)."""
        return len(self._channels) > 1

    async def listen(self, stopping: asyncio.Event) -> None:
        """Follow the cancel channel until `stopping`, resubscribing after Redis comes back."""
        while not stopping.is_set():
            try:
                await self._follow()  # ends only when cancelled, or when Redis fails
            except RedisError as exc:
                log.warning("cancel channel lost: %s; resubscribing", exc)
                await pause(stopping, 0.5)

    async def _follow(self) -> None:
        pubsub = self.redis.pubsub()
        await pubsub.subscribe(*self._channels)
        try:
            async for message in pubsub.listen():
                if message.get("type") == "subscribe" and message.get("channel") == self._channels[0]:
                    # At start, and each time redis-py reconnects.
                    # Notices sent while the subscription was down are gone: catch up from the stashes.
                    self.cancel_missed(await self.stashed(self.redis.pipeline(transaction=False)))
                    continue
                if message.get("type") != "message":
                    continue
                try:
                    notice = decode(CancelNotice, message["data"])
                except EnvelopeError as exc:
                    log.warning("ignoring malformed cancel notice: %s", exc)
                    continue
                for request_id in notice.request_ids:
                    if request_id in self.running:
                        self.cancel(request_id, notice.reason, notice.sent_at)
        finally:
            await pubsub.aclose()

    async def stashed(self, pipe) -> dict[str, str]:
        """Run `pipe` with a GET of each running request's cancel stash added; the causes of the
        stashed cancels that have not reached their request, by request id."""
        running = list(self.running)
        for request_id in running:
            pipe.get(keys.cancelled_key(request_id))
        replies = await pipe.execute()
        stashes = replies[len(replies) - len(running):]
        return {request_id: cause.decode() for request_id, cause in zip(running, stashes, strict=True)
                if cause is not None and request_id not in self.requested}

    def cancel_missed(self, missed: dict[str, str]) -> None:
        """Cancel running requests whose cancel notice never came (it was stashed, not received)."""
        for request_id, cause in missed.items():
            if request_id in self.running and request_id not in self.requested:
                log.warning("request %s: its cancel notice was lost; cancelling it from the stash", request_id)
                metrics.CANCELS_FROM_STASH.labels(self.model).inc()
                self.cancel(request_id, cause, 0.0)
