"""Serving one encoder request (embeddings, score, rerank, classify, pooling): submit, one answer.

The second kind of work travels the generation's path: the same envelope and queue, the same
`RequestLife` (gateway/serve/life.py) owning its end, so keys, limits (tokens per window count
the inputs' tokens), fair share, deadlines, cancels, metrics and accounting are the same. Only the
answer differs: an encoder's is one terminal chunk (never a stream), which the family writes
(`write`, gateway/api/pooling/answers.py). A client gone before it comes cancels the request on
its worker, as a non-streaming generation's does.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import Response

from gateway.fleet.runs import Fleet
from gateway.http.errors import fleet_error_response
from gateway.serve.generation import life_of
from gateway.serve.sse import ClientDisconnected, race_disconnect
from shared.envelopes import GenerationChunk, RequestEnvelope
from shared.errors import Cancelled, FleetError, RequestTimeout, ServiceUnavailable


async def serve_encoding(request: Request, fleet: Fleet, envelope: RequestEnvelope, endpoint: str,
                         write: Callable[[GenerationChunk], Response], timeout: float | None = None) -> Response:
    """Answer one encoder request: its worker's outputs, written by the family; or its error.
    `timeout`: the client's own, when it set the deadline (an encoding cut short by it is a 408)."""
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
