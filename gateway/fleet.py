"""The gateway's view of the fleet: submit a request, follow its chunks, cancel it.

`Fleet` owns the process-wide pieces (Redis client, `ReplyRouter`, `WorkerRegistry`) and the
background tasks that run them. `Run` is one submitted request: an async iterator over its
chunks that, if closed before the terminal chunk, tells the workers to stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway import metrics
from gateway.registry import WorkerRegistry
from gateway.relay import ReplyRouter
from shared import keys
from shared.codec import encode
from shared.envelopes import CancelNotice, ChunkEnvelope, GenerationChunk, RequestEnvelope
from shared.errors import ServiceUnavailable, error_from_info

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GatewaySettings:
    redis_url: str = "redis://127.0.0.1:6379/0"
    request_timeout_s: float = 600.0
    gateway_id: str = ""

    def __post_init__(self) -> None:
        self.gateway_id = self.gateway_id or uuid.uuid4().hex[:12]


class Run:
    """One request in flight; iterate `chunks()` once, then `close()` (done by `async with`)."""

    def __init__(self, fleet: Fleet, envelope: RequestEnvelope, replies: asyncio.Queue[ChunkEnvelope]):
        self.fleet = fleet
        self.envelope = envelope
        self.request_id = envelope.request_id
        self._replies = replies
        self.finished = False
        self.worker_id = ""

    async def __aenter__(self) -> Run:
        return self

    async def __aexit__(self, *exc_info) -> None:
        self.close()

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """Every chunk of the request, in order, ending with its terminal chunk."""
        deadline = self.envelope.deadline
        while not self.finished:
            timeout = deadline - time.time()
            try:
                envelope = await asyncio.wait_for(self._replies.get(), timeout=max(timeout, 0.001))
            except TimeoutError:
                self.close(reason="deadline")
                raise ServiceUnavailable("The request timed out before the model answered.",
                                         code="request_timeout") from None
            self.worker_id = envelope.worker_id
            for chunk in envelope.chunks:
                if chunk.done:
                    self.finished = True
                yield chunk

    async def first_or_error(self) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        """Wait for the first chunk; raise the worker's error if the request failed at once."""
        stream = self.chunks()
        first = await anext(stream)
        if first.done and first.error is not None:
            raise error_from_info(first.error)
        return first, stream

    def close(self, reason: str = "disconnect") -> None:
        """Stop following the request; if it has not ended, cancel it on its worker."""
        self.fleet.router.close(self.request_id)
        if not self.finished:
            self.finished = True
            self.fleet.cancel_soon([self.request_id], reason)


class Fleet:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.redis = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                             health_check_interval=10)
        self.router = ReplyRouter(self.redis, settings.gateway_id)
        self.registry = WorkerRegistry(self.redis)
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for job in (self.router.run(), self.router.keep_alive(), self.registry.run()):
            self._spawn(job)

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.redis.aclose()

    def _spawn(self, job) -> None:
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def ready(self) -> bool:
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    async def submit(self, envelope: RequestEnvelope) -> Run:
        """Queue the request for its model's workers and return its `Run`."""
        envelope.reply_to = self.router.stream
        replies = self.router.open(envelope.request_id)
        try:
            await self.redis.xadd(keys.request_stream(envelope.model), {keys.ENVELOPE_FIELD: encode(envelope)},
                                  maxlen=keys.REQUEST_STREAM_MAXLEN, approximate=True)
        except (RedisError, OSError) as exc:
            self.router.close(envelope.request_id)
            raise ServiceUnavailable("The request queue is unreachable; try again shortly.") from exc
        metrics.SUBMITTED.labels(envelope.model).inc()
        return Run(self, envelope, replies)

    def cancel_soon(self, request_ids: list[str], reason: str) -> None:
        """Publish a cancel in the background: callers are often being cancelled themselves."""
        self._spawn(self._publish_cancel(CancelNotice(request_ids, reason)))

    async def _publish_cancel(self, notice: CancelNotice) -> None:
        try:
            await self.redis.publish(keys.CANCEL_CHANNEL, encode(notice))
            metrics.CANCELS.labels(notice.reason).inc(len(notice.request_ids))
        except (RedisError, OSError) as exc:
            log.warning("publishing a cancel failed: %s", exc)
