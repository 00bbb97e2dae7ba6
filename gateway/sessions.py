"""Sessions that live in the fleet: a conversation kept in Redis, continued by chat requests that
name it (`session_id`), and snapshots of it. Any replica answers for any session.

A turn (`POST /v1/chat/completions` with `session_id`) sends only its new messages: the gateway
prepends the stored ones, serves the request as any other, and stores the request's messages and
the assistant's answer when the turn ends: at its terminal chunk (before the client reads the
stream's end, so a next turn on any replica finds it), or when it was cancelled or its client went
away (what was generated so far; a whole response whose client left stores an empty answer).
The stored history keeps one leading system message: a request that starts with one replaces it
(an equal one changes nothing), so a client may resend its system prompt every turn.

One turn of a session runs at a time: a turn takes the session's lock (`keys.session_keys`, with
the request's deadline as its TTL) and a second one gets a 409 until the first is stored. The
lock is released by the turn's end on every path; rollback and loading a snapshot over the
session refuse with 409 while a turn runs.

Bounds: every key has a TTL (`--session-ttl`, renewed by each turn; `--snapshot-ttl`); a session
holds at most `--session-max-messages` messages and `--session-max-bytes` bytes of them, checked
before a turn runs (a turn past either gets a 400: nothing is trimmed behind the client's back,
so a session holds at most the bound plus one answer); at most `--max-sessions` sessions (the least
recently used go first) and `--max-snapshots` snapshots (the oldest go first). A session or
snapshot belongs to the API key (tenant) that made it: another key's requests get a 404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr
from redis.asyncio import Redis
from starlette.responses import Response, StreamingResponse

from gateway import tenancy
from gateway.bounded_index import BoundedIndex
from gateway.errors import json_response
from gateway.fleet import Fleet, GatewaySettings
from gateway.serving import Formatter, serve_body, serve_generation
from gateway.streams import serve_resumable
from shared import keys
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope
from shared.errors import Conflict, FleetError, InvalidRequest, NotFound

router = APIRouter()

# The request fields that are llmfleet's, not the engine's: never forwarded to the worker.
EXTENSIONS = ("session_id", "discard_thinking")
LOCK_MARGIN_S = 5.0  # a turn's lock outlives its deadline by this much, for its end to be stored

SessionId = Annotated[StrictStr, Field(min_length=1, max_length=256)]

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
class AssistantTurn:
    """What choice 0 of a turn generated, as its formatter saw it go by: the answer to store."""

    text: str = ""
    reasoning: str = ""
    calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    seen: bool = False  # a chunk came
    ended: bool = False  # the terminal chunk, or an error, came
    failed: bool = False

    def add(self, chunk: GenerationChunk) -> None:
        self.seen = True
        self.ended = self.ended or chunk.done
        if chunk.choice_index != 0:
            return
        self.text += chunk.text or ""
        self.reasoning += chunk.reasoning or ""
        for delta in chunk.tool_calls or ():
            call = self.calls.setdefault(delta.index, {"id": None, "type": "function",
                                                       "function": {"name": None, "arguments": ""}})
            call["id"] = call["id"] or delta.id
            call["function"]["name"] = call["function"]["name"] or delta.name
            call["function"]["arguments"] += delta.arguments

    def take(self, terminal: GenerationChunk) -> None:
        """A whole response's choice 0."""
        candidate = next(iter(terminal.candidates or ()), Candidate(0))
        self.seen = self.ended = True
        self.text, self.reasoning = candidate.text or "", candidate.reasoning or ""
        for call in candidate.tool_calls or ():
            self.add(GenerationChunk(text=None, tool_calls=[call]))

    def fail(self) -> None:
        self.ended = self.failed = True

    def message(self, discard_thinking: bool) -> dict[str, Any] | None:
        """The assistant message to store; None when the turn failed before generating anything."""
        if self.failed and not self.seen:
            return None
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.calls:
            message["tool_calls"] = [self.calls[i] for i in sorted(self.calls)]
        if self.reasoning and not discard_thinking:
            message["reasoning"] = self.reasoning
        return message


@dataclass(slots=True)
class Turn:
    """One running turn of a session, holding its lock: the stored history and the request's new
    messages; `end` stores them with the answer and releases the lock."""

    store: SessionStore
    session_id: str
    owner: str  # the request id, the lock's value
    history: list[dict[str, Any]]
    system: dict[str, Any] | None  # the request's leading system message
    new: list[dict[str, Any]]
    discard_thinking: bool
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

    async def end(self, answer: AssistantTurn | None) -> None:
        """Store the turn (the new messages and `answer`), or with None only release the lock."""
        self.done = True
        message = answer.message(self.discard_thinking) if answer is not None else None
        await self.store.end_turn(self, message)

    def end_soon(self, answer: AssistantTurn | None) -> None:
        """`end` in a task the store owns: for a stream whose client went away, where awaiting is cut short."""
        if not self.done:
            self.store.own(self.end(answer))


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
        self._pending: set[asyncio.Task] = set()

    def own(self, work) -> None:
        task = asyncio.ensure_future(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

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
    async def begin_turn(self, session_id: str, envelope: RequestEnvelope, messages: list[dict[str, Any]],
                         discard_thinking: bool) -> Turn:
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
        turn = Turn(self, session_id, envelope.request_id, [], system, messages[1:] if system else messages,
                    discard_thinking)
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


def session_store(fleet: Fleet) -> SessionStore:
    """The store of this gateway's Redis, made once per fleet."""
    store = getattr(fleet, "session_store", None)
    if store is None:  # the Fleet knows nothing of sessions; the first use makes it
        store = fleet.session_store = SessionStore(fleet.redis, fleet.settings)
    return store


# --- chat turns ----------------------------------------------------------------------------------

async def serve_chat(body: Any, request: Request, fleet: Fleet, envelope: RequestEnvelope,
                     formatter: Formatter) -> Response:
    """Chat's `Serve`: a request without `session_id` as any other; with one, a turn of the session."""
    envelope.body = {name: value for name, value in envelope.body.items() if name not in EXTENSIONS}
    if body.session_id is None:
        return await serve_body(body, request, fleet, envelope, formatter)
    if body.n != 1:
        raise InvalidRequest("A turn of a session has one answer: `n` must be 1.", param="n")
    turn = await session_store(fleet).begin_turn(body.session_id, envelope, envelope.body["messages"],
                                                 body.discard_thinking)
    envelope.body["messages"] = turn.prompt()
    envelope.session_id = body.session_id  # a cancel by session_id stops the turn
    if body.resumable:  # the run outlives its client: its own end stores the turn
        async def store_turn(_terminal: GenerationChunk | None, _error: FleetError | None) -> None:
            await turn.end(formatter.turn if formatter.turn.seen else None)  # refused: only released

        try:
            return await serve_resumable(request, fleet, envelope, formatter, on_terminal=store_turn)
        except BaseException:  # refused before it ran (429, 503): nothing to store
            turn.end_soon(None)
            raise
    try:
        answer = await serve_generation(request, fleet, envelope, formatter)
    except BaseException:
        turn.end_soon(None)
        raise
    if isinstance(answer, StreamingResponse):
        answer.body_iterator = _stored_at_end(answer.body_iterator, turn, formatter.turn)
    else:  # a whole answer, or its client left (499): stored; a refusal: only released
        await turn.end(formatter.turn if answer.status_code in (200, 499) else None)
    return answer


async def _stored_at_end(parts: AsyncIterator[bytes], turn: Turn, answer: AssistantTurn) -> AsyncIterator[bytes]:
    """The stream, its turn stored before the client reads its end; if the client goes away first
    (the stream is cancelled or closed), stored from what was generated so far."""
    try:
        async for part in parts:
            if answer.ended and not turn.done:
                await turn.end(answer)
            yield part
    finally:
        turn.end_soon(answer)


# --- routes --------------------------------------------------------------------------------------

class NewSession(BaseModel):
    session_id: SessionId
    max_seq_len: Annotated[StrictInt, Field(gt=0, le=2**31 - 1)] | None = None  # stored as JSON: a bounded int


class Rollback(BaseModel):
    keep_messages: Annotated[StrictInt, Field(ge=0, le=2**31 - 1)]


class Labels(BaseModel):
    title: Annotated[StrictStr, Field(max_length=256)] | None = None
    description: Annotated[StrictStr, Field(max_length=4096)] | None = None
    tags: Annotated[list[Annotated[StrictStr, Field(max_length=64)]], Field(max_length=64)] | None = None

    def given(self) -> dict[str, Any]:
        labels = self.model_dump(include=self.model_fields_set)
        if "tags" in labels:
            labels["tags"] = labels["tags"] or []
        return labels


class Load(BaseModel):
    session_id: SessionId | None = None
    force: StrictBool = False


def _store(request: Request) -> SessionStore:
    return session_store(request.app.state.fleet)


def _no_session(session_id: str) -> NotFound:
    return NotFound(f"Session '{session_id}' not found.", param="session_id")


def _no_snapshot(snapshot_id: str) -> NotFound:
    return NotFound(f"Snapshot '{snapshot_id}' not found.", param="snapshot_id")


@router.post("/v1/sessions")
async def create_session(body: NewSession, request: Request) -> Response:
    if await _store(request).write(body.session_id, [], max_seq_len=body.max_seq_len) != "ok":
        raise Conflict(f"Session '{body.session_id}' exists already.", param="session_id")
    return json_response({"status": "created", **await _store(request).info(body.session_id)})


@router.get("/v1/sessions")
async def list_sessions(request: Request) -> Response:
    return json_response({"object": "list", "sessions": await _store(request).all()})


@router.get("/v1/sessions/{session_id}")
async def get_session(session_id: str, request: Request) -> Response:
    info = await _store(request).info(session_id)
    if info is None:
        raise _no_session(session_id)
    return json_response(info)


@router.delete("/v1/sessions/{session_id}")
async def delete_session(session_id: str, request: Request) -> Response:
    if not await _store(request).delete(session_id):
        raise _no_session(session_id)
    return json_response({"status": "deleted", "session_id": session_id})


@router.get("/v1/sessions/{session_id}/history")
async def session_history(session_id: str, request: Request) -> Response:
    messages = await _store(request).history(session_id)
    if messages is None:
        raise _no_session(session_id)
    return json_response({"session_id": session_id, "messages": messages})


@router.post("/v1/sessions/{session_id}/rollback")
async def rollback_session(session_id: str, body: Rollback, request: Request) -> Response:
    left = await _store(request).rollback(session_id, body.keep_messages)
    if left == -1:
        raise _no_session(session_id)
    if left == -2:
        raise Conflict(f"Session '{session_id}' is answering a turn; roll it back when it ends.",
                       param="session_id")
    return json_response({"status": "ok", "session_id": session_id,
                          "session": await _store(request).info(session_id)})


@router.post("/v1/sessions/{session_id}/save")
async def save_session(session_id: str, request: Request, body: Labels | None = None) -> Response:
    manifest = await _store(request).save(session_id, body.given() if body else {})
    if manifest is None:
        raise _no_session(session_id)
    return json_response({"status": "saved", "snapshot_id": manifest["snapshot_id"], "snapshot": manifest})


@router.get("/v1/snapshots")
async def list_snapshots(request: Request) -> Response:
    return json_response({"object": "list", "snapshots": await _store(request).snapshots()})


@router.get("/v1/snapshots/{snapshot_id}")
async def get_snapshot(snapshot_id: str, request: Request) -> Response:
    manifest = await _store(request).snapshot(snapshot_id, with_messages=True)
    if manifest is None:
        raise _no_snapshot(snapshot_id)
    return json_response(manifest)


@router.patch("/v1/snapshots/{snapshot_id}")
async def label_snapshot(snapshot_id: str, body: Labels, request: Request) -> Response:
    manifest = await _store(request).label(snapshot_id, body.given())
    if manifest is None:
        raise _no_snapshot(snapshot_id)
    return json_response(manifest)


@router.delete("/v1/snapshots/{snapshot_id}")
async def delete_snapshot(snapshot_id: str, request: Request) -> Response:
    if not await _store(request).delete_snapshot(snapshot_id):
        raise _no_snapshot(snapshot_id)
    return json_response({"status": "deleted", "snapshot_id": snapshot_id})


@router.post("/v1/snapshots/{snapshot_id}/load")
async def load_snapshot(snapshot_id: str, request: Request, body: Load | None = None) -> Response:
    body = body or Load()
    store = _store(request)
    manifest = await store.snapshot(snapshot_id, with_messages=True)
    if manifest is None:
        raise _no_snapshot(snapshot_id)
    session_id = body.session_id or f"sess_{uuid.uuid4().hex}"
    if (await store.info(session_id)) is None and await store.redis.exists(keys.session_keys(session_id)[0]):
        raise Conflict(f"Session '{session_id}' exists already.", param="session_id")  # another key's
    loaded = await store.write(session_id, manifest["messages"], force=body.force,
                               max_seq_len=manifest["max_seq_len"])
    if loaded != "ok":
        why = "exists already (force: true replaces it)" if loaded == "exists" else "is answering a turn"
        raise Conflict(f"Session '{session_id}' {why}.", param="session_id")
    return json_response({"status": "loaded", "snapshot_id": snapshot_id, "session_id": session_id,
                          "session": await store.info(session_id)})
