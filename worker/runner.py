"""Running one claimed request through the engine, from its lease to its terminal chunk.

Each request runs as a task of its own (`Runner.start`). It takes the request's lease and the
cancel stashed for it while it waited (an encoding is with its engine meanwhile: `_encode_early`;
nothing is published before the lease is held), refuses it unstarted when it must not run (cancelled,
past its deadline or queue timeout, half-sent by a worker that died, unless it replays exactly
or is continued from what its client was sent: see gateway/fleet/replay.py and
`--migration-limit`), and otherwise dispatches
on what the engine is: a generation (`GenerationAdapter`: chat, completion), an encoder
(`EncoderAdapter`: embed, score, rerank, classify, pooling) or a tokenizer (`TokenizerAdapter`:
tokenize, detokenize). A request of a kind this worker's engine is not, or that `--kinds` leaves
out, is answered with a clear error. Deltas go to the publisher as they come; the terminal chunk
goes out with the acknowledgement of the request's entry.

Cancels reach a running request as `cancel(request_id, cause)`: the adapter aborts a generation,
and one that ignores its abort for ABORT_GRACE_S has its task cancelled; an encoding (one answer,
nothing of it to keep) has its task cancelled at once. A request whose lease may have lapsed
(`lease_lost`) is aborted too, and nothing more is published for it, neither chunks nor ending
nor acknowledgement: the worker that takes it over answers it. A draining worker gives up the
leases of what another can take over at its deadline (`hand_over`) the same way.

Invariant: the terminal chunk is the last thing published for a request, exactly once, unless the
lease was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
from redis.exceptions import RedisError

from shared import keys, takeover, tracing
from shared.codec import MAX_ENVELOPE_BYTES, decode
from shared.envelopes import Candidate, Continuation, GenerationChunk, RequestEnvelope, Usage
from shared.errors import EngineError, EnvelopeError, FleetError, InvalidRequest, ServiceUnavailable, WorkerLost
from shared.logs import REQUEST_ID
from shared.redis_batch import BatchedRedis
from worker import metrics
from worker.adapters.aggregate import collect_candidates
from worker.adapters.base import (
    ENCODER_KINDS,
    GENERATION_KINDS,
    TOKENIZER_KINDS,
    Adapter,
    EncoderAdapter,
    GenerationAdapter,
    TokenizerAdapter,
)
from worker.continuing import continuing, stopped_across_the_break
from worker.leases import Leases
from worker.publisher import ReplyPublisher

log = logging.getLogger(__name__)
request_log = logging.getLogger("llmfleet.requests")

ABORT_GRACE_S = 2.0  # how long an aborted generation may take to yield its terminal chunk
MAX_ANSWER_BYTES = MAX_ENVELOPE_BYTES - 64 * 1024  # an encoder's vectors, with room for the rest of its reply
# A stream taken over to be continued waits this long for its gateway to say what its client was
# sent (the gateway sees the worker dead about when its lease lapses: keys.HEARTBEAT_TTL_S).
CONTINUATION_WAIT_S = 10.0
CONTINUATION_POLL_S = 0.1
HAND_OVER_NOTICE_S = 2.0  # a draining worker's wait for its hand-over notices to reach Redis
# A generation that has sent nothing this long (a non-streaming one, or a stream in a long prefill
# or behind a full engine) tells its gateway it runs here (`ReplyPublisher.started`), so that the
# gateway can hand it to another worker at once if this one dies. Sooner, most have answered.
STARTED_NOTE_AFTER_S = 0.25


class Runner:
    """The requests running on this worker, each in a task of its own."""

    def __init__(self, adapter: Adapter, model: str, worker_id: str, kinds: tuple[str, ...], batched: BatchedRedis,
                 publisher: ReplyPublisher, leases: Leases, *, log_requests: bool = False, migration_limit: int = 3,
                 on_engine_failure: Callable[[], None] = lambda: None):
        self.adapter = adapter
        self.model = model
        self.worker_id = worker_id
        self.kinds = kinds  # the kinds this worker answers (`--kinds`, or all its engine's)
        self.batched = batched
        self._release_lease = batched.register_script(keys.RELEASE_LEASE)
        self.publisher = publisher
        self.leases = leases
        self.log_requests = log_requests  # one info line per request at its end (`--enable-log-requests`)
        self.migration_limit = migration_limit  # replays of one stream that a dead worker had begun
        self.on_engine_failure = on_engine_failure  # the engine raised: the worker checks whether it died
        self.running: dict[str, asyncio.Task] = {}
        self.requests: dict[str, RequestEnvelope] = {}  # the running requests (the keys of `running`)
        self.cancel_requested: dict[str, str] = {}  # request id -> cause
        self.completed = 0  # requests answered since the worker started
        self.on_finished: Callable[[], None] = lambda: None  # a slot is free: the consumer may claim
        self._progress: dict[str, _Progress] = {}
        self._parts: dict[str, list[str]] = {}  # request id -> its engine requests, where it has several
        self._encoding: set[str] = set()  # requests in their encoder's hands (a cancel cancels their task)
        self._background: set[asyncio.Task] = set()
        metrics.start_series(model, kinds)

    @property
    def in_flight(self) -> int:
        return len(self.running)

    def start(self, stream: str, entry_id: str, request: RequestEnvelope, reclaimed: bool = False) -> None:
        """Run a claimed request in a task of its own (not twice: a reclaim of one running here is ignored)."""
        if request.request_id in self.running:
            return
        task = asyncio.create_task(self._run(stream, entry_id, request, reclaimed), name=request.request_id)
        self.running[request.request_id] = task
        self.requests[request.request_id] = request
        task.add_done_callback(lambda _t, rid=request.request_id: self._finished(rid))

    def spawn(self, job) -> None:
        """Run `job` in the background, kept until it ends."""
        task = asyncio.create_task(job)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _finished(self, request_id: str) -> None:
        self.running.pop(request_id, None)
        self.requests.pop(request_id, None)
        self.leases.forget(request_id)
        self.publisher.release(request_id)
        self.cancel_requested.pop(request_id, None)
        metrics.IN_FLIGHT.labels(self.model).set(self.in_flight)
        self.on_finished()

    async def _run(self, stream: str, entry_id: str, request: RequestEnvelope, reclaimed: bool) -> None:
        REQUEST_ID.set(request.client_request_id or request.request_id)  # this task's log lines (shared.logs)
        metrics.IN_FLIGHT.labels(self.model).set(self.in_flight)
        queued = max(0.0, time.time() - request.arrival)
        asked = time.monotonic()
        taking = self.leases.take(request.request_id)  # queued before an early encoding's first step
        early = self._encode_early(request, reclaimed)
        try:
            try:
                lease, stashed, streamed = await taking
            except RedisError as exc:  # leave the entry pending, for a retry
                log.warning("could not lease request %s (%s); leaving it for a retry", request.request_id, exc)
                return
            if not lease:
                return  # its worker is alive and holds the lease (and owns any cancel that came meanwhile)
            metrics.LEASE_WAIT.labels(self.model).observe(time.monotonic() - asked)
            self.publisher.hold(request.request_id, lease, (stream, entry_id))
            if reclaimed:
                metrics.RECLAIMED.labels(self.model).inc()
                metrics.CLAIMS.labels(self.model, "reclaimed").inc()
            else:
                metrics.QUEUE_TIME.labels(self.model).observe(queued)
            runs = int(streamed or 0)  # runs of it that reached a client: 1 after the first, + each replay
            terminal = self._refuse_unstarted(request, stashed, runs)
            state = None
            if terminal is None and runs:
                terminal, state = await self._take_over(request, runs)
            if terminal is None:
                terminal = await self._answer(request, state, early)
        finally:
            if early is not None:
                early.task.cancel()  # unless answered: refused, not ours, or this task cancelled
        if request.request_id in self.leases.lost:  # its answer is for the worker that took it over
            return
        await self._finish(stream, entry_id, request, terminal, queued, reclaimed)

    def _encode_early(self, request: RequestEnvelope, reclaimed: bool) -> _Early | None:
        """An encoding handed to the engine at once, while its lease is taken: the lease's round
        trip is off the answer's path (a few hundred microseconds of a few milliseconds). Only a
        request first claimed, of a kind this worker encodes; it is cancelled (the engine aborts
        it) if the lease is another's or the request must not run, which the lease's reply tells.
        Nothing of it is published before the lease is held. Not a request already cancelled or
        out of time, which the lease's reply would refuse: an overloaded engine does no work for it."""
        if reclaimed or not isinstance(self.adapter, EncoderAdapter) or request.kind not in ENCODER_KINDS:
            return None
        if request.kind not in self.kinds or request.request_id in self.cancel_requested \
                or _past(request.deadline) or _past(request.queue_deadline):
            return None
        task = asyncio.ensure_future(self.adapter.encode(request))
        task.add_done_callback(_retrieved)  # an answer never awaited (its lease was another's) logs nothing
        return _Early(task, time.monotonic())

    async def _finish(self, stream: str, entry_id: str, request: RequestEnvelope, terminal: GenerationChunk,
                      queued: float, reclaimed: bool) -> None:
        """Count the request, log it, and publish its terminal chunk with the entry's acknowledgement."""
        if self.cancel_requested.get(request.request_id) == "deadline":
            _mark_deadline(terminal)
        metrics.REQUESTS.labels(self.model, terminal.finish_reason or "unknown").inc()
        terminal.timings = {**(terminal.timings or {}), "queue_s": queued, "finished_at": time.time()}
        tracing.worker_generation(request.traceparent, terminal.timings, {
            "llmfleet.model": self.model, "llmfleet.worker": self.worker_id, "llmfleet.request_id": request.request_id,
            "llmfleet.finish_reason": terminal.finish_reason,
            "llmfleet.completion_tokens": terminal.usage.completion_tokens if terminal.usage else None})
        self._log(request, terminal, reclaimed)
        if terminal.usage is not None:
            metrics.GENERATED_TOKENS.labels(self.model).inc(terminal.usage.completion_tokens)
        self.completed += 1
        ack = (stream, entry_id, request.request_id)
        if request.tenant and stream == keys.request_stream(self.model):  # perhaps a ticket's: its binding too
            ack += (keys.bound_requests(self.model),)
        await asyncio.shield(self.publisher.finish(request, terminal, ack))

    def _log(self, request: RequestEnvelope, terminal: GenerationChunk, reclaimed: bool) -> None:
        """The request's line: at info with `--enable-log-requests`, else at debug."""
        level = logging.INFO if self.log_requests else logging.DEBUG
        if not request_log.isEnabledFor(level):
            return
        usage, timings = terminal.usage, terminal.timings
        request_log.log(level, "request %s %s", request.request_id, terminal.finish_reason, extra={"fields": {
            "request": request.request_id, "tenant": request.tenant, "model": self.model,
            "finish_reason": terminal.finish_reason, "error": terminal.error.code if terminal.error else None,
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "queue_s": timings.get("queue_s"), "prefill_s": timings.get("prefill_s"),
            "decode_s": timings.get("decode_s"), "reclaimed": reclaimed or None}})

    async def _take_over(self, request: RequestEnvelope, runs: int) -> tuple[GenerationChunk | None,
                                                                             Continuation | None]:
        """Take over a stream a dead worker had begun: what to continue it from (None: run it again
        from its start, for its gateway to join where its client stood), or the terminal chunk that
        ends it here."""
        await self._note_replay(request, runs)
        state = None
        if request.continues:
            state = await self._continuation(request)
            if state is None and request.request_id in self.cancel_requested:
                return _cancelled_terminal(request), None
            if state is None or (state.replay and not request.replays_exactly):
                return _error_terminal(WorkerLost("The worker generating this response stopped mid-stream; "
                                                  "retry the request.")), None
            if state.replay:  # a greedy stream whose tokens its gateway does not have all of
                state = None
        how = "running it again" if state is None else (
            "continuing it from the engine's tokens" if state.from_tokens else "continuing it from its text")
        log.info("request %s: its worker stopped mid-stream; %s (takeover %d of at most %d)", request.request_id,
                 how, runs, self.migration_limit)
        return None, state

    async def _note_replay(self, request: RequestEnvelope, runs: int) -> None:
        """Count a takeover of a stream a dead worker had begun (its gateway joins or continues it,
        gateway/fleet/replay.py)."""
        metrics.MIGRATIONS.labels(self.model).inc()
        with contextlib.suppress(RedisError):  # unrecorded, the limit counts this replay at most once less
            await self.batched.set(keys.streamed_key(request.request_id), runs + 1, xx=True, keepttl=True)

    async def _continuation(self, request: RequestEnvelope) -> Continuation | None:
        """What the client of a stream taken over was sent, as its gateway saves it once it sees the
        worker lost (gateway/fleet/runs.py): waited for up to CONTINUATION_WAIT_S; None if it does not
        come (the gateway is gone, or the text alone cannot be continued), or cannot be continued here.

        Not there at the first look, this worker tells the gateway that it has the request (its
        note of a start, under its newer lease): the gateway may not have seen the worker before it
        go, one whose lease lapsed while it lived (Redis stalled, or out of its reach for a while).
        Following the newer lease, the gateway saves what its client was sent then."""
        waited_until = time.monotonic() + CONTINUATION_WAIT_S
        first = True
        while request.request_id not in self.cancel_requested:
            try:
                data = await self.batched.getdel(keys.continuation_key(request.request_id))
            except RedisError as exc:
                log.warning("request %s: could not read its continuation: %s", request.request_id, exc)
                data = None
            if data is not None:
                try:
                    state = decode(Continuation, data)
                except EnvelopeError as exc:
                    log.warning("request %s: its continuation is unreadable: %s", request.request_id, exc)
                    return None
                max_tokens = request.params.max_tokens
                full = max_tokens is not None and any(choice.tokens >= max_tokens for choice in state.choices)
                return None if full else state
            if time.monotonic() > waited_until:
                return None
            if first:
                self.publisher.started(request)
                first = False
            await asyncio.sleep(CONTINUATION_POLL_S)
        return None

    def _refuse_unstarted(self, request: RequestEnvelope, stashed: bytes | None,
                          runs: int) -> GenerationChunk | None:
        """The terminal chunk of a request that must not start (cancelled, stale, half-sent)."""
        if runs and not ((request.replays_exactly or request.continues) and runs <= self.migration_limit):
            # a dead worker already sent part of it: running it again would repeat or change output
            return _error_terminal(WorkerLost("The worker generating this response stopped mid-stream; "
                                              "retry the request."))
        cause = stashed.decode() if stashed else self.cancel_requested.get(request.request_id)
        if cause is not None:
            metrics.CANCELS.labels(self.model, cause, "queued").inc()
            return _cancelled_terminal(request)
        if request.kind not in self.kinds:  # queued by a gateway that did not know this worker yet
            return _error_terminal(ServiceUnavailable(
                f"The worker that took this request serves only {', '.join(self.kinds)} requests of "
                f"`{self.model}`, not {request.kind}; retry the request.", code="kind_not_served"))
        waited = time.time() - request.arrival
        if _past(request.deadline):  # the client's own `timeout` ran out
            metrics.CANCELS.labels(self.model, "deadline", "queued").inc()
            terminal = _cancelled_terminal(request)
            _mark_deadline(terminal)
            return terminal
        if _past(request.queue_deadline):
            metrics.QUEUE_TIMEOUTS.labels(self.model).inc()
            return _error_terminal(ServiceUnavailable(
                f"The request waited {waited:.1f}s in the queue, past its queue timeout; the fleet is "
                "overloaded, retry later.", code="queue_timeout"))
        return None

    async def _answer(self, request: RequestEnvelope, state: Continuation | None = None,
                      early: _Early | None = None) -> GenerationChunk:
        """The request's terminal chunk, from the adapter of its kind of work (a generation: from
        where its client's stream stood, given that; an encoding: `early`'s, if it began early)."""
        adapter = self.adapter
        if request.kind in GENERATION_KINDS and isinstance(adapter, GenerationAdapter):
            return await self._generate(adapter, request, state)
        if request.kind in ENCODER_KINDS and isinstance(adapter, EncoderAdapter):
            return await self._encode(adapter, request, early)
        if request.kind in TOKENIZER_KINDS and isinstance(adapter, TokenizerAdapter):
            return await self._whole(adapter.tokenize(request))
        return _error_terminal(EngineError(f"The {type(adapter).__name__} engine of `{self.model}` cannot answer "
                                           f"{request.kind} requests."))

    async def _whole(self, answering) -> GenerationChunk:
        """An answer that is one chunk: an engine failure fails the request, not the worker."""
        try:
            return await answering
        except FleetError as exc:
            return _error_terminal(exc)
        except Exception as exc:  # noqa: BLE001 - an engine bug must fail this request, not the worker
            log.exception("request failed")
            self.on_engine_failure()
            return _error_terminal(EngineError(f"the engine failed: {exc}"))

    async def _encode(self, adapter: EncoderAdapter, request: RequestEnvelope,
                      early: _Early | None = None) -> GenerationChunk:
        """The encoder's answer (`early`'s, if it began while the lease was taken): one terminal
        chunk; a cancel or the deadline cancels its task, and with it `early`'s."""
        deadline = self._deadline_alarm(request)
        answering, started = early or (adapter.encode(request), time.monotonic())
        self._encoding.add(request.request_id)
        try:
            terminal = await self._whole(answering)
        except asyncio.CancelledError:
            if request.request_id in self.cancel_requested:
                return _cancelled_terminal(request)
            raise
        finally:
            self._encoding.discard(request.request_id)
            if deadline is not None:
                deadline.cancel()
        elapsed = time.monotonic() - started
        if (size := sum(len(output.data) for output in terminal.pooled or ())) > MAX_ANSWER_BYTES:
            return _error_terminal(InvalidRequest(
                f"The answer holds {size / 2**20:.1f} MiB of vectors, more than one reply may carry "
                f"({MAX_ANSWER_BYTES / 2**20:.1f} MiB); send fewer inputs per request.", code="answer_too_large"))
        terminal.timings = {"prefill_s": elapsed, "decode_s": 0.0}
        if terminal.pooled is not None:
            metrics.ENCODED_INPUTS.labels(self.model, request.kind).inc(len(terminal.pooled))
            metrics.ENCODE_TIME.labels(self.model, request.kind).observe(elapsed)
        if terminal.usage is not None:
            metrics.ENCODED_TOKENS.labels(self.model, request.kind).inc(terminal.usage.prompt_tokens)
        return terminal

    def _deadline_alarm(self, request: RequestEnvelope) -> asyncio.TimerHandle | None:
        """Cancel the request at its deadline (the client's `timeout`, or the gateway's)."""
        if not request.deadline:
            return None
        delay = max(0.0, request.deadline - time.time())
        return asyncio.get_running_loop().call_later(
            delay, lambda: self.spawn(self.cancel(request.request_id, "deadline")))

    async def _generate(self, adapter: GenerationAdapter, request: RequestEnvelope,
                        state: Continuation | None = None) -> GenerationChunk:
        """Run the generation, publishing deltas; return the terminal chunk (not yet published)."""
        if state is None:
            generation = adapter.generate(request)
        else:  # each choice an engine request of its own, named apart where there are several
            parts = {choice.index: request.continued(choice) for choice in state.choices}
            if len(parts) > 1:
                parts = {index: msgspec.structs.replace(part, request_id=f"{request.request_id}/{index}")
                         for index, part in parts.items()}
                self._parts[request.request_id] = [part.request_id for part in parts.values()]
            sent = {choice.index: choice for choice in state.choices}
            generation = continuing({index: stopped_across_the_break(adapter.generate(part, sent[index].token_ids),
                                                                     sent[index].text, request.params)
                                     for index, part in parts.items()}, state)
        chunks = self._observe(adapter, request, generation)
        deadline = self._deadline_alarm(request)
        note = asyncio.get_running_loop().call_later(STARTED_NOTE_AFTER_S, self.publisher.started, request)
        try:
            if not request.stream:
                return await collect_candidates(chunks, request.choice_count)
            async for chunk in chunks:
                if chunk.done:
                    return chunk
                note.cancel()  # its first output says it runs here (a cancelled timer's cancel is a no-op)
                self.publisher.publish(request, chunk)
            raise EngineError("the engine ended the generation without a terminal chunk")
        except FleetError as exc:
            return _error_terminal(exc)
        except asyncio.CancelledError:
            if request.request_id in self.cancel_requested:  # forced after an ignored abort
                return _cancelled_terminal(request)
            raise
        except Exception as exc:  # noqa: BLE001 - an engine bug must fail this request, not the worker
            log.exception("request %s failed", request.request_id)
            self.on_engine_failure()
            return _error_terminal(EngineError(f"generation failed: {exc}"))
        finally:
            note.cancel()
            if deadline is not None:
                deadline.cancel()
            await chunks.aclose()
            self._parts.pop(request.request_id, None)

    async def _abort(self, adapter: GenerationAdapter, request_id: str) -> None:
        for engine_request in self._parts.get(request_id, (request_id,)):
            await adapter.abort(engine_request)

    async def _observe(self, adapter: GenerationAdapter, request: RequestEnvelope,
                       chunks: AsyncIterator[GenerationChunk]) -> AsyncIterator[GenerationChunk]:
        """Pass chunks through, tracking the phase and tokens a cancel would interrupt."""
        request_id = request.request_id
        state = self._progress[request_id] = _Progress()
        try:
            async for chunk in chunks:
                state.tokens += chunk.token_count
                if chunk.first_token:
                    state.first_token(chunk.first_token_at)
                    metrics.PREFILL_TIME.labels(self.model).observe(state.first_token_at - state.started)
                    if not chunk.done and (request.continues or request.replays_exactly):
                        # its gateway keeps them, should another worker take the stream over
                        chunk.timings = {"prefill_s": state.first_token_at - state.started,
                                         "first_token_at": state.first_token_wall}
                if chunk.done:
                    chunk.timings = state.timings(self.model)
                if request_id in self.cancel_requested and not state.reaborted:
                    # The abort may have reached the adapter before the engine knew the request.
                    state.reaborted = True
                    await self._abort(adapter, request_id)
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

    async def hand_over(self) -> None:
        """At a draining worker's deadline: give up the running requests another worker can take
        over without a client noticing (greedy or seeded streams, which it replays for their
        gateway to join; sampled streams, which it continues from what their gateway relayed (its
        text, or the engine's tokens), told so by a last `handed_over` chunk; non-streaming requests, which sent
        nothing), and stop them here. Their entries stay pending, rung on the model's takeover
        doorbell for a worker with room to claim at once (`shared.takeover`); else the others'
        sweeps reclaim them (`reclaim_requests`), as a dead worker's."""
        handed = [rid for rid, request in self.requests.items() if isinstance(self.adapter, GenerationAdapter)
                  and (request.replays_exactly or request.continues or not request.stream)]
        if not handed:
            return
        notices = [self.publisher.last(request, GenerationChunk(text=None, handed_over=True))
                   for rid in handed if (request := self.requests[rid]).continues]
        for request_id in handed:
            self.leases.give_up(request_id)
        if notices:  # on the wire before the lease goes: its gateway saves what to continue from
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.gather(*notices), HAND_OVER_NOTICE_S)
        for request_id in handed:  # nothing more from here, before another worker can take the lease
            self.publisher.drop(request_id)
        try:  # its own only: a gateway that saw the notice may have taken one back for another worker
            await asyncio.gather(*(self._release_lease(keys=[keys.lease_key(request_id)], args=[self.worker_id])
                                   for request_id in handed))
            # rung for a worker with room to claim at once, not at its next sweep (a stream to be
            # continued is rung by its gateway, once it has saved what to continue from)
            await takeover.ring(self.batched, self.model, [self.publisher.entry(rid) for rid in handed
                                                           if not self.requests[rid].continues])
        except RedisError as exc:  # the leases lapse on their own (LEASE_TTL_S), unrenewed; the sweeps find them
            log.warning("handing over %d requests failed: %s", len(handed), exc)
        metrics.HANDED_OVER.labels(self.model).inc(len(handed))
        log.info("drain deadline: handing %d requests to other workers", len(handed))
        for request_id in handed:
            self.spawn(self.cancel(request_id, "handed_over"))

    def lease_lost(self, request_id: str) -> None:
        """Another worker may own the request now: publish nothing more for it, and stop it here."""
        self.publisher.drop(request_id)
        self.spawn(self.cancel(request_id, "lease_lost"))

    async def cancel(self, request_id: str, cause: str, sent_at: float = 0.0) -> None:
        """Abort a running request; force it if the adapter does not end it in time."""
        task = self.running.get(request_id)
        if task is None or request_id in self.cancel_requested:
            return
        self.cancel_requested[request_id] = cause
        state = self._progress.get(request_id)
        if state is not None:
            state.tokens_at_cancel = state.tokens
            state.cancel_sent_at = sent_at or time.time()
            metrics.CANCELS.labels(self.model, cause, state.phase).inc()
        if request_id in self._encoding:  # one answer, nothing of it worth waiting for
            metrics.CANCELS.labels(self.model, cause, "encode").inc()
            task.cancel()
            return
        if isinstance(self.adapter, GenerationAdapter):
            await self._abort(self.adapter, request_id)
        done, _ = await asyncio.wait({task}, timeout=ABORT_GRACE_S)
        if not done:
            log.warning("request %s ignored its abort; cancelling its task", request_id)
            task.cancel()


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


class _Early(NamedTuple):
    """An encoding handed to its engine before its lease was in (`Runner._encode_early`)."""

    task: asyncio.Task
    started: float  # monotonic


def _past(deadline: float) -> bool:
    """Whether a deadline (wall-clock; 0 for none) has passed."""
    return bool(deadline) and time.time() > deadline


def _retrieved(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()


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
