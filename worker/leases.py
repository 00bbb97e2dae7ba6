"""A worker's leases on the requests it runs.

A running request is this worker's while it holds the request's lease (`lease:{id}`, TTL
LEASE_TTL_S). A thread of its own renews the leases (`keep`), with its own connection, and keeps
the worker's heartbeat key alive between the event loop's beats: a loop busy for seconds (vLLM's
input processing, a first request's set-up on a loaded machine) starves neither, so a healthy
worker does not lose its requests to a stall. A loop silent for LOOP_STALL_LIMIT_S is hung, not
busy: the thread stops renewing and the requests go to other workers. A worker cut off from Redis
cannot renew a lease: once the
lease may have lapsed (another worker can then take the request over), `watch` reports the
request lost, and the worker aborts it and publishes nothing more for it. What it had already
put on the wire can still land when the link comes back: every chunk carries its lease's
fencing token (Redis's clock when the lease was taken), and gateways drop chunks of a lease
older than one they have heard from.

A lease is held from when it was asked for: the thread also renews a lease whose reply is late
(ASKED_RENEW_AFTER_S, a loop held up between the ask and the reply, say by another request's
render), so a stall there loses nothing either. A renewal counts only where Redis found the key.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Awaitable, Callable

import redis

from shared import keys
from shared.redis_batch import BatchedRedis
from shared.stopping import pause

log = logging.getLogger(__name__)

CHECK_S = 0.1  # how often leases are checked for renewals that did not come
MARGIN_S = 0.25  # a lease counts as lost this long before Redis could let it lapse
LOOP_STALL_LIMIT_S = 30.0  # an event loop silent this long is hung: its leases are let go
RENEW_TIMEOUT_S = 2.0  # the renewing connection's socket timeout
# A heartbeat this recent keeps its key alive: the key's TTL (HEARTBEAT_TTL_S) outlasts it by more
# than one renewal interval, so a stalled loop's key is renewed here before it lapses.
BEAT_TRUST_S = keys.HEARTBEAT_TTL_S - keys.HEARTBEAT_INTERVAL_S * 1.5
# A lease's reply this late means a loop held up (a round trip takes a millisecond): the thread
# renews the lease meanwhile. Less than LEASE_TTL_S - MARGIN_S by more than one renewal interval,
# so a renewal reaches the key before it lapses; never a reply that is merely on its way, so
# nothing but a stall can lengthen a key the ask did not take (another worker's).
ASKED_RENEW_AFTER_S = 0.5

# KEYS: a request's lease, its stashed cancel, its streamed count (one slot: the request's); ARGV:
# worker id, TTL in seconds. Takes the lease if nobody holds it and returns its fencing token, Redis's
# clock in microseconds, with the cancel stashed while it was queued (taken: it is consumed once) and
# how many runs of it reached a client; {0} if the lease is held (its holder owns the rest). A later
# lease of the request is taken on the same server after this one lapsed, so it gets a larger token.
_TAKE = """
if not redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return {0} end
local now = redis.call('TIME')
return {tonumber(now[1]) * 1000000 + tonumber(now[2]), redis.call('GETDEL', KEYS[2]), redis.call('GET', KEYS[3])}
"""

# KEYS: a request's lease, its stashed cancel; ARGV: worker id, TTL in seconds, the cancel the take
# consumed ('' if none), its TTL. Renews the lease if this worker holds it (1); else puts the cancel
# back for whoever takes the request, and 0. For a lease whose reply came too late to trust the
# ask's clock (`Leases._taken`).
_CONFIRM = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('EXPIRE', KEYS[1], ARGV[2]) end
if ARGV[3] ~= '' then redis.call('SET', KEYS[2], ARGV[3], 'NX', 'EX', ARGV[4]) end
return 0
"""


class Leases:
    def __init__(self, batched: BatchedRedis, worker_id: str):
        self.worker_id = worker_id
        self._batched = batched
        self._take = batched.register_script(_TAKE)
        self._confirm = batched.register_script(_CONFIRM)
        # Request id -> when (monotonic) its lease may lapse, less MARGIN_S: the last renewal Redis
        # confirmed was sent LEASE_TTL_S before that. Only leases still held are here. Shared
        # with the renewing thread, under the lock, as is `_asked`.
        self._until: dict[str, float] = {}
        # Request id -> when (monotonic) its lease was asked for, or last renewed while its reply
        # was out: what it holds from if taken.
        self._asked: dict[str, float] = {}
        self._lock = threading.Lock()
        self.lost: set[str] = set()
        self.loop_seen = time.monotonic()  # the event loop's last turn in `watch`
        self.beat_at = 0.0  # when (monotonic) the heartbeat's last write reached Redis (`beaten`)
        self._stop_keeping = threading.Event()
        self._keeper: threading.Thread | None = None

    def take(self, request_id: str) -> Awaitable[tuple[int, bytes | None, bytes | None]]:
        """Take the lease: its fencing token, the cancel stashed for the request while it was queued
        and the count of its runs that reached a client (`keys.streamed_key`); a token of 0 (and
        nothing else) if another worker holds it. One command, for a request's three reads,
        queued at this call: ahead of what the caller starts next (an encoding's first step),
        whatever that holds the loop for. Taken, the lease is held from now (or its last renewal
        while the reply was out) and renewed until `forget`."""
        with self._lock:
            self._asked[request_id] = time.monotonic()
        reply = self._batched.script_now(self._take, [keys.lease_key(request_id), keys.cancelled_key(request_id),
                                                      keys.streamed_key(request_id)],
                                         [self.worker_id, keys.LEASE_TTL_S])
        return self._taken(request_id, reply)

    async def _taken(self, request_id: str, reply: Awaitable[list]) -> tuple[int, bytes | None, bytes | None]:
        """The take's reply. One this late (a loop held up, and the ask perhaps written only after
        it) says that the lease was taken, not when: it is renewed if it is still this worker's, or
        counted as another's (a token of 0) if it lapsed meanwhile."""
        token, found, held, confirmed = 0, [], False, 0.0
        try:
            token, *found = await reply
            # One entry read: atomic under the GIL. None: forgotten meanwhile (the request ended).
            asked = self._asked.get(request_id)
            if token and asked is not None and time.monotonic() - asked >= ASKED_RENEW_AFTER_S:
                confirmed = time.monotonic()
                if not await self._confirm(keys=[keys.lease_key(request_id), keys.cancelled_key(request_id)],
                                           args=[self.worker_id, keys.LEASE_TTL_S, found[0] or b"",
                                                 keys.CANCEL_MEMORY_TTL_S]):
                    log.warning("request %s: its lease lapsed before its reply was read; leaving it to "
                                "whoever takes it", request_id)
                    token, found = 0, []
            held = bool(token)
        finally:
            with self._lock:
                asked = self._asked.pop(request_id, None)
                if held and asked is not None:
                    self._until[request_id] = max(asked, confirmed) + keys.LEASE_TTL_S - MARGIN_S
        stashed, streamed = found or (None, None)
        return token, stashed, streamed

    def give_up(self, request_id: str) -> None:
        """Stop renewing a held lease and count the request lost here: it is another worker's to take."""
        with self._lock:
            self._until.pop(request_id, None)
        self.lost.add(request_id)

    def forget(self, request_id: str) -> None:
        """The request has ended here."""
        with self._lock:
            self._until.pop(request_id, None)
            self._asked.pop(request_id, None)
        self.lost.discard(request_id)

    def start_keeping(self, client: redis.Redis | redis.RedisCluster, heartbeat_key: str) -> None:
        """Renew the leases, and the heartbeat key's TTL, from a thread, once a heartbeat interval."""
        self._keeper = threading.Thread(target=self.keep, args=(client, heartbeat_key), name="lease-keeper",
                                        daemon=True)
        self._keeper.start()

    def stop_keeping(self) -> None:
        self._stop_keeping.set()
        if self._keeper is not None:
            self._keeper.join(RENEW_TIMEOUT_S)  # one renewal's socket timeout; it is a daemon thread

    def beaten(self) -> None:
        """The heartbeat's write (which sets its key's TTL) reached Redis just now."""
        self.beat_at = time.monotonic()

    def keep(self, client: redis.Redis | redis.RedisCluster, heartbeat_key: str) -> None:
        """The renewing thread's loop. One renewal per interval, counted from when the last was
        sent: a slow Redis delays the next by no more than it has to. With no lease held and the
        heartbeat beating, it sends nothing: an idle worker's round trip a second saved."""
        stalled_said = False
        sent = time.monotonic()
        while not self._stop_keeping.wait(max(0.0, keys.HEARTBEAT_INTERVAL_S - (time.monotonic() - sent))):
            sent = time.monotonic()
            silent = sent - self.loop_seen
            if silent > LOOP_STALL_LIMIT_S:
                if not stalled_said:
                    log.error("the event loop has not run for %.0fs: no longer renewing leases, so other workers "
                              "take this worker's requests", silent)
                    stalled_said = True
                continue
            stalled_said = False
            with self._lock:
                leases = [*self._until, *(rid for rid, at in self._asked.items() if sent - at >= ASKED_RENEW_AFTER_S)]
            if not leases and sent - self.beat_at < BEAT_TRUST_S:
                continue  # nothing to renew, and the heartbeat's own writes keep its key alive
            pipe = client.pipeline(transaction=False)
            for request_id in leases:
                pipe.expire(keys.lease_key(request_id), keys.LEASE_TTL_S)
            pipe.expire(heartbeat_key, keys.HEARTBEAT_TTL_S)
            try:
                *renewed, _beat = pipe.execute()
            except (redis.RedisError, OSError) as exc:
                log.warning("renewing %d leases failed: %s", len(leases), exc)
                continue
            self._renewed([rid for rid, found in zip(leases, renewed, strict=True) if found], sent)

    def _renewed(self, request_ids: list[str], at: float) -> None:
        """Redis renewed, at `at` or after, the leases of these requests (their keys were there):
        they hold until LEASE_TTL_S after it. A lease whose key had lapsed holds no longer."""
        with self._lock:
            for request_id in request_ids:
                if request_id in self._until:  # not lost meanwhile: a late renewal revives nothing
                    self._until[request_id] = max(self._until[request_id], at + keys.LEASE_TTL_S - MARGIN_S)
                elif request_id in self._asked:  # its reply still out
                    self._asked[request_id] = max(self._asked[request_id], at)

    async def watch(self, stopping, on_lost: Callable[[str], None]) -> None:
        """Report each held lease that may lapse: Redis has not confirmed a renewal (this worker is
        cut off from it, or it is down) for nearly LEASE_TTL_S. Each turn is also the loop's sign of
        life for the renewing thread. With no lease held, once a heartbeat interval: a lease taken
        meanwhile cannot lapse before LEASE_TTL_S - MARGIN_S, well after the next turn."""
        while not await pause(stopping, CHECK_S if self._until else keys.HEARTBEAT_INTERVAL_S):
            now = self.loop_seen = time.monotonic()
            with self._lock:
                lapsing = [rid for rid, until in self._until.items() if now >= until]
                for request_id in lapsing:
                    del self._until[request_id]
            for request_id in lapsing:
                self.lost.add(request_id)
                log.warning("request %s: no lease renewal reached Redis for %.1fs; another worker may take it "
                            "over: aborting it here, publishing nothing more for it", request_id,
                            keys.LEASE_TTL_S - MARGIN_S)
                on_lost(request_id)
