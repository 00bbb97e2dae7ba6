"""Serving one generation request: the route every family shares, its envelope, its answer.

A family (gateway/api/) gives a request model, a `prepare` (the envelope to queue and the
`Formatter` of the answer) and optionally a `serve` that wraps `serve_generation` (chat's
sessions). `serve_generation` submits the request and answers it: SSE if it streams, else the
whole response at once, or, for a resumable stream, a run detached from its client
(gateway/serve/resumable.py). Its `RequestLife` (gateway/serve/life.py) owns the request's end.

Status codes are decided by the first chunk: the gateway waits for it before sending headers,
so a request the worker rejects (prompt too long, bad token ids) is a plain 4xx, as on
`vllm serve`. After the first byte, an error is a `data: {"error": ...}` event then
`data: [DONE]`.

Cancellation: a streaming response (`SSEResponse`) is cancelled when the client disconnects; a
non-streaming one races the generation against the client's `http.disconnect`. Either way the
request's life ends before its terminal chunk, which publishes the cancel to the workers.
"""

from __future__ import annotations

import inspect
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import orjson
from fastapi import APIRouter
from starlette.requests import Request
from starlette.responses import Response

from gateway import tenancy
from gateway.fleet.registry import ModelView
from gateway.fleet.runs import Fleet
from gateway.http import accounting
from gateway.http.auth import current_key
from gateway.http.errors import json_response
from gateway.serve.formatter import Formatter, request_timings
from gateway.serve.life import Hook, RequestLife
from gateway.serve.resumable import serve_resumable
from gateway.serve.sse import (
    ClientDisconnected,
    EventWriter,
    LastPart,
    SSEResponse,
    parts,
    race_disconnect,
    stream_frames,
)
from gateway.settings import GatewaySettings
from shared import tracing
from shared.envelopes import GenerationChunk, RequestEnvelope, SamplingOptions
from shared.errors import FleetError
from shared.logs import REQUEST_ID

# A family's part of a generation route: from the validated body (and the request, for its raw
# body) and the model's view, the envelope to queue and the formatter of the answer.
Prepare = Callable[[Any, Request, ModelView, GatewaySettings], Awaitable[tuple[RequestEnvelope, Formatter]]]


# How a family serves what `prepare` made: `serve_body` unless it wraps it (chat's sessions).
Serve = Callable[[Any, Request, Fleet, RequestEnvelope, Formatter], Awaitable[Response]]


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
                 body: Any = None, params: SamplingOptions | None = None, api: str = "") -> RequestEnvelope:
    """The envelope of a validated request (`body`: its parsed form, whose `timeout`, `stream` and
    `cancel_id` it reads; `api`: the API of `raw` where its kind has several), with the gateway's
    deadlines, for the tenant being served."""
    now = time.time()
    tenant = tenancy.current()
    accounting.note(model=model, arrival=now, tenant=tenant.name)
    timeout = settings.request_timeout_s
    if body is not None and body.timeout:
        timeout = min(body.timeout, timeout)
    return RequestEnvelope(
        request_id=secrets.token_hex(16), model=model, kind=kind, reply_to="", arrival=now,
        deadline=now + timeout, queue_deadline=now + min(settings.queue_timeout_s, timeout),
        stream=body is not None and body.stream, body=raw, params=params or SamplingOptions(),
        cancel_id=body.cancel_id if body is not None else None, batch_replies=True,
        client_request_id=REQUEST_ID.get(), traceparent=tracing.current_traceparent(),
        tenant=tenant.name, priority=tenant.priority, api=api,
    )


async def ask_worker(fleet: Fleet, envelope: RequestEnvelope) -> GenerationChunk:
    """The one chunk a worker answers a request with that is no generation (tokenize), for the
    tenant being served; the worker's error raised."""
    async with fleet.submit(envelope, current_key()) as run:
        answer, _ = await run.first_or_error()
    return answer


def life_of(fleet: Fleet, envelope: RequestEnvelope, endpoint: str, hooks: list[Hook] = ()) -> RequestLife:
    """The life of a request of the tenant being served, with the history hooks of its family."""
    life = RequestLife(fleet, envelope, endpoint, current_key())
    for hook in hooks:
        life.on_end(hook)
    return life


async def serve_generation(request: Request, fleet: Fleet, envelope: RequestEnvelope, formatter: Formatter, *,
                           resumable: bool = False, hooks: list[Hook] = ()) -> Response:
    """Answer one generation request: SSE if it streams, else the whole response at once.

    `resumable` (a streaming request's `"resumable": true`): the generation runs detached from
    the client and survives its disconnect (gateway/serve/resumable.py). `hooks` store the
    request's history at its end (gateway/serve/life.py)."""
    life = life_of(fleet, envelope, formatter.endpoint, hooks)
    if resumable:
        return await serve_resumable(request, fleet, life, formatter)
    async with AsyncExitStack() as owner:
        run = await owner.enter_async_context(life)
        try:
            first, rest = await race_disconnect(request, run.first_or_error())
        except (FleetError, ClientDisconnected) as exc:
            refusal = _refusal(fleet, life, formatter, exc)
        else:
            refusal = None
            life.first_chunk(first)
            if envelope.stream:  # the stream's body owns the request's life from here (`owner.pop_all()`)
                writer = EventWriter(formatter, fleet.settings.sse_event_ids)
                return SSEResponse(_sse_body(owner.pop_all(), life, writer, first, rest))
            life.count(first)
            body = formatter.response(first)
            await life.settle(first)
    if refusal is not None:  # its life ended with the block: its history (a session's lock) first
        await life.stored()
        return refusal
    if formatter.include_timings:
        body["timings"] = request_timings(first, envelope.arrival)
    return json_response(body)


def _refusal(fleet: Fleet, life: RequestLife, formatter: Formatter, error: FleetError | ClientDisconnected) -> Response:
    """The answer to a request that ended before its first chunk."""
    if isinstance(error, ClientDisconnected):
        life.failed(error)
        return Response(status_code=499)  # nobody is listening; the run is cancelled
    if error.in_stream and life.envelope.stream:
        # The engine's server had begun its stream (vLLM checks some parameters only when the
        # engine starts): 200, then the error as an event, as `vllm serve` answers.
        life.failed(error)
        frames = EventWriter(formatter, fleet.settings.sse_event_ids).error_frames(error)
        return SSEResponse(parts([LastPart(b"".join(frames))]))
    life.failed(error, refused=True)
    return formatter.error_response(error)


async def _sse_body(owner: AsyncExitStack, life: RequestLife, writer: EventWriter, first: GenerationChunk,
                    rest: AsyncIterator[GenerationChunk]) -> AsyncIterator[bytes]:
    """A stream's parts; the request's life ends with it, on every way out (a client gone cancels the run)."""
    async with owner:
        async for frames in stream_frames(life, writer, first, rest):
            if frames:
                part = b"".join(frames)
                yield LastPart(part) if writer.ended else part
