"""API keys: the front door of a gateway.

Two kinds, either or both on:

- `--api-key KEY`, as `vllm serve` has it: one shared key, no tenant (requests are the anonymous
  tenant's), no limits.
- Managed keys (`--require-keys`), made with `llmfleet keys create`: each has a name (the
  tenant), a priority, optional limits (`gateway.ratelimit`) and optional models it may use.

A client presents its key as `Authorization: Bearer KEY` or `x-api-key: KEY` (Anthropic's
clients). Secrets are high-entropy random strings, stored only as their SHA-256: a lookup is by
digest, so no secret is ever kept, logged or compared byte by byte (the stored digest is
compared with `hmac.compare_digest`, in constant time). A key record lives under its name, with
an index from digest to name; both expire when the key does (every Redis key has a TTL).

`FrontDoor` is plain ASGI middleware, installed only when keys are on (a gateway without keys
pays nothing): it refuses a missing or unknown key with a 401 in the family's shape (OpenAI's
`invalid_api_key`, Anthropic's `authentication_error` on /v1/messages*), and for a good one sets
the request's tenant (`gateway.tenancy`) and its key (`current_key`), which `gateway.ratelimit`
reads when the request is queued. Paths in `--open-paths` (/health, /ready, /metrics) need no key.

Lookups are cached for CACHE_TTL_S: a revoked key stops working on every replica within that
(and a new one works within it), with one Redis read per key per second per replica at most.
"""

from __future__ import annotations

import contextvars
import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway import ratelimit, tenancy
from gateway.anthropic import errors as anthropic_errors
from gateway.errors import error_body
from gateway.settings import GatewaySettings
from gateway.tenancy import PRIORITIES, Priority, Tenant
from shared import keys as redis_keys

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a key's name: a metric label, a Redis hash tag
SECRET_PREFIX = "sk-llmfleet-"
CACHE_TTL_S = 1.0  # a revoked key works on at most this much longer on each replica
CACHE_MAX_ENTRIES = 10_000  # digests remembered per gateway; past it the cache starts over
DEFAULT_KEY_TTL_S = 365 * 24 * 3600


class KeyExists(Exception):
    """A key of that name exists already."""


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A managed key, as stored (its secret never is: only `digest`). Limits of 0 are no limit."""
    name: str
    digest: str
    priority: Priority = "normal"
    rpm: int = 0  # requests per rate window (a minute unless the gateway's --rate-window says otherwise)
    tpm: int = 0  # tokens (prompt + completion) per rate window
    max_parallel: int = 0  # requests in flight at once
    models: tuple[str, ...] = ()  # the models it may use; () for every model
    created: float = 0.0
    expires: float = 0.0
    max_tokens: int = 0  # output tokens a request may ask for (below the gateway's --max-output-tokens)

    def to_fields(self) -> dict[str, str]:
        return {"name": self.name, "digest": self.digest, "priority": self.priority, "rpm": str(self.rpm),
                "tpm": str(self.tpm), "max_parallel": str(self.max_parallel), "models": ",".join(self.models),
                "created": repr(self.created), "expires": repr(self.expires), "max_tokens": str(self.max_tokens)}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> ApiKey:
        text = {k.decode(): v.decode() for k, v in fields.items()}
        priority = text.get("priority", "normal")
        return cls(name=text["name"], digest=text["digest"],
                   priority=priority if priority in PRIORITIES else "normal",  # type: ignore[arg-type]
                   rpm=int(text.get("rpm") or 0), tpm=int(text.get("tpm") or 0),
                   max_parallel=int(text.get("max_parallel") or 0),
                   models=tuple(m for m in text.get("models", "").split(",") if m),
                   created=float(text.get("created") or 0), expires=float(text.get("expires") or 0),
                   max_tokens=int(text.get("max_tokens") or 0))

    def public(self) -> dict[str, Any]:
        """What `llmfleet keys list` shows: everything but the digest."""
        return {"name": self.name, "priority": self.priority, "rpm": self.rpm, "tpm": self.tpm,
                "max_parallel": self.max_parallel, "max_tokens": self.max_tokens, "models": ",".join(self.models) or "*",
                "created": _iso(self.created), "expires": _iso(self.expires)}


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)  # 256 random bits


def _iso(when: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(when)) if when else "-"


class KeyStore:
    """Managed keys in Redis: made and revoked by `llmfleet keys`, looked up by gateways."""

    def __init__(self, redis: aioredis.Redis):
        self.redis = redis

    async def create(self, key: ApiKey, ttl_s: int) -> None:
        record = redis_keys.api_key_record(key.name)
        if not await self.redis.hsetnx(record, "digest", key.digest):
            raise KeyExists(key.name)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(record, mapping=key.to_fields())
        pipe.expire(record, ttl_s)
        pipe.set(redis_keys.api_key_digest(key.digest), key.name, ex=ttl_s)
        await pipe.execute()

    async def find(self, key_digest: str) -> ApiKey | None:
        """The key whose secret has this digest, or None."""
        name = await self.redis.get(redis_keys.api_key_digest(key_digest))
        if name is None:
            return None
        key = await self.get(name.decode())
        # The index may outlive a revoke that failed half-way, or name a key made anew since.
        if key is None or not hmac.compare_digest(key.digest, key_digest):
            return None
        return key

    async def get(self, name: str) -> ApiKey | None:
        fields = await self.redis.hgetall(redis_keys.api_key_record(name))
        return ApiKey.from_fields(fields) if fields.get(b"digest") and fields.get(b"name") else None

    async def all(self) -> list[ApiKey]:
        names = [key.decode().rpartition(":")[2].strip("{}")
                 async for key in self.redis.scan_iter(match=redis_keys.API_KEY_RECORD_PATTERN, count=1000)]
        found = [await self.get(name) for name in sorted(set(names))]
        return [key for key in found if key is not None]

    async def revoke(self, name: str) -> bool:
        key = await self.get(name)
        if key is None:
            return False
        await self.redis.delete(redis_keys.api_key_record(name))
        await self.redis.delete(redis_keys.api_key_digest(key.digest))
        return True

    async def usage(self, name: str | None = None) -> list[dict[str, Any]]:
        """Requests and tokens per key and model (`gateway.ratelimit` counts them), one row each."""
        if name is not None:
            names = [name]
        else:
            names = sorted({key.decode().rpartition(":")[2].strip("{}") async for key in
                            self.redis.scan_iter(match=redis_keys.USAGE_PATTERN, count=1000)})
        rows = []
        for key_name in names:
            counts: dict[str, dict[str, int]] = {}
            for counter, value in (await self.redis.hgetall(redis_keys.usage_key(key_name))).items():
                what, _, model = counter.decode().partition(":")
                counts.setdefault(model, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})[what] = \
                    int(value)
            rows += [{"name": key_name, "model": model, **values} for model, values in sorted(counts.items())]
        return rows


# The request's key, set by FrontDoor for a managed key (None for the static key, or keys off).
@dataclass(slots=True)
class KeyUse:
    key: ApiKey
    limits: list = field(default_factory=list)  # its `ratelimit.Limit`s, set by admission


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

    def __init__(self, app: ASGIApp, settings: GatewaySettings):
        self.app = app
        self.static_digest = digest(settings.api_key) if settings.api_key else None
        self.managed = settings.require_keys
        self.open_paths = frozenset(settings.open_paths)
        self.cache = KeyCache()
        self.store: KeyStore | None = None  # on the fleet's Redis, once the app has started

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
            key = await self._managed_key(scope, presented_digest)
        except (RedisError, OSError):
            await _refuse(send, scope["path"], 503, "API keys cannot be checked right now (the key store is "
                          "unreachable); try again shortly.")
            return
        if key is None:
            await _refuse(send, scope["path"], 401, "Incorrect API key provided.")
            return
        await self._serve(key, scope, receive, send)

    async def _managed_key(self, scope: Scope, presented_digest: str) -> ApiKey | None:
        if not self.managed:
            return None
        if self.store is None:
            self.store = KeyStore(scope["app"].state.fleet.batched)
        return await self.cache.find(self.store, presented_digest)

    async def _serve(self, key: ApiKey, scope: Scope, receive: Receive, send: Send) -> None:
        tenancy.set_current(Tenant(key.name, key.priority, key.max_tokens))
        use = KeyUse(key)
        token = _current.set(use)

        async def send_with_limits(message) -> None:
            if message["type"] == "http.response.start" and use.limits:
                headers = (ratelimit.anthropic_headers(use.limits, time.time()) if anthropic_errors.owns(scope["path"])
                           else ratelimit.openai_headers(use.limits))
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
