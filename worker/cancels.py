"""How cancels reach a worker's running requests.

Cancels arrive on the pub/sub channel. Pub/sub is at most once: a notice sent while the
subscription is down (Redis restarted, a network blip) is lost. The gateway also stashes every
cancel as `cancelled:{request_id}`, so the worker checks its running requests' stashes after
each (re)subscription and with every heartbeat: a lost notice still stops its run within two
seconds.

A gateway that dies sends no cancel: its clients are gone with it, and nobody reads the replies
of its requests. Each gateway holds a presence channel while it lives
(`RequestEnvelope.gateway_presence`), whose subscription Redis drops the moment its process dies;
each heartbeat counts the subscribers of the channels of the running requests' gateways, and a
request whose gateway had none for keys.GATEWAY_GONE_S of beats is stopped (cause `gateway_gone`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Container, Mapping

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import decode
from shared.envelopes import CancelNotice, RequestEnvelope
from shared.errors import EnvelopeError
from shared.stopping import pause
from worker import metrics

log = logging.getLogger(__name__)

Cancel = Callable[[str, str, float], None]  # request id, cause, when the gateway sent it (0: unknown)


class CancelFollower:
    """Follows the cancel channel; on the same connection it holds the worker's presence channel
    (keys.presence_channel), whose subscription Redis drops the moment the process dies."""

    def __init__(self, redis: aioredis.Redis, model: str, running: Mapping[str, RequestEnvelope],
                 requested: Container[str], cancel: Cancel, worker_id: str = ""):
        self.redis = redis
        self.model = model
        self.running = running  # the worker's running requests by id (a live view)
        self.requested = requested  # those a cancel has reached already
        self.cancel = cancel
        # Not on a cluster, whose nodes count a channel's subscribers each for itself.
        self._channels = [keys.CANCEL_CHANNEL.encode()]
        if worker_id and not isinstance(redis, aioredis.RedisCluster):
            self._channels.append(keys.presence_channel(worker_id).encode())
        self._stashed_before: dict[str, str] = {}  # the stashes the last beat found
        self._absent_since: dict[str, float] = {}  # gateway presence channels found with no subscriber, since when

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
        running = self._read_stashes(pipe)
        replies = await pipe.execute()
        return self._causes(running, replies[len(replies) - len(running):])

    def _read_stashes(self, pipe) -> list[str]:
        """Add a GET of each running request's cancel stash to `pipe`; the requests, in that order."""
        running = list(self.running)
        for request_id in running:
            pipe.get(keys.cancelled_key(request_id))
        return running

    def _causes(self, running: list[str], stashes: list[bytes | None]) -> dict[str, str]:
        return {request_id: cause.decode() for request_id, cause in zip(running, stashes, strict=True)
                if cause is not None and request_id not in self.requested}

    async def beat(self, pipe) -> None:
        """Run the heartbeat's `pipe` with what it looks at for the running requests added, then stop
        those it finds ended: a cancel stash that this beat and the last both found (its notice, a
        second on its way, was lost), and the requests of a gateway whose presence channel had no
        subscriber at every beat for keys.GATEWAY_GONE_S (the gateway is gone). A beat that fails
        forgets what the last one found."""
        running = self._read_stashes(pipe)
        channels = list({channel for request in self.running.values() if (channel := request.gateway_presence)})
        if channels:
            pipe.pubsub_numsub(*channels)
        try:
            replies = await pipe.execute()
        except RedisError:
            self._stashed_before, self._absent_since = {}, {}
            raise
        counts = dict(replies.pop()) if channels else {}
        stashed = self._causes(running, replies[len(replies) - len(running):])
        self.cancel_missed({rid: cause for rid, cause in stashed.items() if rid in self._stashed_before})
        self._stashed_before = stashed
        now = time.monotonic()
        absent = {channel for channel in channels if not counts.get(channel.encode())}
        self._absent_since = {channel: self._absent_since.get(channel, now) for channel in absent}
        gone = {channel for channel, since in self._absent_since.items() if now - since >= keys.GATEWAY_GONE_S}
        for request_id, request in list(self.running.items()):
            if request.gateway_presence in gone and request_id not in self.requested:
                log.warning("request %s: its gateway is gone (nobody holds %s); stopping it", request_id,
                            request.gateway_presence)
                self.cancel(request_id, "gateway_gone", 0.0)

    def cancel_missed(self, missed: dict[str, str]) -> None:
        """Cancel running requests whose cancel notice never came (it was stashed, not received)."""
        for request_id, cause in missed.items():
            if request_id in self.running and request_id not in self.requested:
                log.warning("request %s: its cancel notice was lost; cancelling it from the stash", request_id)
                metrics.CANCELS_FROM_STASH.labels(self.model).inc()
                self.cancel(request_id, cause, 0.0)
