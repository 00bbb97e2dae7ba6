"""Sessions and snapshots (gateway/fleet/sessions.py) across two gateways over one Redis.

A session made through one gateway is continued, read, rolled back, saved and loaded through the
other: the state lives in Redis. The scripted engine repeats the last user message's words, one
per token, and counts every word of every message as a prompt token, so `usage.prompt_tokens`
shows exactly which messages the gateway prepended.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import orjson
import pytest

from shared import codec, redis_pool
from shared.envelopes import RequestEnvelope
from shared.keys import ENVELOPE_FIELD
from tests.procs import start_gateway, start_redis, start_redis_cluster, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

MODEL = "session-model"
GHOST = "session-ghost"  # a model no worker serves: its requests wait in Redis, where they can be read
MAX_MESSAGES = 20
MAX_BYTES = 20_000
MAX_SESSIONS = 40
TTL_S = 3600


@pytest.fixture(scope="module")
def fleet():
    """A Redis of its own (the session index is Redis-wide; a cluster with LLMFLEET_TEST_REDIS=cluster),
    a scripted worker streaming 200 tokens/s, and two gateways with small session bounds."""
    redis = start_redis_cluster() if os.environ.get("LLMFLEET_TEST_REDIS") == "cluster" else start_redis()
    started = [redis]
    try:
        started.append(start_worker(redis.url, MODEL, "--scripted-tokens-per-second", "200",
                                    "--max-concurrency", "16"))
        bounds = ["--session-max-messages", str(MAX_MESSAGES), "--session-max-bytes", str(MAX_BYTES),
                  "--max-sessions", str(MAX_SESSIONS), "--session-ttl", str(TTL_S), "--models", GHOST]
        gateways = [start_gateway(redis.url, *bounds) for _ in range(2)]
        started += gateways
        for gateway in gateways:
            wait_until_served(gateway, MODEL)
        yield redis, gateways
    finally:
        for proc in reversed(started):
            proc.stop()


@pytest.fixture
def http(fleet):
    _, gateways = fleet
    with httpx.Client(timeout=60) as one, httpx.Client(timeout=60) as other:
        one.base_url, other.base_url = gateways[0].url, gateways[1].url
        yield one, other


def new_session(client: httpx.Client, **extra) -> str:
    session_id = f"s-{uuid.uuid4().hex[:8]}"
    response = client.post("/v1/sessions", json={"session_id": session_id, **extra})
    assert response.status_code == 200, response.text
    return session_id


def turn(client: httpx.Client, session_id: str, *messages: dict, max_tokens: int = 2, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL, "messages": list(messages),
                                                     "max_tokens": max_tokens, "session_id": session_id, **extra})


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def history(client: httpx.Client, session_id: str) -> list[dict]:
    response = client.get(f"/v1/sessions/{session_id}/history")
    assert response.status_code == 200, response.text
    return response.json()["messages"]


def words(*texts: str) -> int:
    return sum(len(t.split()) for t in texts)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status and error["message"]
    if param is not None:
        assert param in (error["param"] or ""), error
    return error


def test_session_routes_and_their_errors(http):
    one, other = http
    session_id = new_session(one, max_seq_len=4096)
    assert_error(other.post("/v1/sessions", json={"session_id": session_id}), 409, "session_id")
    for bad in ({}, {"session_id": 7}, {"session_id": ""}, {"session_id": None},
                {"session_id": "x", "max_seq_len": "big"}, {"session_id": "x", "max_seq_len": 0}):
        assert_error(one.post("/v1/sessions", json=bad), 400)
    assert_error(one.post("/v1/sessions", content=b"not json", headers={"content-type": "application/json"}), 400)

    info = other.get(f"/v1/sessions/{session_id}").json()
    assert info["session_id"] == session_id and info["max_seq_len"] == 4096 and info["message_count"] == 0
    assert session_id in [s["session_id"] for s in other.get("/v1/sessions").json()["sessions"]]
    assert history(other, session_id) == []
    assert_error(one.get("/v1/sessions/nobody"), 404, "session_id")
    assert_error(one.get("/v1/sessions/nobody/history"), 404)

    for bad in ({}, {"keep_messages": -1}, {"keep_messages": True}, {"keep_messages": "1"},
                {"keep_messages": 1.5}):
        assert_error(one.post(f"/v1/sessions/{session_id}/rollback", json=bad), 400)
    assert_error(one.post("/v1/sessions/nobody/rollback", json={"keep_messages": 0}), 404)

    assert other.delete(f"/v1/sessions/{session_id}").json() == {"status": "deleted", "session_id": session_id}
    assert_error(one.delete(f"/v1/sessions/{session_id}"), 404)
    assert_error(one.get(f"/v1/sessions/{session_id}"), 404)
    assert session_id not in [s["session_id"] for s in one.get("/v1/sessions").json()["sessions"]]


@pytest.mark.cluster
def test_turns_continue_the_stored_history_on_either_gateway(fleet, http):
    _, gateways = fleet
    one, other = http
    session_id = new_session(one)
    sdk = openai.OpenAI(base_url=f"{gateways[0].url}/v1", api_key="x", max_retries=0, timeout=60)
    first = sdk.chat.completions.create(model=MODEL, max_tokens=4, extra_body={"session_id": session_id},
                                        messages=[{"role": "system", "content": "be brief"},
                                                  user("red green blue")])
    assert first.choices[0].message.content == "red green blue red"
    assert first.usage.prompt_tokens == words("be brief", "red green blue")

    # The other gateway prepends the stored turn; the same system message again is not duplicated.
    second = turn(other, session_id, {"role": "system", "content": "be brief"}, user("yellow")).json()
    assert second["choices"][0]["message"]["content"] == "yellow yellow"
    assert second["usage"]["prompt_tokens"] == words("be brief", "red green blue", "red green blue red", "yellow")
    assert history(one, session_id) == [
        {"role": "system", "content": "be brief"}, user("red green blue"),
        {"role": "assistant", "content": "red green blue red"}, user("yellow"),
        {"role": "assistant", "content": "yellow yellow"}]

    # A different system message replaces the stored one; none keeps it.
    third = turn(one, session_id, {"role": "system", "content": "be very brief"}, user("cyan")).json()
    assert third["usage"]["prompt_tokens"] == words("be very brief", "red green blue", "red green blue red",
                                                    "yellow", "yellow yellow", "cyan")
    fourth = turn(other, session_id, user("plain")).json()
    assert fourth["usage"]["prompt_tokens"] == third["usage"]["prompt_tokens"] + words("cyan cyan", "plain")
    stored = history(other, session_id)
    assert [m["role"] for m in stored].count("system") == 1 and stored[0]["content"] == "be very brief"
    assert len(stored) == 9
    assert one.get(f"/v1/sessions/{session_id}").json()["message_count"] == 9


def test_a_streamed_turn_is_stored_as_streamed(http):
    one, other = http
    session_id = new_session(one)
    turn(one, session_id, user("alpha beta"), max_tokens=2)
    body = {"model": MODEL, "messages": [user("gamma delta epsilon")], "max_tokens": 5, "stream": True,
            "stream_options": {"include_usage": True}, "session_id": session_id}
    text, usage = "", None
    with other.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = httpx.Response(200, content=line[6:]).json()
                usage = chunk.get("usage") or usage
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
    assert text == "gamma delta epsilon gamma delta"
    assert usage["prompt_tokens"] == words("alpha beta", "alpha beta", "gamma delta epsilon")
    # Stored before the stream's end was sent: read at once, from the other gateway.
    assert history(one, session_id)[-2:] == [user("gamma delta epsilon"), {"role": "assistant", "content": text}]


@pytest.mark.cluster
def test_a_turn_whose_client_disconnects_stores_what_was_generated(redis_client_of, http):
    one, other = http
    session_id = new_session(one)
    body = {"model": MODEL, "messages": [user("slow words")], "max_tokens": 4000, "stream": True,
            "session_id": session_id}
    with one.stream("POST", "/v1/chat/completions", json=body) as response:
        lines, seen = response.iter_lines(), ""  # kept: dropping the iterator would close the connection
        while seen.count('"content":"') < 6:  # a few tokens in
            seen += next(lines)
        # While the turn runs, its lock is held (with a TTL) and a second turn is refused.
        lock = f"llmfleet:session:{{{session_id}}}:turn"
        assert redis_client_of.ttl(lock) > 0
        assert_error(turn(other, session_id, user("meanwhile")), 409, "session_id")
        assert history(other, session_id) == []
    # The client went away (the connection closed with the `with`).
    stored = wait_for(lambda: (h := history(other, session_id)) and len(h) == 2 and h, 30,
                      "the interrupted turn to be stored")
    assert stored[0] == user("slow words")
    partial = stored[1]["content"]
    assert stored[1]["role"] == "assistant" and partial.startswith("slow words")
    assert 2 <= len(partial.split()) < 4000
    assert not redis_client_of.exists(lock)
    after = turn(other, session_id, user("next")).json()
    assert after["usage"]["prompt_tokens"] == words("slow words", partial, "next")


def test_a_resumable_turn_is_stored_whole_though_its_client_left(http):
    """A resumable turn runs on without its client: its whole answer is stored when the run ends,
    and the stream can be resumed on the other gateway meanwhile."""
    one, other = http
    session_id = new_session(one)
    body = {"model": MODEL, "messages": [user("resumed words")], "max_tokens": 200, "stream": True,
            "resumable": True, "session_id": session_id}
    with one.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
    response_id = orjson.loads(first[6:])["id"]
    resumed = other.get(f"/v1/streams/{response_id}", headers={"Last-Event-ID": "0"})
    assert resumed.status_code == 200 and "data: [DONE]" in resumed.text
    stored = wait_for(lambda: (h := history(other, session_id)) and len(h) == 2 and h, 30, "the turn to be stored")
    assert stored[0] == user("resumed words")
    assert stored[1]["role"] == "assistant" and len(stored[1]["content"].split()) == 200  # whole, not cut
    assert turn(other, session_id, user("next")).status_code == 200  # its lock was released


def test_two_turns_at_once_one_is_refused(http):
    one, other = http
    session_id = new_session(one)
    body = {"model": MODEL, "messages": [user("long one")], "max_tokens": 200, "stream": True,
            "session_id": session_id}
    with one.stream("POST", "/v1/chat/completions", json=body) as running:
        assert running.status_code == 200
        refused = turn(other, session_id, user("second"))
        text = running.read().decode()
    error = assert_error(refused, 409, "session_id")
    assert error["type"] == "Conflict"
    assert "data: [DONE]" in text and '"finish_reason":"length"' in text
    stored = history(other, session_id)
    assert [m["content"] for m in stored if m["role"] == "user"] == ["long one"]  # never interleaved
    assert turn(other, session_id, user("second")).status_code == 200


def test_turn_errors(http):
    one, _ = http
    session_id = new_session(one)
    assert_error(turn(one, "no-such-session", user("hi")), 404, "session_id")
    assert_error(turn(one, session_id, user("hi"), n=2, temperature=1.0), 400, "n")
    assert_error(turn(one, 42, user("hi")), 400, "session_id")
    assert history(one, session_id) == []  # refused turns store nothing and leave the session free
    assert turn(one, session_id, user("hi")).status_code == 200
    # The extensions are the gateway's: a request without a session that carries one is served.
    plain = one.post("/v1/chat/completions", json={"model": MODEL, "messages": [user("hi")], "max_tokens": 1,
                                                   "discard_thinking": False})
    assert plain.status_code == 200 and plain.json()["choices"][0]["message"]["content"] == "hi"


def waiting_envelopes(client) -> list[RequestEnvelope]:
    """The envelopes of GHOST's requests waiting in Redis: in its stream, or its tenants' queues."""
    found = [fields[ENVELOPE_FIELD] for _, fields in client.xrange(f"llmfleet:requests:{{{GHOST}}}")
             if ENVELOPE_FIELD in fields]
    for queue in client.scan_iter(match=f"llmfleet:queue:{{{GHOST}}}:*"):
        found += client.lrange(queue, 0, -1)
    return [codec.decode(RequestEnvelope, data) for data in found]


def test_the_engine_gets_the_whole_conversation_and_none_of_the_extensions(redis_client_of, http):
    one, other = http
    session_id = new_session(one)
    turn(one, session_id, {"role": "system", "content": "sys"}, user("first"), max_tokens=1)
    with ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(turn, other, session_id, user("second"), model=GHOST, timeout=4,
                              discard_thinking=False)
        envelope = wait_for(lambda: next(iter(waiting_envelopes(redis_client_of)), None), 10,
                            "the turn's envelope to wait in Redis")
        assert envelope.body["messages"] == [{"role": "system", "content": "sys"}, user("first"),
                                             {"role": "assistant", "content": "first"}, user("second")]
        assert not set(envelope.body) & {"session_id", "discard_thinking"}
        assert envelope.body["max_tokens"] == 2 and envelope.body["model"] == GHOST
        refused = waiting.result()
    assert refused.status_code >= 400  # never served: nothing stored, the session free again
    assert len(history(one, session_id)) == 3
    assert turn(one, session_id, user("third")).status_code == 200


@pytest.mark.cluster
def test_rollback_keeps_the_first_messages(http):
    one, other = http
    session_id = new_session(one)
    for text in ("one", "two", "three"):
        turn(one, session_id, user(text), max_tokens=1)
    assert len(history(one, session_id)) == 6
    rolled = other.post(f"/v1/sessions/{session_id}/rollback", json={"keep_messages": 2}).json()
    assert rolled["status"] == "ok" and rolled["session"]["message_count"] == 2
    assert history(one, session_id) == [user("one"), {"role": "assistant", "content": "one"}]
    again = turn(one, session_id, user("four"), max_tokens=1).json()
    assert again["usage"]["prompt_tokens"] == words("one", "one", "four")
    assert other.post(f"/v1/sessions/{session_id}/rollback", json={"keep_messages": 0}).json()[
        "session"]["message_count"] == 0
    assert turn(one, session_id, user("five"), max_tokens=1).json()["usage"]["prompt_tokens"] == 1


@pytest.mark.cluster
def test_snapshots_save_list_get_label_load_delete(http):
    one, other = http
    session_id = new_session(one, max_seq_len=2048)
    turn(one, session_id, {"role": "system", "content": "sys"}, user("saved words"), max_tokens=2)
    assert_error(one.post("/v1/sessions/nobody/save"), 404)
    saved = other.post(f"/v1/sessions/{session_id}/save", json={"title": "first", "tags": ["a"]}).json()
    snapshot_id = saved["snapshot_id"]
    assert saved["status"] == "saved" and saved["snapshot"]["message_count"] == 3
    assert snapshot_id in [s["snapshot_id"] for s in one.get("/v1/snapshots").json()["snapshots"]]

    got = one.get(f"/v1/snapshots/{snapshot_id}").json()
    assert got["title"] == "first" and got["tags"] == ["a"] and got["session_id"] == session_id
    assert got["messages"] == history(one, session_id) and got["max_seq_len"] == 2048
    assert_error(one.get("/v1/snapshots/snap_none"), 404, "snapshot_id")

    patched = other.patch(f"/v1/snapshots/{snapshot_id}", json={"description": "why", "tags": ["b", "c"]}).json()
    assert (patched["title"], patched["description"], patched["tags"]) == ("first", "why", ["b", "c"])
    assert one.get(f"/v1/snapshots/{snapshot_id}").json()["description"] == "why"
    assert_error(one.patch(f"/v1/snapshots/{snapshot_id}", json={"tags": "not a list"}), 400)
    assert_error(one.patch(f"/v1/snapshots/{snapshot_id}", json={"title": 5}), 400)
    assert_error(one.patch("/v1/snapshots/snap_none", json={"title": "x"}), 404)

    # The session goes on; a load makes a session of the saved transcript, a new id when none is given.
    turn(one, session_id, user("later"), max_tokens=1)
    loaded = one.post(f"/v1/snapshots/{snapshot_id}/load").json()
    fresh = loaded["session_id"]
    assert loaded["status"] == "loaded" and fresh != session_id and loaded["session"]["message_count"] == 3
    assert history(other, fresh) == got["messages"]
    assert turn(other, fresh, user("on")).json()["usage"]["prompt_tokens"] == words("sys", "saved words",
                                                                                     "saved words", "on")
    # Onto an existing session: 409 unless force.
    assert_error(other.post(f"/v1/snapshots/{snapshot_id}/load", json={"session_id": session_id}), 409)
    assert_error(other.post(f"/v1/snapshots/{snapshot_id}/load", json={"session_id": session_id, "force": "yes"}),
                 400)
    assert len(history(one, session_id)) == 5
    forced = other.post(f"/v1/snapshots/{snapshot_id}/load", json={"session_id": session_id, "force": True})
    assert forced.status_code == 200 and history(one, session_id) == got["messages"]
    named = one.post(f"/v1/snapshots/{snapshot_id}/load", json={"session_id": "loaded-" + session_id}).json()
    assert named["session_id"] == "loaded-" + session_id

    assert one.delete(f"/v1/snapshots/{snapshot_id}").json() == {"status": "deleted", "snapshot_id": snapshot_id}
    assert_error(other.delete(f"/v1/snapshots/{snapshot_id}"), 404)
    assert_error(other.get(f"/v1/snapshots/{snapshot_id}"), 404)
    assert_error(other.post(f"/v1/snapshots/{snapshot_id}/load"), 404)


def test_a_session_past_its_bounds_refuses_the_turn(http):
    one, _ = http
    session_id = new_session(one)
    for i in range((MAX_MESSAGES - 2) // 2 + 1):  # each turn stores two messages
        assert turn(one, session_id, user(f"w{i}"), max_tokens=1).status_code == 200
    error = assert_error(turn(one, session_id, user("over")), 400, "session_id")
    assert "bound of 20" in error["message"]
    assert len(history(one, session_id)) == MAX_MESSAGES  # nothing stored, nothing trimmed
    one.post(f"/v1/sessions/{session_id}/rollback", json={"keep_messages": 0})
    assert_error(turn(one, session_id, user("x" * MAX_BYTES)), 400, "session_id")
    assert turn(one, session_id, user("fits")).status_code == 200  # the lock was released


def test_discard_thinking_keeps_reasoning_out_of_the_history(fleet):
    """In process, with the gateway's store on the test's Redis: the scripted engine has no reasoning."""
    from gateway.api.sessions import AssistantTurn
    from gateway.fleet.sessions import SessionStore
    from gateway.settings import GatewaySettings
    from shared.envelopes import GenerationChunk, RequestEnvelope

    redis_proc, _ = fleet

    async def stored_answer(discard: bool) -> dict:
        client = redis_pool.connect(redis_proc.url, max_connections=4, wait_s=5, client_name="test")
        store = SessionStore(client, GatewaySettings(redis_url=redis_proc.url))
        session_id = f"think-{uuid.uuid4().hex[:6]}"
        assert await store.write(session_id, []) == "ok"
        envelope = RequestEnvelope(request_id=uuid.uuid4().hex, model=MODEL, kind="chat", reply_to="",
                                   arrival=time.time(), deadline=time.time() + 30)
        running = await store.begin_turn(session_id, envelope, [user("why")])
        answer = AssistantTurn()
        for chunk in (GenerationChunk(text=None, reasoning="let me think"), GenerationChunk(text="because"),
                      GenerationChunk(done=True)):
            answer.add(chunk)
        await running.end(answer.message(discard))
        messages = await store.history(session_id)
        await client.aclose()
        return messages[-1]

    assert asyncio.run(stored_answer(True)) == {"role": "assistant", "content": "because"}
    assert asyncio.run(stored_answer(False)) == {"role": "assistant", "content": "because",
                                                 "reasoning": "let me think"}


@pytest.mark.cluster
def test_every_key_has_a_ttl_and_sessions_are_bounded(redis_client_of, http):
    one, _ = http
    kept = new_session(one)
    turn(one, kept, user("kept"))
    assert one.post(f"/v1/sessions/{kept}/save").status_code == 200
    keys = [k.decode() for k in redis_client_of.scan_iter(match="llmfleet:session*")]
    keys += [k.decode() for k in redis_client_of.scan_iter(match="llmfleet:snapshot*")]
    assert f"llmfleet:session:{{{kept}}}:messages" in keys and "llmfleet:snapshots:{snapshots}" in keys
    assert any(k.startswith("llmfleet:snapshot:{snap_") for k in keys)
    for key in keys:
        assert redis_client_of.ttl(key) > 0, key
    assert not [k for k in keys if k.endswith(":turn")]  # every turn released its lock

    # Past --max-sessions, the least recently used go.
    made = [new_session(one) for _ in range(MAX_SESSIONS + 5)]
    listed = {s["session_id"] for s in one.get("/v1/sessions").json()["sessions"]}
    assert len(listed) == MAX_SESSIONS and set(made[-MAX_SESSIONS:]) == listed
    assert_error(one.get(f"/v1/sessions/{made[0]}"), 404)
    assert redis_client_of.zcard("llmfleet:sessions:{sessions}") == MAX_SESSIONS


@pytest.fixture(scope="module")
def redis_client_of(fleet):
    redis_proc, _ = fleet
    return redis_pool.connect_sync(redis_proc.url)


def test_sessions_and_snapshots_belong_to_the_key_that_made_them(fleet):
    """With managed keys, another key neither sees nor reaches a key's sessions and snapshots."""
    from tests.test_keys import create_key

    redis, _gateways = fleet
    gateway = start_gateway(redis.url, "--require-keys")
    try:
        (_a, owner), (_b, stranger) = create_key(redis.url), create_key(redis.url)
        with httpx.Client(base_url=gateway.url, timeout=60, headers={"Authorization": f"Bearer {owner}"}) as mine, \
                httpx.Client(base_url=gateway.url, timeout=60,
                             headers={"Authorization": f"Bearer {stranger}"}) as theirs:
            session_id = new_session(mine)
            # The first turn once its registry has refreshed (a refused turn stores nothing).
            wait_for(lambda: turn(mine, session_id, {"role": "user", "content": "hello there"}).status_code == 200,
                     15, "the key's first turn")
            snapshot_id = mine.post(f"/v1/sessions/{session_id}/save").json()["snapshot_id"]
            assert mine.get(f"/v1/sessions/{session_id}/history").json()["messages"]
            for path in (f"/v1/sessions/{session_id}", f"/v1/sessions/{session_id}/history",
                         f"/v1/snapshots/{snapshot_id}"):
                assert theirs.get(path).status_code == 404, path
            assert turn(theirs, session_id, {"role": "user", "content": "mine now"}).status_code == 404
            assert theirs.delete(f"/v1/sessions/{session_id}").status_code == 404
            assert session_id not in str(theirs.get("/v1/sessions").json())
            assert snapshot_id not in str(theirs.get("/v1/snapshots").json())
            assert mine.get(f"/v1/sessions/{session_id}").status_code == 200  # untouched by the stranger
    finally:
        gateway.stop()
