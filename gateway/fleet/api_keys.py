"""Managed API keys in Redis: made and revoked by `llmfleet keys`, looked up by gateways
(gateway/http/auth.py checks them at the front door).

A key has a name (its tenant), a priority, optional limits (gateway/fleet/rate_limits.py), an
optional ceiling on output tokens and optional models it may use. Secrets are high-entropy
random strings, stored only as their SHA-256: a lookup is by digest, so no secret is ever kept,
logged or compared byte by byte (the stored digest is compared with `hmac.compare_digest`, in
constant time). A key record lives under its name, with an index from digest to name; both
expire when the key does (every Redis key has a TTL).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from gateway.tenancy import PRIORITIES, Priority
from shared import keys

NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")  # a key's name: a metric label, a Redis hash tag
SECRET_PREFIX = "sk-llmfleet-"
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
        record = keys.api_key_record(key.name)
        if not await self.redis.hsetnx(record, "digest", key.digest):
            raise KeyExists(key.name)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hset(record, mapping=key.to_fields())
        pipe.expire(record, ttl_s)
        pipe.set(keys.api_key_digest(key.digest), key.name, ex=ttl_s)
        await pipe.execute()

    async def find(self, key_digest: str) -> ApiKey | None:
        """The key whose secret has this digest, or None."""
        name = await self.redis.get(keys.api_key_digest(key_digest))
        if name is None:
            return None
        key = await self.get(name.decode())
        # The index may outlive a revoke that failed half-way, or name a key made anew since.
        if key is None or not hmac.compare_digest(key.digest, key_digest):
            return None
        return key

    async def get(self, name: str) -> ApiKey | None:
        fields = await self.redis.hgetall(keys.api_key_record(name))
        return ApiKey.from_fields(fields) if fields.get(b"digest") and fields.get(b"name") else None

    async def all(self) -> list[ApiKey]:
        names = [key.decode().rpartition(":")[2].strip("{}")
                 async for key in self.redis.scan_iter(match=keys.API_KEY_RECORD_PATTERN, count=1000)]
        found = [await self.get(name) for name in sorted(set(names))]
        return [key for key in found if key is not None]

    async def revoke(self, name: str) -> bool:
        key = await self.get(name)
        if key is None:
            return False
        await self.redis.delete(keys.api_key_record(name))
        await self.redis.delete(keys.api_key_digest(key.digest))
        return True

    async def usage(self, name: str | None = None) -> list[dict[str, Any]]:
        """Requests and tokens per key and model (`gateway.ratelimit` counts them), one row each."""
        if name is not None:
            names = [name]
        else:
            names = sorted({key.decode().rpartition(":")[2].strip("{}") async for key in
                            self.redis.scan_iter(match=keys.USAGE_PATTERN, count=1000)})
        rows = []
        for key_name in names:
            counts: dict[str, dict[str, int]] = {}
            for counter, value in (await self.redis.hgetall(keys.usage_key(key_name))).items():
                what, _, model = counter.decode().partition(":")
                counts.setdefault(model, {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})[what] = \
                    int(value)
            rows += [{"name": key_name, "model": model, **values} for model, values in sorted(counts.items())]
        return rows
