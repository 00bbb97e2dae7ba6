"""Every HTTP response a gateway gives, counted: refusals before a request reaches the queue
(400, 404, 413, 429, 503) as much as answers, and errors inside a stream by their own status.

`CountResponses` is plain ASGI middleware around the whole app. It holds one small dict per
request (`facts`) in a context variable; the code serving the request adds what it learns to
it through `note` (the model once resolved, the status of an error met after the first byte),
so the count needs nothing passed through the routes. A streaming body runs in a child task,
which shares the dict.
"""

from __future__ import annotations

import contextvars
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics

# Route path -> (family, endpoint). Other routes count as family "llmfleet" under their path
# template; a path no route matches counts as endpoint "unmatched" (bounded labels).
FAMILIES = {
    "/v1/chat/completions": ("openai", "chat"),
    "/v1/completions": ("openai", "completions"),
    "/v1/responses": ("openai", "responses"),
    "/v1/messages": ("anthropic", "messages"),
    "/v1/messages/count_tokens": ("anthropic", "count_tokens"),
}

_facts: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("llmfleet_request_facts")


def note(**facts: Any) -> None:
    """Record facts about the request being served (no-op outside a request)."""
    current = _facts.get(None)
    if current is not None:
        current.update(facts)


class CountResponses:
    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        facts: dict[str, Any] = {}
        token = _facts.set(facts)

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                facts.setdefault("sent_status", message["status"])
            await send(message)

        try:
            await self.app(scope, receive, noting_send)
        except BaseException:
            facts.setdefault("status", 500 if "sent_status" not in facts else 499)
            raise
        finally:
            _facts.reset(token)
            _count(scope, facts)


def _count(scope: Scope, facts: dict[str, Any]) -> None:
    route = scope.get("route")
    # A 413 from BodySizeLimit comes before routing: an API path still names its family.
    path = route.path if route is not None else scope["path"] if scope["path"] in FAMILIES else None
    family, endpoint = FAMILIES.get(path) or ("llmfleet", path or "unmatched")
    status = facts.get("status") or facts.get("sent_status") or 500
    metrics.REQUESTS.labels(family, endpoint, facts.get("model", ""), str(status)).inc()
