"""Serving one encoder request (embeddings, score, rerank, classify, pooling): submit, one answer.

The second kind of work travels the generation's path: the same envelope and queue, the same
`RequestLife` (gateway/serve/life.py) owning its end, so keys, limits (tokens per window count
the inputs' tokens), fair share, deadlines, cancels, metrics and accounting are the same. Only the
answer differs: an encoder's is one terminal chunk (never a stream), which the family writes
(`write`, gateway/api/pooling/answers.py). A client gone before it comes cancels the request on
its worker, as a non-streaming generation's does.

A request of many inputs (embeddings, classify, pooling: more than `--encoder-part-inputs`) is
served in parts, so that one large indexing job uses every worker of the model, not one: its
`input` list is cut into parts, each queued as a request of its own that any worker may take
(each with a life of its own: its own run, cancel and deadline), a few at a time, two per live
worker of the model, so that each worker takes its share as it frees instead of the first to read
taking them all. The request itself is admitted once against its key's limits (one request, its
inputs' tokens), and answered once, with the parts' outputs in input order and their tokens
summed. The first part to fail (an error, a cancel of the request's cancel_id, its deadline) ends
the others, and the request with its error; a client gone ends every part.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import metrics
from gateway.fleet.runs import Fleet
from gateway.http import accounting
from gateway.http.auth import current_key
from gateway.http.errors import fleet_error_response
from gateway.serve.generation import life_of
from gateway.serve.life import RequestLife
from gateway.serve.sse import ClientDisconnected, race_disconnect
from shared.envelopes import GenerationChunk, RequestEnvelope, Usage
from shared.errors import Cancelled, FleetError, RequestTimeout, ServiceUnavailable


async def serve_encoding(request: Request, fleet: Fleet, envelope: RequestEnvelope, endpoint: str,
                         write: Callable[[GenerationChunk], Response], timeout: float | None = None) -> Response:
    """Answer one encoder request: its worker's outputs, written by the family; or its error.
    `timeout`: the client's own, when it set the deadline (an encoding cut short by it is a 408)."""
    parts = parts_of(envelope, fleet.settings.encoder_part_inputs)
    if len(parts) > 1:
        return await _serve_parts(request, fleet, envelope, parts, endpoint, write, timeout)
    life = life_of(fleet, envelope, endpoint)
    async with life as run:
        try:
            terminal, _ = await race_disconnect(request, run.first_or_error())
            if terminal.pooled is None:  # no outputs and no error: its worker stopped it
                raise _stopped(terminal, timeout)
        except ClientDisconnected as exc:
            life.failed(exc)
            return Response(status_code=499)  # nobody is listening; the run is cancelled
        except FleetError as exc:
            life.failed(exc, refused=True)
            return fleet_error_response(exc)
        life.count(terminal)
        response = write(terminal)
        await life.settle(terminal)
    return response


# The kinds whose requests hold a list of inputs, one output each, that can be split.
SPLIT_KINDS = frozenset({"embed", "classify", "pooling"})


def parts_of(envelope: RequestEnvelope, size: int) -> list[RequestEnvelope]:
    """The parts a request is served in: its `input` list cut into lists of at most `size` inputs,
    each a request of its own; or the request alone, if it holds no more (or `size` is 0)."""
    inputs = envelope.body.get("input") if envelope.kind in SPLIT_KINDS and not envelope.api else None
    if size <= 0 or not isinstance(inputs, list) or len(inputs) <= size or not isinstance(inputs[0], (str, list)):
        return [envelope]  # a list of token ids is one input
    return [msgspec.structs.replace(envelope, request_id=uuid.uuid4().hex,
                                    body={**envelope.body, "input": inputs[start:start + size]})
            for start in range(0, len(inputs), size)]


async def _serve_parts(request: Request, fleet: Fleet, envelope: RequestEnvelope, parts: list[RequestEnvelope],
                       endpoint: str, write: Callable[[GenerationChunk], Response], timeout: float | None) -> Response:
    fleet.check_open(envelope)
    grant = await fleet.limits.admit(envelope, current_key())  # once, for the whole request
    try:
        try:
            answers = await race_disconnect(request, _run_parts(fleet, parts, endpoint, timeout))
        except ClientDisconnected:
            return Response(status_code=499)  # nobody is listening; every part is cancelled
        except FleetError as exc:
            return fleet_error_response(exc)
        terminal = _joined([answer for answer, _ in answers])
        if grant is not None:
            grant.count(terminal)
        accounting.note(prompt_tokens=terminal.usage.prompt_tokens, completion_tokens=0,
                        worker=",".join(sorted({worker for _, worker in answers if worker})) or None,
                        engine_request_id=envelope.request_id)
        return write(terminal)
    finally:
        fleet.spawn(fleet.limits.release(grant))


async def _run_parts(fleet: Fleet, parts: list[RequestEnvelope], endpoint: str,
                     timeout: float | None) -> list[tuple[GenerationChunk, str]]:
    """The parts' answers and their workers, in order; or the first part's error, raised once
    every other part is stopped."""
    view = fleet.registry.models.get(parts[0].model)
    workers = sum(1 for worker in view.workers if parts[0].kind in worker.kinds and not worker.draining) if view else 0
    window = asyncio.Semaphore(max(2, 2 * workers))

    async def one(part: RequestEnvelope) -> tuple[GenerationChunk, str]:
        async with window:
            with accounting.apart():
                return await _run_part(fleet, part, endpoint, timeout)

    metrics.REQUEST_PARTS.labels(parts[0].model).inc(len(parts))
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(one(part)) for part in parts]
    except BaseExceptionGroup as failed:
        first = next((exc for exc in failed.exceptions if isinstance(exc, FleetError)), None)
        if first is None:
            raise
        raise first from None
    return [task.result() for task in tasks]


async def _run_part(fleet: Fleet, part: RequestEnvelope, endpoint: str,
                    timeout: float | None) -> tuple[GenerationChunk, str]:
    # Its own time in the queue, from now: a part waits for those before it to free a worker.
    part.arrival = time.time()
    part.queue_deadline = min(part.deadline, part.arrival + fleet.settings.queue_timeout_s)
    life = RequestLife(fleet, part, endpoint)  # no key: the request was admitted as a whole
    async with life as run:
        try:
            terminal, _ = await run.first_or_error()
            if terminal.pooled is None:
                raise _stopped(terminal, timeout)
        except FleetError as exc:
            life.failed(exc, refused=True)
            raise
        life.count(terminal)
        await life.settle(terminal)
    return terminal, run.worker_id


def _joined(answers: list[GenerationChunk]) -> GenerationChunk:
    """One answer of the parts' answers: their outputs in order, their tokens summed."""
    tokens = sum(answer.usage.prompt_tokens for answer in answers if answer.usage is not None)
    return msgspec.structs.replace(answers[0], pooled=[pooled for answer in answers for pooled in answer.pooled],
                                   usage=Usage(prompt_tokens=tokens))


def _stopped(terminal: GenerationChunk, timeout: float | None) -> FleetError:
    """Why a request ended without an answer: its deadline passed (the client's `timeout`, or the
    gateway's --request-timeout), or a cancel (POST /v1/cancel) came."""
    if terminal.stop_reason == "deadline" and timeout is not None:
        return RequestTimeout(f"The request's timeout ({timeout:g} s) ran out before the model answered; an "
                              "encoding has nothing to give before it ends. Allow it more time.")
    if terminal.stop_reason == "deadline":
        return ServiceUnavailable("The request timed out before the model answered.", code="request_timeout")
    return Cancelled("The request was cancelled (POST /v1/cancel, by its cancel_id or session) before it was "
                     "answered.")
