"""Sending a run's answer as Server-Sent Events.

- `EventWriter` turns a formatter's events into SSE frames and is the only place event ids are
  given: a stream's bytes are by default exactly those `vllm serve` sends (`data: {...}` frames,
  no `id:` lines), since clients that read SSE line by line (`vllm bench serve`) take an `id:`
  line for part of the data; a resumable stream (gateway/serve/resumable.py) gives every event
  `id: <n>`, its 0-based position in the response (the end marker included), which a client
  names to resume. `--sse-event-ids` gives every stream ids.
- `stream_frames` is a started run's frames, chunk by chunk, ending with the family's end or its
  error events; the request's life is settled at its terminal chunk, before the end goes out.
- `SSEResponse` sends the parts, cancelled where it stands when the client disconnects
  (`CancelledOnDisconnect`, which also serves a non-streaming request's wait). Every stream is
  sent with `Cache-Control: no-cache` and `X-Accel-Buffering: no`, so no proxy caches or buffers it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from starlette.requests import Request
from starlette.responses import StreamingResponse

from gateway import metrics
from gateway.http.accounting import BODY_SEND
from gateway.serve.formatter import Formatter
from gateway.serve.life import RequestLife
from shared.envelopes import GenerationChunk
from shared.errors import FleetError, error_from_info

# Of every SSE answer: no cache may keep it, and nginx must pass each event on as it comes.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class EventWriter:
    """One response's events as SSE frames, each with its `id:`: the only place ids are given.

    Ids count from 0 and number every event, the end marker (`data: [DONE]`) and error events
    included, so in the Responses family an event's id is its `sequence_number`. The id line
    closes the frame (`data: {...}\\nid: 3\\n\\n`): the event's own lines come first, as before ids.
    """

    def __init__(self, formatter: Formatter, ids: bool = True):
        self.formatter = formatter
        self.ids = ids  # off (the default, but for resumable streams): frames as `vllm serve` writes them
        self.next_id = 0
        self.terminal: GenerationChunk | None = None  # set by `stream_frames` when it comes
        # What ended a stream after its first byte (a timeout, a lost worker): set by
        # `stream_frames`. An error the worker reports comes in the terminal chunk instead.
        self.error: FleetError | None = None

    def frames(self, events: list[dict[str, Any]]) -> list[bytes]:
        return [self._frame(self.formatter.encode(event)) for event in events]

    def chunk_frames(self, chunk: GenerationChunk) -> list[bytes]:
        if chunk.error is not None:
            return self.frames(self.formatter.error_events(error_from_info(chunk.error)))
        return self.frames(self.formatter.stream_events(chunk))

    @property
    def ended(self) -> bool:
        """The frames given last were the response's last: its terminal chunk's, or an error's."""
        return self.terminal is not None or self.error is not None

    def end_frames(self) -> list[bytes]:
        marker = self.formatter.done_marker
        return [self._frame(marker)] if marker else []

    def error_frames(self, error: FleetError) -> list[bytes]:
        """The family's error events, then its end: the last frames of a failed stream."""
        return self.frames(self.formatter.error_events(error)) + self.end_frames()

    @classmethod
    def lost_frames(cls, family: type[Formatter], error: FleetError, first_id: int) -> list[bytes]:
        """The last frames of a stream that a reader with none of its state ends (a follower on
        another gateway, its relay dead), ids from `first_id`: the family's stateless error events
        (`Formatter.lost_events`), then its end."""
        writer = cls(family)  # type: ignore[arg-type] - the class: its encoding and end need no state
        writer.next_id = first_id
        return writer.frames(family.lost_events(error, first_id)) + writer.end_frames()

    def _frame(self, encoded: bytes) -> bytes:
        if not self.ids:
            return encoded
        frame = encoded[:-1] + b"id: %d\n\n" % self.next_id  # every encoded event ends with a blank line
        self.next_id += 1
        return frame


async def stream_frames(life: RequestLife, writer: EventWriter, first: GenerationChunk,
                        rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[list[bytes]]:
    """The frames of a started stream, a list per chunk, ending with the family's end (or its
    error events, on an error after the first byte). The request's life is settled at its terminal
    chunk (its unregistering on its way to Redis, its history stored) before the end goes out: a cancel sent right
    after the answer finds nothing, and the next turn of a session finds this one. Closing this
    early leaves the request to its owner, whose end cancels the run.

    Once every choice has had its finish, the frames wait for the terminal chunk, which follows
    at once (the worker publishes them together), and go out with it and the end: one write
    for the end of a response instead of three."""
    inter_token = metrics.INTER_TOKEN_LATENCY.labels(life.envelope.model)
    last_token_at = 0.0
    finished = 0  # choices whose last delta has come
    held: list[bytes] = []
    try:
        chunk = first
        while True:
            if chunk.token_count and not chunk.done:  # the gaps between token events, as the client reads them
                now = time.monotonic()
                if last_token_at:
                    inter_token.observe(now - last_token_at)
                last_token_at = now
            frames = held + writer.chunk_frames(chunk)
            life.count(chunk)
            if chunk.done:
                writer.terminal = chunk
                await life.settle(chunk)
                yield frames + writer.end_frames()
                return
            finished += chunk.finish_reason is not None
            if finished >= writer.formatter.n:
                held = frames
            else:
                held = []
                yield frames
            chunk = await anext(rest)
    except FleetError as exc:  # e.g. the request timed out mid-stream
        writer.error = exc
        life.failed(exc)
        yield held + writer.error_frames(exc)


class ClientDisconnected(Exception):
    """The client hung up: before the response started, or (caught in `SSEResponse`) during a stream."""


async def race_disconnect(request: Request, work):
    """Await `work`, or raise ClientDisconnected if the client hangs up first."""
    with CancelledOnDisconnect(request.receive):
        return await work


class CancelledOnDisconnect:
    """Inside it, the client's hang-up cancels the task that entered, at the await under way, and
    the block ends with ClientDisconnected; any other cancel goes on as it is. One asyncio task
    reads `receive`: the work stays in the request's task, where racing it in a task of its own
    costs a second task and an `asyncio.wait` per request."""

    def __init__(self, receive):
        self._receive = receive

    def __enter__(self) -> None:
        self._task = asyncio.current_task()
        self._inside = True
        self._cancelled = False
        self._listener = asyncio.ensure_future(_wait_for_disconnect(self._receive))
        self._listener.add_done_callback(self._heard)

    def _heard(self, listener: asyncio.Task) -> None:
        # A done callback runs while the task waits at an await inside the block (if `_inside`):
        # the cancel lands there.
        if self._inside and not listener.cancelled() and listener.exception() is None:
            self._cancelled = True
            self._task.cancel()

    def __exit__(self, kind, exc, traceback) -> None:
        self._inside = False
        self._listener.cancel()
        if self._cancelled and self._task.uncancel() == 0 and kind is asyncio.CancelledError:
            raise ClientDisconnected from exc


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class LastPart(bytes):
    """The last part of an SSE body, marked so that `SSEResponse` sends it with the end of the
    response: one write instead of two. Whatever wraps a body iterator (sessions, stored responses)
    passes its parts on as they are, which keeps the mark; a part that lost it costs a write more."""


class SSEResponse(StreamingResponse):
    """A stream of SSE parts, each part one send: Starlette's `StreamingResponse` less two costs of
    the hot path. Its last part (`LastPart`) goes out with the end of the body, not before an empty
    one. A client's disconnect cancels the stream (`CancelledOnDisconnect`), not an anyio task
    group around a second task: the stream runs in the request's own task."""

    media_type = "text/event-stream"

    def __init__(self, parts: AsyncIterator[bytes]):
        super().__init__(parts, headers=SSE_HEADERS)

    async def __call__(self, scope, receive, send) -> None:
        try:
            with CancelledOnDisconnect(receive):
                await self.stream_response(send, scope.get(BODY_SEND, send))
        except ClientDisconnected:
            pass  # the stream was cancelled where it stood, as Starlette's cancel scope does

    async def stream_response(self, send, body_send=None) -> None:
        """The start through `send`, the body's parts through `body_send` (the send under the
        middlewares, `accounting.BODY_SEND`)."""
        body_send = body_send or send
        last = b""
        # Closed on every way out: a cancel in `send` leaves the body waiting at a yield. Entered
        # before the response starts: a body that owns a run (`_sse_body`) ends it even if the
        # client is gone before the first byte (a body never started would never run its ending).
        async with aclosing(self.body_iterator) as parts:
            part = await anext(parts, None)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while part is not None:
                if last:  # a part came after the one marked last: send that one as it is
                    await body_send({"type": "http.response.body", "body": last, "more_body": True})
                if isinstance(part, LastPart):
                    last = part
                else:
                    last = b""
                    await body_send({"type": "http.response.body", "body": part, "more_body": True})
                part = await anext(parts, None)
        await body_send({"type": "http.response.body", "body": last, "more_body": False})


async def parts(of: list[bytes]) -> AsyncIterator[bytes]:
    """An SSE body of parts known in advance."""
    for part in of:
        yield part


