"""Cancels that work from any gateway replica, at any moment of a request's life, for the tenant
whose run it is and no other.

The registry lives in Redis, not in a process, so `POST /v1/cancel` on one replica stops a run
streaming through another. Three paths reach a worker:

- a running request: a `CancelNotice` on the pub/sub channel; the worker aborts its engine;
- a queued request: `cancelled:{request_id}` is stashed first, and the worker that claims the
  request consumes it (DEL) before starting, so the request never runs;
- a run not registered yet (the cancel beat the request to the gateway): `cancel-early:{group}`
  is stashed, and registering a run of that group consumes it atomically.

Runs are found by *group*: a tenant's `cancel_id`, or a tenant's session (`keys.cancel_group`).
A group may hold several runs at once (an agent's parallel calls): `cancel-id:{group}` is the
set of the request ids registered under it and not finished yet, so a cancel of the group stops
every one of them, and a run that finishes leaves the set without making the others
uncancellable. Registering, finishing and cancelling a group are each one Lua script on the two
keys of that group (one cluster slot), so there is no check-then-act window between them.

Tenants: a group's name holds its tenant, so one tenant's cancel_id never reaches, nor stashes
an early cancel for, another's runs. A cancel by response id reads the run's key
(`run:{request_id}`, which holds the tenant that made it) in the script that stashes the cancel:
another tenant's id cancels nothing. On one Redis server the worker that answers a run removes
that key in the write of its answer, ahead of it (`ChunkEnvelope.unregistered`), which saves the
gateway a round trip per request; otherwise (a cluster, an older worker, a run that did not end
with its worker's answer) the gateway removes it once the run ends.

A finished run leaves `FINISHED` in its groups (for at least as long as the run could have
lasted), so a late cancel for it is a no-op instead of a stash that could hit a later run. A
set's TTL only ever grows, to cover its longest run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable

from shared import keys
from shared.codec import encode
from shared.envelopes import CancelNotice, RequestEnvelope
from shared.redis_batch import BatchedRedis

# A member of `cancel-id:{group}` that no request id can be (request ids are hex): some run of
# this group has finished.
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

# KEYS: cancel-id, cancel-early; ARGV: ttl, stash ('1': an early cancel waits for a run of the group).
# Returns the members of the set (the runs still registered, and the finished mark if one finished),
# or nil when there is none (after stashing an early cancel if asked).
_CANCEL_GROUP = """
if redis.call('EXISTS', KEYS[1]) == 1 then return redis.call('SMEMBERS', KEYS[1]) end
if ARGV[2] == '1' then redis.call('SET', KEYS[2], '1', 'EX', ARGV[1]) end
return false
"""

# KEYS: run, cancelled (one slot: the request's). ARGV: tenant, cause, ttl. Stashes the cancel of a
# registered run of that tenant; returns 1 if it did.
_CANCEL_RUN = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[2], ARGV[2], 'EX', ARGV[3])
return 1
"""


def cancel_groups(envelope: RequestEnvelope) -> list[str]:
    """The groups a request is cancelled by: its tenant's cancel_id, its tenant's session."""
    groups = []
    if envelope.cancel_id is not None:
        groups.append(keys.cancel_group(envelope.tenant, cancel_id=envelope.cancel_id))
    if envelope.session_id:
        groups.append(keys.cancel_group(envelope.tenant, session_id=envelope.session_id))
    return groups


class CancelRegistry:
    def __init__(self, redis: BatchedRedis):
        self.redis = redis
        self._register = redis.register_script(_REGISTER)
        self._finish = redis.register_script(_FINISH)
        self._cancel_group = redis.register_script(_CANCEL_GROUP)
        self._cancel_run = redis.register_script(_CANCEL_RUN)

    async def register(self, request_id: str, tenant: str, groups: list[str], ttl: int) -> bool:
        """Record a run of `tenant` before it is queued; True if a cancel of one of its groups came first."""
        # Side by side: the keys may live on different cluster nodes.
        _, *early = await asyncio.gather(self.record(request_id, tenant, ttl), *(self._register(
            keys=[keys.cancel_id_key(group), keys.early_cancel_key(group)], args=[request_id, ttl]) for group in groups))
        return any(early)

    def record(self, request_id: str, tenant: str, ttl: int) -> asyncio.Future:
        """Record a run of `tenant` that no cancel can have come for (it has no groups), queued at this
        call, ahead of its request's queueing."""
        return self.redis.now("SET", keys.run_key(request_id), tenant, "EX", ttl)

    def finish(self, request_id: str, groups: list[str], ttl: int,
               registered: bool = True) -> Awaitable | None:
        """Unregister a run that has ended, its commands queued at this call (`BatchedRedis.now`):
        a cancel of it that this registry is asked for after this call finds it ended. Not
        `registered`: its worker removed its key already, with its answer; nothing if no group either."""
        deleted = [self.redis.now("DEL", keys.run_key(request_id))] if registered else []
        if not groups:
            return deleted[0] if deleted else None
        return asyncio.gather(*deleted, *(
            self.redis.call_now(self._finish, [keys.cancel_id_key(group)], [request_id, ttl, FINISHED])
            for group in groups))

    async def cancel_requests(self, request_ids: list[str], reason: str, sent_at: float = 0.0) -> None:
        """Stop these requests wherever they are: queued (stash) or running (notice). The caller
        has made sure they are its own."""
        pipe = self.redis.pipeline(transaction=False)
        for request_id in request_ids:
            pipe.set(keys.cancelled_key(request_id), reason, ex=keys.CANCEL_MEMORY_TTL_S)
        self._publish(pipe, request_ids, reason, sent_at)
        await pipe.execute()

    async def cancel_group(self, group: str, *, early: bool) -> int:
        """Cancel every run registered in `group`; with `early`, a cancel that finds none waits for
        the group's next run. Returns how many runs it stopped."""
        members = await self._cancel_group(keys=[keys.cancel_id_key(group), keys.early_cancel_key(group)],
                                           args=[keys.CANCEL_MEMORY_TTL_S, "1" if early else "0"])
        # Registered and not finished: no need to look for their runs.
        request_ids = sorted(m.decode() for m in members or () if m != FINISHED)
        if request_ids:
            await self.cancel_requests(request_ids, "explicit")
        return len(request_ids)

    async def cancel_run(self, request_id: str, tenant: str, reason: str = "explicit") -> int:
        """Cancel the run `request_id` if it is registered and `tenant`'s; returns 1 if it was."""
        stashed = await self._cancel_run(keys=[keys.run_key(request_id), keys.cancelled_key(request_id)],
                                         args=[tenant, reason, keys.CANCEL_MEMORY_TTL_S])
        if not stashed:
            return 0
        pipe = self.redis.pipeline(transaction=False)
        self._publish(pipe, [request_id], reason, 0.0)
        await pipe.execute()
        return 1

    @staticmethod
    def _publish(pipe, request_ids: list[str], reason: str, sent_at: float) -> None:
        # As a raw command: a cluster pipeline refuses `publish()`, but sends PUBLISH to a node,
        # and a cluster passes it to the subscribers of every node.
        pipe.execute_command("PUBLISH", keys.CANCEL_CHANNEL,
                             encode(CancelNotice(request_ids, reason, sent_at=sent_at or time.time())))
