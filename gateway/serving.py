"""Serve one generation over HTTP: submit it, then stream SSE or answer once.

Both API families (chat, completions) go through `serve_generation`; they differ only in the
`Formatter` that turns chunks into their JSON shapes.

Status codes are decided by the first chunk: the gateway waits for it before sending headers,
so a request the worker rejects (prompt too long, bad token ids) is a plain 4xx, as on
`vllm serve`. After the first byte, an error is a `data: {"error": ...}` event then
`data: [DONE]`.

A stream's bytes are by default exactly those `vllm serve` sends (`data: {...}` frames, no `id:`
lines), since clients that read SSE line by line (`vllm bench serve`) take an `id:` line for part
of the data. A resumable stream (`gateway.streams`) gives every event `id: <n>`, its 0-based
position in the response (the end marker included), given by `EventWriter` and nowhere else: a
client that lost its connection names the last id it read, and the events after it are replayed.
`--sse-event-ids` gives every stream ids. Every stream is sent with `Cache-Control: no-cache`
and `X-Accel-Buffering: no`, so that no proxy caches or buffers it.

Cancellation: a streaming response (`SSEResponse`) is cancelled when the client disconnects; a
non-streaming one races the generation against the client's `http.disconnect`. Either way the
`Run` is closed before its terminal chunk, which publishes the cancel to the workers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, aclosing
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import accounting, metrics, tenancy
from gateway.errors import fleet_error_body, fleet_error_response, json_response
from gateway.fleet import Fleet, GatewaySettings, Run
from gateway.protocol import GenerationRequest
from gateway.registry import ModelView
from shared import tracing
from shared.envelopes import GenerationChunk, RequestEnvelope, SamplingOptions, Usage
from shared.errors import FleetError, error_from_info
from shared.logs import REQUEST_ID

SSE_DONE = b"data: [DONE]\n\n"
# Of every SSE answer: no cache may keep it, and nginx must pass each event on as it comes.
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def usage_body(usage: Usage | None, details: bool = False) -> dict[str, Any]:
    """OpenAI usage; `details` adds vLLM's null detail fields (whole responses)."""
    usage = usage or Usage()
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    elif details:
        body["prompt_tokens_details"] = None
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    elif details:
        body["completion_tokens_details"] = None
    return body


class Formatter:
    """Turns one request's chunks into an API family's JSON: SSE events, or the whole response.

    The shapes are `vllm serve`'s, key for key: a client switching from it sees no difference.
    Subclasses give the choice objects (`_choice`) and the whole response (`response`).
    """

    endpoint: str
    id_prefix: str
    chunk_object: str
    # SSE framing: OpenAI's unnamed `data:` events closed by `data: [DONE]`; the Anthropic and
    # Responses families name each event after its "type" (`event: message_start`) and close
    # with their own last event instead of a marker.
    named_events = False
    done_marker: bytes | None = SSE_DONE
    include_timings = False
    n = 1  # choices; a family whose formatter has its own __init__ (Anthropic, Responses) has one

    def __init__(self, request: GenerationRequest, envelope: RequestEnvelope):
        self.response_id = f"{self.id_prefix}-{envelope.request_id}"
        self.created = int(envelope.arrival)
        self.model = envelope.model
        self.n = request.choice_count  # n, or n per prompt of a completion with several
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)
        self.include_timings = request.include_timings or bool(options and options.include_timings)
        self.arrival = envelope.arrival
        self._prompt_tokens = 0
        self._tokens = [0] * self.n  # completion tokens per choice so far
        self._finished = [False] * self.n
        self._fingerprint: str | None = None

    def _chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The SSE events for one delta or terminal chunk."""
        if chunk.usage is not None:
            self._prompt_tokens = chunk.usage.prompt_tokens
        if chunk.system_fingerprint is not None:
            self._fingerprint = chunk.system_fingerprint
        events = self._opening_events(chunk)
        if chunk.done:
            return events + self._closing_events(chunk)
        self._tokens[chunk.choice_index] += chunk.token_count
        events.append(self._delta_event(chunk))
        return events

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        """The whole non-streaming response, from the terminal chunk's candidates."""
        raise NotImplementedError

    def encode(self, event: dict[str, Any]) -> bytes:
        """One SSE event on the wire, as `vllm serve` writes it: compact JSON, but for an error in
        an OpenAI stream, which vLLM writes with `json.dumps` (spaces after separators)."""
        if self.named_events:
            return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        if "error" in event:
            return b"data: " + json.dumps(event).encode() + b"\n\n"
        return sse(event)

    def error_response(self, error: FleetError) -> Response:
        """A refusal before the stream starts, in the family's error shape."""
        return fleet_error_response(error)

    def error_events(self, error: FleetError) -> list[dict[str, Any]]:
        """The events that end a stream on an error after its first byte."""
        return [fleet_error_body(error)]

    def _choice(self, index: int, chunk: GenerationChunk | None, finish: str | None) -> dict[str, Any]:
        """One choice of a stream chunk; `chunk` None for the empty finish of a silent choice."""
        raise NotImplementedError

    def _opening_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """Events owed before this chunk's own (chat's role chunks); counted before its tokens."""
        return []

    def _running_usage(self, index: int) -> dict[str, Any] | None:
        """`continuous_usage_stats`: the usage of choice `index` so far, on every chunk."""
        if not self.continuous_usage:
            return None
        done = self._tokens[index]
        usage = {"prompt_tokens": self._prompt_tokens, "total_tokens": self._prompt_tokens + done,
                 "completion_tokens": done}
        if self.endpoint == "chat":
            usage["completion_tokens_details"] = None
        return usage

    def _delta_event(self, chunk: GenerationChunk) -> dict[str, Any]:
        index = chunk.choice_index
        finish = chunk.finish_reason
        self._finished[index] = self._finished[index] or finish is not None
        return self._finishing(self._chunk([self._choice(index, chunk, finish)], self._running_usage(index)), finish)

    def _finishing(self, event: dict[str, Any], finish: str | None) -> dict[str, Any]:
        # Without a usage chunk to close the stream, each choice's finish carries the fingerprint.
        if finish is not None and not self.include_usage and self._fingerprint is not None:
            event["system_fingerprint"] = self._fingerprint
        return event

    def _closing_events(self, terminal: GenerationChunk) -> list[dict[str, Any]]:
        """A finish for every choice that has none yet, then the usage chunk if asked for."""
        events = []
        for i in range(self.n):
            if not self._finished[i]:
                self._finished[i] = True
                finish = terminal.finish_reason or "stop"
                event = self._chunk([self._choice(i, None, finish)], self._running_usage(i))
                events.append(self._finishing(event, finish))
        if self.include_usage:
            event = self._chunk([], usage_body(terminal.usage))
            if self._fingerprint is not None:
                event["system_fingerprint"] = self._fingerprint
            events.append(event)
        if self.include_timings:  # on the usage chunk, or on a chunk of its own
            if not self.include_usage:
                events.append(self._chunk([]))
            events[-1]["timings"] = request_timings(terminal, self.arrival)
        return events


def request_timings(terminal: GenerationChunk, arrival: float) -> dict[str, float | None]:
    """One request's stage times, seconds: queue (arrival to a worker's claim), prefill (to the
    first token), decode (first token to last), relay (the worker's end to this gateway), total
    (arrival to now), time to first token (arrival to the engine's first token), and completion
    tokens per second of decode. Worker and gateway clocks meet in `relay` and `ttft`, which are
    only as right as they agree."""
    now = time.time()
    worker = terminal.timings or {}
    decode = worker.get("decode_s")
    tokens = terminal.usage.completion_tokens if terminal.usage is not None else 0
    finished_at, first_token_at = worker.get("finished_at"), worker.get("first_token_at")
    return {"queue_s": worker.get("queue_s"), "prefill_s": worker.get("prefill_s"), "decode_s": decode,
            "relay_s": max(0.0, now - finished_at) if finished_at else None, "total_s": now - arrival,
            "ttft_s": max(0.0, first_token_at - arrival) if first_token_at else None,
            "completion_tokens_per_s": tokens / decode if decode else None}


# A family's part of a generation route: from the validated body (and the request, for its raw
# body) and the model's view, the envelope to queue and the formatter of the answer.
Prepare = Callable[[Any, Request, ModelView, GatewaySettings], Awaitable[tuple[RequestEnvelope, "Formatter"]]]


# How a family serves what `prepare` made: `serve_body` unless it wraps it (chat's sessions).
Serve = Callable[[Any, Request, Fleet, RequestEnvelope, "Formatter"], Awaitable[Response]]


async def serve_body(body: Any, request: Request, fleet: Fleet, envelope: RequestEnvelope,
                     formatter: Formatter) -> Response:
    return await serve_generation(request, fleet, envelope, formatter, resumable=body.resumable)


def generation_route(router: APIRouter, path: str, body_model: type, prepare: Prepare,
                     serve: Serve = serve_body) -> Callable[[Any, Request], Awaitable[Response]]:
    """Add `POST path`, the route every generation family shares: validate the body as
    `body_model`, resolve its model, let the family `prepare` the envelope and formatter, serve.
    A family differs in its request model, its `prepare` and its `serve` only, never in a copied route.
    Returns the route's handler, for routes that dispatch to it (`/invocations`)."""
    async def create(body, request: Request) -> Response:
        fleet = request.app.state.fleet
        view = await fleet.registry.resolve(body.model)
        envelope, formatter = await prepare(body, request, view, fleet.settings)
        return await serve(body, request, fleet, envelope, formatter)

    keyword = inspect.Parameter.POSITIONAL_OR_KEYWORD
    create.__signature__ = inspect.Signature(  # what FastAPI validates and documents
        [inspect.Parameter("body", keyword, annotation=body_model), inspect.Parameter("request", keyword,
                                                                                       annotation=Request)],
        return_annotation=Response)
    router.add_api_route(path, create, methods=["POST"], name=f"create {body_model.__name__}")
    return create


async def request_json(request: Request) -> dict[str, Any]:
    """The request body as the client sent it (FastAPI has read and validated it already)."""
    return orjson.loads(await request.body())


def output_ceiling(settings: GatewaySettings) -> int:
    """The most output tokens the request being served may ask for: the gateway's ceiling, or its
    key's if lower (0: none)."""
    ceilings = [c for c in (settings.max_output_tokens, tenancy.current().max_tokens) if c > 0]
    return min(ceilings, default=0)


def new_envelope(raw: dict[str, Any], kind: str, model: str, settings: GatewaySettings, *,
                 body: GenerationRequest | None = None, params: SamplingOptions | None = None) -> RequestEnvelope:
    """The envelope of a validated request (`body`: its parsed form), with the gateway's deadlines."""
    now = time.time()
    accounting.note(model=model, arrival=now, tenant=tenancy.current().name)
    timeout = settings.request_timeout_s
    if body is not None and body.timeout:
        timeout = min(body.timeout, timeout)
    return RequestEnvelope(
        request_id=uuid.uuid4().hex, model=model, kind=kind, reply_to="", arrival=now,
        deadline=now + timeout, queue_deadline=now + min(settings.queue_timeout_s, timeout),
        stream=body is not None and body.stream, body=raw, params=params or SamplingOptions(),
        cancel_id=body.cancel_id if body is not None else None, batch_replies=True,
        client_request_id=REQUEST_ID.get(), traceparent=tracing.current_traceparent(),
        tenant=tenancy.current().name, priority=tenancy.current().priority,
    )


async def serve_generation(request: Request, fleet: Fleet, envelope: RequestEnvelope,
                           formatter: Formatter, *, resumable: bool = False) -> Response:
    """Answer one generation request: SSE if it streams, else the whole response at once.

    `resumable` (a streaming request's `"resumable": true`): the generation runs detached from
    the client and survives its disconnect (`gateway.streams`)."""
    if resumable:
        # Imported here: gateway.streams builds on this module (EventWriter, stream_frames).
        from gateway.streams import serve_resumable

        return await serve_resumable(request, fleet, envelope, formatter)
    started = time.monotonic()
    async with AsyncExitStack() as owner:
        run = await owner.enter_async_context(fleet.submit(envelope))
        metrics.OPEN_STREAMS.inc()
        try:
            first, rest = await race_disconnect(request, run.first_or_error())
        except BaseException as exc:
            finish_run(run, envelope, formatter, started, exc)
            if isinstance(exc, FleetError) and exc.in_stream and envelope.stream:
                # The engine's server had begun its stream (vLLM checks some parameters only when the
                # engine starts): 200, then the error as an event, as `vllm serve` answers.
                frames = EventWriter(formatter, fleet.settings.sse_event_ids).error_frames(exc)
                return SSEResponse(_parts([LastPart(b"".join(frames))]))
            if isinstance(exc, FleetError):
                return formatter.error_response(exc)
            if isinstance(exc, ClientDisconnected):
                return Response(status_code=499)  # nobody is listening; the run is cancelled
            raise
        record_first_token(first, envelope)
        if envelope.stream:  # the stream's body owns the run from here (`owner.pop_all()`)
            writer = EventWriter(formatter, fleet.settings.sse_event_ids)
            return SSEResponse(_sse_body(owner.pop_all(), run, envelope, writer, first, rest, started))
        await run.release()
        finish_run(run, envelope, formatter, started, None)
    if first.error is not None:
        return formatter.error_response(error_from_info(first.error))
    _count_tokens(first, envelope)
    body = formatter.response(first)
    if formatter.include_timings:
        body["timings"] = request_timings(first, envelope.arrival)
    return json_response(body)


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

    def _frame(self, encoded: bytes) -> bytes:
        if not self.ids:
            return encoded
        frame = encoded[:-1] + b"id: %d\n\n" % self.next_id  # every encoded event ends with a blank line
        self.next_id += 1
        return frame


async def stream_frames(run: Run, envelope: RequestEnvelope, writer: EventWriter, first: GenerationChunk,
                        rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[list[bytes]]:
    """The frames of a started stream, a list per chunk, ending with the family's end (or its
    error events, on an error after the first byte). The run is released at its terminal chunk;
    closing this early leaves the run to the caller, who closes it (which cancels it).

    Once every choice has had its finish, the frames wait for the terminal chunk, which follows
    at once (the worker publishes them together), and go out with it and the end: one write
    for the end of a response instead of three."""
    inter_token = metrics.INTER_TOKEN_LATENCY.labels(envelope.model)
    last_token_at = 0.0
    finished = 0  # choices whose last delta has come
    held: list[bytes] = []
    try:
        chunk = first
        while True:
            if chunk.done:
                await run.release()
                writer.terminal = chunk
            elif chunk.token_count:  # the gaps between token events, as the client reads them
                now = time.monotonic()
                if last_token_at:
                    inter_token.observe(now - last_token_at)
                last_token_at = now
            frames = held + writer.chunk_frames(chunk)
            _count_tokens(chunk, envelope)
            if chunk.done:
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
                await self.stream_response(send)
        except ClientDisconnected:
            pass  # the stream was cancelled where it stood, as Starlette's cancel scope does

    async def stream_response(self, send) -> None:
        last = b""
        # Closed on every way out: a cancel in `send` leaves the body waiting at a yield. Entered
        # before the response starts: a body that owns a run (`_sse_body`) ends it even if the
        # client is gone before the first byte (a body never started would never run its ending).
        async with aclosing(self.body_iterator) as parts:
            part = await anext(parts, None)
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            while part is not None:
                if last:  # a part came after the one marked last: send that one as it is
                    await send({"type": "http.response.body", "body": last, "more_body": True})
                if isinstance(part, LastPart):
                    last = part
                else:
                    last = b""
                    await send({"type": "http.response.body", "body": part, "more_body": True})
                part = await anext(parts, None)
        await send({"type": "http.response.body", "body": last, "more_body": False})


async def _parts(parts: list[bytes]) -> AsyncIterator[bytes]:
    for part in parts:
        yield part


async def _sse_body(owner: AsyncExitStack, run: Run, envelope: RequestEnvelope, writer: EventWriter,
                    first: GenerationChunk, rest: AsyncIterator[GenerationChunk],
                    started: float) -> AsyncIterator[bytes]:
    error: BaseException | None = None
    async with owner:  # `Fleet.submit`'s ending, on every way out of the stream
        try:
            async for frames in stream_frames(run, envelope, writer, first, rest):
                if frames:
                    part = b"".join(frames)
                    yield LastPart(part) if writer.ended else part
            error = writer.error
        except BaseException as exc:  # the client went away: close the run, which cancels it
            error = exc
            raise
        finally:
            finish_run(run, envelope, writer.formatter, started, error)


def time_to_first_token(chunk: GenerationChunk, arrival: float) -> float | None:
    """Seconds from the gateway's arrival to the first token, if `chunk` is the first with one: as
    relayed, for a stream; when the engine produced it, for a whole answer (its terminal chunk comes
    at the end, and the worker says when the first token came; the two clocks meet here)."""
    if not chunk.first_token:
        return None
    first_token_at = (chunk.timings or {}).get("first_token_at") if chunk.done else None
    return max(0.0, (first_token_at or time.time()) - arrival)


def record_first_token(chunk: GenerationChunk, envelope: RequestEnvelope) -> None:
    if (ttft := time_to_first_token(chunk, envelope.arrival)) is not None:
        metrics.TIME_TO_FIRST_TOKEN.labels(envelope.model).observe(ttft)
        accounting.note(ttft_s=ttft)


def _count_tokens(chunk: GenerationChunk, envelope: RequestEnvelope) -> None:
    if chunk.done and chunk.usage is not None:
        metrics.RELAYED_TOKENS.labels(envelope.model).inc(chunk.usage.completion_tokens)
        accounting.note(prompt_tokens=chunk.usage.prompt_tokens, completion_tokens=chunk.usage.completion_tokens,
                        worker_timings=chunk.timings, finish_reason=chunk.finish_reason)


def finish_run(run: Run, envelope: RequestEnvelope, formatter: Formatter, started: float,
               error: BaseException | None) -> None:
    """Close the run (cancelling it if it has not ended) and count the request: once per request."""
    reason = "deadline" if isinstance(error, FleetError) and error.code == "request_timeout" else "disconnect"
    accounting.note(worker=run.worker_id or None, engine_request_id=envelope.request_id,
                    cancel=None if run.finished else reason)
    run.close(reason)
    metrics.OPEN_STREAMS.dec()
    status = error.status if isinstance(error, FleetError) else (499 if error is not None else 200)
    accounting.note(status=status)  # an error after the first byte counts by its own status
    metrics.REQUEST_LATENCY.labels(envelope.model, formatter.endpoint).observe(time.monotonic() - started)
