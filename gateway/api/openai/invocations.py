"""POST /invocations, `vllm serve`'s SageMaker-style entry point: one route for every generation
request, dispatched on the body's shape (a chat request first, then a completion), as vLLM does."""

from __future__ import annotations

import orjson
import pydantic
from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.openai.chat import create_chat_completion
from gateway.api.openai.completions import create_completion
from gateway.api.openai.protocol import ChatCompletionRequest, CompletionRequest
from gateway.http.errors import bad_request, error_body, invalid_json_message, is_json, json_response, not_json_message

router = APIRouter()

# In vLLM's order: the first model a body validates as takes it.
HANDLERS = ((ChatCompletionRequest, create_chat_completion), (CompletionRequest, create_completion))


# The body is read by hand (the first model it validates as wins); the schema says which it may be.
_BODY_SCHEMA = {"requestBody": {"required": True, "content": {"application/json": {"schema": {"anyOf": [
    {"$ref": f"#/components/schemas/{model.__name__}"} for model, _ in HANDLERS]}}}}}


@router.post("/invocations", openapi_extra=_BODY_SCHEMA)
async def invocations(request: Request) -> Response:
    content_type = request.headers.get("content-type")
    if not is_json(content_type):  # as FastAPI refuses it on every other route
        return bad_request(not_json_message(content_type))
    try:
        body = orjson.loads(await request.body())
    except orjson.JSONDecodeError as exc:
        return bad_request(invalid_json_message(exc))
    for model, handler in HANDLERS:
        try:
            parsed = model.model_validate(body)
        except pydantic.ValidationError:
            continue
        return await handler(parsed, request)
    names = [model.__name__ for model, _ in HANDLERS]
    return json_response(error_body(f"Cannot find suitable handler for request. Expected one of: {names}", 400,
                                    err_type="BadRequestError"), 400)
