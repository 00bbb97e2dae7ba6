"""The front door of a gateway: API keys, checked before a request's body is read.

Two kinds, either or both on:

- `--api-key KEY`, as `vllm serve` has it: one shared key, no tenant (requests are the anonymous
  tenant's), no limits.
- Managed keys (`--require-keys`), made with `llmfleet keys create` (gateway/fleet/api_keys.py):
  each has a name (the tenant), a priority, optional limits (gateway/fleet/rate_limits.py), a
  ceiling on output tokens and optional models it may use.

A client presents its key as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's
clients). `FrontDoor` is plain ASGI middleware, installed only when keys are on (a gateway without
keys pays nothing): it refuses a missing or unknown key with a 401 in the family's shape (OpenAI's
`invalid_api_key`, Anthropic's `authentication_error` on /v1/messages*), and for a good one sets
the request's tenant (`gateway.tenancy`) and its key (`current_key`), which the request's
submit hands to the limiter; the limits the admission reported go out as the family's headers.
Paths in `--open-paths` (/health, /ready, /metrics) need no key.

Lookups are cached for CACHE_TTL_S: a revoked key stops working on every replica within that
(and a new one works within it), with one Redis read per key per second per replica at most.
"""

from __future__ import annotations

import contextvars
import hmac
import time

import orjson
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import tenancy
from gateway.fleet import rate_limits
from gateway.fleet.api_keys import ApiKey, KeyStore, digest
from gateway.fleet.rate_limits import KeyUse
from gateway.http import anthropic_errors
from gateway.http.errors import error_body
from gateway.settings import GatewaySettings
from gateway.tenancy import Tenant

CACHE_TTL_S = 1.0  # a revoked key works on at most this much longer on each replica
CACHE_MAX_ENTRIES = 10_000  # digests remembered per gateway; past it the cache starts over


# The request's key, set by FrontDoor for a managed key (None for the static key, or keys off).
_current: contextvars.ContextVar[KeyUse | None] = contextvars.ContextVar("llmfleet_api_key", default=None)


def current_key() -> KeyUse | None:
    return _current.get()


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a request carries: `Authorization: Bearer KEY`, else `x-api-key: KEY`."""
    api_key = None
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
        elif name == b"x-api-key" and value.strip():
            api_key = value.decode("latin-1").strip()
    return api_key


class KeyCache:
    """Lookups by digest, each kept CACHE_TTL_S (found or not), at most CACHE_MAX_ENTRIES."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[float, ApiKey | None]] = {}

    async def find(self, store: KeyStore, key_digest: str) -> ApiKey | None:
        now = time.monotonic()
        cached = self._entries.get(key_digest)
        if cached is not None and now - cached[0] < CACHE_TTL_S:
            return cached[1]
        key = await store.find(key_digest)
        if key is not None and key.expires and key.expires <= time.time():
            key = None
        if len(self._entries) >= CACHE_MAX_ENTRIES:
            self._entries.clear()
        self._entries[key_digest] = (now, key)
        return key


class FrontDoor:
    """ASGI middleware: no valid key, no service (but on the open paths)."""

    def __init__(self, app: ASGIApp, settings: GatewaySettings, store: KeyStore):
        self.app = app
        self.static_digest = digest(settings.api_key) if settings.api_key else None
        self.managed = settings.require_keys
        self.open_paths = frozenset(settings.open_paths)
        self.cache = KeyCache()
        self.store = store  # the fleet's, on its Redis

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        presented = presented_key(scope["headers"])
        if presented is None:
            await _refuse(send, scope["path"], 401, "You didn't provide an API key: send it as "
                          "`Authorization: Bearer KEY` (or `x-api-key: KEY`).")
            return
        presented_digest = digest(presented)
        if self.static_digest is not None and hmac.compare_digest(presented_digest, self.static_digest):
            await self.app(scope, receive, send)  # the anonymous tenant, without limits
            return
        try:
            key = await self.cache.find(self.store, presented_digest) if self.managed else None
        except (RedisError, OSError):
            await _refuse(send, scope["path"], 503, "API keys cannot be checked right now (the key store is "
                          "unreachable); try again shortly.")
            return
        if key is None:
            await _refuse(send, scope["path"], 401, "Incorrect API key provided.")
            return
        await self._serve(key, scope, receive, send)

    async def _serve(self, key: ApiKey, scope: Scope, receive: Receive, send: Send) -> None:
        tenancy.set_current(Tenant(key.name, key.priority, key.max_tokens))
        use = KeyUse(key)
        token = _current.set(use)

        async def send_with_limits(message) -> None:
            if message["type"] == "http.response.start" and use.limits:
                headers = (rate_limits.anthropic_headers(use.limits, time.time()) if anthropic_errors.owns(scope["path"])
                           else rate_limits.openai_headers(use.limits))
                message = {**message, "headers": [*message.get("headers", ()), *headers]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_limits)
        finally:
            _current.reset(token)


async def _refuse(send: Send, path: str, status: int, message: str) -> None:
    if anthropic_errors.owns(path):
        body = anthropic_errors.error_body(message, anthropic_errors.anthropic_status(status))
        status = anthropic_errors.anthropic_status(status)
    elif status == 401:  # OpenAI's own: type invalid_request_error, code invalid_api_key
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": "invalid_api_key"}}
    else:
        body = error_body(message, status)
    encoded = orjson.dumps(body)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(encoded)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": encoded})
