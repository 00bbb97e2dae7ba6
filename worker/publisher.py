"""Publishes generation chunks to the gateways' reply streams, batched and coalesced.

One task owns the Redis writes of a worker. Chunks queue up per request; whenever the previous
write has finished (and at most every `coalesce_s`), everything queued goes out in one
pipeline: one XADD per request, with neighbouring text deltas of the same choice merged. So a
fast engine costs a few round trips per batch instead of one per token, and a slow one still
gets each token out at once.

The terminal chunk of a request is written in the same pipeline as the XACK and XDEL of its
request entry, after every earlier chunk: the gateway never sees a request end twice, and the
entry is only acknowledged once its answer is in Redis.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import encode
from shared.envelopes import ChunkEnvelope, GenerationChunk

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Outbox:
    reply_to: str
    request_id: str
    chunks: list[GenerationChunk] = field(default_factory=list)
    ack: tuple[str, str, str] | None = None  # (request stream, entry id, request id) once terminal
    flushed: asyncio.Future | None = None


def _coalesce(chunks: list[GenerationChunk]) -> list[GenerationChunk]:
    merged: list[GenerationChunk] = []
    for chunk in chunks:
        if merged and merged[-1].can_absorb(chunk):
            merged[-1].absorb(chunk)
        else:
            merged.append(chunk)
    return merged


class ReplyPublisher:
    def __init__(self, redis: aioredis.Redis, worker_id: str, coalesce_s: float = 0.002):
        self.redis = redis
        self.worker_id = worker_id
        self.coalesce_s = coalesce_s
        self._outboxes: dict[str, _Outbox] = {}
        self._seq: dict[str, int] = {}
        self._wake = asyncio.Event()

    def publish(self, reply_to: str, request_id: str, chunk: GenerationChunk) -> None:
        outbox = self._outboxes.get(request_id)
        if outbox is None:
            outbox = self._outboxes[request_id] = _Outbox(reply_to, request_id)
        outbox.chunks.append(chunk)
        self._wake.set()

    def finish(self, reply_to: str, request_id: str, terminal: GenerationChunk,
               ack: tuple[str, str, str] | None) -> asyncio.Future:
        """Queue the terminal chunk; the future resolves once it (and the ack) is in Redis."""
        self.publish(reply_to, request_id, terminal)
        outbox = self._outboxes[request_id]
        outbox.ack = ack
        outbox.flushed = asyncio.get_running_loop().create_future()
        return outbox.flushed

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            started = time.monotonic()
            outboxes, self._outboxes = self._outboxes, {}
            await self._flush(list(outboxes.values()))
            pause = self.coalesce_s - (time.monotonic() - started)
            if pause > 0:
                await asyncio.sleep(pause)

    async def _flush(self, outboxes: list[_Outbox]) -> None:
        writes = []
        for outbox in outboxes:
            seq = self._seq.get(outbox.request_id, 0)
            envelope = ChunkEnvelope(outbox.request_id, seq, _coalesce(outbox.chunks), self.worker_id)
            writes.append((outbox.reply_to, encode(envelope), outbox.ack,
                           outbox.request_id if seq == 0 and outbox.ack is None else None))
            if outbox.flushed is not None:
                self._seq.pop(outbox.request_id, None)
            else:
                self._seq[outbox.request_id] = seq + 1
        await self._write(writes)
        for outbox in outboxes:
            if outbox.flushed is not None and not outbox.flushed.done():
                outbox.flushed.set_result(None)

    async def _write(self, writes: list[tuple]) -> None:
        delay = 0.05
        while True:
            pipe = self.redis.pipeline(transaction=False)
            for reply_to, data, ack, first_of in writes:
                pipe.xadd(reply_to, {keys.ENVELOPE_FIELD: data},
                          maxlen=keys.REPLY_STREAM_MAXLEN, approximate=True, nomkstream=True)
                if first_of is not None:  # output has reached the client: never run it again
                    pipe.set(keys.streamed_key(first_of), b"1", ex=keys.CANCEL_MEMORY_TTL_S)
                if ack is not None:
                    request_id = ack[2]
                    pipe.xack(ack[0], keys.WORKER_GROUP, ack[1])
                    pipe.xdel(ack[0], ack[1])
                    pipe.delete(keys.cancelled_key(request_id), keys.lease_key(request_id),
                                keys.streamed_key(request_id))
            try:
                await pipe.execute()
                return
            except RedisError as exc:
                log.warning("publishing replies failed (%s); retrying in %.2fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
