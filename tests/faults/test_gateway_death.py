"""A gateway that dies (SIGKILL: an OOM kill, a lost node) sends no cancel, and its clients are gone
with it: the workers running its requests stop them, since nobody reads their replies, while the
requests of a live gateway run on. A client following one of its resumable streams from another
gateway is let go, not left waiting for the stream's log to expire, and its background responses
read as failed, not as running for ever.

Each gateway subscribes to a presence channel of its own while it lives; Redis drops the
subscription when the process dies, and a worker's heartbeat, finding nobody on the channel of a
running request's gateway for keys.GATEWAY_GONE_S, stops the request (worker/cancels.py). Before, the
engine went on with a dead gateway's requests to their last token or their deadline.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import httpx
import pytest
import redis

from shared import keys
from tests.conftest import leftover_keys
from tests.procs import metric_value, start_gateway, start_redis, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

TOKENS_PER_SECOND = 20
LONG = 2000  # tokens: 100 s at TOKENS_PER_SECOND, far past the test
SHORT = 100  # 5 s: the live gateway's stream, which ends while the test waits


def _chat(model: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "ping pong"}], "max_tokens": max_tokens,
            "stream": stream}


def _in_background(url: str, body: dict) -> dict:
    """POST `body` in a thread; the result fills in when the response ends, or its connection does."""
    result: dict = {}

    def call():
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as response:
                result["status"] = response.status_code
                result["lines"] = list(response.iter_lines())
        except httpx.HTTPError as exc:
            result["error"] = type(exc).__name__

    result["thread"] = threading.Thread(target=call, daemon=True)
    result["thread"].start()
    return result


@contextlib.contextmanager
def _fleet():
    """Redis, a scripted worker and two gateways: (Redis, model, worker, the doomed gateway, the living one)."""
    server = start_redis()
    model = f"orphans-{uuid.uuid4().hex[:6]}"
    worker = start_worker(server.url, model, "--scripted-tokens-per-second", str(TOKENS_PER_SECOND))
    doomed, living = start_gateway(server.url), start_gateway(server.url)
    try:
        for gateway in (doomed, living):
            wait_until_served(gateway, model)
        yield server, model, worker, doomed, living
    finally:
        for proc in (doomed, living, worker, server):
            proc.stop()


def test_a_dead_gateways_requests_are_stopped_and_a_live_ones_run_on():
    with _fleet() as (server, model, worker, doomed, living):
        orphans = [_in_background(doomed.url, _chat(model, LONG, stream)) for stream in (True, True, False)]
        kept = _in_background(living.url, _chat(model, SHORT, True))
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 4, 10, "all four to run")

        doomed.kill()
        killed_at = time.monotonic()
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 1, 15,
                 "the dead gateway's three requests to stop", interval=0.1)
        stopped_after = time.monotonic() - killed_at
        print(f"the dead gateway's requests stopped {stopped_after:.1f}s after its SIGKILL")
        assert stopped_after >= keys.GATEWAY_GONE_S  # not before its absence had lasted
        assert metric_value(worker.url, "llmfleet_worker_cancels_total", cause="gateway_gone") == 3
        assert [orphan.get("error") for orphan in orphans] == ["RemoteProtocolError"] * 3  # their clients saw the kill

        kept["thread"].join(30)
        events = [line[6:] for line in kept["lines"] if line.startswith("data: ")]
        text = "".join(choice["delta"].get("content") or "" for event in events[:-1]
                       for choice in json.loads(event)["choices"])
        assert kept["status"] == 200 and events[-1] == "[DONE]"
        assert text == " ".join(["ping", "pong"] * (SHORT // 2))
        assert metric_value(worker.url, "llmfleet_worker_cancels_total", cause="gateway_gone") == 3
        client = redis.Redis.from_url(server.url)
        wait_for(lambda: not leftover_keys(client), 10, "the requests to be settled")
        assert client.xlen(keys.request_stream(model)) == 0


def test_a_follower_of_a_dead_gateways_resumable_stream_is_let_go():
    with _fleet() as (_server, model, worker, doomed, living):
        body = {**_chat(model, LONG, True), "resumable": True}
        with httpx.stream("POST", f"{doomed.url}/v1/chat/completions", json=body, timeout=30) as response:
            first = next(line for line in response.iter_lines() if line.startswith("data: "))
        response_id = json.loads(first[6:])["id"]  # its client hung up: the run goes on, its events kept
        followed, thread = _following(f"{living.url}/v1/streams/{response_id}")
        wait_for(lambda: len(followed["lines"]) > 20, 10, "the follower to read the live stream")
        doomed.kill()
        killed_at = time.monotonic()
        thread.join(20)  # before, it waited for the log to expire: the run's deadline and then some
        assert not thread.is_alive(), "the follower of a dead gateway's stream was not let go"
        print(f"the follower was let go {time.monotonic() - killed_at:.1f}s after the relaying gateway's SIGKILL")
        assert followed["status"] == 200
        # It ends as a stream that fails does: the error event, then [DONE], numbered on from the last read.
        *read, (error_id, error), (done_id, done) = _events(followed["lines"])
        assert json.loads(error["data"])["error"]["message"].startswith("The gateway relaying this stream stopped")
        assert done == {"data": "[DONE]"} and [error_id, done_id] == [read[-1][0] + 1, read[-1][0] + 2]
        assert [event_id for event_id, _ in read] == list(range(len(read)))  # every event before it, in order
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_cancels_total", cause="gateway_gone") == 1, 10,
                 "the worker to stop the dead gateway's run")


def test_a_follower_of_a_dead_gateways_background_response_gets_its_error_event():
    """The Responses family's follower ends with the family's `error` event, its sequence number
    its id (`response.failed` carries the output, which a follower does not have)."""
    with _fleet() as (_server, model, worker, doomed, living):
        created = httpx.post(f"{doomed.url}/v1/responses", timeout=30, json={
            "model": model, "input": "ping pong", "background": True, "max_output_tokens": LONG}).json()
        followed, thread = _following(f"{living.url}/v1/responses/{created['id']}?stream=true")
        wait_for(lambda: len(followed["lines"]) > 40, 10, "the follower to read the live stream")
        doomed.kill()
        thread.join(20)
        assert not thread.is_alive(), "the follower of a dead gateway's response was not let go"
        *read, (error_id, error) = _events(followed["lines"])
        assert followed["status"] == 200 and error["event"] == "error"
        assert json.loads(error["data"]) == {
            "code": "service_unavailable", "message": "The gateway relaying this stream stopped before it finished; retry "
            "the request.", "param": None, "sequence_number": error_id, "type": "error"}
        assert error_id == read[-1][0] + 1 and read[-1][1]["event"] == "response.output_text.delta"


def _following(url: str) -> tuple[dict, threading.Thread]:
    """GET a stream at `url` in a thread: its status and lines fill in as they come."""
    followed: dict = {"lines": []}

    def follow():
        with httpx.stream("GET", url, timeout=120) as answer:
            followed["status"] = answer.status_code
            for line in answer.iter_lines():
                followed["lines"].append(line)

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    return followed, thread


def _events(lines: list[str]) -> list[tuple[int, dict[str, str]]]:
    """An SSE stream's events as (id, {field: value}), in order."""
    events, fields = [], {}
    for line in lines:
        if not line:
            if fields:
                events.append((int(fields.pop("id")), fields))
            fields = {}
            continue
        name, _, value = line.partition(": ")
        fields[name] = value
    return events


def test_a_dead_gateways_background_response_reads_as_failed():
    with _fleet() as (_server, model, worker, doomed, living):
        created = httpx.post(f"{doomed.url}/v1/responses", timeout=30, json={
            "model": model, "input": "ping pong", "background": True, "max_output_tokens": LONG}).json()
        response_id = created["id"]
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 1, 10, "the response to run")
        running = httpx.get(f"{living.url}/v1/responses/{response_id}", timeout=10).json()
        assert running["status"] in ("queued", "in_progress") and "error" not in running  # its gateway lives

        doomed.kill()
        wait_for(lambda: httpx.get(f"{living.url}/v1/responses/{response_id}", timeout=10).json()["status"]
                 == "failed", 10, "the response to read as failed")
        failed = httpx.get(f"{living.url}/v1/responses/{response_id}", timeout=10).json()
        assert failed["error"]["code"] == "server_error" and "stopped" in failed["error"]["message"]
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_cancels_total", cause="gateway_gone") == 1, 10,
                 "the worker to stop the dead gateway's run")
