"""One request's life at this gateway, from its submit to its end: the one owner of its end.

`async with RequestLife(fleet, envelope, endpoint, key) as run:` submits the request (its key's
limits, registration, the queue) and yields its `Run`. Its end runs once, on every path: an
answer whose terminal chunk came (`settle`, awaited before the client reads the end of it), an
error before or after the first byte (`failed`), the client gone, a cancel, a deadline, a lost
worker (the exception that leaves the block), or a refusal before the request was queued. That
one place:

- counts it: the open-requests gauge, the latency histogram, the facts of the access line
  (status, cancel cause, worker, tokens; gateway/http/accounting.py) and, with
  `--enable-log-requests`, writes the request's own log line;
- closes its run, which cancels it on its worker if it had not ended, and unregisters it
  (`Fleet.submit`'s ending) and frees its key's place in flight (gateway/fleet/rate_limits.py);
- then stores its history, through the hooks a family gave (`on_end`): a session's turn, a
  stored Response. A hook runs once the run is unregistered, with the request's `Outcome`.

Whoever holds the life when the request ends ends it: the route (a whole answer, a refusal), the
body of a stream (gateway/serve/sse.py), or a detached run's relay (gateway/serve/resumable.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from gateway import metrics
from gateway.fleet.rate_limits import KeyUse
from gateway.fleet.runs import Fleet, Run
from gateway.http import accounting
from shared.envelopes import GenerationChunk, RequestEnvelope
from shared.errors import FleetError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Outcome:
    """How a request ended, as its history hooks see it."""

    terminal: GenerationChunk | None = None  # its terminal chunk, if it came
    error: BaseException | None = None  # what ended it otherwise: an error, the client gone, a cancel
    refused: bool = False  # answered with an error status before any of its events: nothing ran
    queued: bool = False  # it reached the queue (its key admitted it, and the queue had room)


Hook = Callable[[Outcome], Awaitable[None]]


class RequestLife(AbstractAsyncContextManager):
    def __init__(self, fleet: Fleet, envelope: RequestEnvelope, endpoint: str, key: KeyUse | None = None):
        self.fleet = fleet
        self.envelope = envelope
        self.endpoint = endpoint  # the latency histogram's label
        self.key = key
        self.run: Run | None = None
        self.outcome = Outcome()
        self._hooks: list[Hook] = []
        self._submit = None
        self._started = 0.0
        self._ending: asyncio.Future | None = None

    def on_end(self, hook: Hook) -> None:
        """Have `hook(outcome)` store the request's history once it has ended and its run is unregistered."""
        self._hooks.append(hook)

    async def __aenter__(self) -> Run:
        self._submit = self.fleet.submit(self.envelope, self.key)
        try:
            self.run = await self._submit.__aenter__()
        except BaseException as exc:  # not queued: nothing ran, but its history hooks run (a session's lock)
            self.outcome = Outcome(error=exc, refused=True, queued=False)
            self._ending = self.fleet.spawn(self._store())
            await self.stored()
            raise
        self._started = time.monotonic()
        self.outcome.queued = True
        metrics.OPEN_STREAMS.inc()
        return self.run

    async def __aexit__(self, kind, exc, traceback) -> None:
        if exc is not None and self.outcome.error is None and self.outcome.terminal is None:
            self.outcome.error = exc
        self._end()
        await self._submit.__aexit__(kind, exc, traceback)

    def first_chunk(self, chunk: GenerationChunk) -> None:
        """Record the time to first token, if this first chunk has one: as relayed, for a stream;
        when the engine produced it, for a whole answer (its terminal chunk comes at the end, and
        the worker says when the first token came; the two clocks meet here)."""
        if not chunk.first_token:
            return
        first_token_at = (chunk.timings or {}).get("first_token_at") if chunk.done else None
        ttft = max(0.0, (first_token_at or time.time()) - self.envelope.arrival)
        metrics.TIME_TO_FIRST_TOKEN.labels(self.envelope.model).observe(ttft)
        accounting.note(ttft_s=ttft)

    def count(self, chunk: GenerationChunk) -> None:
        """Note what a chunk says of the request: its tokens, its worker's timings, its finish."""
        if chunk.done and chunk.usage is not None:
            metrics.RELAYED_TOKENS.labels(self.envelope.model).inc(chunk.usage.completion_tokens)
            accounting.note(prompt_tokens=chunk.usage.prompt_tokens, completion_tokens=chunk.usage.completion_tokens,
                            worker_timings=chunk.timings, finish_reason=chunk.finish_reason)

    def failed(self, error: BaseException, refused: bool = False) -> None:
        """The request ended with `error`: a refusal before any event, or an error after the first byte."""
        self.outcome.error = error
        self.outcome.refused = refused

    async def settle(self, terminal: GenerationChunk) -> None:
        """End a request whose answer is complete, before the client can read the end of the
        answer: wait until its run's unregistering is on its way to Redis (`Fleet.end`), not for
        Redis's replies, so that a cancel sent right after it finds nothing (`cancelled: 0`) and
        its key's next request finds its place free; with history hooks, until its history is
        stored, so that a next turn finds this one. Shielded: done even if the client goes away now."""
        self.outcome.terminal = terminal
        self._end()
        if self._hooks:
            await asyncio.shield(self._ending)
        else:
            await self.fleet.batched.sent()  # shielded

    async def stored(self) -> None:
        """Once a request has ended without an answer (refused, failed before its first chunk):
        wait until its history hooks have run, if it has any, before the client reads the refusal,
        so that the client's next turn finds the session free, as after `settle`. Shielded."""
        if self._hooks and self._ending is not None:
            await asyncio.shield(self._ending)

    def _end(self) -> None:
        """Once: count the request, close its run (its cancel cause if it had not ended), and start
        its unregistering and the storing of its history."""
        if self._ending is not None:
            return
        run, error = self.run, self.outcome.error
        reason = "deadline" if isinstance(error, FleetError) and error.code == "request_timeout" else "disconnect"
        accounting.note(worker=run.worker_id or None, engine_request_id=self.envelope.request_id,
                        cancel=None if run.finished else reason)
        run.close(reason)
        metrics.OPEN_STREAMS.dec()
        status = error.status if isinstance(error, FleetError) else (499 if error is not None else 200)
        accounting.note(status=status)  # an error after the first byte counts by its own status
        elapsed = time.monotonic() - self._started
        metrics.REQUEST_LATENCY.labels(self.envelope.model, self.endpoint).observe(elapsed)
        accounting.log_request(elapsed)
        unregistering = self.fleet.end(run)  # queued now, ahead of whatever this gateway sends next
        self._ending = self.fleet.spawn(self._store()) if self._hooks else unregistering

    async def _store(self) -> None:
        """After the run is unregistered (cancelled first if it had not ended), the history hooks."""
        if self.run is not None:
            await self.fleet.end(self.run)
        for hook in self._hooks:
            try:
                await hook(self.outcome)
            except Exception:  # noqa: BLE001 - one failed store must not keep the others, or the request, waiting
                log.exception("storing the end of request %s failed", self.envelope.request_id)
