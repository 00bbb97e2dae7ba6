"""Stored Responses in Redis: what `store`, `previous_response_id`, retrieve, delete and cancel
read and write, from any gateway replica.

One hash per response (`keys.response_key`) holds three fields:
- `response`: the Response object as a client reads it (JSON), written when it ends (or, for a
  background request, once at creation with status "queued");
- `history`: the chat messages the response continued from and its own input, without the
  system message (instructions do not carry over, as in OpenAI's API and vLLM's), so that a
  request naming it as `previous_response_id` rebuilds the conversation without the chain;
- `status`: the response's status, kept apart so a cancel can change it atomically (a script)
  without re-encoding the JSON, and so that a response cancelled while it ran stays cancelled
  when its last chunk lands (`status` wins over the JSON's own).

Bounds: every hash has the store's TTL; a record larger than `max_bytes` is not stored (a warning
is logged; a later reference to it answers 404), and an index of stored ids (`keys.RESPONSE_INDEX`,
a sorted set by time, with the same TTL) evicts the oldest responses past `max_entries`, so a flood
of stored responses holds Redis at a bounded size whatever the TTL.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from gateway.bounded_index import BoundedIndex
from shared import keys

log = logging.getLogger(__name__)

# KEYS: the response hash. ARGV: status. Returns the status before, or false when no such response.
# A running response becomes "cancelled"; any other is left as it is.
_CANCEL = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'queued' or status == 'in_progress' then redis.call('HSET', KEYS[1], 'status', ARGV[1]) end
return status
"""

# KEYS: the response hash. ARGV: response JSON, history JSON, status, TTL. A response cancelled while
# it ran keeps its status; the record is written either way (its output is what was generated).
_FINISH = """
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'cancelled' then status = ARGV[3] end
redis.call('HSET', KEYS[1], 'response', ARGV[1], 'history', ARGV[2], 'status', status)
redis.call('EXPIRE', KEYS[1], ARGV[4])
return status
"""

@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    history: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: int, max_bytes: int, max_entries: int):
        self.redis = redis
        self.ttl_s = max(1, int(ttl_s))
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._cancel = redis.register_script(_CANCEL)
        self._finish = redis.register_script(_FINISH)
        self._index = BoundedIndex(redis, keys.RESPONSE_INDEX, max_entries, self.ttl_s,
                                   lambda response_id: [keys.response_key(response_id)])

    async def get(self, response_id: str) -> StoredResponse | None:
        fields = await self.redis.hmget(keys.response_key(response_id), ["response", "history", "status"])
        if fields[0] is None:
            return None
        response = orjson.loads(fields[0])
        response["status"] = fields[2].decode() if fields[2] is not None else response["status"]
        return StoredResponse(response, orjson.loads(fields[1]) if fields[1] else [])

    async def save(self, response: dict[str, Any], history: list[dict[str, Any]]) -> str | None:
        """Store a response (anew, or its end); returns the status it is stored with, None if not stored."""
        response_json, history_json = orjson.dumps(response), orjson.dumps(history)
        if len(response_json) + len(history_json) > self.max_bytes:
            log.warning("response %s not stored: %d bytes, more than the store's bound of %d", response["id"],
                        len(response_json) + len(history_json), self.max_bytes)
            return None
        key = keys.response_key(response["id"])
        status = await self._finish(keys=[key], args=[response_json, history_json, response["status"], self.ttl_s])
        await self._index.add(response["id"], time.time())
        return status.decode() if isinstance(status, bytes) else status

    async def cancel(self, response_id: str) -> str | None:
        """Mark a running response cancelled; returns its status before, None if there is none."""
        status = await self._cancel(keys=[keys.response_key(response_id)], args=["cancelled"])
        return status.decode() if isinstance(status, bytes) else status

    async def delete(self, response_id: str) -> bool:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.response_key(response_id))
            pipe.zrem(keys.RESPONSE_INDEX, response_id)
            deleted, _ = await pipe.execute()
        return bool(deleted)
