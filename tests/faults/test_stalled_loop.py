"""A worker whose event loop is held longer than a lease's TTL (a busy engine's input processing
on a loaded machine: measured on a vLLM worker) keeps its requests: a thread of its own renews the
leases and the heartbeat (worker/leases.py), so no other worker takes them over, and the client's
stream is answered whole by the worker that had it."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
import pytest

from shared import keys
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

STALL_S = 6.0  # twice a lease's TTL: without the thread the lease lapses in the middle of it


def test_a_worker_whose_event_loop_stalls_keeps_its_requests(redis_url, redis_client):
    model = f"stalling-{uuid.uuid4().hex[:6]}"
    gateway = start_gateway(redis_url)
    staller = start_worker(redis_url, model, "--scripted-loop-stall", str(STALL_S))
    rescuer = None
    try:
        wait_until_served(gateway, model)
        body = {"model": model, "messages": [{"role": "user", "content": "hold on"}], "max_tokens": 10, "stream": True}
        answer: dict = {}

        def ask():
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
                answer["lines"] = [line for line in response.iter_lines() if line.startswith("data: ")]

        asking = threading.Thread(target=ask)
        asking.start()
        # The staller holds the request's lease, and its loop is stalled: now another worker is there to take it over.
        wait_for(lambda: any(f"-{staller.pid}-".encode() in (redis_client.get(key) or b"")
                             for key in redis_client.scan_iter(match=keys.lease_key("*"))), 10,
                 "the stalling worker to take the request's lease")
        rescuer = start_worker(redis_url, model, "--claim-idle", "1")
        asking.join(60)
        events = [json.loads(line[6:]) for line in answer["lines"][:-1]]
        assert not [e for e in events if "error" in e], events
        assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"]) == " ".join(
            ["hold", "on"] * 5)
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 0
        assert metric_value(staller.url, "llmfleet_worker_generated_tokens_total") == 10
    finally:
        for proc in (gateway, staller, rescuer):
            if proc is not None:
                proc.stop()


def test_a_worker_whose_encoding_stalls_its_event_loop_keeps_the_request(redis_url, redis_client):
    """An encoding goes to its engine while its lease is taken (worker/runner.py, `_encode_early`),
    and here its start holds the loop past the lease's TTL: the lease's ask is written first and
    renewed through the stall, so the worker that claimed the request answers it, and the other
    worker's sweeps, which find its entry idle, leave it alone."""
    model = f"stalling-embed-{uuid.uuid4().hex[:6]}"
    gateway = start_gateway(redis_url)
    staller = start_worker(redis_url, model, "--runner", "pooling", "--scripted-loop-stall", str(STALL_S))
    rescuer = None
    try:
        wait_until_served(gateway, model)
        answer: dict = {}

        def ask():
            answer["response"] = httpx.post(f"{gateway.url}/v1/embeddings", json={"model": model, "input": "hold on"},
                                            timeout=60)

        asking = threading.Thread(target=ask)
        asking.start()
        wait_for(lambda: redis_client.xpending(keys.request_stream(model), keys.WORKER_GROUP)["pending"], 10,
                 "the stalling worker to claim the request")
        rescuer = start_worker(redis_url, model, "--runner", "pooling", "--claim-idle", "1")
        asking.join(60)
        response = answer["response"]
        assert response.status_code == 200, response.text
        [embedding] = response.json()["data"]
        assert len(embedding["embedding"]) > 0 and response.json()["usage"]["prompt_tokens"] == 2
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 0
        assert metric_value(staller.url, "llmfleet_worker_encoded_inputs_total") == 1
    finally:
        for proc in (gateway, staller, rescuer):
            if proc is not None:
                proc.stop()
