"""POST /invocations, `vllm serve`'s SageMaker-style entry point: one route for every request,
dispatched on the body's shape, as vLLM does: the first request model the body validates as, in
vLLM's order (chat, completion, then the pooling tasks: embed, classify, rerank, score, pooling),
among those the named model serves. `vllm serve` serves one model; here the model's workers say
what it serves (`kinds`); a model with no live worker is offered every route."""

from __future__ import annotations

import json

import pydantic
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.openai.chat import create_chat_completion
from gateway.api.openai.completions import create_completion
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.api.pooling.protocol import ClassifyRequest, EmbeddingRequest, PoolingRequest, RerankRequest, ScoreRequest
from gateway.api.pooling.routes import create_classify, create_embeddings, create_pooling, create_rerank, create_score
from gateway.http.errors import bad_request, error_body, invalid_json_message, is_json, json_response, not_json_message
from gateway.http.json_body import JSONRoute

router = APIRouter(route_class=JSONRoute)

# In vLLM's order: the first model a body validates as takes it. Each with the kind its workers answer.
HANDLERS = (("chat", ChatCompletionRequest, create_chat_completion), ("completion", CompletionRequest, create_completion),
            ("embed", EmbeddingRequest, create_embeddings), ("classify", ClassifyRequest, create_classify),
            ("rerank", RerankRequest, create_rerank), ("score", ScoreRequest, create_score),
            ("pooling", PoolingRequest, create_pooling))


# The body is read by hand (the first model it validates as wins); the schema says which it may be.
_BODY_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": f"#/components/schemas/{model.__name__}"} for _, model, _ in HANDLERS]}}}}}


@router.post("/invocations", openapi_extra=_BODY_SCHEMA)
async def invocations(request: Request) -> Response:
    content_type = request.headers.get("content-type")
    if not is_json(content_type):  # as FastAPI refuses it on every other route
        return bad_request(not_json_message(content_type))
    try:
        body = await request.json()  # a JSONRequest's: orjson's, strict (gateway/http/json_body.py)
    except json.JSONDecodeError as exc:
        return bad_request(invalid_json_message(exc))
    named = body.get("model") if isinstance(body, dict) else None
    served = request.app.state.fleet.registry.kinds_of(named if isinstance(named, str) else None)
    candidates = [(model, handler) for kind, model, handler in HANDLERS if served is None or kind in served]
    for model, handler in candidates:
        try:
            parsed = model.model_validate(body)
        except pydantic.ValidationError:
            continue
        return await handler(parsed, request)
    names = [model.__name__ for model, _ in candidates]
    return json_response(error_body(f"Cannot find suitable handler for request. Expected one of: {names}", 400,
                                    err_type="BadRequestError"), 400)
