"""Stored Responses in Redis: what `store`, `previous_response_id`, retrieve, delete and cancel
read and write, from any gateway replica.

One hash per response (`keys.response_key`) holds:
- `response`: the Response object as a client reads it (JSON), written when it ends (or, for a
  background request, once at creation with status "queued");
- `history`: the chat messages the response continued from and its own input, without the
  system message (instructions do not carry over, as in OpenAI's API and vLLM's), so that a
  request naming it as `previous_response_id` rebuilds the conversation without the chain;
- `input`: the request's own input items, as `GET /v1/responses/{id}/input_items` lists them;
- `status`: the response's status, kept apart so a cancel can change it atomically (a script)
  without re-encoding the JSON, and so that a response cancelled while it ran stays cancelled
  when its last chunk lands (`status` wins over the JSON's own);
- `tenant`: who stored it (`gateway.tenancy`). Every read, cancel and delete names a tenant and
  finds only that tenant's responses: another tenant's id reads as unknown (a 404), and the
  check runs inside the script that cancels or deletes, with no window between them.

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

from gateway.fleet.bounded_index import BoundedIndex
from shared import keys

log = logging.getLogger(__name__)

# KEYS: the response hash. ARGV: status, tenant. Returns the status before, or false when the
# tenant has no such response. A running response becomes "cancelled"; any other is left as it is.
_CANCEL = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[2] then return false end
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return false end
if status == 'queued' or status == 'in_progress' then redis.call('HSET', KEYS[1], 'status', ARGV[1]) end
return status
"""

# KEYS: the response hash. ARGV: response JSON, history JSON, status, TTL, tenant, input JSON. A
# response cancelled while it ran keeps its status; the record is written either way (its output is
# what was generated). Returns false if another tenant holds the id (never, for a new random id).
_FINISH = """
local owner = redis.call('HGET', KEYS[1], 'tenant')
if owner and owner ~= ARGV[5] then return false end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'cancelled' then status = ARGV[3] end
redis.call('HSET', KEYS[1], 'response', ARGV[1], 'history', ARGV[2], 'status', status, 'tenant', ARGV[5],
           'input', ARGV[6])
redis.call('EXPIRE', KEYS[1], ARGV[4])
return status
"""

# KEYS: the response hash. ARGV: tenant, the failed response's JSON. The tenant's response, if it
# still runs, becomes that failed one; returns 1 if it did.
_FAIL = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
if status ~= 'queued' and status ~= 'in_progress' then return 0 end
redis.call('HSET', KEYS[1], 'response', ARGV[2], 'status', 'failed')
return 1
"""

# KEYS: the response hash. ARGV: tenant. Deletes the tenant's response; returns 1 if it did.
_DELETE = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[1] then return 0 end
return redis.call('DEL', KEYS[1])
"""


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]
    history: list[dict[str, Any]]
    input: list[dict[str, Any]]


class ResponseStore:
    def __init__(self, redis: Redis, ttl_s: int, max_bytes: int, max_entries: int):
        self.redis = redis
        self.ttl_s = max(1, int(ttl_s))
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self._cancel = redis.register_script(_CANCEL)
        self._finish = redis.register_script(_FINISH)
        self._delete = redis.register_script(_DELETE)
        self._fail = redis.register_script(_FAIL)
        self._index = BoundedIndex(redis, keys.RESPONSE_INDEX, max_entries, self.ttl_s,
                                   lambda response_id: [keys.response_key(response_id)])

    async def get(self, response_id: str, tenant: str) -> StoredResponse | None:
        """The tenant's stored response, or None (none stored, expired, or another tenant's)."""
        fields = await self.redis.hmget(keys.response_key(response_id), ["response", "history", "status", "tenant",
                                                                         "input"])
        if fields[0] is None or (fields[3] or b"").decode() != tenant:
            return None
        response = orjson.loads(fields[0])
        response["status"] = fields[2].decode() if fields[2] is not None else response["status"]
        return StoredResponse(response, orjson.loads(fields[1]) if fields[1] else [],
                              orjson.loads(fields[4]) if fields[4] else [])

    async def save(self, response: dict[str, Any], history: list[dict[str, Any]], tenant: str,
                   input_items: list[dict[str, Any]] = ()) -> str | None:
        """Store a response of `tenant` (anew, or its end); returns the status it is stored with,
        None if not stored."""
        response_json, history_json, input_json = orjson.dumps(response), orjson.dumps(history), \
            orjson.dumps(list(input_items))
        size = len(response_json) + len(history_json) + len(input_json)
        if size > self.max_bytes:
            log.warning("response %s not stored: %d bytes, more than the store's bound of %d", response["id"], size,
                        self.max_bytes)
            return None
        key = keys.response_key(response["id"])
        status = await self._finish(keys=[key], args=[response_json, history_json, response["status"], self.ttl_s,
                                                      tenant, input_json])
        if not status:
            return None
        await self._index.add(response["id"], time.time())
        return status.decode() if isinstance(status, bytes) else status

    async def cancel(self, response_id: str, tenant: str) -> str | None:
        """Mark the tenant's running response cancelled; returns its status before, None if there is none."""
        status = await self._cancel(keys=[keys.response_key(response_id)], args=["cancelled", tenant])
        return status.decode() if isinstance(status, bytes) else status

    async def fail(self, failed: dict[str, Any], tenant: str) -> bool:
        """Store the tenant's response as `failed` (its Response object, status "failed") if it still
        runs; whether it did."""
        return bool(await self._fail(keys=[keys.response_key(failed["id"])], args=[tenant, orjson.dumps(failed)]))

    async def delete(self, response_id: str, tenant: str) -> bool:
        if not await self._delete(keys=[keys.response_key(response_id)], args=[tenant]):
            return False
        await self.redis.zrem(keys.RESPONSE_INDEX, response_id)  # the index's slot is not the response's
        return True
