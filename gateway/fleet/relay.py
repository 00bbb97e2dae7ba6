"""The gateway's reply path: one reader per process, one queue per open request.

Every worker publishes the chunks of a request to the gateway process that accepted it: on the
channel the gateway holds while it lives (its presence, `hold_presence`), whose messages each hold
the envelopes of one or more requests published together, read as they come in, with no command
per message (`shared.redis_direct.Subscription`); or, for an answer in one envelope too large for
a channel, for every request on a Redis Cluster and from workers older than the channel, on its
reply stream, whose entries hold one envelope or a batch (`keys.BATCH_FIELD`), read by a single
task (XREAD COUNT). Each envelope goes to the queue of its request, so a gateway holding thousands
of open requests still has one subscription and one blocking read for replies.

The router's loops end at their next turn after `stop()` (a read blocks for at most
READ_BLOCK_MS), even if a cancel was lost on the way (`shared.stopping`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway import metrics
from shared import keys
from shared.codec import decode, decode_batch
from shared.envelopes import ChunkEnvelope, GenerationChunk
from shared.errors import EnvelopeError, ServiceUnavailable
from shared.redis_direct import Subscription, direct_connection
from shared.stopping import pause

log = logging.getLogger(__name__)

READ_BATCH = 1000
READ_BLOCK_MS = 1000  # the longest a read waits for replies, so the longest `run` takes to see a stop
SILENCE = None  # put in a request's queue by `watch_silence`: nothing came, look around
# With requests open, a channel that has brought nothing for CHANNEL_QUIET_S is pinged, and taken
# for lost if the ping is not answered within CHANNEL_TIMEOUT_S (the clients' socket timeout).
CHANNEL_QUIET_S = 1.0
CHANNEL_TIMEOUT_S = 5.0


class ReplyRouter:
    def __init__(self, redis: aioredis.Redis, gateway_id: str, max_buffered: int = 1024,
                 on_overflow: Callable[[str], None] = lambda request_id: None):
        self.redis = redis
        self.stream = keys.reply_stream(gateway_id)
        # Held while this process lives (`hold_presence`); not on a cluster, whose nodes count a
        # channel's subscribers each for itself.
        self._presence = "" if isinstance(redis, aioredis.RedisCluster) else keys.gateway_presence_channel(gateway_id)
        self._subscription: Subscription | None = None  # to `_presence`, while held
        self.max_buffered = max_buffered  # envelopes waiting for one slow client
        self.on_overflow = on_overflow
        self._routes: dict[str, asyncio.Queue[ChunkEnvelope | None]] = {}
        self._opened = asyncio.Event()  # a route opened since `watch_silence` found none
        self._last_id = "$"
        self._direct = direct_connection(redis)  # one read per engine step: past the client's layers
        self.connected = asyncio.Event()
        self.connected_at = 0.0  # when (monotonic) the reply stream was last (re)made: the link to Redis holds since
        self.stopping = asyncio.Event()

    def open(self, request_id: str) -> asyncio.Queue[ChunkEnvelope | None]:
        queue: asyncio.Queue[ChunkEnvelope | None] = asyncio.Queue()
        if not self._routes:
            self._opened.set()
        self._routes[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def stop(self) -> None:
        """End `run`, `watch_silence`, `keep_alive` and `hold_presence` at their next turn."""
        self.stopping.set()
        self._opened.set()
        if self._subscription is not None:
            self._subscription.transport.close()

    @property
    def open_requests(self) -> int:
        return len(self._routes)

    async def create_stream(self) -> None:
        """Create the reply stream (workers never create it) and start reading at its end."""
        entry_id = await self.redis.xadd(self.stream, {b"hello": b"1"}, maxlen=keys.REPLY_STREAM_MAXLEN)
        await self.redis.expire(self.stream, keys.REPLY_STREAM_TTL_S)
        self._last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id

    async def run(self) -> None:
        while not self.stopping.is_set():  # one check per batch read, not per reply
            try:
                if not self.connected.is_set():
                    await self.create_stream()
                    self.connected.set()
                    self.connected_at = time.monotonic()
                entries = await self._read()
            except RedisError as exc:
                if self.connected.is_set():
                    log.warning("reading replies failed: %s; failing %d open requests", exc, len(self._routes))
                    self._fail_open_requests()
                self.connected.clear()
                await pause(self.stopping, 0.5)
                continue
            if not entries:
                continue
            now_ms = time.time() * 1000
            for entry_id, fields in entries:
                # An entry's id is Redis's clock when the worker's XADD reached it (ms).
                metrics.RELAY_DELAY.observe(max(0.0, now_ms - int(entry_id.split(b"-", 1)[0])) / 1000)
                self._deliver(fields)
            self._last_id = entries[-1][0]
        if self._direct is not None:
            await self._direct.close()

    async def _read(self) -> list:
        """The next entries of the reply stream, as (id, [field, value, ...]); none after READ_BLOCK_MS."""
        if self._direct is None:  # a cluster: its client finds the stream's node
            replies = await self.redis.xread({self.stream: self._last_id}, count=READ_BATCH, block=READ_BLOCK_MS)
            return [(entry_id, [item for pair in fields.items() for item in pair])
                    for _stream, entries in replies or () for entry_id, fields in entries]
        [reply] = await self._direct.execute([("XREAD", "COUNT", READ_BATCH, "BLOCK", READ_BLOCK_MS, "STREAMS",
                                               self.stream, self._last_id)])
        if not reply:
            return []
        return next(iter(reply.values())) if isinstance(reply, dict) else reply[0][1]  # RESP3 or RESP2

    def _fail_open_requests(self) -> None:
        """Redis went away: whatever was in flight can no longer reach us, so end it now."""
        error = ServiceUnavailable("Lost the connection to the request queue; retry the request.").to_info()
        for request_id, queue in self._routes.items():
            queue.put_nowait(ChunkEnvelope(request_id, -1, [GenerationChunk(done=True, finish_reason="error",
                                                                            error=error)]))

    def _deliver(self, fields: list[bytes]) -> None:
        """One entry's envelope, or its batch of them (its fields: name, value, ...)."""
        for name, value in zip(fields[::2], fields[1::2], strict=True):
            if name == keys.ENVELOPE_FIELD:
                self._route(value)
            elif name == keys.BATCH_FIELD:
                self._deliver_batch(value)

    def _deliver_batch(self, value: bytes) -> float:
        """A batch of envelopes (a stream entry's `keys.BATCH_FIELD`, or a message on the channel);
        when the first was written (its `sent_at`; 0: unknown)."""
        try:
            envelopes = decode_batch(value)
        except EnvelopeError as exc:
            log.error("dropping a malformed batch of replies: %s", exc)
            return 0.0
        sent_at = 0.0
        for data in envelopes:
            envelope = self._route(data)
            if not sent_at and envelope is not None:
                sent_at = envelope.sent_at
        return sent_at

    def _deliver_message(self, value: bytes) -> None:
        """A message on the channel, the reply path timed from its write."""
        if sent_at := self._deliver_batch(value):
            metrics.RELAY_DELAY.observe(max(0.0, time.time() - sent_at))

    def _route(self, data: bytes) -> ChunkEnvelope | None:
        """Hand an envelope to its request's queue; the envelope, unless it is unreadable."""
        try:
            envelope = decode(ChunkEnvelope, data)
        except EnvelopeError as exc:
            log.error("dropping malformed reply: %s", exc)
            return None
        queue = self._routes.get(envelope.request_id)
        if queue is None:
            return envelope
        if queue.qsize() >= self.max_buffered:  # the client stopped reading: drop it, not our memory
            self.close(envelope.request_id)
            error = ServiceUnavailable("The client read too slowly; the response was cancelled.",
                                       code="slow_client").to_info()
            queue.put_nowait(ChunkEnvelope(envelope.request_id, -1,
                                           [GenerationChunk(done=True, finish_reason="error", error=error)]))
            self.on_overflow(envelope.request_id)
            return envelope
        queue.put_nowait(envelope)
        return envelope

    async def watch_silence(self, interval: float) -> None:
        """Every `interval`, wake each request with nothing waiting in its queue (a `SILENCE`), so
        it checks its deadline and its worker: one timer for the process instead of a timeout
        armed and cancelled around every wait of every request. With no request open, it sleeps
        until one opens: an idle gateway does not wake for it."""
        while not self.stopping.is_set():
            if not self._routes:
                self._opened.clear()
                await self._opened.wait()
            elif not await pause(self.stopping, interval):
                self.wake_silent()
                if self._subscription is not None:  # a link gone quiet with requests open: is it there?
                    self._subscription.check(CHANNEL_QUIET_S, CHANNEL_TIMEOUT_S)

    def wake_silent(self) -> None:
        """Wake each request with nothing waiting in its queue, to look around now (a worker was
        found gone): a `SILENCE`."""
        for queue in self._routes.values():
            if queue.empty():
                queue.put_nowait(SILENCE)

    @property
    def presence(self) -> str:
        """The channel this gateway holds now ("": none), for its requests to name as its presence
        (`RequestEnvelope.gateway_presence`) and as where to publish their replies
        (`RequestEnvelope.reply_channel`): one it could not subscribe to is not named, so no worker
        takes the gateway for gone while it lives, nor publishes where nobody reads."""
        return self._presence if self._subscription is not None else ""

    async def hold_presence(self) -> None:
        """Subscribe to this gateway's channel while it lives (`shared.redis_direct.Subscription`).
        Redis drops the subscription the moment the process dies, and the workers running its
        requests, finding nobody there, stop them (worker/cancels.py). The workers publish the
        replies of the requests that name it there: each comes to `_deliver_message` as the socket
        is read, with no command sent and no task woken for it. Subscribed again after Redis comes
        back: at once after a subscription that held, else after a wait that doubles up to 5 s
        (a subscription refused, as by an ACL without the channel, is not retried twice a second).
        A subscription lost fails the requests open here: what was published meanwhile is gone."""
        delay = 0.5
        while self._presence and not self.stopping.is_set():
            held = False
            try:
                subscription = await Subscription.open(self.redis, self._presence, self._deliver_message)
            except (RedisError, OSError, asyncio.TimeoutError) as exc:
                log.warning("gateway channel not subscribed: %s; subscribing again in %.1fs", exc, delay)
            else:
                held, self._subscription = True, subscription
                if self.stopping.is_set():  # stopped while subscribing
                    subscription.transport.close()
                why = await subscription.lost
                self._subscription = None
                await subscription.close()
                if not self.stopping.is_set():
                    metrics.REPLY_CHANNEL_LOST.inc()
                    log.warning("gateway channel lost: %s; failing %d open requests", why, len(self._routes))
                    self._fail_open_requests()
            delay = 0.5 if held else min(delay * 2, 5.0)
            await pause(self.stopping, delay)

    async def keep_alive(self) -> None:
        """Refresh the reply stream's TTL while this gateway lives."""
        while not await pause(self.stopping, keys.REPLY_STREAM_TTL_S / 4):
            try:
                if not await self.redis.expire(self.stream, keys.REPLY_STREAM_TTL_S):
                    self.connected.clear()  # the stream vanished (Redis restart): recreate it
            except RedisError as exc:
                log.warning("refreshing the reply stream failed: %s", exc)
