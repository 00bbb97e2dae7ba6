"""Responses that outlive their client: detached runs, and their events kept in Redis.

A *detached run* is a generation this gateway follows on its own account, not for an HTTP
request: it submits the request, then relays every chunk to the response's `EventLog` (the
SSE frames, ids included, exactly as a client reads them) until the terminal chunk, whoever
reads it. Any replica replays the log and follows it live (`follow`). Two features build on it:

- `"resumable": true` on a streaming request (`serve_resumable`, `GET /v1/streams/{id}`): the
  client that sent it reads the run's events straight from this process; if it goes away, the
  run goes on, and the client reconnects to any replica with `Last-Event-ID`. A run nobody
  reads for `GatewaySettings.resume_grace_s` is cancelled (cause "disconnect").
- Responses background mode (gateway/api/openai/responses.py): `run_detached` and `follow`.

Invariants:
- An event is in the log before any client sees it: the writer hands a chunk's frames to the
  local listeners only once their XADD is done, so a client that resumes after the last id it
  read finds every later event.
- The log is one Redis stream per response (`keys.event_log_key`): an opening entry `0-1`
  written before `run_detached` returns (so a follower never sees a 404 for a run that
  exists), which names the tenant the response is for; event n at entry id `1-n`; an end entry
  `2-0` once the run ended, however it ended. Every write sets the key's TTL: the run's deadline
  plus the keep time while it runs, the keep time (`event_log_keep_s`) after its end; MAXLEN
  ~EVENT_LOG_MAXLEN bounds its size.
- A detached run is owned by its task: it ends its request's life (which cancels an unended run
  and stores its history, gateway/serve/life.py), then ends the log, on every path.
  `Fleet.stop` cancels those left, bounded.
- Only the tenant that made a response reads its events: `follow` checks the opening entry's
  tenant, and another tenant's id reads as unknown (a 404), as sessions and stored responses do.

Requests that are not resumable never come here: no Redis write per event for them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import NamedTuple

from fastapi import Request
from redis.exceptions import RedisError
from starlette.responses import Response, StreamingResponse

from gateway.fleet.runs import DEADLINE_GRACE_S, Fleet, Run
from gateway.serve.formatter import Formatter
from gateway.serve.life import RequestLife
from gateway.serve.sse import SSE_HEADERS, ClientDisconnected, EventWriter, race_disconnect, stream_frames
from shared import keys
from shared.envelopes import GenerationChunk
from shared.errors import FleetError, NotFound, ServiceUnavailable, error_from_info
from shared.stopping import pause

log = logging.getLogger(__name__)

OPEN_ID = "0-1"
END_ID = "2-0"
FRAME_FIELD = b"e"
TENANT_FIELD = b"tenant"  # of the opening entry
PRESENCE_FIELD = b"presence"  # of the opening entry: the relaying gateway's presence channel, if it holds one
FAMILY_FIELD = b"family"  # of the opening entry: the API family of its events (`Formatter.endpoint`)
READ_BATCH = 1000  # log entries per read
FOLLOW_BLOCK_MS = 1000  # a follower on another replica wakes at least this often (reader mark, expiry)
READER_CHECK_S = 1.0  # how often a resumable run with no local reader looks for one elsewhere
LISTENER_MAX_CHUNKS = 1024  # chunks held for a local reader that stopped reading; past it, it is cut off

# What a local listener gets: a chunk's frames with the id of the first, or None at the end.
Frames = tuple[int, list[bytes]]


class Opening(NamedTuple):
    """A log's opening entry: the tenant the response is for, the presence channel of the gateway
    relaying it ("": none held), and its events' API family ("": a log an older gateway opened)."""

    tenant: str
    presence: str
    family: str


class EventLog:
    """The encoded SSE events of one response, kept in Redis and readable from any replica.

    `redis` is the fleet's client: writes may go through `Fleet.batched`, blocking reads must not.
    """

    def __init__(self, redis, response_id: str):
        self.redis = redis
        self.key = keys.event_log_key(response_id)

    async def open(self, tenant: str, ttl_s: int, presence: str = "", family: str = "") -> None:
        """Create the log (its opening entry, naming its tenant, the presence channel of the gateway
        that relays it and the API family of its events), before any event is appended."""
        await self.redis.pipeline(transaction=False).xadd(
            self.key, {b"open": b"", TENANT_FIELD: tenant, PRESENCE_FIELD: presence, FAMILY_FIELD: family}, id=OPEN_ID
        ).expire(self.key, ttl_s).execute()

    async def append(self, first_id: int, frames: list[bytes], ttl_s: int) -> None:
        """Add the frames of events `first_id`, `first_id + 1`...: one round trip."""
        pipe = self.redis.pipeline(transaction=False)
        for event_id, frame in enumerate(frames, first_id):
            pipe.xadd(self.key, {FRAME_FIELD: frame}, id=f"1-{event_id}", maxlen=keys.EVENT_LOG_MAXLEN,
                      approximate=True)
        await pipe.expire(self.key, ttl_s).execute()

    async def end(self, keep_s: int) -> None:
        """Mark the end: followers stop there. The log is kept `keep_s` more seconds."""
        await self.redis.pipeline(transaction=False).xadd(self.key, {b"end": b""}, id=END_ID) \
            .expire(self.key, keep_s).execute()

    async def exists(self) -> bool:
        return bool(await self.redis.exists(self.key))

    async def opening(self) -> Opening | None:
        """What the opening entry says; None when no log is kept."""
        opening = await self.redis.xrange(self.key, OPEN_ID, OPEN_ID)
        if not opening:
            return None
        fields = opening[0][1]
        return Opening(*(fields.get(name, b"").decode() for name in (TENANT_FIELD, PRESENCE_FIELD, FAMILY_FIELD)))

    async def read(self, after: int, block_ms: int | None = None) -> tuple[list[tuple[int, bytes]], bool]:
        """The events with an id above `after` (-1: all), up to READ_BATCH of them, and whether
        the end follows them. `block_ms`: wait that long for one if there is none yet."""
        start = OPEN_ID if after < 0 else f"1-{after}"
        replies = await self.redis.xread({self.key: start}, count=READ_BATCH, block=block_ms)
        events, ended = [], False
        for _stream, entries in replies or ():
            for entry_id, fields in entries:
                entry_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                if entry_id == END_ID:
                    ended = True
                elif FRAME_FIELD in fields:
                    events.append((int(entry_id.split("-")[1]), fields[FRAME_FIELD]))
        return events, ended


class DetachedRun:
    """One generation this gateway relays to its `EventLog` and to local listeners, for no client.

    Create it, `listen()` if the caller reads it here, then `start()`. Its task (`task`) owns
    the run from then on.
    """

    def __init__(self, fleet: Fleet, life: RequestLife, formatter: Formatter, *, reader_grace_s: float | None = None):
        self.fleet = fleet
        self.life = life  # the request's end, and its history hooks (gateway/serve/life.py)
        self.envelope = life.envelope
        self.writer = EventWriter(formatter)
        self.response_id = formatter.response_id
        # A non-streaming run has no events to keep: only its end (its life's hooks).
        self.log = EventLog(fleet.batched, self.response_id) if self.envelope.stream else None
        self.reader_grace_s = reader_grace_s  # None: runs to its end whether anyone reads or not
        self.task: asyncio.Task | None = None
        self.refusal: FleetError | None = None  # the request was refused before its first event
        self._listeners: set[asyncio.Queue[Frames | None]] = set()
        self._ended = asyncio.Event()
        self._watching: asyncio.Task | None = None  # `_cancel_when_unread`, which ends with the run
        self._relaying = False  # the relay task has taken its first step (and so owns the run's ending)

    def listen(self) -> asyncio.Queue[Frames | None]:
        """A queue of the frames published from now on, then None at the end (or when the reader
        fell LISTENER_MAX_CHUNKS behind: it can resume from the log)."""
        queue: asyncio.Queue[Frames | None] = asyncio.Queue()
        if self._ended.is_set():
            queue.put_nowait(None)
        else:
            self._listeners.add(queue)
        return queue

    def unlisten(self, queue: asyncio.Queue[Frames | None]) -> None:
        self._listeners.discard(queue)

    async def start(self) -> None:
        """Submit the request and open its log; return once it is queued, the relay running."""
        async with AsyncExitStack() as owner:  # on an error or a cancel here, the request's end cancels it
            run = await owner.enter_async_context(self.life)
            if self.log is not None:
                try:
                    await self.log.open(self.envelope.tenant, self._ttl_while_running(), self.envelope.gateway_presence,
                                        self.writer.formatter.endpoint)
                except (RedisError, OSError) as exc:  # nobody could read it
                    raise ServiceUnavailable("The request queue is unreachable; try again shortly.") from exc
            self.fleet.detached[self.response_id] = self
            # From here the relay owns the run: its `finally` ends it (`owner.aclose()`); if the task is
            # cancelled before its first step, its done callback does.
            relay_owner = owner.pop_all()
            self.task = asyncio.create_task(self._relay(relay_owner, run), name=f"detached {self.response_id}")
            self.task.add_done_callback(lambda task: None if self._relaying else self.fleet.spawn(
                self._end_unstarted(relay_owner)))
        if self.reader_grace_s is not None:
            self._watching = asyncio.create_task(self._cancel_when_unread(self.reader_grace_s))

    def abandon(self) -> None:
        """Cancel the run now (its ending is written as on any other path)."""
        if self.task is not None:
            self.task.cancel()

    async def _relay(self, owner: AsyncExitStack, run: Run) -> None:
        self._relaying = True
        error: BaseException | None = None
        try:
            first, rest = await self._first(run)
            self.life.first_chunk(first)
            async for frames in stream_frames(self.life, self.writer, first, rest):
                await self._publish(frames)
            error = self.writer.error
        except FleetError as exc:  # refused before its first event
            error = exc
        except (RedisError, OSError) as exc:  # the log is unreachable: nobody could read the rest
            log.warning("relaying %s to its event log failed: %s; cancelling it", self.response_id, exc)
            error = exc
        except BaseException as exc:  # cancelled: nobody read it within the grace, or the gateway stops
            error = exc
            raise
        finally:
            await self._close(owner, error)

    async def _end_unstarted(self, owner: AsyncExitStack) -> None:
        """The ending of a relay cancelled before its first step (its `finally` never ran)."""
        await self._close(owner, asyncio.CancelledError())

    async def _close(self, owner: AsyncExitStack, error: BaseException | None) -> None:
        """The request's end (the cancel of an unended run) before the log's."""
        if error is not None and self.life.outcome.error is None:
            self.life.failed(error)
        await owner.aclose()
        await self._end(error)

    async def _first(self, run: Run) -> tuple[GenerationChunk, AsyncIterator[GenerationChunk]]:
        try:
            return await run.first_or_error()
        except FleetError as exc:
            # The engine's server had begun its stream: 200, then the error (serve_generation's rule).
            self.refusal = None if exc.in_stream else exc
            self.life.failed(exc, refused=not exc.in_stream)
            raise

    async def _publish(self, frames: list[bytes]) -> None:
        """Frames to the log first, then to the local listeners (the module's first invariant)."""
        if not frames:
            return
        first_id = self.writer.next_id - len(frames)
        if self.log is not None:
            await self.log.append(first_id, frames, self._ttl_while_running())
        for queue in list(self._listeners):
            if queue.qsize() >= LISTENER_MAX_CHUNKS:
                self._listeners.discard(queue)
                queue.put_nowait(None)
            else:
                queue.put_nowait((first_id, frames))

    async def _end(self, error: BaseException | None) -> None:
        """The ending of every path: the log's last events and its end, the listeners'."""
        failure = self._failure(error)
        try:
            if self.writer.terminal is None and self.writer.error is None:  # refused, or cut short
                await self._publish(self.writer.error_frames(failure))
            if self.log is not None:
                await self.log.end(math.ceil(self.fleet.settings.event_log_keep_s))
        except (RedisError, OSError) as exc:  # then the log ends by its TTL
            log.warning("ending the event log of %s failed: %s", self.response_id, exc)
        finally:
            self._ended.set()
            self.fleet.detached.pop(self.response_id, None)
            for queue in self._listeners:
                queue.put_nowait(None)
            self._listeners.clear()

    def _failure(self, error: BaseException | None) -> FleetError | None:
        """The error the response failed with, as its error events say it."""
        terminal = self.writer.terminal
        if terminal is not None:
            return error_from_info(terminal.error) if terminal.error is not None else None
        if isinstance(error, FleetError):
            return error
        return ServiceUnavailable("The response was cancelled before it finished: no client read it within "
                                  "its grace, its gateway stopped, or the request queue became unreachable.")

    async def _cancel_when_unread(self, grace_s: float) -> None:
        """Cancel the run once no client has read it for `grace_s`: none here (a listener), none
        on another replica (its reader key, refreshed by `follow`)."""
        reader_key = keys.stream_reader_key(self.response_id)
        last_read = time.monotonic()
        while not await pause(self._ended, READER_CHECK_S):
            try:
                if self._listeners or await self.fleet.batched.exists(reader_key):
                    last_read = time.monotonic()
                    continue
            except (RedisError, OSError):
                continue  # Redis is away: nobody can resume, and its relay fails on its own
            if time.monotonic() - last_read >= grace_s:
                self.abandon()
                return

    def _ttl_while_running(self) -> int:
        left = max(0.0, self.envelope.deadline - time.time()) + DEADLINE_GRACE_S
        return math.ceil(left + self.fleet.settings.event_log_keep_s)


async def run_detached(fleet: Fleet, life: RequestLife, formatter: Formatter) -> None:
    """Submit the generation and return once it is queued (its event log opened). From then on it
    runs in this gateway independent of any client, appending every encoded event (`formatter`'s
    SSE frames, ids included) to the log of `formatter.response_id`, until its terminal chunk; its
    life's history hooks store its end, whatever it was (gateway/serve/life.py).

    Raises what `Fleet.submit` raises (429, 503) when the request cannot be queued. A request with
    `envelope.stream` False keeps no log (`follow` answers 404): only its hooks see its end.
    Runs left when the gateway stops are cancelled within `Fleet.stop`'s bounds.
    """
    await DetachedRun(fleet, life, formatter).start()


async def follow(fleet: Fleet, response_id: str, after: int | None, tenant: str) -> AsyncIterator[bytes]:
    """The encoded events of `tenant`'s response `response_id` with an id above `after` (all if
    None), then the live ones as they are appended, until the end of the log. Await it, then iterate:

        events = await follow(fleet, response_id, after, tenant)   # NotFound (404) before the first byte
        return StreamingResponse(events, media_type="text/event-stream")

    Raises NotFound if no log of that tenant exists for that id (never kept, expired, not
    streamed, or another tenant's), or if the events after `after` are no longer all kept (the log's
    MAXLEN). Works on any replica: a
    run relayed by this process is followed from memory after the replay, one elsewhere from Redis.
    """
    after = -1 if after is None else after
    events = EventLog(fleet.redis, response_id)
    local = fleet.detached.get(response_id)
    listener = local.listen() if local is not None else None  # before the replay: nothing falls between
    try:
        opening = await events.opening()
        if opening is None or opening.tenant != tenant:
            raise NotFound(f"No events are kept for the stream `{response_id}`: it is unknown, was not "
                           "streamed, or ended too long ago.", param="response_id")
        batch, ended = await events.read(after)
        if batch and batch[0][0] != after + 1:
            raise NotFound(f"The events of `{response_id}` after {after} are no longer all kept.",
                           param="Last-Event-ID")
    except BaseException:
        if listener is not None:
            local.unlisten(listener)
        raise
    if listener is not None:
        return _follow_here(local, listener, events, after, batch, ended)
    return _follow_log(fleet, events, response_id, after, batch, ended, opening)


async def relay_gone(fleet: Fleet, response_id: str) -> bool:
    """Whether the gateway relaying response `response_id` has died: its log names the presence
    channel it held, and nobody holds it now (one look: a gateway subscribes again within a
    second of Redis coming back, and its runs did not outlive Redis going away)."""
    opening = await EventLog(fleet.redis, response_id).opening()
    return opening is not None and bool(opening.presence) and not await _held(fleet, opening.presence)


async def _held(fleet: Fleet, presence: str) -> bool:
    """Whether a gateway holds the presence channel `presence` (keys.gateway_presence_channel)."""
    counts = await fleet.batched.pubsub_numsub(presence)
    return bool(dict(counts).get(presence.encode()))


async def _follow_here(run: DetachedRun, listener: asyncio.Queue[Frames | None], events: EventLog, after: int,
                       batch: list[tuple[int, bytes]], ended: bool) -> AsyncIterator[bytes]:
    """The replay from the log, then the live frames of a run this process relays."""
    try:
        while batch:
            yield b"".join(frame for _, frame in batch)
            after = batch[-1][0]
            batch, ended = await events.read(after)
        while not ended and (item := await listener.get()) is not None:
            first_id, frames = item
            new = frames[max(0, after + 1 - first_id):]  # those the replay already gave are skipped
            if new:
                yield b"".join(new)
                after = first_id + len(frames) - 1
    finally:
        run.unlisten(listener)


async def _follow_log(fleet: Fleet, events: EventLog, response_id: str, after: int,
                      batch: list[tuple[int, bytes]], ended: bool, opening: Opening) -> AsyncIterator[bytes]:
    """The events of a run relayed elsewhere, from the log, marking that a client reads it. Ends
    early if the gateway relaying it is gone (nobody holds its presence channel, once a second, for
    keys.GATEWAY_GONE_S; or the log expired unended), or if this reader fell behind what the log
    keeps: then as a stream that fails ends, with its family's error events and end, numbered on
    (none for a log that names no family: an older gateway's)."""
    reader_key = keys.stream_reader_key(response_id)
    presence = opening.presence
    next_mark = 0.0
    absent_since = 0.0  # when the relaying gateway's presence channel was first found with nobody
    while True:
        if batch:
            if batch[0][0] != after + 1:  # trimmed under a reader that fell far behind
                log.warning("a follower of %s fell behind the kept events; ending its stream", response_id)
                error = ServiceUnavailable(f"This reader fell behind the events kept for the stream `{response_id}`: "
                                           f"those after {after} are no longer all kept.")
                break
            yield b"".join(frame for _, frame in batch)
            after = batch[-1][0]
        if ended:
            return
        if time.monotonic() >= next_mark:  # at most once a second, however fast the events come
            marked = fleet.batched.set(reader_key, b"1", ex=keys.STREAM_READER_TTL_S)
            if not presence:
                await marked
            else:
                _, held = await asyncio.gather(marked, _held(fleet, presence))
                now = time.monotonic()
                absent_since = 0.0 if held else absent_since or now
                if absent_since and now - absent_since >= keys.GATEWAY_GONE_S:
                    log.warning("the gateway relaying %s is gone (nobody holds %s); ending its follower",
                                response_id, presence)
                    error = _relay_gone()
                    break
            next_mark = time.monotonic() + READER_CHECK_S
        batch, ended = await events.read(after, block_ms=FOLLOW_BLOCK_MS)
        if not batch and not ended and not await events.exists():
            error = _relay_gone()  # expired unended: the gateway relaying it died
            break
    family = Formatter.families.get(opening.family)
    if family is not None:
        yield b"".join(EventWriter.lost_frames(family, error, after + 1))


def _relay_gone() -> ServiceUnavailable:
    return ServiceUnavailable("The gateway relaying this stream stopped before it finished; retry the request.")


async def serve_resumable(request: Request, fleet: Fleet, life: RequestLife, formatter: Formatter) -> Response:
    """A streaming request that survives its client: run it detached and relay it from here. Its
    life's hooks store its end whether its client still reads."""
    run = DetachedRun(fleet, life, formatter, reader_grace_s=fleet.settings.resume_grace_s)
    listener = run.listen()
    await run.start()
    try:
        first = await race_disconnect(request, listener.get())
    except ClientDisconnected:
        run.abandon()  # gone before its first event, it never learnt the id to resume with
        return Response(status_code=499)
    if run.refusal is not None:  # set before its error events went out: answer it as a status
        run.unlisten(listener)
        return formatter.error_response(run.refusal)
    if first is None:
        return formatter.error_response(ServiceUnavailable("This gateway stopped before the response began; "
                                                           "retry the request."))
    return StreamingResponse(_relay_to_client(run, listener, first), media_type="text/event-stream",
                             headers=SSE_HEADERS)


async def _relay_to_client(run: DetachedRun, listener: asyncio.Queue[Frames | None],
                           first: Frames) -> AsyncIterator[bytes]:
    item: Frames | None = first
    try:
        while item is not None:
            yield b"".join(item[1])
            item = await listener.get()
    finally:  # the client went away: the run goes on, for whoever resumes it
        run.unlisten(listener)
