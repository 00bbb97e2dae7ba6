"""A bounded index of stored things (responses, sessions, snapshots), most recent last.

Each thing lives in keys of its own, with a TTL; the index, a sorted set scored by time of last
use, bounds how many there are whatever the TTL: adding one past the bound deletes the oldest.
Entries older than the TTL are pruned as they are passed over, since their keys have expired.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from redis.asyncio import Redis

# KEYS: the index. ARGV: member, now, most entries, TTL, the score below which entries have
# expired. Returns the members evicted past the bound.
_ADD = """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[5])
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[4])
local over = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[3])
if over <= 0 then return {} end
local evicted = redis.call('ZRANGE', KEYS[1], 0, over - 1)
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, over - 1)
return evicted
"""


class BoundedIndex:
    def __init__(self, redis: Redis, key: str, most: int, ttl_s: int, keys_of: Callable[[str], Iterable[str]]):
        self.redis = redis
        self.key = key
        self.most = most
        self.ttl_s = ttl_s
        self.keys_of = keys_of  # a member's own keys, deleted when it is evicted
        self._add = redis.register_script(_ADD)

    async def add(self, member: str, now: float) -> None:
        """Index `member` as used at `now`, and delete the keys of those evicted past the bound."""
        evicted = await self._add(keys=[self.key], args=[member, now, self.most, self.ttl_s, now - self.ttl_s])
        if evicted:  # each member's keys have a slot of their own: one DEL each, in one round trip
            async with self.redis.pipeline(transaction=False) as pipe:
                for old in evicted:
                    pipe.delete(*self.keys_of(old.decode()))
                await pipe.execute()
