"""The one error hierarchy of llmfleet, shared by gateway and worker.

    FleetError                      base; carries code, message, param and HTTP status
    ├── InvalidRequest              400  the request can never succeed as sent
    ├── ModelNotFound               404  no worker has served this model recently
    ├── NotFound                    404  a kept thing (a stream's events) is unknown or gone
    ├── RequestTimeout              408  the client's own `timeout` ran out before an answer it cannot cut short
    ├── Conflict                    409  a kept thing exists already, or is busy (a session's turn)
    ├── Cancelled                   499  the client's own cancel (POST /v1/cancel) ended a request with nothing to give
    ├── Overloaded                  429  queue or in-flight limit reached; retry later
    ├── ServiceUnavailable          503  no live worker, Redis down, queue timeout, draining
    ├── WorkerLost                  502  the worker running the request vanished
    ├── EngineError                 500  the engine failed while generating
    └── EnvelopeError               400  bytes on the wire that are not a valid envelope

Lower-layer exceptions (pydantic, redis, vLLM) are translated into these where they cross a
process boundary (`raise InvalidRequest(...) from exc`). A worker reports an error to the
gateway as an `ErrorInfo` inside the terminal chunk; `error_from_info` turns it back into the
matching exception class, so both sides speak the same codes.
"""

from __future__ import annotations

import msgspec


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    """An error as it travels in a chunk envelope (shared.envelopes)."""

    code: str
    message: str
    status: int = 500
    param: str | None = None
    type: str | None = None  # the engine server's own error type, when it gave one ("Bad Request")
    in_stream: bool = False  # raised after the stream began: the client gets 200, then an error event


class FleetError(Exception):
    status: int = 500
    code: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 err_type: str | None = None, in_stream: bool = False):
        super().__init__(message)
        self.message = message
        self.param = param
        self.err_type = err_type  # overrides the type named after the status
        self.in_stream = in_stream
        if code is not None:
            self.code = code

    def to_info(self) -> ErrorInfo:
        return ErrorInfo(code=self.code, message=self.message, status=self.status, param=self.param,
                         type=self.err_type, in_stream=self.in_stream)


class InvalidRequest(FleetError):
    status = 400
    code = "invalid_request"


class ModelNotFound(FleetError):
    status = 404
    code = "model_not_found"


class NotFound(FleetError):
    status = 404
    code = "not_found"


class RequestTimeout(FleetError):
    status = 408
    code = "request_timeout"


class Conflict(FleetError):
    status = 409
    code = "conflict"


class Cancelled(FleetError):
    """Nginx's 499 ("client closed request"), for a request its own client cancelled: no 4xx of
    the standard says it, and no 5xx may, nothing having failed."""

    status = 499
    code = "cancelled"

    def __init__(self, message: str, **kwargs):
        super().__init__(message, **{"err_type": "Cancelled", **kwargs})


class Overloaded(FleetError):
    status = 429
    code = "overloaded"

    def __init__(self, message: str, *, retry_after: float = 1.0, **kwargs):
        super().__init__(message, **kwargs)
        self.retry_after = retry_after


class ServiceUnavailable(FleetError):
    status = 503
    code = "service_unavailable"


class WorkerLost(FleetError):
    status = 502
    code = "worker_lost"


class EngineError(FleetError):
    status = 500
    code = "engine_error"


class EnvelopeError(FleetError):
    status = 400
    code = "bad_envelope"


_BY_STATUS: dict[int, type[FleetError]] = {
    cls.status: cls
    for cls in (InvalidRequest, ModelNotFound, RequestTimeout, Overloaded, ServiceUnavailable, WorkerLost, EngineError)
}


def error_from_info(info: ErrorInfo) -> FleetError:
    """Rebuild the exception a worker reported, keeping its code and status."""
    cls = _BY_STATUS.get(info.status, EngineError)
    error = cls(info.message, param=info.param, code=info.code, err_type=info.type, in_stream=info.in_stream)
    error.status = info.status
    return error
