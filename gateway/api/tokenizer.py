"""POST /tokenize and /detokenize, as `vllm serve` has them, answered by a worker of the model.

The gateway holds no tokenizer: the request travels the model's queue like a generation, and
the worker's own tokenizer (vLLM's `ServingTokenization`) answers it in one terminal chunk.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.openai.protocol import TokenizerRequest
from gateway.http.errors import json_response
from gateway.http.json_body import JSONRoute
from gateway.serve.generation import ask_worker, new_envelope, request_json

router = APIRouter(route_class=JSONRoute)


async def _ask_worker(kind: str, body: TokenizerRequest, request: Request) -> Response:
    fleet = request.app.state.fleet
    view = await fleet.registry.resolve(body.model)
    envelope = new_envelope(await request_json(request), kind, view.name, fleet.settings)
    return json_response((await ask_worker(fleet, envelope)).result)


@router.post("/tokenize")
async def tokenize(body: TokenizerRequest, request: Request) -> Response:
    return await _ask_worker("tokenize", body, request)


@router.post("/detokenize")
async def detokenize(body: TokenizerRequest, request: Request) -> Response:
    return await _ask_worker("detokenize", body, request)
