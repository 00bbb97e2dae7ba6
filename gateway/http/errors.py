"""The one builder of OpenAI error bodies, and the handlers that use it.

Body: {"error": {"message", "type", "param", "code"}}, with vLLM's `type` names, so clients
written against `vllm serve` read our errors the same way. A request model's own rules raise
`FieldRuleError` inside pydantic's validation; the handler answers it with the rule's message and
param. On the Anthropic routes every error takes Anthropic's shape instead (anthropic_errors.py).

Where a newcomer's first request goes wrong, the message says what to do, rather than echo the
framework: a body that is not JSON (its parser's position, or the missing Content-Type), a path no
route has (unknown_paths.py), a method the path does not take.
"""

from __future__ import annotations

import json
import math
from http import HTTPStatus
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from redis.exceptions import RedisError
from starlette.exceptions import HTTPException
from starlette.responses import Response

from gateway.http import anthropic_errors, unknown_paths
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
    405: "MethodNotAllowedError",
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


def is_json(content_type: str | None) -> bool:
    """True for the Content-Types FastAPI reads a body as JSON for (application/json, application/*+json)."""
    maintype, _, subtype = (content_type or "").partition(";")[0].strip().lower().partition("/")
    return maintype == "application" and (subtype == "json" or subtype.endswith("+json"))


def not_json_message(content_type: str | None) -> str:
    sent = f"this one says `{content_type}`" if content_type else "this one has none"
    return ("The request body must be JSON, sent with `Content-Type: application/json` "
            f"({sent}; curl -d sends application/x-www-form-urlencoded unless given "
            "-H 'Content-Type: application/json').")


def invalid_json_message(error: json.JSONDecodeError) -> str:
    return (f"The request body is not valid JSON: {error.msg} at line {error.lineno} column {error.colno} "
            f"(char {error.pos}).")


def bad_request(message: str) -> Response:
    return json_response(error_body(message, 400), 400)


def _unreadable_body(request: Request, exc: RequestValidationError, errors: list[dict]) -> Response | None:
    """The answer to a body that is not JSON at all, in words (FastAPI's would be a repr of its error)."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid" and isinstance(exc.body, str):
        return bad_request(invalid_json_message(json.JSONDecodeError(first["ctx"]["error"], exc.body,
                                                                     first["loc"][1])))
    content_type = request.headers.get("content-type")
    if tuple(first.get("loc", ())) == ("body",) and not is_json(content_type):
        return bad_request(not_json_message(content_type))  # FastAPI validated the raw bytes
    return None


async def _on_validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = list(exc.errors())
    unreadable = _unreadable_body(request, exc, errors)
    if unreadable is not None:
        return unreadable
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


async def _on_http_error(request: Request, exc: HTTPException) -> Response:
    """The router's 404 (no route has the path) and 405 (the route takes other methods), said usefully."""
    status, headers = exc.status_code, getattr(exc, "headers", None)
    message = str(exc.detail)
    if status == 404 and "route" not in request.scope:
        message = unknown_paths.explain(request)
    elif status == 405:
        allowed = (headers or {}).get("Allow", "")
        message = f"{request.method} is not allowed on {request.url.path}; it takes {allowed or 'other methods'}."
    return json_response(error_body(message, status), status, headers)


async def _on_redis_error(_request: Request, exc: Exception) -> Response:
    return json_response(error_body(f"The request queue is unreachable; try again shortly. ({exc})", 503), 503)


def _in_family_shape(handler):
    """The handler, answering on the Anthropic routes (and a mistyped path meant for them) in
    Anthropic's error shape."""
    async def handle(request: Request, exc: Exception) -> Response:
        if not anthropic_errors.owns(unknown_paths.meant_path(request.url.path)):
            return await handler(request, exc)
        if isinstance(exc, FleetError):
            return anthropic_errors.error_response(exc)
        answer = await handler(request, exc)
        reshaped = anthropic_errors.reshape(answer)
        if "allow" in answer.headers:  # a 405's list of the methods the path takes
            reshaped.headers["Allow"] = answer.headers["allow"]
        return reshaped
    return handle


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RedisError, _in_family_shape(_on_redis_error))
    app.add_exception_handler(RequestValidationError, _in_family_shape(_on_validation_error))
    app.add_exception_handler(FleetError, _in_family_shape(_on_fleet_error))
    app.add_exception_handler(HTTPException, _in_family_shape(_on_http_error))
