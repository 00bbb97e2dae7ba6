"""The pooling endpoints, as `vllm serve` has them for a pooling model, served by the model's encoder workers.

POST /v1/embeddings (and Cohere's /v2/embed), /score (and /v1/score), /rerank (and /v1/rerank,
/v2/rerank), /classify and /pooling: parse, bound the inputs, queue for the model's workers (`serve_encoding`), write the
answer (answers.py). A model whose workers serve no such kind (a generation model asked for
embeddings) is refused before the queue, with a 400 naming what it serves.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.pooling import answers
from gateway.api.pooling.protocol import (
    ClassifyRequest,
    CohereEmbedRequest,
    EmbeddingRequest,
    EncoderRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from gateway.http.json_body import JSONRoute
from gateway.serve.encoding import serve_encoding
from gateway.serve.generation import new_envelope, request_json
from shared.envelopes import GenerationChunk, RequestEnvelope
from shared.errors import InvalidRequest

router = APIRouter(route_class=JSONRoute)

Write = Callable[[GenerationChunk, RequestEnvelope], Response]


async def _serve(kind: str, endpoint: str, body: EncoderRequest | CohereEmbedRequest, request: Request, write: Write,
                 api: str = "") -> Response:
    fleet = request.app.state.fleet
    limit = fleet.settings.max_encoder_inputs
    if body.pooled_inputs > limit:
        raise InvalidRequest(f"The request holds {body.pooled_inputs} inputs; one request may hold at most {limit} here "
                             "(--max-encoder-inputs). Send them in several requests.", param="input",
                             code="too_many_inputs")
    view = await fleet.registry.resolve(body.model)
    envelope = new_envelope(await request_json(request), kind, view.name, fleet.settings, body=body, api=api)
    own_timeout = body.timeout if body.timeout and body.timeout <= fleet.settings.request_timeout_s else None
    return await serve_encoding(request, fleet, envelope, endpoint, lambda terminal: write(terminal, envelope),
                                own_timeout)


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Response:
    return await _serve("embed", "embeddings", body, request, lambda terminal, envelope: answers.embeddings(
        terminal, envelope.request_id, int(envelope.arrival), envelope.model, body))


@router.post("/v2/embed")
async def create_cohere_embeddings(body: CohereEmbedRequest, request: Request) -> Response:
    return await _serve("embed", "embed", body, request, lambda terminal, envelope: answers.cohere_embed(
        terminal, envelope.request_id, body), api="cohere")


@router.post("/pooling")
async def create_pooling(body: PoolingRequest, request: Request) -> Response:
    return await _serve("pooling", "pooling", body, request, lambda terminal, envelope: answers.pooling(
        terminal, envelope.request_id, int(envelope.arrival), envelope.model, body))


@router.post("/classify")
async def create_classify(body: ClassifyRequest, request: Request) -> Response:
    return await _serve("classify", "classify", body, request, lambda terminal, envelope: answers.classify(
        terminal, envelope.request_id, int(envelope.arrival), envelope.model))


@router.post("/score")
@router.post("/v1/score")
async def create_score(body: ScoreRequest, request: Request) -> Response:
    return await _serve("score", "score", body, request, lambda terminal, envelope: answers.score(
        terminal, envelope.request_id, int(envelope.arrival), envelope.model))


@router.post("/rerank")
@router.post("/v1/rerank")
@router.post("/v2/rerank")
async def create_rerank(body: RerankRequest, request: Request) -> Response:
    return await _serve("rerank", "rerank", body, request, lambda terminal, envelope: answers.rerank(
        terminal, envelope.request_id, envelope.model, body))
