"""Overload: a full queue is a 429 with Retry-After; a model with no live worker is a 503 at its queue timeout."""

from __future__ import annotations

import threading
import time
import uuid

import httpx
import pytest

from shared import keys
from tests.conftest import leftover_keys
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 30, **extra}


@pytest.mark.cluster
def test_full_queue_is_a_429_with_retry_after(redis_url, redis_client):
    model = f"busy-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--max-concurrency", "1")
    gateway = start_gateway(redis_url, "--max-queue", "2")
    try:
        wait_until_served(gateway, model)
        waiting = [threading.Thread(target=httpx.post, args=(f"{gateway.url}/v1/chat/completions",),
                                    kwargs={"json": _chat(model), "timeout": 60}) for _ in range(3)]
        for thread in waiting:
            thread.start()
        wait_for(lambda: redis_client.xlen(keys.request_stream(model)) == 3, 10, "one running and two queued")
        started = time.monotonic()
        refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model))
        assert time.monotonic() - started < 1.0
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "RateLimitError"
        assert int(refused.headers["retry-after"]) >= 1
        assert metric_value(gateway.url, "llmfleet_gateway_overloaded_total") == 1
        for thread in waiting:
            thread.join(30)
        wait_for(lambda: not leftover_keys(redis_client), 5, "the queue to drain")
    finally:
        gateway.stop()
        worker.stop()


def test_model_whose_workers_are_gone_is_a_503_at_its_queue_timeout(redis_url, redis_client):
    """The model is still known, so its request queues for a worker to start (scale from zero),
    then ends with a 503 at the queue timeout, and leaves the queue: nothing stale for the next worker."""
    model = f"gone-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model)
    gateway = start_gateway(redis_url, "--queue-timeout", "1")
    try:
        wait_until_served(gateway, model)
        worker.stop()
        wait_for(lambda: model not in {m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]}, 10,
                 "the model to leave /v1/models")
        started = time.monotonic()
        response = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model), timeout=30)
        assert 1.0 <= time.monotonic() - started < 15.0
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "ServiceUnavailableError"
        wait_for(lambda: not leftover_keys(redis_client), 10, "the request to leave the queue")
        worker = start_worker(redis_url, model)
        assert httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model), timeout=30).status_code == 200
    finally:
        gateway.stop()
        worker.stop()
