"""Every HTTP response a gateway gives, counted and logged: refusals before a request reaches the
queue (400, 404, 413, 429, 503) as much as answers, and errors inside a stream by their own status.

`CountResponses` is plain ASGI middleware around the whole app. It holds one small dict per
request (`facts`) in a context variable; the code serving the request adds what it learns to
it through `note` (the model once resolved, the status of an error met after the first byte,
tokens, time to first token, the worker), so the count needs nothing passed through the
routes. A streaming body runs in a child task, which shares the dict.

With `--enable-log-requests` (as `vllm serve` has it), each generation request also gets one
line of its own at its end (`log_request`, from its life's end, gateway/serve/life.py), on the
`llmfleet.requests` logger: its ids, tenant, model, tokens, stage times and outcome. Off by
default: the access line alone is the default.

It also gives each request its id: the client's `X-Request-Id` (if it is a sane token) or a new
one, echoed on the response, carried to the worker in the envelope, and on every log line
about the request (`shared.logs`), the access line included: one per request, at its end.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import re
import secrets
import time
from collections.abc import Iterator
from typing import Any

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import metrics
from shared import tracing
from shared.logs import REQUEST_ID

access_log = logging.getLogger("gateway.access")
request_log = logging.getLogger("llmfleet.requests")

_SANE_ID = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")

# Route path -> (family, endpoint). Other routes count as family "llmfleet" under their path
# template; a path no route matches counts as endpoint "unmatched" (bounded labels).
FAMILIES = {
    "/v1/chat/completions": ("openai", "chat"),
    "/v1/completions": ("openai", "completions"),
    "/v1/responses": ("openai", "responses"),
    "/v1/messages": ("anthropic", "messages"),
    "/v1/messages/count_tokens": ("anthropic", "count_tokens"),
    "/v1/embeddings": ("openai", "embeddings"),
    **dict.fromkeys(("/score", "/v1/score"), ("pooling", "score")),
    **dict.fromkeys(("/rerank", "/v1/rerank", "/v2/rerank"), ("pooling", "rerank")),
    "/classify": ("pooling", "classify"),
    "/pooling": ("pooling", "pooling"),
}

_facts: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("llmfleet_request_facts")

# The scope key of the `send` under every middleware of the app. Each middleware here notes or amends
# a response's start and passes its body on untouched (BodySizeLimit drops it only once it refused
# the request, before any endpoint ran), so a stream sends its body's parts there directly
# (gateway/serve/sse.py): four wrappers fewer per SSE event.
BODY_SEND = "llmfleet.body_send"


def note(**facts: Any) -> None:
    """Record facts about the request being served (no-op outside a request)."""
    current = _facts.get(None)
    if current is not None:
        current.update(facts)


@contextlib.contextmanager
def apart() -> Iterator[None]:
    """Inside it, the facts of a part of the request being served are kept apart from the request's
    own (the parts of a split encoding each have a life of their own, gateway/serve/encoding.py):
    a part's outcome does not become the request's, and each part gets a request log line of its own."""
    parent = _facts.get(None) or {}
    token = _facts.set({name: parent[name] for name in ("log_request", "model", "tenant", "arrival") if name in parent})
    try:
        yield
    finally:
        _facts.reset(token)


class CountResponses:
    def __init__(self, app: ASGIApp, log_requests: bool = False):
        self.app = app
        self.log_requests = log_requests

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        scope[BODY_SEND] = send
        request_id = _request_id(scope)
        facts: dict[str, Any] = {"log_request": self.log_requests}
        token = _facts.set(facts)
        id_token = REQUEST_ID.set(request_id)
        id_header = (b"x-request-id", request_id.encode())

        async def noting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                facts.setdefault("sent_status", message["status"])
                message = {**message, "headers": [*message.get("headers", ()), id_header]}
            await send(message)

        span = tracing.start_request_span(f"{scope['method']} {scope['path']}", scope["headers"]) \
            if tracing.enabled() else None
        try:
            if span is None:
                await self.app(scope, receive, noting_send)
            else:
                with tracing.use(span):
                    await self.app(scope, receive, noting_send)
        except BaseException:
            facts.setdefault("status", 500 if "sent_status" not in facts else 499)
            raise
        finally:
            _account(scope, facts, time.monotonic() - started)
            if span is not None:
                _end_span(span, facts, request_id)
            REQUEST_ID.reset(id_token)
            _facts.reset(token)


def _end_span(span, facts: dict[str, Any], request_id: str) -> None:
    span.set_attributes({key: value for key, value in {
        "http.response.status_code": facts.get("status") or facts.get("sent_status"),
        "llmfleet.model": facts.get("model"), "llmfleet.request_id": request_id,
        "llmfleet.engine_request_id": facts.get("engine_request_id"), "llmfleet.worker": facts.get("worker"),
        "llmfleet.completion_tokens": facts.get("completion_tokens")}.items() if value is not None})
    if "arrival" in facts:
        tracing.gateway_stages(span, facts["arrival"], facts.get("worker_timings"), time.time())
    span.end()


def _request_id(scope: Scope) -> str:
    for name, value in scope["headers"]:
        if name == b"x-request-id" and _SANE_ID.fullmatch(value):
            return value.decode()
    return secrets.token_hex(16)


def _route_path(scope: Scope) -> str | None:
    """The template of the route that served the request or, for a refusal before routing (FrontDoor's
    401, BodySizeLimit's 413), of the one it was for; None for a path no route has."""
    route = scope.get("route")
    if route is not None:
        return route.path
    app = scope.get("app")  # Starlette puts itself there before any middleware runs
    for candidate in getattr(app, "routes", ()):
        if candidate.matches(scope)[0] != Match.NONE:
            return candidate.path
    return None


def _account(scope: Scope, facts: dict[str, Any], elapsed: float) -> None:
    path = _route_path(scope)
    family, endpoint = FAMILIES.get(path) or ("llmfleet", path or "unmatched")
    status = facts.get("status") or facts.get("sent_status") or 500
    model = facts.get("model", "")
    metrics.REQUESTS.labels(family, endpoint, model, str(status)).inc()
    if access_log.isEnabledFor(logging.INFO) and endpoint not in _QUIET:
        access_log.info("%s %s %s", scope["method"], scope["path"], status, extra={"fields": {
            "family": family, "model": model or None, "status": status, "total_s": elapsed,
            "ttft_s": facts.get("ttft_s"), "queue_s": facts.get("queue_s"), "prompt_tokens": facts.get("prompt_tokens"),
            "completion_tokens": facts.get("completion_tokens"), "worker": facts.get("worker"),
            "cancel": facts.get("cancel"), "request": facts.get("engine_request_id"),
            "migrations": (facts.get("worker_timings") or {}).get("migrations")}})


def log_request(elapsed: float) -> None:
    """The request log's line of the request being served, at its end (`--enable-log-requests`)."""
    facts = _facts.get(None)
    if not facts or not facts.get("log_request") or not request_log.isEnabledFor(logging.INFO):
        return
    status = facts.get("status") or facts.get("sent_status") or 500
    worker = facts.get("worker_timings") or {}
    outcome = ("cancelled" if facts.get("cancel") else facts.get("finish_reason") or "ok") if status == 200 \
        else "client_gone" if status == 499 else "error"
    request_log.info("request %s %s", facts["engine_request_id"], outcome, extra={"fields": {
        "request": facts["engine_request_id"], "tenant": facts.get("tenant"), "model": facts.get("model"),
        "status": status, "outcome": outcome, "cancel": facts.get("cancel"),
        "prompt_tokens": facts.get("prompt_tokens"), "completion_tokens": facts.get("completion_tokens"),
        "ttft_s": facts.get("ttft_s"), "queue_s": worker.get("queue_s"), "prefill_s": worker.get("prefill_s"),
        "decode_s": worker.get("decode_s"), "migration_s": worker.get("migration_s"),
        "migrations": worker.get("migrations"), "total_s": elapsed, "worker": facts.get("worker")}})


# Probes and scrapes: answered many times a minute, never about a request.
_QUIET = frozenset({"/health", "/ready", "/metrics"})
