"""The backlog counts only requests a client still waits for: a request the gateway gives up on
before a worker claims it (its queue timeout, its client gone) leaves the queue at once
(`shared.fair_queue.WITHDRAW`), as an envelope entry, a tenant's ticket and envelope, or an entry
in a worker's own stream; the waiting figure KEDA scales workers on (`/fleet/load`, the backlog
gauge) drops back, and the next request is served as if the others had never come.

Real Redis (a Cluster in the `cluster` pass), real gateways and scripted workers.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from shared import keys
from shared.codec import decode
from shared.envelopes import WorkerInfo
from tests.procs import metric_value, start_gateway, start_worker, wait_for
from tests.test_keys import create_key

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

QUEUE_TIMEOUT_S = 3.0  # the time the backlog is seen full, before it must drain
REQUESTS = 6


@pytest.fixture
def model() -> str:
    return f"drain-{uuid.uuid4().hex[:8]}"


def _chat(model: str, words: str = "wake up", **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": words}], "max_tokens": 4, **extra}


def _load(gateway_url: str, model: str, headers: dict) -> dict:
    return httpx.get(f"{gateway_url}/fleet/load", params={"model": model}, headers=headers, timeout=5).json()


def _waiting(gateway_url: str, model: str, headers: dict) -> tuple[int, float]:
    """The waiting backlog as `/fleet/load` and the gauge on /metrics say it."""
    return (_load(gateway_url, model, headers)["waiting"],
            metric_value(gateway_url, "llmfleet_gateway_backlog", model=model, state="waiting"))


def _queue_keys(redis_client, model: str) -> list[str]:
    """The model's request streams holding entries, and its tenant queues and turn lists."""
    found = []
    for pattern in (f"{keys.PREFIX}:requests:{{{model}}}*", f"{keys.PREFIX}:queue:{{{model}}}:*",
                    f"{keys.PREFIX}:turns:{{{model}}}:*"):
        for key in redis_client.scan_iter(match=pattern):
            name = key.decode()
            if name.endswith(":doorbell") or (name.startswith(f"{keys.PREFIX}:requests:")
                                              and redis_client.xlen(key) == 0):
                continue
            found.append(name)
    return found


class _Post(threading.Thread):
    """A chat request sent from a thread, timed from its send to its answer."""

    def __init__(self, url: str, body: dict, headers: dict):
        super().__init__(daemon=True)
        self.url, self.body, self.headers = url, body, headers
        self.response: httpx.Response | None = None
        self.elapsed = 0.0

    def run(self) -> None:
        started = time.monotonic()
        self.response = httpx.post(f"{self.url}/v1/chat/completions", json=self.body, headers=self.headers,
                                   timeout=60)
        self.elapsed = time.monotonic() - started


def _tenants(redis_url: str, keyed: bool) -> list[dict]:
    """The request headers of each tenant: two managed keys, or one anonymous client."""
    if not keyed:
        return [{}]
    return [{"Authorization": f"Bearer {create_key(redis_url)[1]}"} for _ in range(2)]


@pytest.mark.parametrize("keyed", [False, True], ids=["anonymous", "tenants"])
def test_requests_no_worker_took_leave_the_backlog_at_their_queue_timeout(redis_url, redis_client, model, keyed):
    tenants = _tenants(redis_url, keyed)
    gateway = start_gateway(redis_url, "--models", model, "--queue-timeout", str(QUEUE_TIMEOUT_S),
                            *(["--require-keys"] if keyed else []))
    worker = None
    try:
        posts = [_Post(gateway.url, _chat(model), tenants[i % len(tenants)]) for i in range(REQUESTS)]
        for post in posts:
            post.start()
        wait_for(lambda: _waiting(gateway.url, model, tenants[0]) == (REQUESTS, REQUESTS), QUEUE_TIMEOUT_S,
                 "every request counted while its client waits")
        for post in posts:
            post.join(30)
        # The 503 at the queue timeout, for each of them (not before it, nor seconds after).
        for post in posts:
            assert post.response is not None and post.response.status_code == 503, post.response
            assert "queue timeout" in post.response.json()["error"]["message"]
            assert QUEUE_TIMEOUT_S <= post.elapsed < QUEUE_TIMEOUT_S + 2, post.elapsed
        wait_for(lambda: _waiting(gateway.url, model, tenants[0]) == (0, 0), 5, "the waiting backlog to drain")
        assert not _queue_keys(redis_client, model)

        # A worker that starts now finds nothing stale: the next request is bound to its own envelope.
        worker = start_worker(redis_url, model, "--max-concurrency", "1")
        fresh = _Post(gateway.url, _chat(model, "fresh start"), tenants[-1])
        fresh.run()
        assert fresh.response.status_code == 200, fresh.response.text
        assert fresh.response.json()["choices"][0]["message"]["content"] == "fresh start fresh start"
        assert metric_value(worker.url, "llmfleet_worker_claims_total", model=model) == 1
        assert metric_value(worker.url, "llmfleet_worker_cancels_total", phase="queued") == 0
        wait_for(lambda: not _queue_keys(redis_client, model), 5, "the model's queue to be empty")
        assert redis_client.hlen(keys.bound_requests(model)) == 0
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()


def _hang_up_later(url: str, body: dict, headers: dict) -> socket.socket:
    """Send a request on a raw connection, left open until the caller closes it: a real disconnect."""
    address = urlsplit(url)
    connection = socket.create_connection((address.hostname, address.port), timeout=10)
    payload = json.dumps(body).encode()
    head = "".join(f"{name}: {value}\r\n" for name, value in {
        "Host": address.netloc, "Content-Type": "application/json", "Content-Length": len(payload),
        **headers}.items())
    connection.sendall(f"POST /v1/chat/completions HTTP/1.1\r\n{head}\r\n".encode() + payload)
    return connection


def _answer(connection: socket.socket) -> str:
    """The whole HTTP answer to a request sent by `_hang_up_later` (a body with a Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += connection.recv(65536) or b"(closed)\r\n\r\n"
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += connection.recv(65536) or b"(closed)"
    return (head + b"\r\n\r\n" + body).decode()


@pytest.mark.parametrize("keyed", [False, True], ids=["anonymous", "tenants"])
def test_a_client_gone_before_any_worker_claimed_leaves_the_backlog(redis_url, redis_client, model, keyed):
    tenants = _tenants(redis_url, keyed)
    gateway = start_gateway(redis_url, "--models", model, "--queue-timeout", "60",
                            *(["--require-keys"] if keyed else []))
    worker = None
    try:
        hung = [_hang_up_later(gateway.url, _chat(model, stream=i % 2 == 0), tenants[i % len(tenants)])
                for i in range(4)]
        wait_for(lambda: _waiting(gateway.url, model, tenants[0]) == (4, 4), 10, "four requests waiting")
        for connection in hung[:3]:
            connection.close()
        wait_for(lambda: _waiting(gateway.url, model, tenants[0]) == (1, 1), 5, "the three gone to leave the backlog")
        assert redis_client.xlen(keys.request_stream(model)) == 1

        # The one still waiting is the one served, whatever tickets its tenant's requests had.
        worker = start_worker(redis_url, model, "--max-concurrency", "1")
        answer = _answer(hung[3])
        hung[3].close()
        assert answer.startswith("HTTP/1.1 200"), answer
        assert json.loads(answer.split("\r\n\r\n", 1)[1])["choices"][0]["message"]["content"] == "wake up wake up"
        assert metric_value(worker.url, "llmfleet_worker_claims_total", model=model) == 1
        wait_for(lambda: not _queue_keys(redis_client, model), 5, "the model's queue to be empty")
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()


def test_a_request_waiting_in_a_busy_workers_own_stream_leaves_it_with_its_client(redis_url, redis_client, model):
    """Cache affinity queued it in its worker's own stream (shared/affinity.py), behind the
    request that worker runs; its client goes, and so does it, while both workers stay busy."""
    slow = ("--scripted-tokens-per-second", "20", "--max-concurrency", "1")
    workers = [start_worker(redis_url, model, *slow) for _ in range(2)]
    gateway = start_gateway(redis_url)
    own_streams = [keys.worker_stream(model, w) for w in _worker_ids(redis_client, model)]
    cancel_id = uuid.uuid4().hex
    try:
        wait_for(lambda: _load(gateway.url, model, {}).get("workers") == 2, 10, "two live workers")
        busy = [_Post(gateway.url, _chat(model, max_tokens=200, cancel_id=cancel_id), {}) for _ in range(2)]
        for post in busy:
            post.start()
        wait_for(lambda: _load(gateway.url, model, {})["running"] == 2, 10, "both workers busy")
        long_prompt = " ".join(["cache"] * 400)  # long enough to be worth a worker's cache
        hung = _hang_up_later(gateway.url, _chat(model, long_prompt), {})
        wait_for(lambda: sum(redis_client.xlen(s) for s in own_streams) == 1, 10, "the request in a worker's stream")
        wait_for(lambda: _waiting(gateway.url, model, {}) == (1, 1), 5, "one request waiting")
        hung.close()
        wait_for(lambda: sum(redis_client.xlen(s) for s in own_streams) == 0, 5, "the request to leave it")
        wait_for(lambda: _waiting(gateway.url, model, {}) == (0, 0), 5, "no request waiting")
        assert _load(gateway.url, model, {})["running"] == 2
        assert httpx.post(f"{gateway.url}/v1/cancel", json={"cancel_id": cancel_id}).json() == {"cancelled": 2}
        for post in busy:
            post.join(30)
        assert [post.response.status_code for post in busy] == [200, 200]
        assert sum(metric_value(w.url, "llmfleet_worker_claims_total", model=model) for w in workers) == 2
        wait_for(lambda: not _queue_keys(redis_client, model), 5, "the model's queue to be empty")
    finally:
        gateway.stop()
        for worker in workers:
            worker.stop()


def _worker_ids(redis_client, model: str) -> list[str]:
    """The ids of the live workers of `model`, from their heartbeats."""
    infos = [decode(WorkerInfo, redis_client.get(key)) for key in redis_client.scan_iter(match=keys.WORKER_KEY_PATTERN)]
    return [info.worker_id for info in infos if info.model == model]
