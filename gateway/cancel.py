"""Cancels that work from any gateway replica, at any moment of a request's life.

The registry lives in Redis, not in a process, so `POST /v1/cancel` on one replica stops a run
streaming through another. Three paths reach a worker:

- a running request: a `CancelNotice` on the pub/sub channel; the worker aborts its engine;
- a queued request: `cancelled:{request_id}` is stashed first, and the worker that claims the
  request consumes it (DEL) before starting, so the request never runs;
- a run not registered yet (the cancel beat the request to the gateway): `cancel-early:{id}`
  is stashed, and registering a run with that cancel_id consumes it atomically.

A cancel_id may be shared by several runs at once (an agent's parallel calls): `cancel-id:{id}`
is the set of the request ids registered under it and not finished yet, so a cancel by that
cancel_id stops every one of them, and a run that finishes leaves the set without making the
others uncancellable. Registering, finishing and cancelling by cancel_id are each one Lua script
on the two keys of that cancel_id (one cluster slot), so there is no check-then-act window
between them. A cancel by cancel_id needs nothing else, so the run's own key (`run:{request_id}`,
another slot, for cancels by response id) is written beside the scripts, not in them.

A finished run leaves `FINISHED` in the set (for at least as long as the run could have
lasted), so a late cancel for it is a no-op instead of a stash that could hit a later run. The
set's TTL only ever grows, to cover its longest run.
"""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis

from shared import keys
from shared.codec import encode
from shared.envelopes import CancelNotice

# A member of `cancel-id:{id}` that no request id can be (request ids are hex): some run of this
# cancel_id has finished.
FINISHED = b"(finished)"

# keep(key, ttl): the key lives at least `ttl` more seconds; a longer TTL stays (EXPIRE GT, not in Redis 6).
_KEEP = """
local function keep(key, ttl)
  if redis.call('TTL', key) < tonumber(ttl) then redis.call('EXPIRE', key, ttl) end
end
"""

# KEYS: cancel-id, cancel-early; ARGV: request_id, ttl. Returns 1 if cancelled early.
_REGISTER = _KEEP + """
if redis.call('DEL', KEYS[2]) == 1 then return 1 end
redis.call('SADD', KEYS[1], ARGV[1])
keep(KEYS[1], ARGV[2])
return 0
"""

# KEYS: cancel-id; ARGV: request_id, ttl, the finished mark.
_FINISH = _KEEP + """
redis.call('SREM', KEYS[1], ARGV[1])
redis.call('SADD', KEYS[1], ARGV[3])
keep(KEYS[1], ARGV[2])
return 0
"""

# KEYS: cancel-id, cancel-early; ARGV: ttl. Returns the members of the set (the runs still
# registered, and the finished mark if one finished), or nil after stashing an early cancel.
_CANCEL_BY_ID = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('SMEMBERS', KEYS[1]) end
redis.call('SET', KEYS[2], '1', 'EX', ARGV[1])
return false
"""


class CancelRegistry:
    def __init__(self, redis: aioredis.Redis, gateway_id: str):
        self.redis = redis
        self.gateway_id = gateway_id
        self._register = redis.register_script(_REGISTER)
        self._finish = redis.register_script(_FINISH)
        self._cancel_by_id = redis.register_script(_CANCEL_BY_ID)

    async def register(self, request_id: str, cancel_id: str | None, ttl: int) -> bool:
        """Record a run before it is queued; True if a cancel for its cancel_id came first."""
        registered = self.redis.set(keys.run_key(request_id), self.gateway_id, ex=ttl)
        if cancel_id is None:
            await registered
            return False
        # Side by side: the two keys may live on different cluster nodes.
        _, early = await asyncio.gather(registered, self._register(
            keys=[keys.cancel_id_key(cancel_id), keys.early_cancel_key(cancel_id)], args=[request_id, ttl]))
        return bool(early)

    async def finish(self, request_id: str, cancel_id: str | None, ttl: int) -> None:
        unregistered = self.redis.delete(keys.run_key(request_id))
        if cancel_id is None:
            await unregistered
            return
        await asyncio.gather(unregistered, self._finish(keys=[keys.cancel_id_key(cancel_id)],
                                                        args=[request_id, ttl, FINISHED]))

    async def cancel_requests(self, request_ids: list[str], reason: str, sent_at: float = 0.0) -> None:
        """Stop these requests wherever they are: queued (stash) or running (notice)."""
        pipe = self.redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(keys.cancelled_key(request_id), reason, ex=keys.CANCEL_MEMORY_TTL_S)
        # As a raw command: a cluster pipeline refuses `publish()`, but sends PUBLISH to a node,
        # and a cluster passes it to the subscribers of every node.
        pipe.execute_command("PUBLISH", keys.CANCEL_CHANNEL,
                             encode(CancelNotice(request_ids, reason, sent_at=sent_at or time.time())))
        await pipe.execute()

    async def cancel(self, *, cancel_id: str | None = None, request_id: str | None = None) -> int:
        """Cancel by cancel_id (every run registered under it) or by request id; returns how many
        runs it stopped."""
        if cancel_id is not None:
            members = await self._cancel_by_id(keys=[keys.cancel_id_key(cancel_id), keys.early_cancel_key(cancel_id)],
                                               args=[keys.CANCEL_MEMORY_TTL_S])
            # Registered and not finished: no need to look for their runs.
            request_ids = sorted(m.decode() for m in members or () if m != FINISHED)
        elif request_id is not None and await self.redis.exists(keys.run_key(request_id)):
            request_ids = [request_id]
        else:
            request_ids = []
        if request_ids:
            await self.cancel_requests(request_ids, "explicit")
        return len(request_ids)
