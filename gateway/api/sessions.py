"""Sessions that live in the fleet: a conversation kept in Redis (gateway/fleet/sessions.py),
continued by chat requests that name it (`session_id`), and snapshots of it. Any replica answers
for any session.

A turn (`POST /v1/chat/completions` with `session_id`) sends only its new messages: the gateway
prepends the stored ones, serves the request as any other, and stores the request's messages and
the assistant's answer when the turn ends (a history hook of its request's life,
gateway/serve/life.py): at its terminal chunk (before the client reads the stream's end, so a
next turn on any replica finds it), or when it was cancelled or its client went away (what was
generated so far; a whole response whose client left stores an empty answer). A turn refused
before it ran only releases the session's lock. `POST /v1/cancel {"session_id": ...}` stops the
turn a session runs (its cancel group, gateway/fleet/cancels.py).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, StrictBool, StrictInt, StrictStr
from starlette.responses import Response

from gateway.fleet.runs import Fleet
from gateway.fleet.sessions import SessionStore, Turn
from gateway.http.errors import json_response
from gateway.http.json_body import JSONRoute
from gateway.serve.formatter import Formatter
from gateway.serve.generation import serve_generation
from gateway.serve.life import Hook, Outcome
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope
from shared.errors import Conflict, InvalidRequest, NotFound

router = APIRouter(route_class=JSONRoute)

# The request fields that are llmfleet's, not the engine's: never forwarded to the worker.
EXTENSIONS = ("session_id", "discard_thinking")

SessionId = Annotated[StrictStr, Field(min_length=1, max_length=256)]


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


# --- chat turns ----------------------------------------------------------------------------------

async def serve_chat(body: Any, request: Request, fleet: Fleet, envelope: RequestEnvelope,
                     formatter: Formatter) -> Response:
    """Chat's `Serve`: a request without `session_id` as any other; with one, a turn of the session."""
    envelope.body = {name: value for name, value in envelope.body.items() if name not in EXTENSIONS}
    if body.session_id is None:
        return await serve_generation(request, fleet, envelope, formatter, resumable=body.resumable)
    if body.n != 1:
        raise InvalidRequest("A turn of a session has one answer: `n` must be 1.", param="n")
    turn = await fleet.sessions.begin_turn(body.session_id, envelope, envelope.body["messages"])
    envelope.body["messages"] = turn.prompt()
    envelope.session_id = body.session_id  # a cancel by session_id stops the turn
    hook = _store_turn(turn, formatter.turn, body.discard_thinking, detached=body.resumable)
    return await serve_generation(request, fleet, envelope, formatter, resumable=body.resumable, hooks=[hook])


def _store_turn(turn: Turn, answer: AssistantTurn, discard_thinking: bool, detached: bool) -> Hook:
    """The turn's end: its messages and answer stored, or, refused before it ran, only its lock
    released. A detached (resumable) turn that generated nothing stores nothing either."""
    async def store(outcome: Outcome) -> None:
        if outcome.refused or (detached and not answer.seen):
            await turn.end(None)
        else:
            await turn.end(answer.message(discard_thinking))
    return store


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
    return request.app.state.fleet.sessions


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
    if await store.held_by_another(session_id):
        raise Conflict(f"Session '{session_id}' exists already.", param="session_id")  # another key's
    loaded = await store.write(session_id, manifest["messages"], force=body.force,
                               max_seq_len=manifest["max_seq_len"])
    if loaded != "ok":
        why = "exists already (force: true replaces it)" if loaded == "exists" else "is answering a turn"
        raise Conflict(f"Session '{session_id}' {why}.", param="session_id")
    return json_response({"status": "loaded", "snapshot_id": snapshot_id, "session_id": session_id,
                          "session": await store.info(session_id)})
