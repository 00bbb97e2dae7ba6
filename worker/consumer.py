"""Reading and claiming: which requests this worker takes, and when.

A worker pulls: it asks the consumer group for at most as many requests as it has free slots,
so work lands where there is room and no router has to guess load. It claims the oldest waiting
requests of its own stream (sent to it for its cache, `shared/affinity.py`) and its model's, and
with a free slot, every `steal_after_s`, what has waited that long in other workers' own streams.
With every slot busy, it may start `express_slots` more, for tenants with nothing else queued
(`shared/fair_queue.py`). A dead or draining worker's requests are taken over (`reclaim_requests`),
in up to `takeover_slots` more: they already waited, and go ahead of new work.

What it claims goes to the `Runner` (worker/runner.py). An entry that is not a valid request
envelope (it fails the typed decoding of `shared.codec`) is acknowledged, dead-lettered with the
reason (`keys.dead_letter_stream`), counted (`llmfleet_worker_poison_messages_total`) and never
redelivered; if it names its request and reply stream, that request is answered with the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import affinity, fair_queue, keys
from shared.codec import decode
from shared.envelopes import GenerationChunk, RequestEnvelope
from shared.errors import EnvelopeError, InvalidRequest
from shared.redis_direct import DirectConnection, direct_connection
from shared.stopping import pause
from worker import metrics
from worker.runner import Runner

log = logging.getLogger(__name__)

CLAIM_BLOCK_MS = 1000  # a claim's blocking read; new requests end it at once
DOORBELL_WAIT_S = 1  # an idle worker's wait for a request routed to another worker; a ring ends it at once
FORGET_AFTER_S = 30.0  # a worker whose heartbeat expired this long ago has its empty stream deleted


class RequestConsumer:
    """The claiming loops of one worker: `claim_requests`, `steal_waiting`, `reclaim_requests` and
    `claim_express`, each ending at its next turn once `stop()` is called."""

    def __init__(self, redis: aioredis.Redis, batched: aioredis.Redis, runner: Runner, model: str, worker_id: str,
                 max_concurrency: int, *, claim_idle_s: float = 3.0, steal_after_s: float = 0.01,
                 express_slots: int = 0, takeover_slots: int = 1):
        self.redis = redis
        self.runner = runner
        self.model = model
        self.worker_id = worker_id
        self.max_concurrency = max_concurrency
        self.claim_idle_s = claim_idle_s
        self.steal_after_s = steal_after_s
        self.express_slots = express_slots
        self.takeover_slots = takeover_slots
        self.stream = keys.request_stream(model)
        self.own_stream = keys.worker_stream(model, worker_id)
        self._bind = redis.register_script(fair_queue.BIND)
        self._express = redis.register_script(fair_queue.EXPRESS)
        # Claimed once per turn of `claim_requests` under load: in the worker's shared pipelines
        # (`BatchedRedis`, a held connection), not through the client's pool and packer.
        self._claim = batched.register_script(affinity.CLAIM)
        self._steal = redis.register_script(affinity.STEAL)
        self._move = redis.register_script(affinity.MOVE)
        self._ring = redis.register_script(affinity.RING)
        self._forget = redis.register_script(affinity.FORGET)
        # Each loop's blocking read (a claim, a doorbell), once a second while idle, on a connection it
        # holds, past redis-py's layers (`shared.redis_direct`; None on a cluster: through the client).
        self._links: dict[str, DirectConnection | None] = {
            loop: direct_connection(redis) for loop in ("claim", "steal", "express", "takeover")}
        self.draining = False
        self._slot_freed = asyncio.Event()
        self._express_open = asyncio.Event()  # every slot busy, an express slot free (or stopping)
        self.stopping = asyncio.Event()  # `stop()`: claim nothing more
        runner.on_finished = self._slot_free
        for source in ("own", "shared", "stolen", "reclaimed", "express"):
            metrics.CLAIMS.labels(self.model, source)

    @property
    def in_flight(self) -> int:
        return self.runner.in_flight

    @property
    def takeover_room(self) -> int:
        """How many taken-over requests this worker may start now: its free slots and those kept for them."""
        return self.max_concurrency + self.takeover_slots - self.in_flight

    def loops(self) -> list:
        """The claiming loops but `claim_requests` (which a stop waits for apart)."""
        return [self.reclaim_requests(), self.steal_waiting(), *([self.claim_express()] if self.express_slots else [])]

    async def stopped(self) -> None:
        await self.stopping.wait()

    def stop(self) -> None:
        """Claim nothing more; every loop ends at its next turn."""
        self.draining = True
        self.stopping.set()
        self._slot_freed.set()
        self._express_open.set()

    def _slot_free(self) -> None:
        self._slot_freed.set()
        self._update_express()

    async def _ensure_group(self) -> None:
        for stream in (self.stream, self.own_stream):
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await self.redis.expire(self.own_stream, keys.AFFINITY_STREAM_TTL_S)

    async def claim_requests(self) -> None:
        """Claim as many requests as there are free slots: the oldest waiting in this worker's own
        stream and its model's, blocking on both while they are empty.

        A claim that took fewer than it had room for left nothing waiting in either stream, so the
        next turn goes straight to the blocking read, which returns at once what came meanwhile: at
        low load a request costs the claiming script's round trip (its streams' groups read, Redis
        woken once more, and this worker) only when a backlog may be there to take oldest first."""
        backlog = True  # whether requests may wait beyond what the last claim took
        while not self.draining:
            free = self.max_concurrency - self.in_flight
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                backlog = True  # requests may have come while every slot was busy
                continue
            try:
                entries = await self._oldest_waiting(free) if backlog else []
                if not entries:
                    entries = await self._read({self.own_stream: ">", self.stream: ">"}, free, CLAIM_BLOCK_MS)
                backlog = len(entries) >= free
            except RedisError as exc:
                log.warning("claiming requests failed: %s", exc)
                backlog = True
                await asyncio.sleep(0.5)
                if "NOGROUP" in str(exc):  # Redis restarted empty, or our stream expired: make the group again
                    with contextlib.suppress(RedisError):
                        await self._ensure_group()
                continue
            await self._start_entries(entries, limited=True)

    async def steal_waiting(self) -> None:
        """While a slot is free, take what has waited `steal_after_s` in other workers' own streams
        (their worker is busy or stopped), when it is due. While nothing waits there, wait for the
        model's doorbell, rung as a gateway adds a request to a worker's stream (`shared.affinity`),
        instead of asking Redis every period; a worker that took a ring and has no slot left rings
        again for another."""
        delay = 0.0
        due = None  # when the oldest request seen waiting in another worker's stream may be taken
        while not await pause(self.stopping, delay):
            delay = self.steal_after_s
            free = self.max_concurrency - self.in_flight
            try:
                if free <= 0:
                    if due is not None:  # seen, and no slot left to take it: an idle worker may
                        await self._ring(keys=[keys.affinity_doorbell(self.model)],
                                         args=[round((due - self.steal_after_s) * 1000), keys.AFFINITY_STREAM_TTL_S])
                        due = None
                    continue
                entries, oldest = await self._steal_waiting(free)
                if not entries and oldest is None:  # nothing waits: until a request is routed (rung at its arrival)
                    rung = await self._blpop("steal", keys.affinity_doorbell(self.model), DOORBELL_WAIT_S)
                    if rung is None:  # a wait without a ring: look again at once, no pause (a lost ring)
                        delay, due = 0.0, None
                        continue
                    oldest = float(rung[1]) / 1000
            except RedisError as exc:
                log.warning("taking waiting requests failed: %s", exc)
                continue
            if entries:
                await self._start_entries(entries, "stolen", limited=True)
            due = None if oldest is None else oldest + self.steal_after_s
            if due is not None:
                delay = min(self.steal_after_s, max(0.001, due - time.time()))

    async def claim_express(self) -> None:
        """While every slot is busy, start up to `express_slots` more requests, only of tenants that
        have nothing else queued (`shared.fair_queue.EXPRESS`): a light tenant's request starts at
        once, not when the next slot frees. Woken by the model's new-turn doorbell."""
        while not self.stopping.is_set():
            await self._express_open.wait()
            if self.stopping.is_set():
                break
            try:
                entries = _entries(await self._express(keys=fair_queue.express_keys(self.model),
                                                       args=[keys.WORKER_GROUP, self.worker_id]))
                if not entries:  # until a tenant's queue takes a new turn (or a second has passed)
                    await self._blpop("express", keys.new_turn_doorbell(self.model), DOORBELL_WAIT_S)
            except RedisError as exc:
                log.warning("express claim failed: %s", exc)
                await pause(self.stopping, 0.5)
                continue
            if entries:
                await self._start_entries(entries, "express")

    def _update_express(self) -> None:
        if self.max_concurrency <= self.in_flight < self.max_concurrency + self.express_slots:
            self._express_open.set()
        elif not self.stopping.is_set():
            self._express_open.clear()

    async def _read(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[tuple]:
        """XREADGROUP as (stream, entry id, fields) triples, this worker's own stream's first."""
        link = self._links["claim"]
        if link is None:
            replies = await self.redis.xreadgroup(keys.WORKER_GROUP, self.worker_id, streams, count=count,
                                                  block=block_ms)
        else:
            [replies] = await link.execute([("XREADGROUP", "GROUP", keys.WORKER_GROUP, self.worker_id, "COUNT", count,
                                             *(("BLOCK", block_ms) if block_ms is not None else ()),
                                             "STREAMS", *streams, *streams.values())])
        if isinstance(replies, dict):  # RESP3
            replies = list(replies.items())
        entries = [(stream.decode(), entry_id, _fields(fields))
                   for stream, got in replies or () for entry_id, fields in got]
        return sorted(entries, key=lambda entry: entry[0] != self.own_stream)

    async def _blpop(self, loop: str, key: str, timeout: float):
        """BLPOP on `loop`'s own connection: [key, value], or None after `timeout` seconds."""
        timeout = max(timeout, 0.001)  # Redis counts milliseconds, and reads a timeout of 0 as none at all
        link = self._links[loop]
        if link is None:
            return await self.redis.blpop([key], timeout=timeout)
        [reply] = await link.execute([("BLPOP", key, timeout)])
        return reply

    async def close(self) -> None:
        """Give back the loops' connections (once they have ended)."""
        for link in self._links.values():
            if link is not None:
                await link.close()

    async def _oldest_waiting(self, count: int) -> list[tuple]:
        return _entries(await self._claim(keys=[self.own_stream, self.stream],
                                          args=[keys.WORKER_GROUP, self.worker_id, count]))

    async def _steal_waiting(self, count: int) -> tuple[list[tuple], float | None]:
        """The entries taken, and when the oldest one still waiting elsewhere arrived (None: none)."""
        triples, oldest_ms = await self._steal(keys=[keys.affinity_waiting(self.model)], args=[
            keys.WORKER_GROUP, self.worker_id, count, int(time.time() * 1000), round(self.steal_after_s * 1000),
            self.own_stream])
        oldest_ms = float(oldest_ms)
        return _entries(triples), oldest_ms / 1000 if oldest_ms >= 0 else None

    async def reclaim_requests(self) -> None:
        """Take over requests whose worker died: at once those a gateway names on the model's
        takeover doorbell when it sees their worker gone (`_take_over_rung`), and every
        `claim_idle_s / 2` pending entries idle past `claim_idle_s`, in the model's stream and in
        the own streams of workers whose heartbeat expired (which are deleted once empty; their
        waiting entries are taken by `steal_waiting`).

        Entries of live workers come back too (XAUTOCLAIM cannot tell), but their worker still
        holds the request's lease, so they are left alone.
        """
        idle_ms = int(self.claim_idle_s * 1000)
        sweep_at = time.monotonic() + self.claim_idle_s / 2
        while not self.stopping.is_set():
            if (wait := sweep_at - time.monotonic()) > 0:
                await self._take_over_rung(wait)
                continue
            sweep_at = time.monotonic() + self.claim_idle_s / 2
            now_ms = time.time() * 1000
            try:
                dead = await self.redis.zrangebyscore(keys.affinity_streams(self.model), "-inf", now_ms,
                                                      withscores=True)
            except RedisError as exc:
                log.warning("reading the workers' streams failed: %s", exc)
                dead = []
            for stream, expired_at in [(self.stream, now_ms), *((name.decode(), at) for name, at in dead)]:
                free = self.takeover_room
                if free <= 0:
                    break
                try:
                    _next, entries, *_ = await self.redis.xautoclaim(
                        stream, keys.WORKER_GROUP, self.worker_id, idle_ms, "0-0", count=free)
                    # A worker silent that long is gone, not stalled (a stopped one said so: at 0).
                    if stream != self.stream and not entries and expired_at < now_ms - FORGET_AFTER_S * 1000:
                        await self._forget(keys=[keys.affinity_streams(self.model), stream])
                except RedisError as exc:
                    log.warning("reclaiming requests failed: %s", exc)
                    continue
                await self._start_entries([(stream, entry_id, fields) for entry_id, fields in entries], "reclaimed")

    async def _take_over_rung(self, wait: float) -> None:
        """Wait up to `wait` seconds for the takeover doorbell while a slot is free (one kept for
        takeovers counts), and claim the entries rung there (a gateway saw their worker gone and took
        the lease back; a draining worker handed them over): the request goes on here within
        milliseconds, not at the next sweep nor behind new work."""
        free = self.takeover_room
        if free <= 0:
            await pause(self.stopping, wait)
            return
        doorbell = keys.takeover_doorbell(self.model)
        try:
            rung = await self._blpop("takeover", doorbell, min(wait, DOORBELL_WAIT_S))  # within socket timeouts
            if rung is None:
                return
            if self.stopping.is_set():  # a stopping worker takes nothing: the ring is another's
                await self.redis.lpush(doorbell, rung[1])
                return
            named = [rung[1], *(await self.redis.lpop(doorbell, free - 1) or ())] if free > 1 else [rung[1]]
        except RedisError as exc:
            log.warning("taking over rung requests failed: %s", exc)
            await pause(self.stopping, wait)
            return
        claimed = []
        for item in named:  # each on its own: one gone (its stream deleted since) spoils no other
            try:
                stream, entry_id = item.decode().split(" ", 1)
                entries = await self.redis.xclaim(stream, keys.WORKER_GROUP, self.worker_id, 0, [entry_id])
            except (RedisError, ValueError) as exc:
                log.warning("taking over the rung request %r failed: %s", item, exc)
                continue
            claimed += [(stream, claimed_id, fields) for claimed_id, fields in entries]
        await self._start_entries(claimed, "reclaimed")

    async def _start_entries(self, entries: list[tuple], source: str | None = None, limited: bool = False) -> None:
        """Start each claimed entry's request: the envelope it carries, or for a fair-share ticket
        the envelope bound to it (`shared.fair_queue`). A ticket that could not be bound stays
        pending on this worker, and is reclaimed from it like a dead worker's. `limited`: what is
        past the slots free now (the other claiming loop may have taken some meanwhile) waits in
        this worker's own stream. `source`: the claims' label, by default own or shared by stream."""
        claims = []
        tickets = []
        for stream, entry_id, fields in entries:
            if fields is None:  # deleted since (XAUTOCLAIM still names it)
                continue
            entry_id = entry_id.decode()
            if keys.TICKET_FIELD in fields:
                tickets.append(entry_id)
                claims.append((stream, entry_id, None))
            else:  # an envelope, or a malformed entry, which `_start` dead-letters
                claims.append((stream, entry_id, fields.get(keys.ENVELOPE_FIELD, b"")))
        if tickets:
            try:
                bound = await self._bind(keys=fair_queue.bind_keys(self.model), args=[keys.FAIR_QUEUE_TTL_S, *tickets])
            except RedisError as exc:
                log.warning("binding %d claimed tickets failed: %s", len(tickets), exc)
                claims = [claim for claim in claims if claim[2] is not None]
            else:
                envelopes = dict(zip(tickets, bound, strict=True))  # '' for a ticket whose request is gone
                claims = [(stream, entry_id, envelopes[entry_id] if data is None else data)
                          for stream, entry_id, data in claims]
        free = max(0, self.max_concurrency - self.in_flight)
        if limited and len(claims) > free:
            claims, surplus = claims[:free], claims[free:]
            for stream in {claim[0] for claim in surplus}:
                self.runner.spawn(self._keep_waiting(stream, [claim for claim in surplus if claim[0] == stream]))
        for stream, entry_id, data in claims:
            if source != "reclaimed":  # a reclaim counts once its lease is taken (Runner._run): XAUTOCLAIM
                # also returns the entries of requests still running, here or on a live worker, left alone
                metrics.CLAIMS.labels(self.model, source or ("own" if stream == self.own_stream else "shared")).inc()
            if entry_id in tickets and not data:  # its request is gone (its queue expired): nothing to answer
                self.runner.spawn(self._drop_entry(stream, entry_id))
            else:
                self._start(stream, entry_id, data, reclaimed=source == "reclaimed")

    async def _keep_waiting(self, stream: str, surplus: list[tuple]) -> None:
        """Move requests of `stream` claimed beyond the free slots to this worker's own stream, where
        they wait for its next free slot, or for another worker's (`steal_waiting`)."""
        args = [keys.WORKER_GROUP, int(time.time() * 1000), keys.AFFINITY_STREAM_TTL_S, keys.REQUEST_STREAM_MAXLEN,
                keys.ENVELOPE_FIELD]
        for _stream, entry_id, data in surplus:
            args += [entry_id, data]
        bindings = [keys.bound_requests(self.model)] if stream == self.stream else []  # a ticket's, of that stream
        try:
            await self._move(keys=[stream, self.own_stream, keys.affinity_waiting(self.model),
                                   keys.affinity_doorbell(self.model), *bindings], args=args)
        except RedisError as exc:  # they stay pending here, and are reclaimed like a dead worker's
            log.warning("could not requeue %d requests: %s", len(surplus), exc)

    async def _drop_entry(self, stream: str, entry_id: str) -> None:
        with contextlib.suppress(RedisError):
            await (self.runner.batched.pipeline(transaction=False).xack(stream, keys.WORKER_GROUP, entry_id)
                   .xdel(stream, entry_id).execute())

    def _start(self, stream: str, entry_id: str, data: bytes, reclaimed: bool = False) -> None:
        try:
            request = decode(RequestEnvelope, data)
        except EnvelopeError as exc:
            self._refuse_poison(stream, entry_id, data, exc)
            return
        self.runner.start(stream, entry_id, request, reclaimed)
        self._update_express()

    def _refuse_poison(self, stream: str, entry_id: str, data: bytes, error: EnvelopeError) -> None:
        """An entry that is no valid request: acknowledged and dead-lettered with the reason, never
        redelivered; and when it names a request and its gateway, that request is answered with the
        reason, so its client does not wait out its deadline."""
        log.error("dead-lettering malformed request %s: %s", entry_id, error)
        metrics.POISON_MESSAGES.labels(self.model).inc()
        self.runner.spawn(self._dead_letter(stream, entry_id, data, str(error)))
        route = _reply_route(data)
        if route is not None:
            refused = GenerationChunk(done=True, finish_reason="error", error=InvalidRequest(
                f"The worker could not read this request ({error}); a gateway and worker of different "
                "versions may disagree on the wire format.", code="bad_envelope").to_info())
            self.runner.publisher.finish(route, refused, None)

    async def _dead_letter(self, stream: str, entry_id: str, data: bytes, reason: str) -> None:
        """Move a poison entry to the model's dead-letter stream, with why, and acknowledge it."""
        record = {b"entry_id": entry_id, b"reason": reason, b"bytes": len(data),
                  b"data": data[: keys.DEAD_LETTER_KEEP_BYTES], b"worker_id": self.worker_id}
        pipe = (self.runner.batched.pipeline(transaction=False)
                .xadd(keys.dead_letter_stream(self.model), record, maxlen=keys.DEAD_LETTER_MAXLEN, approximate=True)
                .xack(stream, keys.WORKER_GROUP, entry_id)
                .xdel(stream, entry_id))
        if stream == self.stream:  # if a ticket's, its binding goes too (bindings are of the model's stream)
            pipe.hdel(keys.bound_requests(self.model), entry_id)
        with contextlib.suppress(RedisError):
            await pipe.execute()


class _ReplyRoute(msgspec.Struct):
    """What a malformed request envelope may still say: which request, and where it is awaited."""

    request_id: str
    reply_to: str
    batch_replies: bool = False


def _reply_route(data: bytes) -> RequestEnvelope | None:
    """A stand-in envelope to answer a malformed request with, when its request and gateway can be read."""
    try:
        route = msgspec.msgpack.decode(data, type=_ReplyRoute)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if not route.request_id or not route.reply_to.startswith(f"{keys.PREFIX}:replies:"):
        return None
    return RequestEnvelope(request_id=route.request_id[:256], model="?", kind="chat", reply_to=route.reply_to[:256],
                           arrival=0.0, batch_replies=route.batch_replies)


def _fields(fields) -> dict | None:
    """An entry's fields as redis-py's client gives them (a dict), from a flat list as Redis sends
    them; None for an entry deleted since it was added."""
    if fields is None or isinstance(fields, dict):
        return fields
    return dict(zip(fields[::2], fields[1::2], strict=True))


def _entries(triples) -> list[tuple]:
    """A claiming script's {stream, entry id, flat fields} triples as (stream, entry id, fields)."""
    return [(stream.decode(), entry_id, _fields(flat)) for stream, entry_id, flat in triples]
