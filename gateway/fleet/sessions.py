"""Sessions in Redis: a conversation's stored messages, the lock of its one running turn, and
snapshots of it, read and written by any replica (the routes and chat turns: gateway/api/sessions.py).

One turn of a session runs at a time: a turn takes the session's lock (`keys.session_keys`, with
the request's deadline as its TTL) and a second one gets a 409 until the first is stored. The
lock is released by the turn's end on every path; rollback and loading a snapshot over the
session refuse with 409 while a turn runs. The stored history keeps one leading system message:
a request that starts with one replaces it (an equal one changes nothing).

Bounds: every key has a TTL (`--session-ttl`, renewed by each turn; `--snapshot-ttl`); a session
holds at most `--session-max-messages` messages and `--session-max-bytes` bytes of them, checked
before a turn runs (a turn past either gets a 400: nothing is trimmed behind the client's back,
so a session holds at most the bound plus one answer); at most `--max-sessions` sessions (the least
recently used go first) and `--max-snapshots` snapshots (the oldest go first). A session or
snapshot belongs to the API key (tenant) that made it: the scripts compare the stored tenant, and
another key's requests find nothing (a 404).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

import orjson
from redis.asyncio import Redis

from gateway import tenancy
from gateway.fleet.bounded_index import BoundedIndex
from gateway.settings import GatewaySettings
from shared import keys
from shared.envelopes import RequestEnvelope
from shared.errors import Conflict, InvalidRequest, NotFound

LOCK_MARGIN_S = 5.0  # a turn's lock outlives its deadline by this much, for its end to be stored

# KEYS: a session's keys. ARGV: TTL, force ("1"), the number of fields, the fields (name, value...),
# then the messages. A new session, or one that replaces a session (force) while no turn runs.
_WRITE = """
if redis.call('EXISTS', KEYS[1]) == 1 and ARGV[2] ~= '1' then return 'exists' end
if redis.call('EXISTS', KEYS[3]) == 1 then return 'busy' end
redis.call('DEL', KEYS[1], KEYS[2])
local n = tonumber(ARGV[3])
redis.call('HSET', KEYS[1], unpack(ARGV, 4, 3 + n))
for i = 4 + n, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('EXPIRE', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[1])
return 'ok'
"""

# KEYS: a session's keys. ARGV: the turn's request id, lock TTL in ms, tenant.
_BEGIN = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[3] then return 'missing' end
if not redis.call('SET', KEYS[3], ARGV[1], 'NX', 'PX', ARGV[2]) then return 'busy' end
return 'ok'
"""

# KEYS: a session's keys. ARGV: the turn's request id, TTL, now, what to do with the first
# message ('' nothing, 'set' replace it, 'push' insert it, 'release' store nothing), the bytes
# added, the first message, then the messages to append. Stores nothing when the session went
# (deleted, evicted) or another turn holds the lock (this one outlived its own).
_END = """
local holder = redis.call('GET', KEYS[3])
if holder == ARGV[1] then redis.call('DEL', KEYS[3]) elseif holder then return 0 end
if ARGV[4] == 'release' or redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if ARGV[4] == 'set' then redis.call('LSET', KEYS[2], 0, ARGV[6]) end
if ARGV[4] == 'push' then redis.call('LPUSH', KEYS[2], ARGV[6]) end
for i = 7, #ARGV do redis.call('RPUSH', KEYS[2], ARGV[i]) end
redis.call('HINCRBY', KEYS[1], 'bytes', ARGV[5])
redis.call('HSET', KEYS[1], 'updated_at', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[2], ARGV[2])
return 1
"""

# KEYS: a session's keys. ARGV: messages to keep, tenant, TTL, now. Returns the messages left,
# -1 for no such session, -2 while a turn runs.
_ROLLBACK = """
if redis.call('HGET', KEYS[1], 'tenant') ~= ARGV[2] then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
local keep = tonumber(ARGV[1])
if keep == 0 then redis.call('DEL', KEYS[2]) else redis.call('LTRIM', KEYS[2], 0, keep - 1) end
local bytes = 0
for _, message in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do bytes = bytes + #message end
redis.call('HSET', KEYS[1], 'bytes', bytes, 'updated_at', ARGV[4])
redis.call('EXPIRE', KEYS[1], ARGV[3])
redis.call('EXPIRE', KEYS[2], ARGV[3])
return redis.call('LLEN', KEYS[2])
"""

def _json(value: Any) -> bytes:
    return orjson.dumps(value)


def _text(value: bytes | str | None) -> str | None:
    return value.decode() if isinstance(value, bytes) else value


@dataclass(slots=True)
class Turn:
    """One running turn of a session, holding its lock: the stored history and the request's new
    messages; `end` stores them with the answer and releases the lock, once."""

    store: SessionStore
    session_id: str
    owner: str  # the request id, the lock's value
    history: list[dict[str, Any]]
    system: dict[str, Any] | None  # the request's leading system message
    new: list[dict[str, Any]]
    done: bool = False

    @property
    def stored_system(self) -> dict[str, Any] | None:
        return self.history[0] if self.history and self.history[0].get("role") == "system" else None

    def prompt(self) -> list[dict[str, Any]]:
        """The conversation the engine sees: one system message, the history, the new messages."""
        system = self.system or self.stored_system
        rest = self.history[1:] if self.stored_system is not None else self.history
        return ([system] if system else []) + rest + self.new

    def first_action(self) -> str:
        """What the request's system message does to the stored one: '' nothing, 'set', 'push'."""
        if self.system is None or self.system == self.stored_system:
            return ""
        return "set" if self.stored_system is not None else "push"

    async def end(self, answer: dict[str, Any] | None) -> None:
        """Store the turn (the new messages and the assistant's `answer`), or with None only release the lock."""
        if not self.done:
            self.done = True
            await self.store.end_turn(self, answer)


class SessionStore:
    def __init__(self, redis: Redis, settings: GatewaySettings):
        self.redis = redis
        self.ttl_s = max(1, int(settings.session_ttl_s))
        self.snapshot_ttl_s = max(1, int(settings.snapshot_ttl_s))
        self.max_messages = settings.session_max_messages
        self.max_bytes = settings.session_max_bytes
        self.max_sessions = settings.max_sessions
        self.max_snapshots = settings.max_snapshots
        self._write = redis.register_script(_WRITE)
        self._begin = redis.register_script(_BEGIN)
        self._end = redis.register_script(_END)
        self._rollback = redis.register_script(_ROLLBACK)
        self._sessions = BoundedIndex(redis, keys.SESSION_INDEX, self.max_sessions, self.ttl_s, keys.session_keys)
        self._snapshots = BoundedIndex(redis, keys.SNAPSHOT_INDEX, self.max_snapshots, self.snapshot_ttl_s,
                                       lambda snapshot_id: [keys.snapshot_key(snapshot_id)])

    # -- sessions --
    async def write(self, session_id: str, messages: list[dict[str, Any]], *, force: bool = False,
                    max_seq_len: int | None = None) -> str:
        """A new session holding `messages`: 'ok', 'exists' (unless `force`) or 'busy' (a turn runs)."""
        now = time.time()
        encoded = [_json(m) for m in messages]
        fields = {"tenant": tenancy.current().name, "created_at": int(now), "updated_at": int(now),
                  "max_seq_len": max_seq_len or "", "bytes": sum(map(len, encoded))}
        flat = [item for pair in fields.items() for item in pair]
        result = _text(await self._write(keys=keys.session_keys(session_id),
                                         args=[self.ttl_s, "1" if force else "0", len(flat), *flat, *encoded]))
        if result == "ok":
            await self._sessions.add(session_id, now)
        return result

    async def info(self, session_id: str) -> dict[str, Any] | None:
        meta_key, messages_key, _ = keys.session_keys(session_id)
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(meta_key)
            pipe.llen(messages_key)
            meta, count = await pipe.execute()
        return _session_info(session_id, meta, count)

    async def held_by_another(self, session_id: str) -> bool:
        """A session of that id exists, and it is another tenant's."""
        return await self.info(session_id) is None and bool(await self.redis.exists(keys.session_keys(session_id)[0]))

    async def all(self) -> list[dict[str, Any]]:
        ids = [_text(i) for i in await self.redis.zrevrange(keys.SESSION_INDEX, 0, -1)]
        async with self.redis.pipeline(transaction=False) as pipe:
            for session_id in ids:
                meta_key, messages_key, _ = keys.session_keys(session_id)
                pipe.hgetall(meta_key)
                pipe.llen(messages_key)
            replies = await pipe.execute()
        found = (_session_info(i, replies[2 * n], replies[2 * n + 1]) for n, i in enumerate(ids))
        return [info for info in found if info is not None]

    async def history(self, session_id: str) -> list[dict[str, Any]] | None:
        if await self.info(session_id) is None:
            return None
        return await self._messages(session_id)

    async def delete(self, session_id: str) -> bool:
        if await self.info(session_id) is None:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(*keys.session_keys(session_id)[:2])
            pipe.zrem(keys.SESSION_INDEX, session_id)
            await pipe.execute()
        return True

    async def rollback(self, session_id: str, keep: int) -> int:
        """Keep the first `keep` messages; the messages left, -1 for no session, -2 while a turn runs."""
        now = time.time()
        left = await self._rollback(keys=keys.session_keys(session_id),
                                    args=[keep, tenancy.current().name, self.ttl_s, int(now)])
        if left >= 0:
            await self._sessions.add(session_id, now)
        return left

    async def _messages(self, session_id: str) -> list[dict[str, Any]]:
        return [orjson.loads(m) for m in await self.redis.lrange(keys.session_keys(session_id)[1], 0, -1)]

    # -- turns --
    async def begin_turn(self, session_id: str, envelope: RequestEnvelope, messages: list[dict[str, Any]]) -> Turn:
        """Lock the session for this request's turn and read its history; raises NotFound, Conflict
        (a turn runs) or InvalidRequest (the session would outgrow its bounds)."""
        lock_ms = int(max(1.0, envelope.deadline - time.time() + LOCK_MARGIN_S) * 1000)
        began = _text(await self._begin(keys=keys.session_keys(session_id),
                                        args=[envelope.request_id, lock_ms, tenancy.current().name]))
        if began == "missing":
            raise NotFound(f"Session '{session_id}' not found.", param="session_id")
        if began == "busy":
            raise Conflict(f"Session '{session_id}' is answering another turn; send the next one when it "
                           "ends.", param="session_id")
        system = messages[0] if messages and messages[0].get("role") == "system" else None
        turn = Turn(self, session_id, envelope.request_id, [], system, messages[1:] if system else messages)
        try:
            turn.history = await self._messages(session_id)
            self._check_bounds(turn)
        except BaseException:
            await turn.end(None)
            raise
        return turn

    def _check_bounds(self, turn: Turn) -> None:
        count = len(turn.prompt()) + 1
        size = sum(len(_json(m)) for m in turn.prompt())
        for amount, bound, unit in ((count, self.max_messages, "messages"), (size, self.max_bytes, "bytes")):
            if amount > bound:
                raise InvalidRequest(f"Session '{turn.session_id}' would hold {amount} {unit} after this turn, "
                                     f"more than this gateway's bound of {bound}: roll it back or start another "
                                     "session.", param="session_id", code="session_full")

    async def end_turn(self, turn: Turn, answer: dict[str, Any] | None) -> None:
        now = time.time()
        action = "release" if answer is None else turn.first_action()
        first = _json(turn.system) if action in ("set", "push") else b""
        appended = [_json(m) for m in turn.new] + ([_json(answer)] if answer is not None else [])
        added = len(first) + sum(map(len, appended))
        if action == "set":
            added -= len(_json(turn.stored_system))
        stored = await self._end(keys=keys.session_keys(turn.session_id),
                                 args=[turn.owner, self.ttl_s, int(now), action, added, first, *appended])
        if stored:
            await self._sessions.add(turn.session_id, now)

    # -- snapshots --
    async def save(self, session_id: str, labels: dict[str, Any]) -> dict[str, Any] | None:
        """A snapshot of the session's transcript; None when there is no such session."""
        info = await self.info(session_id)
        if info is None:
            return None
        messages = await self._messages(session_id)
        now = time.time()
        manifest = {"snapshot_id": f"snap_{uuid.uuid4().hex}", "object": "session.snapshot",
                    "created_at": int(now), "session_id": session_id, "max_seq_len": info["max_seq_len"],
                    "message_count": len(messages), "title": None, "description": None, "tags": [], **labels}
        await self._put_snapshot(manifest, messages)
        await self._snapshots.add(manifest["snapshot_id"], now)
        return manifest

    async def _put_snapshot(self, manifest: dict[str, Any], messages: list[dict[str, Any]] | None = None) -> None:
        key = keys.snapshot_key(manifest["snapshot_id"])
        fields = {"manifest": _json(manifest), "tenant": tenancy.current().name}
        if messages is not None:
            fields["messages"] = _json(messages)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(key, mapping=fields)
            pipe.expire(key, self.snapshot_ttl_s)
            await pipe.execute()

    async def snapshot(self, snapshot_id: str, with_messages: bool = False) -> dict[str, Any] | None:
        manifest, tenant, messages = await self.redis.hmget(keys.snapshot_key(snapshot_id),
                                                            ["manifest", "tenant", "messages"])
        if manifest is None or _text(tenant) != tenancy.current().name:
            return None
        manifest = orjson.loads(manifest)
        if with_messages:
            manifest["messages"] = orjson.loads(messages)
        return manifest

    async def snapshots(self) -> list[dict[str, Any]]:
        ids = [_text(i) for i in await self.redis.zrevrange(keys.SNAPSHOT_INDEX, 0, -1)]
        found = [await self.snapshot(i) for i in ids]
        return [manifest for manifest in found if manifest is not None]

    async def label(self, snapshot_id: str, labels: dict[str, Any]) -> dict[str, Any] | None:
        manifest = await self.snapshot(snapshot_id)
        if manifest is None:
            return None
        manifest.update(labels)
        await self._put_snapshot(manifest)
        return manifest

    async def delete_snapshot(self, snapshot_id: str) -> bool:
        if await self.snapshot(snapshot_id) is None:
            return False
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.delete(keys.snapshot_key(snapshot_id))
            pipe.zrem(keys.SNAPSHOT_INDEX, snapshot_id)
            await pipe.execute()
        return True


def _session_info(session_id: str, meta: dict[bytes, bytes], count: int) -> dict[str, Any] | None:
    if not meta or _text(meta.get(b"tenant")) != tenancy.current().name:
        return None
    max_seq_len = _text(meta.get(b"max_seq_len"))
    return {"session_id": session_id, "object": "session", "created_at": int(meta[b"created_at"]),
            "updated_at": int(meta[b"updated_at"]), "max_seq_len": int(max_seq_len) if max_seq_len else None,
            "message_count": count, "bytes": int(meta.get(b"bytes") or 0)}
