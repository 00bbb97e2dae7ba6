"""The one builder of OpenAI error bodies, and the handlers that use it.

Body: {"error": {"message", "type", "param", "code"}}, with vLLM's `type` names, so clients
written against `vllm serve` read our errors the same way. A request model's own rules raise
`FieldRuleError` inside pydantic's validation; the handler answers it with the rule's message and
param. On the Anthropic routes every error takes Anthropic's shape instead (anthropic_errors.py).
"""

from __future__ import annotations

import math
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gateway.http import anthropic_errors
from shared.errors import FleetError, Overloaded


class FieldRuleError(ValueError):
    """A schema rule broken by a request; `param` names the field, as vLLM does. A rule of OpenAI's
    that vLLM does not check answers in OpenAI's words: `err_type` invalid_request_error, no code."""

    def __init__(self, message: str, param: str | None = None, *, err_type: str = "BadRequestError",
                 code: str | int | None = 400):
        super().__init__(message)
        self.param = param
        self.err_type = err_type
        self.code = code


def openai_rule(message: str, param: str) -> FieldRuleError:
    """A rule the OpenAI API checks and `vllm serve` does not (docs/compatibility.md)."""
    return FieldRuleError(message, param, err_type="invalid_request_error", code=None)


ERROR_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    422: "UnprocessableEntityError",
    429: "RateLimitError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


_STATUS = object()


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None,
               code: Any = _STATUS) -> dict[str, Any]:
    """The error body; its `code` is the status (vLLM's way) unless given (None for OpenAI's own rules)."""
    err_type = err_type or ERROR_TYPES.get(status) or HTTPStatus(status).phrase
    return {"error": {"message": message, "type": err_type, "param": param,
                      "code": status if code is _STATUS else code}}


def fleet_error_body(error: FleetError) -> dict[str, Any]:
    return error_body(error.message, error.status, error.param, error.err_type)


def json_response(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)


def fleet_error_response(error: FleetError) -> Response:
    headers = None
    if isinstance(error, Overloaded):
        headers = {"Retry-After": str(max(1, math.ceil(error.retry_after)))}
    return json_response(fleet_error_body(error), error.status, headers)


# pydantic's own markers in an error's `loc` (wrappers, union branches), which vLLM 0.32 leaves out
# of `param` (its clean_loc_for_param): `input: 42` is param "body.input", not "body.input.str".
_LOC_MARKERS = frozenset({
    "function-wrap", "function-after", "function-before", "function-plain", "json-or-python", "lax-or-strict",
    "chain", "default", "nullable", "tagged-union", "union", "call", "arguments", "is-instance", "is-subclass",
    "callable", "str", "int", "float", "bool", "bytes", "bytearray", "list", "tuple", "dict", "set", "frozenset",
    "complex", "none", "nonetype"})


def _loc_param(loc: tuple) -> str:
    return ".".join(str(p) for p in loc
                    if not any(c in str(p) for c in "[]{}()") and str(p).lower() not in _LOC_MARKERS)


def _describe(error: dict) -> str:
    error = {k: v for k, v in error.items() if k in ("type", "loc", "msg")}
    error["loc"] = _loc_param(tuple(error.get("loc", ())))
    return str(error)


async def _on_validation_error(_request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    rule = next((e["ctx"]["error"] for e in errors if isinstance((e.get("ctx") or {}).get("error"), FieldRuleError)),
                None)
    if rule is not None:  # a rule vLLM checks in its request model: its own error type and message
        return json_response(error_body(str(rule), 400, rule.param, rule.err_type, rule.code), 400)
    label = "error" if len(errors) == 1 else "errors"
    message = f"{len(errors)} validation {label}:\n" + "\n".join(f"  {_describe(e)}" for e in errors[:10])
    param = _loc_param(tuple(errors[0].get("loc", ()))) if errors else None
    return json_response(error_body(message, 400, param, "Bad Request"), 400)


async def _on_fleet_error(_request: Request, exc: FleetError) -> Response:
    return fleet_error_response(exc)


async def _on_http_error(_request: Request, exc: HTTPException) -> Response:
    return json_response(error_body(str(exc.detail), exc.status_code, err_type=HTTPStatus(exc.status_code).phrase),
                         exc.status_code, getattr(exc, "headers", None))


async def _on_redis_error(_request: Request, exc: Exception) -> Response:
    return json_response(error_body(f"The request queue is unreachable; try again shortly. ({exc})", 503), 503)


def _in_family_shape(handler):
    """The handler, answering on the Anthropic routes in Anthropic's error shape."""
    async def handle(request: Request, exc: Exception) -> Response:
        if not anthropic_errors.owns(request.url.path):
            return await handler(request, exc)
        if isinstance(exc, FleetError):
            return anthropic_errors.error_response(exc)
        return anthropic_errors.reshape(await handler(request, exc))
    return handle


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RedisError, _in_family_shape(_on_redis_error))
    app.add_exception_handler(RequestValidationError, _in_family_shape(_on_validation_error))
    app.add_exception_handler(FleetError, _in_family_shape(_on_fleet_error))
    app.add_exception_handler(HTTPException, _in_family_shape(_on_http_error))
