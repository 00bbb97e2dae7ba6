"""The worker's consumer loop: claims requests from its model's stream and runs them.

A worker pulls: it asks the consumer group for at most as many requests as it has free slots,
so work lands where there is room and no router has to guess load. It claims the oldest waiting
requests of its own stream (sent to it for its cache, `shared/affinity.py`) and its model's, and
with a free slot, every `steal_after_s`, what has waited that long in other workers' own streams.
With every slot busy, it may start `express_slots` more, for tenants with nothing else queued
(`shared/fair_queue.py`).
Each claimed request runs as its own task; its chunks go to the `ReplyPublisher`. Cancels reach it by pub/sub and their
stashes (`worker/cancels.py`) and the adapter as `abort(request_id)`. A heartbeat key tells the
gateways what this worker serves and how busy it is; the same beat renews the leases of the
requests it runs (`worker/leases.py`) and looks for cancel notices that were lost. A request whose
lease may have lapsed is aborted, and nothing more is published for it, neither its chunks nor
its ending nor its acknowledgement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from shared import affinity, fair_queue, keys, tracing
from shared.codec import decode, encode
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, Usage, WorkerInfo
from shared.errors import EngineError, EnvelopeError, FleetError, ServiceUnavailable, WorkerLost
from shared.logs import REQUEST_ID
from shared.redis_batch import BatchedRedis
from shared.stopping import pause, stop_tasks, within
from worker import metrics
from worker.adapter import GenerationAdapter
from worker.aggregate import collect_candidates
from worker.cancels import CancelFollower
from worker.leases import Leases
from worker.publisher import ReplyPublisher

log = logging.getLogger(__name__)
request_log = logging.getLogger("llmfleet.requests")

ABORT_GRACE_S = 2.0  # how long an aborted generation may take to yield its terminal chunk
ENGINE_CHECK_S = 2.0  # how often the engine's health is checked
DRAIN_REDIS_GRACE_S = 10.0  # a draining worker drops its replies once Redis has been away this long
CLAIM_STOP_S = 2.0  # a claim blocks 1 s: past this, Redis hangs, and the claim is cancelled
STOP_CANCEL_S = 2.0  # a cancelled loop that has not ended after this is left behind
DEREGISTER_S = 2.0  # the last write of a stop: removing the heartbeat, which expires anyway
CLAIM_BLOCK_MS = 1000  # a claim's blocking read; new requests end it at once
DOORBELL_WAIT_S = 1  # an idle worker's wait for a request routed to another worker; a ring ends it at once
FORGET_AFTER_S = 30.0  # a worker whose heartbeat expired this long ago has its empty stream deleted


def new_worker_id() -> str:
    """A worker's name in the consumer group, heartbeats and `CLIENT LIST`: host, pid, and a nonce."""
    return f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class RequestConsumer:
    def __init__(self, redis: aioredis.Redis, adapter: GenerationAdapter, max_concurrency: int,
                 worker_id: str | None = None, claim_idle_s: float = 3.0, kinds: tuple[str, ...] = (),
                 steal_after_s: float = 0.01, express_slots: int = 0, log_requests: bool = False):
        self.redis = redis
        self.log_requests = log_requests  # one info line per request at its end (`--enable-log-requests`)
        # The per-request commands (lease, dead letters) of every request go out in shared pipelines:
        # a claim of hundreds of requests is one round trip, not hundreds of connections.
        self.batched = BatchedRedis(redis)
        self.adapter = adapter
        self.model = adapter.served_model_name
        self.max_concurrency = max_concurrency
        # The request kinds this worker answers, as its heartbeat announces them; it refuses the others.
        self.kinds = tuple(kinds or adapter.kinds)
        self.claim_idle_s = claim_idle_s
        self.worker_id = worker_id or new_worker_id()
        self.stream = keys.request_stream(self.model)
        self.own_stream = keys.worker_stream(self.model, self.worker_id)
        self.steal_after_s = steal_after_s
        self.express_slots = express_slots
        self._bind = redis.register_script(fair_queue.BIND)
        self._express = redis.register_script(fair_queue.EXPRESS)
        self._claim = redis.register_script(affinity.CLAIM)
        self._steal = redis.register_script(affinity.STEAL)
        self._move = redis.register_script(affinity.MOVE)
        self._ring = redis.register_script(affinity.RING)
        self._forget = redis.register_script(affinity.FORGET)
        self.publisher = ReplyPublisher(redis, self.worker_id)
        self.started = time.time()
        self.completed = 0
        self.draining = False
        self.fatal: BaseException | None = None  # set when the engine died
        self._running: dict[str, asyncio.Task] = {}
        self._cancel_requested: dict[str, str] = {}  # request id -> cause
        self._progress: dict[str, _Progress] = {}
        self._background: set[asyncio.Task] = set()
        self._slot_freed = asyncio.Event()
        self._express_open = asyncio.Event()  # every slot busy, an express slot free (or stopping)
        self._stop_claiming = asyncio.Event()  # `stop()`: claim nothing more
        self._stop_loops = asyncio.Event()  # the drain is over: heartbeat, cancels and leases end
        # Every per-model series exists from the start, at 0, so that a rate sees the first event
        # (a series born at 1 shows no increase) and dashboards show 0 rather than nothing.
        for family in (metrics.QUEUE_TIME, metrics.GENERATED_TOKENS, metrics.POISON_MESSAGES, metrics.CANCELS_FROM_STASH,
                       metrics.TOKENS_AFTER_CANCEL, metrics.QUEUE_TIMEOUTS, metrics.CANCEL_LATENCY, metrics.RECLAIMED,
                       metrics.PREFILL_TIME, metrics.DECODE_TIME):
            family.labels(self.model)
        for source in ("own", "shared", "stolen", "reclaimed", "express"):
            metrics.CLAIMS.labels(self.model, source)
        self.leases = Leases(self.batched, self.worker_id)
        self.cancels = CancelFollower(redis, self.model, self._running, self._cancel_requested,
                                      lambda rid, cause, sent_at: self._spawn(self.cancel(rid, cause, sent_at)))

    @property
    def in_flight(self) -> int:
        return len(self._running)

    async def run(self) -> None:
        """Serve until `stop()` (or cancelled); then stop claiming, finish what runs, stop the loops
        and deregister, each step bounded whatever Redis does. A loop that fails stops the worker:
        `run` raises its error once the rest has stopped."""
        await self._ensure_group()
        jobs = [self.batched.run(), self.publisher.run(), self._heartbeat(), self.cancels.listen(self._stop_loops),
                self.reclaim_requests(), self.steal_waiting(), self._watch_engine(),
                self.leases.watch(self._stop_loops, self._lease_lost)]
        if self.express_slots:
            jobs.append(self.claim_express())
        loops = [asyncio.create_task(job, name=job.__qualname__) for job in jobs]
        claiming = asyncio.create_task(self.claim_requests(), name="RequestConsumer.claim_requests")
        stop_requested = asyncio.create_task(self._stop_claiming.wait())
        try:
            await asyncio.wait([stop_requested, claiming, *loops], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_requested.cancel()
            await self._stop(claiming, loops)
        for task in (claiming, *loops):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    async def _stop(self, claiming: asyncio.Task, loops: list[asyncio.Task]) -> None:
        self.stop()
        await stop_tasks([claiming], grace_s=CLAIM_STOP_S, cancel_s=STOP_CANCEL_S, what="claiming requests")
        await self._drain()
        # Nothing is left for the loops to do: cancel them at once. Their stop events end them at
        # their next turn should a cancel be lost (shared.stopping).
        self._stop_loops.set()
        self.publisher.stop()
        self.batched.stop()
        await stop_tasks(loops, grace_s=0, cancel_s=STOP_CANCEL_S, what="worker loops")
        await self._deregister()

    def _check_engine(self) -> None:
        """If the engine is dead, stop: in-flight requests fail, and the process exits non-zero."""
        if self.fatal is None and self.adapter.failure is not None:
            self.fatal = self.adapter.failure
            log.error("the engine died (%s): failing in-flight requests and exiting", self.fatal)
            self.stop()

    async def _watch_engine(self) -> None:
        while not await pause(self._stop_claiming, ENGINE_CHECK_S):
            try:
                await self.adapter.check_health()
            except Exception as exc:  # noqa: BLE001 - any failure of the health check means the engine is gone
                log.error("engine health check failed: %s", exc)
            self._check_engine()

    def stop(self) -> None:
        """Stop claiming (SIGTERM); `run` returns once in-flight requests are answered."""
        self.draining = True
        self._stop_claiming.set()
        self._slot_freed.set()
        self._express_open.set()

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
        stream and its model's, blocking on both while they are empty."""
        while not self.draining:
            free = self.max_concurrency - self.in_flight
            if free <= 0:
                self._slot_freed.clear()
                await self._slot_freed.wait()
                continue
            try:
                entries = (await self._oldest_waiting(free)
                           or await self._read({self.own_stream: ">", self.stream: ">"}, free, CLAIM_BLOCK_MS))
            except RedisError as exc:
                log.warning("claiming requests failed: %s", exc)
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
        while not await pause(self._stop_claiming, delay):
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
                    rung = await self.redis.blpop([keys.affinity_doorbell(self.model)], timeout=DOORBELL_WAIT_S)
                    oldest = float(rung[1]) / 1000 if rung else None
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
        while not self._stop_claiming.is_set():
            await self._express_open.wait()
            if self._stop_claiming.is_set():
                break
            try:
                entries = _entries(await self._express(keys=fair_queue.express_keys(self.model),
                                                       args=[keys.WORKER_GROUP, self.worker_id]))
                if not entries:  # until a tenant's queue takes a new turn (or a second has passed)
                    await self.redis.blpop([keys.new_turn_doorbell(self.model)], timeout=DOORBELL_WAIT_S)
            except RedisError as exc:
                log.warning("express claim failed: %s", exc)
                await pause(self._stop_claiming, 0.5)
                continue
            if entries:
                await self._start_entries(entries, "express")

    def _update_express(self) -> None:
        if self.max_concurrency <= self.in_flight < self.max_concurrency + self.express_slots:
            self._express_open.set()
        elif not self._stop_claiming.is_set():
            self._express_open.clear()

    async def _read(self, streams: dict[str, str], count: int, block_ms: int | None) -> list[tuple]:
        """XREADGROUP as (stream, entry id, fields) triples, this worker's own stream's first."""
        replies = await self.redis.xreadgroup(keys.WORKER_GROUP, self.worker_id, streams, count=count, block=block_ms)
        if isinstance(replies, dict):  # RESP3
            replies = list(replies.items())
        entries = [(stream.decode(), entry_id, fields) for stream, got in replies or () for entry_id, fields in got]
        return sorted(entries, key=lambda entry: entry[0] != self.own_stream)

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
        """Take over requests whose worker died: pending entries idle past `claim_idle_s`, in the
        model's stream and in the own streams of workers whose heartbeat expired (which are deleted
        once empty; their waiting entries are taken by `steal_waiting`).

        Entries of live workers come back too (XAUTOCLAIM cannot tell), but their worker still
        holds the request's lease, so they are left alone.
        """
        idle_ms = int(self.claim_idle_s * 1000)
        while not await pause(self._stop_claiming, self.claim_idle_s / 2):
            now_ms = time.time() * 1000
            try:
                dead = await self.redis.zrangebyscore(keys.affinity_streams(self.model), "-inf", now_ms,
                                                      withscores=True)
            except RedisError as exc:
                log.warning("reading the workers' streams failed: %s", exc)
                dead = []
            for stream, expired_at in [(self.stream, now_ms), *((name.decode(), at) for name, at in dead)]:
                free = self.max_concurrency - self.in_flight
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
                self._spawn(self._keep_waiting(stream, [claim for claim in surplus if claim[0] == stream]))
        for stream, entry_id, data in claims:
            metrics.CLAIMS.labels(self.model, source or ("own" if stream == self.own_stream else "shared")).inc()
            if entry_id in tickets and not data:  # its request is gone (its queue expired): nothing to answer
                self._spawn(self._drop_entry(stream, entry_id))
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
            await (self.batched.pipeline(transaction=False).xack(stream, keys.WORKER_GROUP, entry_id)
                   .xdel(stream, entry_id).execute())

    def _start(self, stream: str, entry_id: str, data: bytes, reclaimed: bool = False) -> None:
        try:
            request = decode(RequestEnvelope, data)
        except EnvelopeError as exc:
            log.error("dead-lettering malformed request %s: %s", entry_id, exc)
            metrics.POISON_MESSAGES.labels(self.model).inc()
            self._spawn(self._dead_letter(stream, entry_id, data, str(exc)))
            return
        if request.request_id in self._running:
            return  # already ours: a reclaim of our own long-running entry
        task = asyncio.create_task(self.run_request(stream, entry_id, request, reclaimed), name=request.request_id)
        self._running[request.request_id] = task
        task.add_done_callback(lambda _t, rid=request.request_id: self._finished(rid))
        self._update_express()

    def _finished(self, request_id: str) -> None:
        self._running.pop(request_id, None)
        self.leases.forget(request_id)
        self.publisher.release(request_id)
        self._cancel_requested.pop(request_id, None)
        metrics.IN_FLIGHT.labels(self.model).set(self.in_flight)
        self._slot_freed.set()
        self._update_express()

    async def _dead_letter(self, stream: str, entry_id: str, data: bytes, reason: str) -> None:
        """Move a poison entry to the model's dead-letter stream, with why, and acknowledge it."""
        record = {b"entry_id": entry_id, b"reason": reason, b"bytes": len(data),
                  b"data": data[: keys.DEAD_LETTER_KEEP_BYTES], b"worker_id": self.worker_id}
        pipe = (self.batched.pipeline(transaction=False)
                .xadd(keys.dead_letter_stream(self.model), record, maxlen=keys.DEAD_LETTER_MAXLEN, approximate=True)
                .xack(stream, keys.WORKER_GROUP, entry_id)
                .xdel(stream, entry_id))
        if stream == self.stream:  # if a ticket's, its binding goes too (bindings are of the model's stream)
            pipe.hdel(keys.bound_requests(self.model), entry_id)
        with contextlib.suppress(RedisError):
            await pipe.execute()

    def _spawn(self, job) -> None:
        task = asyncio.create_task(job)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def run_request(self, stream: str, entry_id: str, request: RequestEnvelope, reclaimed: bool = False) -> None:
        REQUEST_ID.set(request.client_request_id or request.request_id)  # this task's log lines (shared.logs)
        metrics.IN_FLIGHT.labels(self.model).set(self.in_flight)
        try:
            asked = time.monotonic()
            queued = max(0.0, time.time() - request.arrival)
            lease, (stashed, streamed) = await asyncio.gather(
                self.leases.take(request.request_id),
                self.batched.pipeline(transaction=False)
                .getdel(keys.cancelled_key(request.request_id))  # a cancel stashed while queued, consumed once
                .exists(keys.streamed_key(request.request_id))
                .execute())
        except RedisError as exc:
            log.warning("could not lease request %s (%s); leaving it for a retry", request.request_id, exc)
            return
        if not lease:
            return  # its worker is alive and holds the lease (and owns any cancel that came meanwhile)
        self.leases.hold(request.request_id, asked)
        self.publisher.hold(request.request_id, lease)
        if reclaimed:
            metrics.RECLAIMED.labels(self.model).inc()
        else:
            metrics.QUEUE_TIME.labels(self.model).observe(queued)
        terminal = self._refuse_unstarted(request, stashed, bool(streamed))
        if terminal is None:
            terminal = await self._generate(request)
        if request.request_id in self.leases.lost:  # its answer is for the worker that took it over
            return
        if self._cancel_requested.get(request.request_id) == "deadline":
            _mark_deadline(terminal)
        metrics.REQUESTS.labels(self.model, terminal.finish_reason or "unknown").inc()
        terminal.timings = {**(terminal.timings or {}), "queue_s": queued, "finished_at": time.time()}
        tracing.worker_generation(request.traceparent, terminal.timings, {
            "llmfleet.model": self.model, "llmfleet.worker": self.worker_id, "llmfleet.request_id": request.request_id,
            "llmfleet.finish_reason": terminal.finish_reason,
            "llmfleet.completion_tokens": terminal.usage.completion_tokens if terminal.usage else None})
        timings = terminal.timings
        request_log.log(logging.INFO if self.log_requests else logging.DEBUG, "request %s %s", request.request_id,
                        terminal.finish_reason, extra={"fields": {
                            "request": request.request_id, "tenant": request.tenant, "model": self.model,
                            "finish_reason": terminal.finish_reason,
                            "error": terminal.error.code if terminal.error else None,
                            "prompt_tokens": terminal.usage.prompt_tokens if terminal.usage else None,
                            "completion_tokens": terminal.usage.completion_tokens if terminal.usage else None,
                            "queue_s": timings.get("queue_s"), "prefill_s": timings.get("prefill_s"),
                            "decode_s": timings.get("decode_s"), "reclaimed": reclaimed or None}})
        if terminal.usage is not None:
            metrics.GENERATED_TOKENS.labels(self.model).inc(terminal.usage.completion_tokens)
        self.completed += 1
        ack = (stream, entry_id, request.request_id)
        if request.tenant and stream == self.stream:  # perhaps a ticket's (shared.fair_queue): its binding goes too
            ack += (keys.bound_requests(self.model),)
        flushed = self.publisher.finish(request, terminal, ack)
        await asyncio.shield(flushed)

    def _refuse_unstarted(self, request: RequestEnvelope, stashed: bytes | None,
                          streamed: bool) -> GenerationChunk | None:
        """The terminal chunk of a request that must not start (cancelled, stale, half-sent)."""
        if streamed:  # a dead worker already sent part of it: running it again would repeat output
            return _error_terminal(WorkerLost("The worker generating this response stopped mid-stream; "
                                              "retry the request."))
        cause = stashed.decode() if stashed else self._cancel_requested.get(request.request_id)
        if cause is not None:
            metrics.CANCELS.labels(self.model, cause, "queued").inc()
            return _cancelled_terminal(request)
        if not isinstance(self.adapter, GenerationAdapter):
            return _error_terminal(EngineError(f"{type(self.adapter).__name__} cannot generate text"))
        if request.kind not in self.kinds:  # queued by a gateway that did not know this worker yet
            return _error_terminal(ServiceUnavailable(
                f"The worker that took this request serves only {', '.join(self.kinds)} requests of "
                f"`{self.model}`, not {request.kind}; retry the request.", code="kind_not_served"))
        waited = time.time() - request.arrival
        if request.deadline and time.time() > request.deadline:  # the client's own `timeout` ran out
            metrics.CANCELS.labels(self.model, "deadline", "queued").inc()
            terminal = _cancelled_terminal(request)
            _mark_deadline(terminal)
            return terminal
        if request.queue_deadline and time.time() > request.queue_deadline:
            metrics.QUEUE_TIMEOUTS.labels(self.model).inc()
            return _error_terminal(ServiceUnavailable(
                f"The request waited {waited:.1f}s in the queue, past its queue timeout; the fleet is "
                "overloaded, retry later.", code="queue_timeout"))
        return None

    async def _generate(self, request: RequestEnvelope) -> GenerationChunk:
        """Run the adapter, publishing deltas; return the terminal chunk (not yet published)."""
        chunks = self._observe(request, self.adapter.generate(request))
        deadline = None
        if request.deadline:
            delay = max(0.0, request.deadline - time.time())
            deadline = asyncio.get_running_loop().call_later(
                delay, lambda: self._spawn(self.cancel(request.request_id, "deadline")))
        try:
            if not request.stream:
                return await collect_candidates(chunks, request.choice_count)
            async for chunk in chunks:
                if chunk.done:
                    return chunk
                self.publisher.publish(request, chunk)
            raise EngineError("the engine ended the generation without a terminal chunk")
        except FleetError as exc:
            return _error_terminal(exc)
        except asyncio.CancelledError:
            if request.request_id in self._cancel_requested:  # forced after an ignored abort
                return _cancelled_terminal(request)
            raise
        except Exception as exc:  # an engine bug must fail this request, not the worker
            log.exception("request %s failed", request.request_id)
            self._check_engine()
            return _error_terminal(EngineError(f"generation failed: {exc}"))
        finally:
            if deadline is not None:
                deadline.cancel()
            await chunks.aclose()

    async def _observe(self, request: RequestEnvelope, chunks) -> AsyncIterator[GenerationChunk]:
        """Pass chunks through, tracking the phase and tokens a cancel would interrupt."""
        request_id = request.request_id
        state = self._progress[request_id] = _Progress()
        try:
            async for chunk in chunks:
                state.tokens += chunk.token_count
                if chunk.first_token:
                    state.first_token(chunk.first_token_at)
                    metrics.PREFILL_TIME.labels(self.model).observe(state.first_token_at - state.started)
                if chunk.done:
                    chunk.timings = state.timings(self.model)
                if request_id in self._cancel_requested and not state.reaborted:
                    # The abort may have reached the adapter before the engine knew the request.
                    state.reaborted = True
                    await self.adapter.abort(request_id)
                if chunk.done and state.tokens_at_cancel is not None:
                    self._record_abort(request, state)
                yield chunk
        finally:
            self._progress.pop(request_id, None)
            await chunks.aclose()

    def _record_abort(self, request: RequestEnvelope, state: _Progress) -> None:
        stopped = time.time()
        latency = stopped - state.cancel_sent_at
        metrics.TOKENS_AFTER_CANCEL.labels(self.model).inc(state.tokens - state.tokens_at_cancel)
        metrics.CANCEL_LATENCY.labels(self.model).observe(latency)
        log.info("aborted request %s: engine stopped at %.6f, %.1f ms after the cancel was sent, "
                 "%d tokens after it", request.request_id, stopped, latency * 1000,
                 state.tokens - state.tokens_at_cancel)

    def _lease_lost(self, request_id: str) -> None:
        self.publisher.drop(request_id)
        self._spawn(self.cancel(request_id, "lease_lost"))

    async def cancel(self, request_id: str, cause: str, sent_at: float = 0.0) -> None:
        """Abort a running request; force it if the adapter does not end it in time."""
        task = self._running.get(request_id)
        if task is None or request_id in self._cancel_requested:
            return
        self._cancel_requested[request_id] = cause
        state = self._progress.get(request_id)
        if state is not None:
            state.tokens_at_cancel = state.tokens
            state.cancel_sent_at = sent_at or time.time()
            metrics.CANCELS.labels(self.model, cause, state.phase).inc()
        await self.adapter.abort(request_id)
        done, _ = await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        if not done:
            log.warning("request %s ignored its abort; cancelling its task", request_id)
            task.cancel()

    async def _heartbeat(self) -> None:
        stashed_before: dict[str, str] = {}
        while not self._stop_loops.is_set():
            info = WorkerInfo(
                worker_id=self.worker_id, model=self.model, max_model_len=self.adapter.max_model_len,
                capacity=self.max_concurrency, in_flight=self.in_flight, engine=self.adapter.engine_name,
                started=self.started, draining=self.draining, completed=self.completed, kinds=list(self.kinds),
            )
            pipe = (self.redis.pipeline(transaction=False)
                    .set(keys.worker_key(self.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
                    .set(keys.model_key(self.model), b"1", ex=keys.MODEL_MEMORY_TTL_S)
                    .zadd(keys.affinity_streams(self.model),
                          {self.own_stream: (time.time() + keys.HEARTBEAT_TTL_S) * 1000})
                    .expire(keys.affinity_streams(self.model), keys.AFFINITY_STREAM_TTL_S)
                    .expire(self.own_stream, keys.AFFINITY_STREAM_TTL_S))
            renewals = self.leases.renew(pipe)
            sent = renewals[1]
            try:
                stashed = await self.cancels.stashed(pipe)
                self.leases.renewed(renewals)
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
                stashed = {}
            # A stash seen by two heartbeats in a row had a second for its notice to arrive: it was lost.
            self.cancels.cancel_missed({rid: cause for rid, cause in stashed.items() if rid in stashed_before})
            stashed_before = stashed
            # One beat per interval, counted from when this one was sent: a slow Redis delays the next
            # renewal by no more than it has to, so the leases do not look lost sooner than they are.
            await pause(self._stop_loops, max(0.0, keys.HEARTBEAT_INTERVAL_S - (time.monotonic() - sent)))

    async def _drain(self) -> None:
        self.draining = True
        self.publisher.give_up_after_s = DRAIN_REDIS_GRACE_S  # a drain must end even if Redis is gone
        if self._running:
            log.info("draining %d in-flight requests", len(self._running))
        while self._running:
            await asyncio.wait(list(self._running.values()), timeout=1.0)
            if self.publisher.given_up:  # their answers can reach nobody: stop generating them
                for request_id in list(self._running):
                    self._spawn(self.cancel(request_id, "shutdown"))

    async def _deregister(self) -> None:
        """Remove the heartbeat, so gateways stop counting on this worker now rather than at its TTL."""
        try:
            # Our stream is left to the others as a dead worker's: its waiting requests are theirs now.
            await within(DEREGISTER_S, self.redis.pipeline(transaction=False).delete(keys.worker_key(self.worker_id))
                         .zadd(keys.affinity_streams(self.model), {self.own_stream: 0}, xx=True).execute(),
                         "deregistering")
        except (TimeoutError, RedisError) as exc:
            log.warning("could not remove the heartbeat (%s); it expires within %ds", exc, keys.HEARTBEAT_TTL_S)


@dataclass(slots=True)
class _Progress:
    phase: str = "prefill"
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)
    first_token_at: float = 0.0  # monotonic
    first_token_wall: float = 0.0
    tokens_at_cancel: int | None = None
    cancel_sent_at: float = 0.0
    reaborted: bool = False

    def first_token(self, at: float) -> None:
        """The engine's first token came now, or at wall-clock time `at` when the adapter knows it
        came earlier (a whole response arrives as one chunk at its end)."""
        self.phase = "decode"
        wall = time.time()
        self.first_token_wall = min(at, wall) if at else wall
        self.first_token_at = time.monotonic() - (wall - self.first_token_wall)

    def timings(self, model: str) -> dict[str, float]:
        """Prefill and decode times at the end of a generation, also observed in the histograms."""
        now = time.monotonic()
        if not self.first_token_at:  # nothing generated: it all was prefill
            return {"prefill_s": now - self.started, "decode_s": 0.0}
        metrics.DECODE_TIME.labels(model).observe(now - self.first_token_at)
        return {"prefill_s": self.first_token_at - self.started, "decode_s": now - self.first_token_at,
                "first_token_at": self.first_token_wall}


def _entries(triples) -> list[tuple]:
    """A claiming script's {stream, entry id, flat fields} triples as (stream, entry id, fields)."""
    return [(stream.decode(), entry_id, dict(zip(flat[::2], flat[1::2], strict=True)))
            for stream, entry_id, flat in triples]


def _cancelled_terminal(request: RequestEnvelope) -> GenerationChunk:
    candidates = None if request.stream else [Candidate(i, finish_reason="cancelled")
                                              for i in range(request.choice_count)]
    return GenerationChunk(done=True, finish_reason="cancelled", usage=Usage(), candidates=candidates)


def _mark_deadline(terminal: GenerationChunk) -> None:
    """Say why a request was cut short: it ran out of time."""
    terminal.stop_reason = "deadline"
    for candidate in terminal.candidates or ():
        if candidate.finish_reason == "cancelled":
            candidate.stop_reason = "deadline"


def _error_terminal(error: FleetError) -> GenerationChunk:
    return GenerationChunk(done=True, finish_reason="error", error=error.to_info())
