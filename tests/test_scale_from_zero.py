"""Scale from zero: a known model with no live worker queues its requests, and the backlog says so.

Every test runs on a Redis of its own, whose leftovers no other test's checks count.
"""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest
import redis

from shared import keys
from tests.procs import metric_value, start_gateway, start_redis, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "wake up"}], "max_tokens": 4, **extra}


class _Post(threading.Thread):
    """A chat request sent from a thread, so the test can act while it waits."""

    def __init__(self, url: str, body: dict):
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.response: httpx.Response | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        started = time.monotonic()
        self.response = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, timeout=60)
        self.elapsed = time.monotonic() - started


@pytest.fixture
def own_redis():
    proc = start_redis()
    yield proc, redis.Redis.from_url(proc.url)
    proc.stop()


def _backlog(gateway_url: str, model: str) -> tuple[float, float, float]:
    return (metric_value(gateway_url, "llmfleet_gateway_backlog", model=model, state="waiting"),
            metric_value(gateway_url, "llmfleet_gateway_backlog", model=model, state="running"),
            metric_value(gateway_url, "llmfleet_gateway_live_workers", model=model))


def test_a_request_for_a_configured_model_waits_for_its_first_worker(own_redis):
    (redis_proc, client), model = own_redis, f"cold-{uuid.uuid4().hex[:6]}"
    gateway = start_gateway(redis_proc.url, "--models", f"other,{model}", "--queue-timeout", "60")
    worker = None
    try:
        waiting = _Post(gateway.url, _chat(model))
        waiting.start()
        wait_for(lambda: client.xlen(keys.request_stream(model)) == 1, 10, "the request to be queued")
        wait_for(lambda: _backlog(gateway.url, model) == (1, 0, 0), 5, "the gauges to show one waiting request")
        assert waiting.response is None, "answered with no worker"
        worker = start_worker(redis_proc.url, model)
        waiting.join(30)
        assert waiting.response is not None and waiting.response.status_code == 200, waiting.response
        assert waiting.response.json()["choices"][0]["message"]["content"] == "wake up wake up"
        wait_for(lambda: _backlog(gateway.url, model) == (0, 0, 1), 5, "an empty backlog and one live worker")
        assert client.xlen(keys.request_stream(model)) == 0
        unknown = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat("never-configured"))
        assert unknown.status_code == 404
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()


def test_a_known_model_with_no_worker_is_a_503_at_its_queue_timeout(own_redis):
    (redis_proc, client), model = own_redis, f"idle-{uuid.uuid4().hex[:6]}"
    gateway = start_gateway(redis_proc.url, "--models", model, "--queue-timeout", "1")
    try:
        waited = _Post(gateway.url, _chat(model))
        waited.run()
        assert waited.response.status_code == 503, waited.response.text
        error = waited.response.json()["error"]
        assert (error["type"], error["code"]) == ("ServiceUnavailableError", 503)
        assert "No worker is serving the model" in error["message"] and "queue timeout" in error["message"]
        # At the queue timeout itself (checked then, not at a later silence check), on a loaded machine too.
        assert 1 <= waited.elapsed < 1 + 2, waited.elapsed
        # The abandoned request leaves the queue: its backlog no longer wakes a worker for nobody.
        wait_for(lambda: client.xlen(keys.request_stream(model)) == 0, 5, "the request to leave the queue")
        wait_for(lambda: _backlog(gateway.url, model) == (0, 0, 0), 5, "an empty backlog")
    finally:
        gateway.stop()


def test_backlog_gauges_split_waiting_from_running(own_redis):
    (redis_proc, client), model = own_redis, f"busy-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_proc.url, model, "--max-concurrency", "1", "--scripted-tokens-per-second", "10")
    gateway = start_gateway(redis_proc.url)
    try:
        wait_until_served(gateway, model)
        requests = [_Post(gateway.url, _chat(model, max_tokens=30)) for _ in range(3)]
        for request in requests:
            request.start()
        wait_for(lambda: client.xlen(keys.request_stream(model)) == 3, 10, "three requests in the stream")
        wait_for(lambda: _backlog(gateway.url, model) == (2, 1, 1), 5, "one running and two waiting")
        for request in requests:
            request.join(30)
        assert [r.response.status_code for r in requests] == [200, 200, 200]
        wait_for(lambda: _backlog(gateway.url, model) == (0, 0, 1), 5, "the backlog to empty")
    finally:
        gateway.stop()
        worker.stop()
