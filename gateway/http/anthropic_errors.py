"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, with its statuses.

Every error on the Messages routes takes it: the fleet's and the workers' (`error_response`,
`error_events`), and the app-wide handlers' OpenAI bodies (request validation, unknown model,
Redis unreachable), which gateway.errors reshapes for these paths with `reshape`.

Statuses are kept but two: the fleet's 503 (no live worker, queue unreachable, a gateway
draining) is Anthropic's 529 overloaded_error, which its SDK retries; a request that ran past
its deadline is 504 timeout_error. (This module builds its responses itself: gateway.errors
imports it.)
"""

from __future__ import annotations

import math
from typing import Any

import orjson
from starlette.responses import Response

from shared.errors import FleetError, Overloaded

ROUTE_PREFIX = "/v1/messages"
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    504: "timeout_error",
    529: "overloaded_error",
}
STATUSES = {503: 529, 422: 400}  # fleet or framework status -> Anthropic's


def owns(path: str) -> bool:
    """True for the paths whose errors are Anthropic's."""
    return path == ROUTE_PREFIX or path.startswith(ROUTE_PREFIX + "/")


def anthropic_status(status: int) -> int:
    return STATUSES.get(status, status)


def error_body(message: str, status: int) -> dict[str, Any]:
    """The body for an error with Anthropic's `status` (see `anthropic_status`)."""
    err_type = ERROR_TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": err_type, "message": message}}


def fleet_error_body(error: FleetError) -> tuple[dict[str, Any], int]:
    status = 504 if error.code == "request_timeout" else anthropic_status(error.status)
    return error_body(error.message, status), status


def error_response(error: FleetError) -> Response:
    body, status = fleet_error_body(error)
    headers = {"Retry-After": str(max(1, math.ceil(error.retry_after)))} if isinstance(error, Overloaded) else None
    return _json(body, status, headers)


def reshape(response: Response) -> Response:
    """An app-wide handler's OpenAI error response, in Anthropic's shape (headers such as Retry-After kept)."""
    try:
        message = orjson.loads(response.body)["error"]["message"]
    except (orjson.JSONDecodeError, KeyError, TypeError):
        message = response.body.decode(errors="replace")
    status = anthropic_status(response.status_code)
    retry_after = response.headers.get("retry-after")
    return _json(error_body(str(message), status), status, {"Retry-After": retry_after} if retry_after else None)


def _json(body: dict[str, Any], status: int, headers: dict[str, str] | None) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json", headers=headers)
