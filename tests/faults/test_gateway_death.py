"""A gateway that dies (SIGKILL: an OOM kill, a lost node) sends no cancel, and its clients are gone
with it: the workers running its requests stop them, since nobody reads their replies, while the
requests of a live gateway run on.

Each gateway subscribes to a presence channel of its own while it lives; Redis drops the
subscription when the process dies, and a worker's heartbeat, finding nobody on the channel of a
running request's gateway for GATEWAY_GONE_S, stops the request (worker/cancels.py). Before, the
engine went on with a dead gateway's requests to their last token or their deadline.
"""

from __future__ import annotations

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
from worker.cancels import GATEWAY_GONE_S

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


def test_a_dead_gateways_requests_are_stopped_and_a_live_ones_run_on():
    server = start_redis()
    model = f"orphans-{uuid.uuid4().hex[:6]}"
    worker = start_worker(server.url, model, "--scripted-tokens-per-second", str(TOKENS_PER_SECOND))
    doomed, living = start_gateway(server.url), start_gateway(server.url)
    procs = [doomed, living, worker, server]
    try:
        for gateway in (doomed, living):
            wait_until_served(gateway, model)
        orphans = [_in_background(doomed.url, _chat(model, LONG, stream)) for stream in (True, True, False)]
        kept = _in_background(living.url, _chat(model, SHORT, True))
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 4, 10, "all four to run")

        doomed.kill()
        killed_at = time.monotonic()
        wait_for(lambda: metric_value(worker.url, "llmfleet_worker_in_flight") == 1, 15,
                 "the dead gateway's three requests to stop", interval=0.1)
        stopped_after = time.monotonic() - killed_at
        print(f"the dead gateway's requests stopped {stopped_after:.1f}s after its SIGKILL")
        assert stopped_after >= GATEWAY_GONE_S  # not before its absence had lasted
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
    finally:
        for proc in procs:
            proc.stop()
