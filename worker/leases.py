"""A worker's leases on the requests it runs.

A running request is this worker's while it holds the request's lease (`lease:{id}`, TTL
LEASE_TTL_S), which the heartbeat renews. A worker cut off from Redis cannot renew it: once the
lease may have lapsed (another worker can then take the request over), `watch` reports the
request lost, and the worker aborts it and publishes nothing more for it. What it had already
put on the wire can still land when the link comes back: every chunk carries its lease's
fencing token (Redis's clock when the lease was taken), and gateways drop chunks of a lease
older than one they have heard from.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from shared import keys
from shared.redis_batch import BatchedRedis
from shared.stopping import pause

log = logging.getLogger(__name__)

CHECK_S = 0.1  # how often leases are checked for renewals that did not come
MARGIN_S = 0.25  # a lease counts as lost this long before Redis could let it lapse

# KEYS[1]: a request's lease; ARGV: worker id, TTL in seconds. Takes the lease if nobody holds it and
# returns its fencing token, Redis's clock in microseconds; 0 if it is held. A later lease of the
# request is taken on the same server after this one lapsed, so it gets a larger token.
_TAKE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 0 end
local now = redis.call('TIME')
return tonumber(now[1]) * 1000000 + tonumber(now[2])
"""


class Leases:
    def __init__(self, batched: BatchedRedis, worker_id: str):
        self.worker_id = worker_id
        self._take = batched.register_script(_TAKE)
        # Request id -> when (monotonic) its lease may lapse, less MARGIN_S: the last renewal Redis
        # confirmed was sent LEASE_TTL_S before that. Only leases still held are here.
        self._until: dict[str, float] = {}
        self.lost: set[str] = set()

    def take(self, request_id: str):
        """The awaitable that takes the lease: its fencing token, or 0 if another worker holds it."""
        return self._take(keys=[keys.lease_key(request_id)], args=[self.worker_id, keys.LEASE_TTL_S])

    def hold(self, request_id: str, asked: float) -> None:
        """The lease asked for at `asked` (monotonic) was taken."""
        self._until[request_id] = asked + keys.LEASE_TTL_S - MARGIN_S

    def forget(self, request_id: str) -> None:
        """The request has ended here."""
        self._until.pop(request_id, None)
        self.lost.discard(request_id)

    def renew(self, pipe: aioredis.client.Pipeline) -> tuple[list[str], float]:
        """Add the renewal of every held lease to `pipe`; pass the result to `renewed` once it ran."""
        held = list(self._until)
        for request_id in held:
            pipe.expire(keys.lease_key(request_id), keys.LEASE_TTL_S)
        return held, time.monotonic()

    def renewed(self, sent: tuple[list[str], float]) -> None:
        """Redis confirmed the renewals sent then: those leases hold until LEASE_TTL_S after it."""
        request_ids, at = sent
        for request_id in request_ids:
            if request_id in self._until:  # not lost meanwhile: a late renewal revives nothing
                self._until[request_id] = max(self._until[request_id], at + keys.LEASE_TTL_S - MARGIN_S)

    async def watch(self, stopping, on_lost: Callable[[str], None]) -> None:
        """Report each held lease that may lapse: Redis has not confirmed a renewal (this worker is
        cut off from it, or it is down) for nearly LEASE_TTL_S."""
        while not await pause(stopping, CHECK_S):
            now = time.monotonic()
            for request_id in [rid for rid, until in self._until.items() if now >= until]:
                del self._until[request_id]
                self.lost.add(request_id)
                log.warning("request %s: no lease renewal reached Redis for %.1fs; another worker may take it "
                            "over: aborting it here, publishing nothing more for it", request_id,
                            keys.LEASE_TTL_S - MARGIN_S)
                on_lost(request_id)
