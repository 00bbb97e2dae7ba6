"""Publishes generation chunks to the gateways, batched and coalesced.

One task owns the Redis writes of a worker. Chunks queue up per request; whenever the previous
write has finished and a pause after its start has passed, everything queued goes out in one
pipeline, with neighbouring deltas of the same kind merged. The envelopes bound for one
gateway share one message: a PUBLISH on the gateway's channel (`RequestEnvelope.reply_channel`),
which the gateway reads as it comes, or, where the request names none or its answer in one
envelope is too large for a channel (CHANNEL_ANSWER_LIMIT_BYTES), one entry of its reply stream
(`keys.BATCH_FIELD`). An engine step of 64 requests is one command, not 64, for Redis and for the
gateway that reads it. (A gateway that did not ask for batches, `RequestEnvelope.batch_replies`,
gets one stream entry per envelope.) So a fast engine costs a few round trips per batch instead of
one per token, and a slow one still gets each token out at once.

The pause grows with the load (`pause_s`): 0.75 ms for each request the last write carried, at
least 2 ms and at most 6 ms. A worker streaming to one client sends each engine step at once (a
step takes longer than 2 ms); one streaming to eight merges about two steps into each write and
each SSE event, for about a third less CPU per token beside the engine here, with at most 6 ms
more between a client's events. A request's first output ends the pause: it never waits. Only
what is queued waits the pause out: a write with nothing after it sets no timer, so a worker
serving one client at a time (an engine step, or an encoding, longer than the pause) wakes once
per write, not twice. What the oldest reply of each write waited for it is the worker's
`llmfleet_worker_publish_wait_seconds`: the pause's price in latency, as it is paid.

The terminal chunk of a request is written in the same pipeline as the XACK and XDEL of its
request entry (on a Redis Cluster, in the pipeline before them), after every earlier chunk: the
gateway never sees a request end twice, and the entry is only acknowledged once its answer is
in Redis (on a channel: on its way to the gateway, which fails its open requests if it loses the
subscription).

`stop()` ends `run` once what is queued has gone out; a write Redis refuses is then dropped, not
retried: a stopping worker's unacknowledged requests are recovered as after a crash.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys, redis_pool
from shared.codec import MAX_ENVELOPE_BYTES, encode, encode_batch
from shared.envelopes import ChunkEnvelope, GenerationChunk, RequestEnvelope
from shared.redis_direct import Commands, direct_connection
from shared.stopping import pause
from worker import metrics

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Outbox:
    reply_to: str
    request_id: str
    batch: bool  # its gateway reads entries of several envelopes
    channel: str  # where its gateway reads its replies as they come (PUBLISH); "": `reply_to` alone
    chunks: list[GenerationChunk] = field(default_factory=list)
    # (request stream, entry id, request id[, the bindings of a fair-share ticket]) once terminal
    ack: tuple[str, ...] | None = None
    flushed: asyncio.Future | None = None
    lease: int = 0  # the fencing token of this worker's lease on the request


@dataclass(slots=True)
class _Entry:
    """One reply stream entry, or one message on a gateway's channel: an envelope, or a batch of
    them for one gateway (on a channel, always a batch)."""
    reply_to: str
    channel: bool = False
    envelopes: list[bytes] = field(default_factory=list)
    size: int = 0
    request_ids: list[str] = field(default_factory=list)  # of each envelope

    def add(self, data: bytes, request_id: str) -> None:
        self.envelopes.append(data)
        self.request_ids.append(request_id)
        self.size += len(data)

    def remove(self, request_id: str) -> None:
        kept = [(rid, data) for rid, data in zip(self.request_ids, self.envelopes, strict=True) if rid != request_id]
        self.request_ids, self.envelopes = [rid for rid, _ in kept], [data for _, data in kept]
        self.size = sum(len(data) for data in self.envelopes)

    def value(self) -> dict[bytes, bytes]:
        """A stream entry's fields."""
        if len(self.envelopes) == 1:
            return {keys.ENVELOPE_FIELD: self.envelopes[0]}
        return {keys.BATCH_FIELD: encode_batch(self.envelopes)}


BATCH_LIMIT_BYTES = MAX_ENVELOPE_BYTES // 2  # a batch stays well inside what a gateway decodes
# The largest answer in one envelope that goes on a gateway's channel; a larger one (an encoder's
# vectors, a long non-streaming answer) goes to its reply stream. What a channel carries waits in
# Redis's output buffer until its gateway reads it, and Redis drops a subscriber whose buffer
# passes its limit (`client-output-buffer-limit pubsub`, 32 MB by default): vectors come faster than
# a busy gateway may read them, a stream's deltas at the engine's pace. Only a whole answer may
# go apart from the rest of its request's replies: nothing with a seq came before it, nor comes after.
CHANNEL_ANSWER_LIMIT_BYTES = 64 * 1024

# The pause between two writes: 2 ms, or 0.75 ms for each request the last write carried, up to 6 ms.
# What waits is merged into the next write: a request's deltas into one, the requests bound for a
# gateway into one entry. A request's first output never waits.
COALESCE_S = 0.002
COALESCE_PER_STREAM_S = 0.00075
COALESCE_MOST_S = 0.006


def _resolve(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def _coalesce(chunks: list[GenerationChunk]) -> list[GenerationChunk]:
    merged: list[GenerationChunk] = []
    for chunk in chunks:
        if merged and merged[-1].can_absorb(chunk):
            merged[-1].absorb(chunk)
        else:
            merged.append(chunk)
    return merged


class ReplyPublisher:
    def __init__(self, redis: aioredis.Redis, worker_id: str, coalesce_s: float = COALESCE_S,
                 per_stream_s: float = COALESCE_PER_STREAM_S, most_s: float = COALESCE_MOST_S, model: str = ""):
        self.redis = redis
        self.worker_id = worker_id
        self._publish_wait = metrics.PUBLISH_WAIT.labels(model)
        self.coalesce_s = coalesce_s
        self.per_stream_s = per_stream_s
        self.most_s = most_s
        self._hurry: asyncio.Future | None = None  # set to end the pause between writes early
        self._urgent = False  # a first output is queued: no pause before the next write
        self._outboxes: dict[str, _Outbox] = {}
        self._queued_at = 0.0  # when (monotonic) the oldest of `_outboxes` was queued
        self._seq: dict[str, int] = {}
        self._leases: dict[str, int] = {}  # request id -> fencing token of this worker's lease on it
        self._entries: dict[str, tuple[str, str]] = {}  # request id -> its entry (stream, id), told on seq 0
        self._dropped: set[str] = set()  # requests whose lease this worker lost
        # What the write under way sends (its entries, first outputs, acks), each time it retries.
        self._in_flight: tuple[list[_Entry], list[str], list[tuple[str, str, str]]] = ([], [], [])
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        # A draining worker sets how long Redis may stay unreachable before its replies are dropped:
        # its requests stay unacknowledged, for the gateways and workers to recover as from a crash.
        self.give_up_after_s: float | None = None
        self._failing_since: float | None = None

    @property
    def redis(self) -> aioredis.Redis:
        return self._redis

    @redis.setter
    def redis(self, client: aioredis.Redis) -> None:
        """The client it writes with; set again, its writes go on the new client's pool (the
        connection held on the old one stays with the old client)."""
        self._redis = client
        self._ordered = redis_pool.pipelines_run_in_order(client)
        self._direct = direct_connection(client)  # one write per engine step: past the pipeline's layers

    @property
    def given_up(self) -> bool:
        """Whether replies are being dropped: Redis has been away past `give_up_after_s`."""
        return (self.give_up_after_s is not None and self._failing_since is not None
                and time.monotonic() - self._failing_since >= self.give_up_after_s)

    def hold(self, request_id: str, lease: int, entry: tuple[str, str] = ("", "")) -> None:
        """Publish for `request_id` under this worker's lease on it (`ChunkEnvelope.lease`); its
        first write says where its entry is pending (`ChunkEnvelope.stream`, `entry_id`)."""
        self._leases[request_id] = lease
        self._entries[request_id] = entry

    def entry(self, request_id: str) -> tuple[str, str]:
        """Where a held request's entry is pending (stream, entry id; empty if not told)."""
        return self._entries.get(request_id, ("", ""))

    def drop(self, request_id: str) -> None:
        """Publish nothing more for a request whose lease this worker lost (another worker may own
        it now): its queued chunks are discarded, and its later chunks, ending and acknowledgement
        ignored until `release`. A write already on the wire still lands; gateways drop its
        chunks by their lease."""
        self._dropped.add(request_id)
        self._outboxes.pop(request_id, None)
        self._seq.pop(request_id, None)
        entries, first_outputs, acks = self._in_flight  # a retry of the write under way leaves it out
        for entry in entries:
            entry.remove(request_id)
        entries[:] = [entry for entry in entries if entry.envelopes]
        first_outputs[:] = [rid for rid in first_outputs if rid != request_id]
        acks[:] = [ack for ack in acks if ack[2] != request_id]

    def release(self, request_id: str) -> None:
        """Forget a request that has ended on this worker."""
        self._leases.pop(request_id, None)
        self._entries.pop(request_id, None)
        self._dropped.discard(request_id)

    def started(self, request: RequestEnvelope) -> None:
        """Tell the request's gateway now that this worker runs it, in an envelope of no chunks
        (which takes no `seq`): a generation that has sent nothing yet (a non-streaming one, or a
        stream before its first token) is otherwise silent, and its gateway needs the worker and
        the entry to hand it over at once if the worker dies."""
        if request.request_id not in self._dropped:
            self._outbox(request)
            self._wake.set()

    def publish(self, request: RequestEnvelope, chunk: GenerationChunk) -> None:
        if request.request_id in self._dropped:
            return
        self._outbox(request).chunks.append(chunk)
        self._wake.set()
        if request.request_id not in self._seq:  # its first output: the pause between writes ends
            self._end_pause()

    def _outbox(self, request: RequestEnvelope) -> _Outbox:
        outbox = self._outboxes.get(request.request_id)
        if outbox is None:
            if not self._outboxes:  # the first since the last write: the one that waits longest
                self._queued_at = time.monotonic()
            outbox = self._outboxes[request.request_id] = _Outbox(request.reply_to, request.request_id,
                                                                  request.batch_replies, request.reply_channel,
                                                                  lease=self._leases.get(request.request_id, 0))
        return outbox

    def finish(self, request: RequestEnvelope, terminal: GenerationChunk,
               ack: tuple[str, ...] | None) -> asyncio.Future:
        """Queue the terminal chunk; the future resolves once it (and the ack) is in Redis."""
        if request.request_id in self._dropped:  # its ending and its ack are the new owner's
            nothing = asyncio.get_running_loop().create_future()
            nothing.set_result(None)
            return nothing
        self.publish(request, terminal)
        outbox = self._outboxes[request.request_id]
        outbox.ack = ack
        outbox.flushed = asyncio.get_running_loop().create_future()
        return outbox.flushed

    def last(self, request: RequestEnvelope, chunk: GenerationChunk) -> asyncio.Future:
        """Queue `chunk` after what is queued for the request, and nothing after it (a draining
        worker's hand-over notice): later chunks and the ending are ignored. The future resolves
        once it is in Redis; `drop` the request then."""
        flushed = self.finish(request, chunk, None)
        self._dropped.add(request.request_id)
        return flushed

    def stop(self) -> None:
        """End `run` once what is queued is written (or dropped: see `_execute`)."""
        self._stopping.set()
        self._wake.set()
        self._end_pause()

    async def run(self) -> None:
        # Whenever an outbox is queued, `_wake` is set or a flush is under way: no write waits for a stop.
        next_write = 0.0  # the pause after a write ends here; only what is queued waits it out
        while not self._stopping.is_set() or self._outboxes:
            await self._wake.wait()
            self._wake.clear()
            rest = next_write - time.monotonic()
            if rest > 0 and not self._urgent and not self._stopping.is_set():
                await self._pause(rest)
            self._urgent = False
            started = time.monotonic()
            outboxes, self._outboxes = self._outboxes, {}
            if outboxes:
                self._publish_wait.observe(started - self._queued_at)
                await self._flush(list(outboxes.values()))
            next_write = started + self.pause_s(sum(1 for outbox in outboxes.values() if outbox.chunks))
        if self._direct is not None:
            await self._direct.close()

    def pause_s(self, requests: int) -> float:
        """The least time from the start of a write that carried `requests` requests to the next:
        the more streams a worker sends, the more of each one's deltas share a write (and an SSE event),
        which costs the worker, Redis and the gateway less CPU per token, at `most_s` of added latency."""
        return min(self.most_s, max(self.coalesce_s, requests * self.per_stream_s))

    async def _pause(self, seconds: float) -> None:
        """Wait `seconds`, or less if a request's first output or a stop comes (`_end_pause`)."""
        loop = asyncio.get_running_loop()
        self._hurry = hurry = loop.create_future()
        timer = loop.call_later(seconds, _resolve, hurry)
        try:
            await hurry
        finally:
            timer.cancel()
            self._hurry = None

    def _end_pause(self) -> None:
        """A first output is queued: what is queued goes out at once, in the pause or after the write under way."""
        self._urgent = True
        if self._hurry is not None:
            _resolve(self._hurry)

    async def _flush(self, outboxes: list[_Outbox]) -> None:
        entries: list[_Entry] = []
        batches: dict[str, _Entry] = {}  # the open batch entry of each gateway that reads batches
        first_outputs = []  # requests whose first output (not their ending) goes out now
        now = time.time()
        for outbox in outboxes:
            seq = self._seq.get(outbox.request_id, 0)
            stream, entry_id = self._entries.get(outbox.request_id, ("", "")) if seq == 0 else ("", "")
            data = encode(ChunkEnvelope(outbox.request_id, seq, _coalesce(outbox.chunks), self.worker_id,
                                        lease=outbox.lease, stream=stream, entry_id=entry_id,
                                        unregistered=self._ordered and outbox.ack is not None, sent_at=now))
            whole = seq == 0 and outbox.flushed is not None  # the request's answer, in this one envelope
            on_channel = bool(outbox.channel) and not (whole and len(data) > CHANNEL_ANSWER_LIMIT_BYTES)
            target = outbox.channel if on_channel else outbox.reply_to
            entry = batches.get(target) if outbox.batch or outbox.channel else None
            if entry is None or entry.size + len(data) > BATCH_LIMIT_BYTES:
                entry = _Entry(target, channel=on_channel)
                entries.append(entry)
                if outbox.batch or outbox.channel:
                    batches[target] = entry
            entry.add(data, outbox.request_id)
            if not outbox.chunks:  # only `started`: no output, and no seq taken
                continue
            if seq == 0 and outbox.ack is None:
                first_outputs.append(outbox.request_id)
            if outbox.flushed is not None:
                self._seq.pop(outbox.request_id, None)
            else:
                self._seq[outbox.request_id] = seq + 1
        self._in_flight = (entries, first_outputs, [outbox.ack for outbox in outboxes if outbox.ack is not None])
        try:
            await self._write(*self._in_flight)
        finally:
            self._in_flight = ([], [], [])
        for outbox in outboxes:
            if outbox.flushed is not None and not outbox.flushed.done():
                outbox.flushed.set_result(None)

    async def _write(self, entries: list[_Entry], first_outputs: list[str],
                     acks: list[tuple[str, ...]]) -> None:
        """The entries, then what the requests' first outputs and endings change.

        A request's entry is in its stream before its request is acknowledged. One server runs a
        pipeline in order, so that is one pipeline; a cluster runs each node's share of a
        pipeline at once, so there the acknowledgements follow in a second one.
        """
        def add_entries(pipe) -> None:
            if self._ordered and acks:  # ended: a cancel by id after its answer finds no run (`unregistered`)
                pipe.delete(*(keys.run_key(request_id) for _stream, _entry_id, request_id, *_bindings in acks))
            for entry in entries:
                if entry.channel:
                    pipe.publish(entry.reply_to, encode_batch(entry.envelopes))
                else:
                    pipe.xadd(entry.reply_to, entry.value(), maxlen=keys.REPLY_STREAM_MAXLEN, approximate=True,
                              nomkstream=True)
            for request_id in first_outputs:  # output is on its way to the client: never run it again
                pipe.set(keys.streamed_key(request_id), b"1", ex=keys.CANCEL_MEMORY_TTL_S, nx=True)  # a replay's: kept

        def acknowledge(pipe) -> None:
            for stream, entry_id, request_id, *bindings in acks:
                pipe.xack(stream, keys.WORKER_GROUP, entry_id)
                pipe.xdel(stream, entry_id)
                if bindings:  # a ticket's request (shared.fair_queue): the same slot as its stream
                    pipe.hdel(bindings[0], entry_id)
                pipe.delete(keys.cancelled_key(request_id), keys.lease_key(request_id),
                            keys.streamed_key(request_id))  # one slot: the request's

        if self._ordered or not acks:
            await self._execute(len(entries), add_entries, acknowledge)
        else:
            await self._execute(len(entries), add_entries)
            await self._execute(0, acknowledge)

    async def _execute(self, n_entries: int, *writes) -> None:
        """One pipeline of `writes`, retried until Redis takes it (or a draining worker gives up, or
        the publisher is stopped)."""
        delay = 0.05
        while True:
            try:
                await self._send(writes)
                self._failing_since = None
                return
            except RedisError as exc:
                now = time.monotonic()
                if self._failing_since is None:
                    self._failing_since = now
                if self.given_up:
                    log.error("Redis unreachable for %.0fs while draining: dropping %d reply entries",
                              now - self._failing_since, n_entries)
                    return
                log.warning("publishing replies failed (%s); retrying in %.2fs", exc, delay)
                if await pause(self._stopping, delay):
                    log.error("stopping with Redis unreachable: dropping %d reply entries", n_entries)
                    return
                delay = min(delay * 2, 2.0)

    async def _send(self, writes) -> None:
        if self._direct is None:  # a cluster: its pipeline sends each node its share
            pipe = self.redis.pipeline(transaction=False)
            for write in writes:
                write(pipe)
            await pipe.execute()
            return
        commands = Commands()
        for write in writes:
            write(commands)
        if commands.args:
            await self._direct.execute(commands.args)
