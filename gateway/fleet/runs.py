"""Runs: requests submitted to the fleet and followed to their end; `Fleet`, the Redis side that makes them.

`Fleet` owns the process-wide pieces, built once at start: the Redis client, the `ReplyRouter`
(replies), the `WorkerRegistry`, the cancel registry, the rate limiter and the stores (API keys,
sessions, stored Responses), and the background tasks that run them. `Fleet.submit` is the one
owner of a request's registration: it admits it against its key's limits, registers it for
cancels, queues it, and on the way out, on every path, unregisters it (if it had not ended, taking
it back from the queue when no worker has claimed it, else cancelling it on its worker) and frees
its key's place in flight. `Run` is one submitted request:
an async iterator over its chunks that, if closed before the terminal chunk, tells the workers to
stop. (What the request's end means to the client, its metrics and its stored history is
gateway/serve/life.py's.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import NoReturn, Protocol

from redis.exceptions import RedisError

from gateway import metrics
from gateway.fleet.api_keys import KeyStore
from gateway.fleet.cancels import CancelRegistry, cancel_groups
from gateway.fleet.rate_limits import Grant, KeyUse, RateLimits
from gateway.fleet.registry import ModelView, WorkerRegistry
from gateway.fleet.relay import SILENCE, ReplyRouter
from gateway.fleet.replay import Diverged, Replay, Sent
from gateway.fleet.responses import ResponseStore
from gateway.fleet.sessions import SessionStore
from gateway.settings import GatewaySettings
from shared import affinity, fair_queue, keys, redis_pool, takeover
from shared.codec import encode
from shared.envelopes import (
    Candidate,
    ChunkEnvelope,
    Continuation,
    GenerationChunk,
    RequestEnvelope,
    Usage,
    WorkerInfo,
)
from shared.errors import FleetError, InvalidRequest, Overloaded, ServiceUnavailable, WorkerLost, error_from_info
from shared.redis_batch import BatchedRedis
from shared.stopping import stop_tasks, within

log = logging.getLogger(__name__)

DEADLINE_GRACE_S = 5.0  # past a request's deadline: the worker ends a generation then, and its ending may follow
PLACE_GRACE_S = 2.0  # a cancelled submit waits this long for its queueing to say where it went
REDIS_CONNECTIONS = 200  # per gateway process; the reply reader and registry hold a few of them
REDIS_POOL_WAIT_S = 5.0  # longest wait for a free connection before the request gets a 503
SILENCE_CHECK_S = 0.5  # how often a silent request checks its deadline and that its worker still lives
QUEUE_ALARM_LAG_S = 0.005  # a timer may fire a little before its time: the queue deadline has passed by then
# How long a stream that a takeover replays or continues waits, once its worker is seen dead, for
# another worker to take it over: the lease lapses (LEASE_TTL_S), the entry has been claimed for a
# worker's --claim-idle (3 s) and a reclaim turn comes (half that), then the takeover's first chunk.
TAKEOVER_WAIT_S = 10.0
SUSPECT_AFTER_S = 0.5  # a streaming worker silent this long has its presence channel looked at
# A stop takes at most STOP_GRACE_S + 2 * STOP_CANCEL_S + REDIS_CLOSE_S, whatever Redis does.
STOP_GRACE_S = 2.0  # the cancels and unregistering of the last runs may take this long
STOP_CANCEL_S = 2.0  # then what still runs is cancelled, and left behind after this
REDIS_CLOSE_S = 2.0


@dataclass(slots=True, frozen=True)
class Placement:
    """Where a queued request waits for a worker, as `fair_queue.WITHDRAW` takes it back."""

    keys: list[str]
    args: list


class Run:
    """One request in flight, owned by `Fleet.submit`: iterate `chunks()` once. `close(reason)`
    says the caller is done with it (the reason is the cancel's cause if it has not ended); the
    owner does the rest when its `async with` ends, or earlier when asked (`Fleet.end`)."""

    def __init__(self, envelope: RequestEnvelope, replies: asyncio.Queue[ChunkEnvelope | None],
                 registry: WorkerRegistry,
                 ready_takeover: Callable[[Run, Continuation | None, bool], object] | None = None):
        self.envelope = envelope
        self.request_id = envelope.request_id
        self._replies = replies
        self._registry = registry
        self.finished = False
        self.closed = False
        self.closed_at = 0.0
        self.cancel_reason: str | None = None  # set by `close` if the run had not ended
        self.grant: Grant | None = None  # its API key's limits and usage (gateway/fleet/rate_limits.py), if any
        self.ending: asyncio.Future | None = None  # the unregistering, once the owner began it
        self.unreachable = False  # Redis failed while registering it: nothing to unregister
        self.unregistered = False  # its worker removed its registration (`ChunkEnvelope.unregistered`)
        self.worker_id = ""
        self.placing = False  # handed to the queue (queued, or maybe: see placement)
        self.placement: Placement | None = None  # where it was queued, once it surely was
        self._queue_alarm: asyncio.TimerHandle | None = None
        self._next_seq = 0
        self._relayed = False  # a worker has sent some of its output (not only that it started it)
        self._lease = 0  # the newest lease of the request heard from (`ChunkEnvelope.lease`)
        self._heard_at = 0.0  # when (monotonic) its worker last sent something
        # A stream a takeover replays or continues: what it sent, to join the replay to, or to continue from.
        self._sent = Sent(envelope.choice_count) if envelope.replays_exactly or envelope.continues else None
        self._ready_takeover = ready_takeover
        self.entry: tuple[str, str] | None = None  # where its request's entry is pending (stream, id), once told
        self._continued_from: Continuation | None = None  # what it saved for a takeover to continue from
        self._replay: Replay | None = None
        self._lost_at = 0.0  # when (monotonic) its streaming worker was seen dead; 0: it was not
        self._paused_at = 0.0  # when (monotonic) a stream taken over last heard from its old worker, until it goes on
        # Takeovers of a stream that had reached its client, and the pauses they added, for the request's
        # timings (`_whole_timings`); and its first worker's prefill and first token (its first delta's timings).
        self.migrations = 0
        self.migration_s = 0.0
        self._migrated_at = 0.0  # wall clock: when its first takeover's pause began
        self._first_timings: dict[str, float] | None = None
        self._worker_gone = False  # its worker said it handed the stream over (`GenerationChunk.handed_over`)

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """Every chunk of the request, in order, ending with its terminal chunk.

        Coalesced under backlog only: while more of the request's replies are already waiting here
        (the client's relay fell behind its worker), neighbouring deltas are merged into one, as the
        worker's publisher merges what queued behind its last write. Nothing is held back to wait
        for more: a delta goes out as soon as nothing else of the request is waiting."""
        # The worker ends a generation at its deadline; the grace lets that ending arrive first.
        deadline = self.envelope.deadline + DEADLINE_GRACE_S
        held: GenerationChunk | None = None  # a delta that the next one, already waiting, may join
        while not self.finished:
            if held is not None and self._replies.empty():
                yield held
                held = None
            envelope = await self._replies.get()
            if envelope is None:  # a silence of up to SILENCE_CHECK_S (ReplyRouter.watch_silence)
                self._check_alive(deadline)
                continue
            if envelope.lease and envelope.lease < self._lease:  # from a worker that lost the request
                metrics.STALE_REPLIES.inc()
                continue
            previous, self.worker_id = self.worker_id, envelope.worker_id
            last_heard, self._heard_at = self._heard_at, time.monotonic()
            self._lost_at = 0.0
            self._worker_gone = False
            if envelope.stream:  # a worker's first write for it: where its entry is pending
                self.entry = envelope.stream, envelope.entry_id
            if envelope.seq >= 0:  # -1: an ending the gateway made itself
                if envelope.lease > self._lease or envelope.seq != self._next_seq:
                    if held is not None:  # what came before the break still reaches the client
                        yield held
                        held = None
                if envelope.lease > self._lease:
                    self._follow_lease(envelope.lease, previous, last_heard)
                if envelope.seq != self._next_seq:
                    self.close(reason="lost_chunks")
                    raise ServiceUnavailable("Part of the response was lost in transit (the queue restarted); "
                                             "retry the request.")
                if envelope.chunks:  # none: its worker's note that it has started it
                    self._next_seq += 1
                    self._relayed = True
            for chunk in envelope.chunks:
                if chunk.handed_over:  # its draining worker gave it up: another continues it
                    self._worker_gone = True
                    self._registry.note_draining(self.worker_id)
                    if not self._awaiting_takeover():
                        self._lost()
                    continue
                if self._replay is not None and (chunk := self._joined(chunk)) is None:
                    continue
                if self._paused_at:  # the first new output of a takeover
                    pause = time.monotonic() - self._paused_at
                    metrics.MIGRATION_PAUSE.labels(self.envelope.model).observe(pause)
                    self.migration_s += pause
                    self._paused_at = 0.0
                if chunk.first_token and chunk.timings and self._first_timings is None:
                    self._first_timings = chunk.timings
                if chunk.done and self.migrations:
                    chunk.timings = self._whole_timings(chunk.timings)
                if self._sent is not None:
                    self._sent.add(chunk)
                if chunk.done:
                    self.finished = True
                    self.unregistered = envelope.unregistered
                if self.grant is not None:
                    self.grant.count(chunk)
                if held is not None:
                    if held.can_absorb(chunk):
                        held.absorb(chunk)
                        continue
                    yield held
                    held = None
                if chunk.is_delta_only:
                    held = chunk
                else:
                    yield chunk
        if held is not None:
            yield held

    def wake_at_queue_deadline(self) -> None:
        """Have the run look around at its queue deadline (a silence, as the router's periodic one),
        so a request no worker can take gets its 503 then, not at a later silence check."""
        if self.envelope.queue_deadline > 0 and not self.closed:
            delay = max(0.0, self.envelope.queue_deadline - time.time()) + QUEUE_ALARM_LAG_S
            self._queue_alarm = asyncio.get_running_loop().call_later(delay, self._replies.put_nowait, SILENCE)

    def _follow_lease(self, lease: int, previous_worker: str, last_heard: float) -> None:
        """Follow the worker holding the newest lease. One that took the request over starts it
        anew: if an earlier worker's output already reached the client, the response goes on only
        where the takeover replays it exactly, joined where it stood, or continues it from there
        (gateway/fleet/replay.py)."""
        if self._next_seq > 0:
            if self._sent is None:
                self._lost()
            saved, self._continued_from = self._continued_from, None
            if saved is None and self.envelope.continues:
                # Taken over before this gateway saw its worker go: a lease that lapsed while its worker
                # lived (Redis stalled, or out of its reach). Its taker waits for what the client was
                # sent, which is final now: the old lease's replies are dropped from here on.
                saved = self._takeover_state()
                if saved is None or self._ready_takeover is None:
                    self._lost()
                self._ready_takeover(self, saved, True)
            if (saved is not None and saved.replay) or (self.envelope.replays_exactly and not self.envelope.continues):
                self._replay = Replay(self._sent)
            elif saved is None or saved != self._sent.continuation():
                # Not a continuation of what the client has: nothing was saved for it, or more was
                # relayed since (from the earlier worker, before it learned of its lost lease).
                self._lost()
            self._next_seq = 0
            cause = "drain" if self._registry.was_draining(previous_worker) else "worker_lost"
            metrics.MIGRATIONS.labels(self.envelope.model, cause).inc()
            self._paused_at = last_heard
            self.migrations += 1
            self._migrated_at = self._migrated_at or time.time() - (time.monotonic() - last_heard)
        self._lease = lease

    def _whole_timings(self, last: dict[str, float] | None) -> dict[str, float]:
        """The stage times of a stream taken over, as one request's: its queue, prefill and first
        token from its first worker (its first delta's timings; the queue is the time to that
        worker's start, on the same two clocks as the time to first token), the pauses its takeovers
        added (`migration_s`, from `migrated_at`), and the decode, the rest up to the end its last
        worker gives (`finished_at`)."""
        timings = dict(last or {})
        first = self._first_timings or {}
        if (first_token_at := first.get("first_token_at")) is not None:
            prefill = first.get("prefill_s", 0.0)
            timings.update(first_token_at=first_token_at, prefill_s=prefill,
                           queue_s=max(0.0, first_token_at - prefill - self.envelope.arrival))
            if (finished_at := timings.get("finished_at")) is not None:
                timings["decode_s"] = max(0.0, finished_at - first_token_at - self.migration_s)
        timings.update(migration_s=self.migration_s, migrations=self.migrations, migrated_at=self._migrated_at)
        return timings

    def _lost(self) -> NoReturn:
        """End the response: its worker stopped mid-stream, and no takeover can go on from there."""
        self.close(reason="worker_lost")
        raise WorkerLost("The worker generating this response stopped mid-stream; retry the request.")

    def _joined(self, chunk: GenerationChunk) -> GenerationChunk | None:
        """A takeover's chunk, less what the client already has (None: all of it)."""
        try:
            chunk = self._replay.take(chunk)
        except Diverged as exc:
            log.warning("request %s: its takeover's replay differs from what was sent (%s)", self.request_id, exc)
            self.close(reason="worker_lost")
            raise WorkerLost("The worker generating this response stopped mid-stream, and the worker that took it "
                             "over did not answer the same; retry the request.") from exc
        if self._replay.done:
            self._replay = None
        return chunk

    def _check_alive(self, deadline: float) -> None:
        """After a silence: raise if the deadline passed, the streaming worker is gone, or the
        request outwaited its queue timeout with no worker of its model alive to take it."""
        if time.time() >= deadline:
            self.close(reason="deadline")
            raise ServiceUnavailable("The request timed out before the model answered.", code="request_timeout")
        if self.worker_id and not self._relayed:
            # Nothing relayed yet (a non-streaming request, or a stream before its first chunk): any
            # worker can run it anew. One found gone has it handed to another at once; otherwise
            # it waits, as a queued request does, for its lease to lapse and a worker to reclaim it.
            if not self._lost_at and self._found_gone() and self._ready_takeover is not None:
                self._lost_at = time.monotonic()
                self._ready_takeover(self, None, False)
        elif self.worker_id and (self._worker_gone or not self._worker_alive()):
            if self._sent is not None and self._awaiting_takeover():
                return
            self.close(reason="worker_lost")
            raise WorkerLost("The worker generating this response stopped; retry the request.")
        if self._unclaimed_past_queue_deadline():
            self.close(reason="queue_timeout")
            raise ServiceUnavailable(f"No worker is serving the model `{self.envelope.model}` right now: the "
                                     "request waited for one until its queue timeout.", code="queue_timeout")

    def _awaiting_takeover(self) -> bool:
        """A stream that a takeover replays or continues waits up to TAKEOVER_WAIT_S for a worker to
        take it over, while one of its model lives to do so; one to be continued first saves what
        its client was sent, for that worker (a greedy one that cannot be continued from its tokens,
        that it is to be replayed)."""
        now = time.monotonic()
        if not self._registry.takes_work(self.envelope.model):
            return False
        if not self._lost_at:
            state = None
            if self.envelope.continues:
                state = self._takeover_state()
                if state is None or self._ready_takeover is None:
                    return False
                self._continued_from = state
            if self._ready_takeover is not None:
                self._ready_takeover(self, state, False)
            self._lost_at = now
        return now - self._lost_at < TAKEOVER_WAIT_S

    def _takeover_state(self) -> Continuation | None:
        """What a takeover of this stream, which continues, goes on from: what its client was sent (a
        greedy one that cannot be continued from its tokens is replayed; None: it cannot go on)."""
        state = self._sent.continuation()
        if self.envelope.replays_exactly and (state is None or not state.from_tokens):
            state = Continuation(choices=[], tokens=0, prompt_tokens=0, replay=True)
        return state

    def _worker_alive(self) -> bool:
        """Its worker's heartbeat is live, or the worker spoke within a heartbeat's TTL: a worker
        that is sending the request's chunks lives, even when its heartbeat key is missing for a
        moment (lost with a Redis failover or restart, until its next beat writes it again). A
        worker silent for SUSPECT_AFTER_S has its presence channel looked at: one with nobody left
        there is dead, heartbeat or not (gateway/fleet/registry.py)."""
        if self._found_gone():
            return False
        return self._registry.is_live(self.worker_id) or time.monotonic() - self._heard_at < keys.HEARTBEAT_TTL_S

    def _found_gone(self) -> bool:
        """Whether its worker, silent for SUSPECT_AFTER_S, was found gone by its presence channel
        (asked for, if not yet)."""
        if time.monotonic() - self._heard_at < SUSPECT_AFTER_S:
            return False
        if self._registry.found_gone(self.worker_id):
            return True
        self._registry.suspect(self.worker_id)
        return False

    def _unclaimed_past_queue_deadline(self) -> bool:
        """Nothing came back by the queue deadline and no worker of the model is alive (checked at
        the deadline itself, `wake_at_queue_deadline`). With a live worker the gateway waits: the
        worker that claims the request ends it itself if it is stale, and one that has started it
        may be in a long prefill."""
        queue_deadline = self.envelope.queue_deadline
        return (not self.worker_id and queue_deadline > 0 and time.time() >= queue_deadline
                and not self._registry.serves(self.envelope.model))

    async def first_or_error(self) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        """Wait for the first chunk; raise the worker's error if the request failed at once."""
        stream = self.chunks()
        first = await anext(stream)
        if first.done and first.error is not None:
            raise error_from_info(first.error)
        return first, stream

    def close(self, reason: str = "disconnect") -> None:
        """Stop following the request; if it has not ended, `reason` is the cause of its cancel."""
        if self.closed:
            return
        self.closed = True
        self.cancel_reason = None if self.finished else reason
        self.finished = True
        self.closed_at = time.time()
        if self._queue_alarm is not None:
            self._queue_alarm.cancel()


class Detached(Protocol):
    """A run no client holds (gateway/serve/resumable.py), owned by its task."""

    task: asyncio.Task | None


class Fleet:
    def __init__(self, settings: GatewaySettings):
        self.settings = settings
        self.redis = redis_pool.connect(settings.redis_url, max_connections=REDIS_CONNECTIONS,
                                        wait_s=REDIS_POOL_WAIT_S, client_name=f"gateway-{settings.gateway_id}")
        self.router = ReplyRouter(self.redis, settings.gateway_id, settings.max_buffered_chunks,
                                  on_overflow=self._cancel_slow_client)
        # Per-request commands share pipelines; the router's blocking read keeps its own connection.
        # A finished run's unregistering is on its way to Redis before its client can read the end
        # of the answer (`end`, gateway/serve/life.py), so a cancel sent right after it finds nothing.
        self.batched = BatchedRedis(self.redis)
        # The registry's reads, twice a second, join them on one server (a cluster's client scans
        # every node itself): most of an idle gateway's CPU went to redis-py's layers around them.
        self.registry = WorkerRegistry(self.batched if redis_pool.pipelines_run_in_order(self.redis) else self.redis,
                                       settings.models)
        self.registry.on_gone = self.router.wake_silent  # its runs see their worker gone at once
        self.registry.linked_since = lambda: self.router.connected_at
        self.cancels = CancelRegistry(self.batched)
        self.limits = RateLimits(self.batched, settings.rate_window_s)
        self.keys = KeyStore(self.batched)
        self.sessions = SessionStore(self.redis, settings)
        self.responses = ResponseStore(self.redis, int(settings.response_store_ttl_s),
                                       settings.response_store_max_bytes, settings.response_store_max_entries)
        self._enqueue_script = self.batched.register_script(fair_queue.ENQUEUE)
        self._withdraw_script = self.batched.register_script(fair_queue.WITHDRAW)
        self._route_script = self.batched.register_script(affinity.ROUTE)
        self._release_lease = self.batched.register_script(keys.RELEASE_LEASE)
        self.draining = False
        self._loops: list[asyncio.Task] = []
        self._tasks: set[asyncio.Task] = set()  # one-off jobs: the unregistering of runs, cancels
        self.detached: dict[str, Detached] = {}  # runs no client holds, by response id

    async def start(self) -> None:
        self._loops = [asyncio.create_task(job, name=job.__qualname__) for job in (
            self.batched.run(), self.router.run(), self.router.watch_silence(SILENCE_CHECK_S),
            self.router.keep_alive(), self.router.hold_presence(), self.registry.run(), self.limits.run())]

    async def stop(self) -> None:
        """Let the last runs' cancels and unregistering finish, stop the loops, close the pool: each
        step bounded, so a slow or vanished Redis delays a shutdown by seconds, never for ever."""
        # Detached runs first: ending one closes its run, which adds to the unregistering.
        await stop_tasks([run.task for run in self.detached.values()], grace_s=STOP_GRACE_S, cancel_s=STOP_CANCEL_S,
                         what="detached runs")
        await stop_tasks(self._tasks, grace_s=STOP_GRACE_S, cancel_s=STOP_CANCEL_S, what="unregistering runs")
        # Nothing the loops would still do matters now: cancel them at once. Their stop events end them
        # at their next turn should a cancel be lost (shared.stopping).
        self.router.stop()
        self.registry.stop()
        self.limits.stop()
        self.batched.stop()
        await stop_tasks(self._loops, grace_s=0, cancel_s=STOP_CANCEL_S, what="gateway loops")
        try:
            await within(REDIS_CLOSE_S, self.redis.aclose(), "closing the gateway's Redis pool")
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("closing the Redis pool failed: %s", exc)

    def spawn(self, job) -> asyncio.Task:
        """Run `job` in the background; `stop` waits for it (bounded)."""
        task = asyncio.create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def ready(self) -> bool:
        """Ready while Redis answers and this gateway's reply stream is being read: until the
        router has (re)made its stream after a Redis restart, a request would get a 503."""
        if self.draining or not self.router.connected.is_set():
            return False
        try:
            return bool(await self.redis.ping())
        except (RedisError, OSError):
            return False

    @asynccontextmanager
    async def submit(self, envelope: RequestEnvelope, key: KeyUse | None = None) -> AsyncIterator[Run]:
        """The one owner of a request's registration here: `async with fleet.submit(envelope) as run:`
        admits it against its key's limits, opens its reply route, registers it and queues it for
        its model's workers; on the way out, on every path (an error, a cancel at any await, a
        client gone), it closes the route and unregisters it, if it had not ended taking it back
        from the queue first, or cancelling it on its worker once one has claimed it."""
        self.check_open(envelope)
        grant = await self.limits.admit(envelope, key)  # its key's limits (404, 429), before anything is registered
        envelope.reply_to = self.router.stream
        envelope.gateway_presence = envelope.reply_channel = self.router.presence
        run = Run(envelope, self.router.open(envelope.request_id), self.registry, self._ready_takeover)
        run.grant = grant  # released by the run's ending, on every path
        try:
            await self._queue(run)
            run.wake_at_queue_deadline()
            yield run
        finally:
            run.close()
            self.end(run)

    def check_open(self, envelope: RequestEnvelope) -> None:
        """Refuse a request this gateway cannot take now: draining, a kind its model does not serve, no queue, full."""
        if self.draining:
            raise ServiceUnavailable("This gateway is shutting down; retry on another replica.")
        self.registry.check_kind(envelope.model, envelope.kind)
        if not self.router.connected.is_set():  # replies would have nowhere to land
            raise ServiceUnavailable("The request queue is unreachable; try again shortly.")
        if self.router.open_requests >= self.settings.max_open_requests:
            raise Overloaded(f"This gateway is following its maximum of {self.settings.max_open_requests} "
                             "requests; retry shortly.", retry_after=1)

    async def _queue(self, run: Run) -> None:
        """Register the run and queue its request. A run that surely was not queued (the queue
        was full) is marked finished, so that its ending does not send a needless cancel; a cancel
        in the middle leaves it unfinished: it may have been queued, and its ending cancels it."""
        envelope = run.envelope
        groups = cancel_groups(envelope)
        try:
            if groups:  # a cancel of its cancel_id or session may have come first
                if await self.cancels.register(envelope.request_id, envelope.tenant, groups, self._ttl(envelope)):
                    run._replies.put_nowait(ChunkEnvelope(envelope.request_id, 0, [_cancelled_before_start(envelope)]))
                    return
                await self._place(run)
            else:  # nothing can have cancelled it: register and queue in the same batch, one round trip
                registering = self.cancels.record(envelope.request_id, envelope.tenant, self._ttl(envelope))
                try:
                    await self._place(run)
                finally:
                    await registering
        except (RedisError, OSError) as exc:
            run.finished = run.unreachable = True  # nothing to unregister: its keys expire on their own
            raise ServiceUnavailable("The request queue is unreachable; try again shortly.") from exc
        except FleetError:  # the queue was full, or the envelope could not be encoded: not queued
            run.finished = True
            raise
        metrics.SUBMITTED.labels(envelope.model).inc()

    def end(self, run: Run) -> asyncio.Future:
        """Close the run's route and unregister it (cancelling it first if it had not ended), in
        the background, since callers are often being cancelled themselves. Once per run: the
        future is the same whoever asks (the owner's exit, or the request's end). A run that has
        ended has its unregistering queued at this call (`BatchedRedis.now`): a cancel of it, or
        its key's next request, that this gateway sends after it reaches Redis after it, so the
        client need not wait for Redis's replies to read the end of its answer. A run with nothing
        left to send (its worker unregistered it, no group, no key) starts no task."""
        if run.ending is None:
            run.close()
            self.router.close(run.request_id)
            if run.cancel_reason is not None:
                run.ending = self.spawn(self._unregister(run))
            elif (finishing := self._finishing(run)) is not None:
                run.ending = self.spawn(finishing)
            else:
                run.ending = asyncio.get_running_loop().create_future()
                run.ending.set_result(None)
        return run.ending

    def _ready_takeover(self, run: Run, state: Continuation | None, taken: bool) -> None:
        """Ready a stream whose worker is gone for another worker to take over: keep what its client
        was sent (`state`, for a continuation), take the gone worker's lease back, then name the
        request's entry on the model's takeover doorbell, where a worker with room claims it at once
        (worker/consumer.py) instead of at its next sweep. `taken`: a worker has it already, and
        waits for `state` alone."""
        request_id, worker_id, entry, model = run.request_id, run.worker_id, run.entry, run.envelope.model

        async def ready() -> None:
            try:
                saved = [self.batched.set(keys.continuation_key(request_id), encode(state),
                                          ex=keys.CONTINUATION_TTL_S)] if state is not None else []
                if taken:
                    await asyncio.gather(*saved)
                    return
                await asyncio.gather(*saved, self._release_lease(keys=[keys.lease_key(request_id)], args=[worker_id]))
                if entry is not None:
                    await takeover.ring(self.batched, model, [entry])
            except (RedisError, OSError) as exc:  # the workers' sweep takes it over once its lease lapses
                log.warning("request %s: could not ready its takeover: %s", request_id, exc)

        self.spawn(ready())

    def _cancel_slow_client(self, request_id: str) -> None:
        metrics.SLOW_CLIENTS.inc()
        self.spawn(self.cancels.cancel_requests([request_id], "slow_client"))

    def _enqueue(self, envelope: RequestEnvelope) -> Awaitable[Placement]:
        """Queue the request unless its model's queue is full (the check and the add are one script):
        in its preferred worker's stream if it has an affinity key and that worker room
        (`shared.affinity`), else in the model's stream, a tenant's request with fair share on as a
        ticket, its envelope in the tenant's queue (`shared.fair_queue`). Awaited: where it waits.

        The script is queued at this call (`BatchedRedis.call_now`), not when awaited, so it goes in
        the batch of what was queued just before (the run's registering): one round trip, where a
        task started to queue it would run only after that batch was sent."""
        # The stream holds every unanswered request: those the workers' slots can run, then the queue.
        view = self.registry.models.get(envelope.model)
        depth_limit = self.settings.max_queue + _slots(view)
        try:
            data = encode(envelope)
        except OverflowError as exc:  # JSON allows any integer, msgpack none beyond 64 bits
            raise InvalidRequest("The request holds an integer outside the 64-bit range, which cannot be "
                                 "served.") from exc
        if candidates := self._preferred_workers(envelope, view):
            routing = self.batched.call_now(self._route_script, affinity.route_keys(
                envelope.model, [keys.worker_stream(envelope.model, w.worker_id) for w in candidates]),
                affinity.route_args(depth_limit, data, int(time.time() * 1000),
                                    [affinity.waiting_allowance(w.capacity) for w in candidates]))
            return self._routed(envelope, view, depth_limit, data, candidates, routing)
        return self._into_stream(envelope, view, depth_limit, data)

    async def _routed(self, envelope: RequestEnvelope, view: ModelView | None, depth_limit: int, data: bytes,
                      candidates: list[WorkerInfo], routing: Awaitable) -> Placement:
        chosen, depth, *entry = await routing
        if chosen < 0:
            self._overloaded(envelope.model, view, depth - _slots(view))
        metrics.AFFINITY.labels(envelope.model, ("shared", "preferred", "spilled")[min(chosen, 2)]).inc()
        if chosen > 0:
            stream = keys.worker_stream(envelope.model, candidates[chosen - 1].worker_id)
            return Placement(fair_queue.withdraw_keys(stream), fair_queue.withdraw_args(_text(entry[0])))
        return await self._into_stream(envelope, view, depth_limit, data)

    def _into_stream(self, envelope: RequestEnvelope, view: ModelView | None, depth_limit: int,
                     data: bytes) -> Awaitable[Placement]:
        """Queue the request in its model's stream (its script queued at this call)."""
        tenant = envelope.tenant if self.settings.fair_share else ""
        queueing = self.batched.call_now(self._enqueue_script, fair_queue.enqueue_keys(envelope.model, tenant,
                                                                                       envelope.priority),
                                         fair_queue.enqueue_args(depth_limit, data, bool(tenant)))
        return self._queued(envelope, view, tenant, data, queueing)

    async def _queued(self, envelope: RequestEnvelope, view: ModelView | None, tenant: str, data: bytes,
                      queueing: Awaitable) -> Placement:
        accepted, depth, *entry = await queueing
        if not accepted:
            self._overloaded(envelope.model, view, depth - _slots(view))
        return Placement(fair_queue.withdraw_keys(keys.request_stream(envelope.model), envelope.model, tenant,
                                                  envelope.priority),
                         fair_queue.withdraw_args(_text(entry[0]), data if tenant else None))

    def _preferred_workers(self, envelope: RequestEnvelope, view: ModelView | None) -> list[WorkerInfo]:
        """The workers a request with an affinity key prefers, best first (none: no key, or affinity off)."""
        if not self.settings.affinity or view is None:
            return []
        workers = [w for w in view.workers if not w.draining and envelope.kind in w.kinds]
        if len(workers) < 2 or (key := affinity.key_of(envelope)) is None:  # one worker has every cache
            return []
        return affinity.ranked(key, workers)[: affinity.CANDIDATES]

    @staticmethod
    def _overloaded(model: str, view: ModelView | None, backlog: int) -> NoReturn:
        backlog = max(1, backlog)
        rate = view.drain_rate if view else 0.0
        retry_after = min(60.0, backlog / rate) if rate > 0 else 5.0
        metrics.OVERLOADED.labels(model).inc()
        raise Overloaded(f"The queue for `{model}` is full ({backlog} requests waiting); retry "
                         f"in about {retry_after:.0f}s.", retry_after=retry_after)

    @staticmethod
    def _ttl(envelope: RequestEnvelope) -> int:
        return max(1, math.ceil(envelope.deadline - time.time())) + 5

    async def _place(self, run: Run) -> None:
        """Queue the run's request and record where. A cancel in the middle (its client gone) still
        waits for the one round trip (up to PLACE_GRACE_S) to say where it went, so that the run's
        end can take it back."""
        run.placing = True
        enqueue = asyncio.ensure_future(self._enqueue(run.envelope))
        try:
            run.placement = await asyncio.shield(enqueue)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                run.placement = await asyncio.wait_for(enqueue, PLACE_GRACE_S)
            raise

    async def _unregister(self, run: Run) -> None:
        """Cancel a run that had not ended, then unregister it."""
        try:
            if not await self._withdraw(run):  # a worker may have it: it drops or stops it
                await self.cancels.cancel_requests([run.request_id], run.cancel_reason, run.closed_at)
            metrics.CANCELS.labels(run.cancel_reason).inc()
        except (RedisError, OSError) as exc:
            log.warning("cancelling request %s failed: %s", run.request_id, exc)
        if (finishing := self._finishing(run)) is not None:
            await finishing

    def _finishing(self, run: Run) -> Awaitable[None] | None:
        """Unregister an ended run and free its key's place, the commands queued at this call; what
        waits for Redis's replies, or None where there is nothing to send."""
        finishing = None if run.unreachable else self.cancels.finish(run.request_id, cancel_groups(run.envelope),
                                                                      self._ttl(run.envelope), not run.unregistered)
        if finishing is None and run.grant is None:
            return None
        return self._finished(run, finishing, None if run.grant is None else self.limits.release(run.grant))

    @staticmethod
    async def _finished(run: Run, finishing: Awaitable | None, releasing: Awaitable[None] | None) -> None:
        try:
            if finishing is not None:
                await finishing
        except (RedisError, OSError) as exc:
            log.warning("unregistering request %s failed: %s", run.request_id, exc)
        if releasing is not None:
            await releasing

    async def _withdraw(self, run: Run) -> bool:
        """Take an unended request back from the queue if no worker has claimed it (one script), so
        the model's backlog, which KEDA scales workers on, counts only requests a client waits for.
        True also for a request never handed to the queue (its submit cancelled before): nothing to
        take back or cancel. False: a worker has it (or may: nothing says where it was queued)."""
        if not run.placing:
            return True
        if run.placement is None or run.worker_id:
            return False
        return bool(await self._withdraw_script(keys=run.placement.keys, args=run.placement.args))


def _slots(view: ModelView | None) -> int:
    """How many requests the model's workers can run at once (those in its stream beyond wait)."""
    return view.capacity if view else 0


def _text(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def _cancelled_before_start(envelope: RequestEnvelope) -> GenerationChunk:
    return GenerationChunk(done=True, finish_reason="cancelled", usage=Usage(),
                           candidates=None if envelope.stream else
                           [Candidate(i, finish_reason="cancelled") for i in range(envelope.choice_count)])
