"""The live worker registry, as each gateway sees it.

Workers write a heartbeat key with a short TTL; a gateway refreshes its view every second by
scanning those keys. A model is *served* while some live worker announces it, and *known* while
its `model:{name}` key lives (an hour after the last heartbeat): an unknown model is a 404, a
known model with no live worker is a 503. A gateway also remembers the models it has seen served,
so a Redis restart (which loses every key) reads as a 503 until the workers announce themselves
again, never as a 404.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.codec import decode
from shared.envelopes import WorkerInfo
from shared.errors import EnvelopeError, ModelNotFound, ServiceUnavailable

log = logging.getLogger(__name__)

REFRESH_S = 1.0


@dataclass(slots=True)
class ModelView:
    name: str
    max_model_len: int
    workers: list[WorkerInfo] = field(default_factory=list)
    drain_rate: float = 0.0  # requests answered per second by the fleet, smoothed

    @property
    def capacity(self) -> int:
        return sum(w.capacity for w in self.workers if not w.draining)


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis):
        self.redis = redis
        self.models: dict[str, ModelView] = {}
        self._seen: dict[str, float] = {}  # model -> when this gateway last saw it served
        self._refreshed = 0.0

    async def refresh(self) -> None:
        names = [key async for key in self.redis.scan_iter(match=keys.WORKER_KEY_PATTERN, count=500)]
        values = await self.redis.mget(names) if names else []
        models: dict[str, ModelView] = {}
        for value in values:
            if value is None:
                continue
            try:
                info = decode(WorkerInfo, value)
            except EnvelopeError as exc:
                log.warning("ignoring malformed heartbeat: %s", exc)
                continue
            view = models.setdefault(info.model, ModelView(info.model, info.max_model_len))
            view.workers.append(info)
        now = time.monotonic()
        for view in models.values():
            view.drain_rate = self._drain_rate(view, now)
        self.models = models
        self._refreshed = now
        self._seen.update((name, now) for name in models)
        self._seen = {name: at for name, at in self._seen.items() if now - at < keys.MODEL_MEMORY_TTL_S}

    def _drain_rate(self, view: ModelView, now: float) -> float:
        """Completions per second since the last refresh, by worker counters, smoothed (EWMA)."""
        old = self.models.get(view.name)
        if old is None or now <= self._refreshed:
            return 0.0
        before = {w.worker_id: w.completed for w in old.workers}
        done = sum(w.completed - before[w.worker_id] for w in view.workers if w.worker_id in before)
        return 0.7 * old.drain_rate + 0.3 * max(done, 0) / (now - self._refreshed)

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("refreshing the worker registry failed: %s", exc)
            await asyncio.sleep(REFRESH_S)

    def is_live(self, worker_id: str) -> bool:
        return any(w.worker_id == worker_id for view in self.models.values() for w in view.workers)

    async def resolve(self, model: str | None) -> ModelView:
        """The live view of `model`, or the error a client should get for it."""
        if model is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        view = self.models.get(model) if model is not None else None
        if view is not None and view.capacity > 0:
            return view
        if model is not None and (view is not None or model in self._seen
                                  or await self.redis.exists(keys.model_key(model))):
            raise ServiceUnavailable(f"No worker is serving the model `{model}` right now.")
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")
