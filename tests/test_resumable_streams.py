"""Streams that survive a dropped connection (issue #12), on real gateways, workers and Redis.

A `"resumable": true` stream runs on when its client goes away; the client reconnects to any
gateway with `GET /v1/streams/{id}` and `Last-Event-ID` and reads exactly what it missed. The
gateways here keep a stream no client reads for 3 s (`--resume-grace`) and its events 4 s after
its end (`--event-log-keep`), so that both bounds can be watched within a test. Each test gets a
worker of its own model, so the worker's cancel counters belong to it.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared import keys
from tests.conftest import leftover_keys
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

GRACE_S = 3.0
KEEP_S = 4.0


@pytest.fixture(scope="module")
def gateways(redis_url):
    procs = [start_gateway(redis_url, "--resume-grace", str(GRACE_S), "--event-log-keep", str(KEEP_S))
             for _ in range(2)]
    yield procs
    for proc in procs:
        proc.stop()


@pytest.fixture
def model(redis_url, gateways):
    """A fresh model whose worker streams 20 tokens/s."""
    name = f"resume-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, name, "--scripted-tokens-per-second", "20", "--max-concurrency", "64")
    for gateway in gateways:
        wait_until_served(gateway, name)
    yield name, worker
    worker.stop()


def _chat(model: str, max_tokens: int = 30, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "one two three four five"}],
            "max_tokens": max_tokens, "stream": True, "resumable": True, **extra}


def _frames(response: httpx.Response):
    """The SSE frames of a response as they come, each with its closing blank line."""
    buffer = b""
    for data in response.iter_bytes():
        buffer += data
        while b"\n\n" in buffer:
            frame, buffer = buffer.split(b"\n\n", 1)
            yield frame + b"\n\n"
    assert not buffer, f"a partial frame at the end: {buffer!r}"


def _id(frame: bytes) -> int:
    return int(re.search(rb"^id: (\d+)$", frame, re.M).group(1))


def _data(frame: bytes):
    line = frame.split(b"\n", 1)[0]
    assert line.startswith(b"data: ")
    return "[DONE]" if line == b"data: [DONE]" else json.loads(line[6:])


def _start(url: str, body: dict, count: int) -> list[bytes]:
    """Send `body`, read its first `count` frames, then hang up."""
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        frames = _frames(response)
        return [next(frames) for _ in range(count)]


def _resume(url: str, response_id: str, last_event_id: int | None = None) -> list[bytes]:
    headers = {} if last_event_id is None else {"Last-Event-ID": str(last_event_id)}
    with httpx.stream("GET", f"{url}/v1/streams/{response_id}", headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        return list(_frames(response))


def _finishes(frames: list[bytes]) -> list[str]:
    events = [_data(f) for f in frames]
    return [c["finish_reason"] for e in events if e != "[DONE]" for c in e["choices"] if c["finish_reason"]]


def _cancels(worker, **labels) -> float:
    return metric_value(worker.url, "llmfleet_worker_cancels_total", **labels)


def _merged(frames: list[bytes], response_id: str) -> list:
    """A response's events, to compare two responses of the same text: its own ids and times
    blanked out, event ids and sequence numbers left out, and each run of text-only deltas of one
    slot merged into one. The worker and the gateway merge the deltas that queue up behind a busy
    hop (coalescing under load), so two streams of the same text may cut it differently."""
    events: list = []
    for frame in frames:
        data = re.search(rb"^data: (.*)$", frame, re.M).group(1).decode().replace(response_id, "ID")
        data = re.sub(r'"(created|created_at)":\d+', r'"\1":0', data)
        event = "[DONE]" if data == "[DONE]" else json.loads(re.sub(r'"(msg|rs|fc|call)_[0-9a-f]{32}"', r'"\1_X"', data))
        if isinstance(event, dict):
            event.pop("sequence_number", None)
        slot, text = _text_delta(event)
        if slot is not None and events and _text_delta(events[-1])[0] == slot:
            _append_text(events[-1], text)
            continue
        events.append(event)
    return events


def _text_delta(event) -> tuple[tuple | None, str]:
    """(where, text) of a delta that carries text and nothing else, in any family's shape."""
    if not isinstance(event, dict):
        return None, ""
    if event.get("object") == "chat.completion.chunk" and len(event["choices"]) == 1:
        (choice,) = event["choices"]
        if set(choice["delta"]) == {"content"} and choice["finish_reason"] is None and not choice.get("logprobs") \
                and not choice.get("token_ids") and "usage" not in event:
            return ("chat", choice["index"]), choice["delta"]["content"]
    if event.get("type") == "content_block_delta" and event["delta"]["type"] == "text_delta":
        return ("messages", event["index"]), event["delta"]["text"]
    if event.get("type") == "response.output_text.delta" and not event.get("logprobs"):
        return ("responses", event["item_id"], event["output_index"], event["content_index"]), event["delta"]
    return None, ""


def _append_text(event: dict, text: str) -> None:
    if event.get("object") == "chat.completion.chunk":
        event["choices"][0]["delta"]["content"] += text
    elif event.get("type") == "content_block_delta":
        event["delta"]["text"] += text
    else:
        event["delta"] += text


@pytest.mark.cluster
def test_a_resumed_stream_equals_the_uninterrupted_one(gateways, model):
    name, worker = model
    first = _start(gateways[0].url, _chat(name), 5)
    assert [_id(f) for f in first] == [0, 1, 2, 3, 4]
    response_id = _data(first[0])["id"]
    # The client is gone; the run goes on. It reconnects to the other gateway.
    rest = _resume(gateways[1].url, response_id, last_event_id=4)
    resumed = first + rest
    assert [_id(f) for f in resumed] == list(range(len(resumed)))
    assert _data(resumed[-1]) == "[DONE]" and _finishes(resumed) == ["length"]
    # The same bytes as the whole stream replayed, and as a stream nobody interrupted.
    assert b"".join(_resume(gateways[0].url, response_id)) == b"".join(resumed)
    with httpx.stream("POST", f"{gateways[1].url}/v1/chat/completions", json={**_chat(name), "resumable": False},
                      timeout=30) as response:
        uninterrupted = list(_frames(response))
    assert _merged(uninterrupted, _data(uninterrupted[0])["id"]) == _merged(resumed, response_id)
    assert _cancels(worker) == 0


def test_last_event_id_in_the_middle_and_after_the_end(gateways, model):
    name, _worker = model
    first = _start(gateways[1].url, _chat(name, max_tokens=10), 3)
    response_id = _data(first[0])["id"]
    everything = _resume(gateways[0].url, response_id)  # follows the run to its end
    assert everything[:3] == first and _data(everything[-1]) == "[DONE]"
    last = len(everything) - 1
    for after in (0, 1, 5, last - 1):
        assert _resume(gateways[0].url, response_id, after) == everything[after + 1:]
        assert _resume(gateways[1].url, response_id, after) == everything[after + 1:]
    assert _resume(gateways[1].url, response_id, last) == []
    assert _resume(gateways[1].url, response_id) == everything  # after the end, everything again


def test_a_reader_on_the_other_replica_keeps_the_run_alive_past_the_grace(gateways, model):
    name, worker = model
    first = _start(gateways[0].url, _chat(name, max_tokens=100), 2)  # 5 s of tokens: longer than the grace
    rest = _resume(gateways[1].url, _data(first[0])["id"], last_event_id=1)
    assert _finishes(rest) == ["length"]
    assert _cancels(worker) == 0


def test_a_stream_nobody_reads_is_cancelled_after_the_grace(gateways, model):
    name, worker = model
    first = _start(gateways[0].url, _chat(name, max_tokens=400), 2)  # 20 s of tokens
    gone = time.monotonic()
    wait_for(lambda: _cancels(worker, cause="disconnect") == 1, GRACE_S + 10, "the unread run to be cancelled")
    assert time.monotonic() - gone >= GRACE_S - 0.5, "cancelled before its grace"
    rest = _resume(gateways[1].url, _data(first[0])["id"], last_event_id=1)
    # Its log ends with the family's error and end marker, not with a finish.
    assert _data(rest[-1]) == "[DONE]" and _data(rest[-2])["error"]["code"] == 503
    assert _cancels(worker) == 1


@pytest.mark.cluster
def test_cancel_of_a_resumable_stream_from_any_replica(gateways, model):
    name, worker = model
    cancel_id = uuid.uuid4().hex
    first = _start(gateways[0].url, _chat(name, max_tokens=400, cancel_id=cancel_id), 3)
    response_id = _data(first[0])["id"]
    assert httpx.post(f"{gateways[1].url}/v1/cancel", json={"id": response_id}).json() == {"cancelled": 1}
    rest = _resume(gateways[1].url, response_id, last_event_id=2)
    assert _finishes(rest) == ["cancelled"] and _data(rest[-1]) == "[DONE]"
    assert _cancels(worker, cause="explicit") == 1 and _cancels(worker) == 1
    # By cancel_id too, while a client follows it on the other gateway.
    second = _start(gateways[1].url, _chat(name, max_tokens=400, cancel_id=cancel_id + "2"), 2)
    with httpx.stream("GET", f"{gateways[0].url}/v1/streams/{_data(second[0])['id']}",
                      headers={"Last-Event-ID": "1"}, timeout=30) as response:
        frames = _frames(response)
        next(frames)
        assert httpx.post(f"{gateways[0].url}/v1/cancel", json={"cancel_id": cancel_id + "2"}).json() == \
            {"cancelled": 1}
        assert _finishes(list(frames)) == ["cancelled"]
    wait_for(lambda: _cancels(worker, cause="explicit") == 2, 5, "the worker to count the second cancel")
    assert _cancels(worker, cause="disconnect") == 0


def test_a_stream_that_did_not_ask_is_cancelled_by_its_disconnect(gateways, model, redis_client):
    name, worker = model
    first = _start(gateways[0].url, _chat(name, max_tokens=400, resumable=False), 2)
    wait_for(lambda: _cancels(worker, cause="disconnect", phase="decode") == 1, 5, "the disconnect to cancel it")
    response_id = _data(first[0])["id"]
    assert not redis_client.exists(keys.event_log_key(response_id)), "no events kept for it"
    answer = httpx.get(f"{gateways[1].url}/v1/streams/{response_id}")
    assert answer.status_code == 404


def test_refusals(gateways, model):
    name, _worker = model
    answer = httpx.get(f"{gateways[0].url}/v1/streams/chatcmpl-{uuid.uuid4().hex}")
    assert answer.status_code == 404
    assert answer.json()["error"]["type"] == "NotFoundError"
    answer = httpx.post(f"{gateways[0].url}/v1/chat/completions", json={**_chat(name), "stream": False})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "resumable"
    first = _start(gateways[0].url, _chat(name, max_tokens=2), 1)
    answer = httpx.get(f"{gateways[1].url}/v1/streams/{_data(first[0])['id']}", headers={"Last-Event-ID": "x"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "Last-Event-ID"
    # A request the worker refuses is a plain 4xx, as without `resumable`.
    answer = httpx.post(f"{gateways[0].url}/v1/completions",
                        json={"model": name, "prompt": "x " * 5000, "stream": True, "resumable": True})
    assert answer.status_code == 400 and "maximum context length" in answer.json()["error"]["message"]


@pytest.mark.cluster
def test_a_flood_of_resumable_streams_leaves_nothing_behind(gateways, model, redis_client):
    name, worker = model

    def one(i: int) -> str:
        body = _chat(name, max_tokens=5, stream_options={"include_usage": True})
        if i % 2:  # half of them hang up after their first event, and are left to the grace
            return _data(_start(gateways[i % 2].url, body, 1)[0])["id"]
        with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions", json=body, timeout=60) as response:
            frames = list(_frames(response))
        assert _data(frames[-1]) == "[DONE]"
        return _data(frames[0])["id"]

    with ThreadPoolExecutor(16) as pool:
        ids = list(pool.map(one, range(120)))
    logs = [keys.event_log_key(response_id) for response_id in ids]
    ttls = [redis_client.ttl(key) for key in logs]  # -2: gone already
    assert all(ttl == -2 or 0 <= ttl <= KEEP_S + 700 for ttl in ttls), sorted(set(ttls))
    # The runs whose clients hung up may still be ending: their entries leave the stream then.
    wait_for(lambda: not leftover_keys(redis_client), 10, "the detached runs to end")
    # Within their keep time after their end, every log is gone, and so is every reader mark.
    wait_for(lambda: not any(redis_client.exists(key) for key in logs), KEEP_S + 15, "the event logs to expire")
    assert not list(redis_client.scan_iter(match="llmfleet:reader:*"))
    assert not leftover_keys(redis_client)
    assert _cancels(worker, cause="disconnect") == 0  # 5 tokens end before any grace runs out


def test_a_stopping_gateway_ends_its_detached_runs(redis_url, gateways, model):
    name, worker = model
    doomed = start_gateway(redis_url, "--drain-grace", "1", "--resume-grace", "60")
    try:
        wait_until_served(doomed, name)
        first = _start(doomed.url, _chat(name, max_tokens=400), 2)  # 20 s of tokens, nobody reading
        stopping = time.monotonic()
        assert doomed.stop(timeout=30) == 0
        # Drain grace, then Fleet.stop's bound for detached runs: well under the run's 20 s.
        assert time.monotonic() - stopping < 12
    finally:
        doomed.kill()
    wait_for(lambda: _cancels(worker, cause="disconnect") == 1, 10, "the worker to stop the run")
    rest = _resume(gateways[0].url, _data(first[0])["id"], last_event_id=1)
    assert _data(rest[-1]) == "[DONE]" and _data(rest[-2])["error"]["code"] == 503


# --- the other families: Anthropic Messages and OpenAI Responses --------------------------------

def _named_data(frame: bytes) -> dict:
    """The JSON of a named event (`event: ...\\ndata: {...}\\nid: n`)."""
    return json.loads(re.search(rb"^data: (.*)$", frame, re.M).group(1))


def _cut_and_resumed(gateways, path: str, body: dict, count: int) -> list[bytes]:
    """Start `body` on gateway 0, hang up after `count` frames, resume on gateway 1 after them."""
    with httpx.stream("POST", f"{gateways[0].url}{path}", json=body, timeout=30) as response:
        assert response.status_code == 200, response.read()
        frames = _frames(response)
        first = [next(frames) for _ in range(count)]
    response_id = _named_data(first[0])[{"/v1/messages": "message", "/v1/responses": "response"}[path]]["id"]
    rest = _resume(gateways[1].url, response_id, last_event_id=count - 1)
    resumed = first + rest
    assert [_id(f) for f in resumed] == list(range(len(resumed)))
    assert b"".join(_resume(gateways[0].url, response_id)) == b"".join(resumed)  # the whole log, replayed
    return resumed


def _uninterrupted(gateways, path: str, body: dict) -> list[bytes]:
    with httpx.stream("POST", f"{gateways[1].url}{path}", json={**body, "resumable": False}, timeout=30) as response:
        assert response.status_code == 200, response.read()
        return list(_frames(response))


def _same_but_ids(a: list[bytes], b: list[bytes], response_id_of) -> None:
    """The same events once each response's own ids and times are blanked out and its text deltas
    merged (`_merged`)."""
    assert _merged(a, response_id_of(a)) == _merged(b, response_id_of(b))


def test_an_anthropic_message_stream_is_resumed_on_the_other_replica(gateways, model):
    name, worker = model
    body = {"model": name, "max_tokens": 30, "stream": True, "resumable": True,
            "messages": [{"role": "user", "content": "one two three four five"}]}
    resumed = _cut_and_resumed(gateways, "/v1/messages", body, 5)
    kinds = [_named_data(f)["type"] for f in resumed]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert _named_data(resumed[-2])["delta"]["stop_reason"] == "max_tokens"
    _same_but_ids(_uninterrupted(gateways, "/v1/messages", body), resumed,
                  lambda frames: _named_data(frames[0])["message"]["id"])
    assert _cancels(worker) == 0
    answer = httpx.post(f"{gateways[0].url}/v1/messages", json={**body, "stream": False})
    assert answer.status_code == 400 and answer.json()["type"] == "error"


def test_a_responses_stream_is_resumed_on_the_other_replica(gateways, model):
    name, worker = model
    body = {"model": name, "input": "one two three four five", "max_output_tokens": 30, "stream": True,
            "resumable": True}
    resumed = _cut_and_resumed(gateways, "/v1/responses", body, 5)
    final = _named_data(resumed[-1])
    assert final["type"] == "response.incomplete" and [_named_data(f)["sequence_number"] for f in resumed] == \
        [_id(f) for f in resumed]
    _same_but_ids(_uninterrupted(gateways, "/v1/responses", body), resumed,
                  lambda frames: _named_data(frames[0])["response"]["id"])
    assert _cancels(worker) == 0
    # The run stored its end although its first client had gone: any replica retrieves it.
    stored = httpx.get(f"{gateways[0].url}/v1/responses/{final['response']['id']}").json()
    assert stored["status"] == "incomplete" and stored["output"] == final["response"]["output"]
    answer = httpx.post(f"{gateways[0].url}/v1/responses", json={**body, "stream": False})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "resumable"


def test_without_event_ids_the_frames_are_vllm_serves(redis_url: str) -> None:
    """--no-sse-event-ids: no `id:` lines (naive SSE readers such as `vllm bench serve`'s), except
    on a resumable stream, which needs them."""
    model = "no-ids-model"
    worker = start_worker(redis_url, model)
    gateway = start_gateway(redis_url, "--no-sse-event-ids")
    try:
        wait_until_served(gateway, model)
        body = {"model": model, "messages": [{"role": "user", "content": "a b c"}], "max_tokens": 3, "stream": True}
        plain = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30).text
        frames = [frame for frame in plain.split("\n\n") if frame]
        assert frames[-1] == "data: [DONE]" and len(frames) >= 4
        assert all(frame.startswith("data: ") and "\n" not in frame for frame in frames), plain
        resumable = httpx.post(f"{gateway.url}/v1/chat/completions", json=body | {"resumable": True}, timeout=30).text
        assert [frame.split("\n")[-1] for frame in resumable.split("\n\n") if frame][:2] == ["id: 0", "id: 1"]
    finally:
        gateway.stop()
        worker.stop()


def test_a_followers_own_ending_is_its_streams_family_error_then_end_numbered_on() -> None:
    """What a follower whose relaying gateway died sends last (EventWriter.lost_frames), for each
    family, from the family's name alone (a log's opening entry): the family's error event with the
    next id, then its end marker where the family has one."""
    import gateway.app  # noqa: F401 - every family's formatter, registered by its endpoint
    from gateway.serve.formatter import Formatter
    from gateway.serve.sse import EventWriter
    from shared.errors import ServiceUnavailable

    error = ServiceUnavailable("gone", param="x")
    frames = {family: EventWriter.lost_frames(Formatter.families[family], error, 7)
              for family in ("chat", "completions", "messages", "responses")}
    for family in ("chat", "completions"):  # as vLLM writes an error in a stream (json.dumps), then [DONE]
        assert frames[family] == [
            b'data: {"error": {"message": "gone", "type": "ServiceUnavailableError", "param": "x", "code": 503}}\n'
            b"id: 7\n\n", b"data: [DONE]\nid: 8\n\n"]
    assert frames["messages"] == [b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error",'
                                  b'"message":"gone"}}\nid: 7\n\n']
    assert frames["responses"] == [b'event: error\ndata: {"code":"service_unavailable","message":"gone","param":"x",'
                                   b'"sequence_number":7,"type":"error"}\nid: 7\n\n']
