"""GET /v1/streams/{id}: resume a resumable stream on any replica (gateway/serve/resumable.py)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response, StreamingResponse

from gateway import tenancy
from gateway.http.json_body import JSONRoute
from gateway.serve.resumable import follow
from gateway.serve.sse import SSE_HEADERS
from shared.errors import InvalidRequest

router = APIRouter(route_class=JSONRoute)


@router.get("/v1/streams/{response_id}")
async def resume_stream(response_id: str, request: Request) -> Response:
    """Replay a resumable stream's events after `Last-Event-ID` (all without it), then follow it."""
    events = await follow(request.app.state.fleet, response_id, _last_event_id(request), tenancy.current().name)
    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)


def _last_event_id(request: Request) -> int | None:
    value = request.headers.get("last-event-id")
    if value is None or not value.strip():
        return None
    if not value.strip().isdigit():
        raise InvalidRequest(f"Last-Event-ID must be the id of an event (a number), got {value!r}.",
                             param="Last-Event-ID")
    return int(value)
