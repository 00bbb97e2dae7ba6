"""Redis goes away and comes back: fail fast, end what was in flight, then heal without help."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
import uuid
from urllib.parse import urlparse

import httpx
import pytest
from redis import Redis

from shared import keys
from tests.procs import start_gateway, start_redis, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


def _chat(model: str, **extra) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "ping pong"}], "max_tokens": 4, **extra}


@contextlib.contextmanager
def _streaming(name: str, tokens_per_second: int, max_tokens: int):
    """A Redis of the test's own, a scripted worker and a gateway, and a stream running on them.
    Yields the stream's lines still to come and the processes; the test may add to the list."""
    redis = start_redis()
    model = f"{name}-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis.url, model, "--scripted-tokens-per-second", str(tokens_per_second))
    gateway = start_gateway(redis.url)
    procs = [gateway, worker, redis]
    try:
        wait_until_served(gateway, model)
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions",
                          json=_chat(model, stream=True, max_tokens=max_tokens), timeout=30) as response:
            lines = response.iter_lines()
            for _ in range(4):  # the request is running on the worker
                next(lines)
            yield model, lines, procs
    finally:
        for proc in procs:
            proc.stop()


def test_redis_restart():
    with _streaming("phoenix", tokens_per_second=10, max_tokens=200) as (model, lines, procs):
        gateway, worker, redis = procs
        redis.kill()
        killed_at = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
        in_flight_error_after = time.monotonic() - killed_at
        assert json.loads(rest[-2][6:])["error"]["code"] == 503 and rest[-1] == "data: [DONE]"
        assert in_flight_error_after < 3.0

        assert httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 503
        started = time.monotonic()
        refused = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model), timeout=10)
        assert refused.status_code == 503 and time.monotonic() - started < 3.0

        # Redis comes back empty. Until a worker announces itself again the model is unserved but
        # still known to the gateway: the request queues (never a 404) and is served once the
        # worker is back. Pause the worker to hold that window open.
        os.kill(worker.pid, signal.SIGSTOP)
        unserved: list[httpx.Response] = []
        try:
            procs.append(start_redis(urlparse(redis.url).port))
            wait_for(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, 10, "the gateway")
            wait_for(lambda: model not in {m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]},
                     10, "the gateway's registry to see no live worker")
            queued = threading.Thread(target=lambda: unserved.append(
                httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model), timeout=30)))
            queued.start()
            new_redis = Redis.from_url(redis.url)
            wait_for(lambda: new_redis.xlen(keys.request_stream(model)) == 1, 10, "the request to be queued")
        finally:
            os.kill(worker.pid, signal.SIGCONT)
        queued.join(30)
        assert unserved and unserved[0].status_code == 200, unserved and unserved[0].text
        restarted_at = time.monotonic()
        statuses = set()

        def serves_again():
            try:
                reply = httpx.post(f"{gateway.url}/v1/chat/completions", json=_chat(model), timeout=5)
            except httpx.HTTPError:
                return False
            statuses.add(reply.status_code)
            content = reply.json()["choices"][0]["message"]["content"] if reply.status_code == 200 else None
            return content == "ping pong ping pong"

        wait_for(serves_again, 20, "the fleet to serve again", interval=0.25)
        # Redis came back empty: the model is still known to the gateway, so 503 until it is served.
        assert statuses <= {200, 503}, statuses
        print(f"in-flight error after {in_flight_error_after:.2f}s; served again "
              f"{time.monotonic() - restarted_at:.2f}s after Redis returned")
        assert worker.alive() and gateway.alive()


def test_a_worker_told_to_stop_while_redis_is_gone_still_exits():
    """SIGTERM drains a worker; its replies cannot be written, so it gives up on them, stops the
    generation (100 s long), and exits. (Its lease on the request lapses first: it aborts the
    request as one another worker may take over, before the drain's own 10 s limit on Redis.)"""
    with _streaming("orphan", tokens_per_second=20, max_tokens=2000) as (_model, _lines, procs):
        _gateway, worker, redis = procs
        redis.kill()
        worker.popen.terminate()
        assert worker.popen.wait(60) == 0, "the draining worker did not give up on Redis"
        log = worker.log()
        assert "dropping" in log or "publishing nothing more for it" in log, log[-3000:]


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_stream_goes_on_after_redis_stalls_past_its_lease(temperature):
    """Redis stops answering (SIGSTOP: a stall, as a failover's or a long fork's) for longer than a
    lease lasts, while a stream is half sent. Its worker lives, but its lease lapses with Redis's
    clock: the worker stops the generation, and the request is taken over (here by the same
    worker, the only one) while its gateway never saw the worker go. The taker tells the gateway
    it has the stream, the gateway saves what its client was sent, and the stream goes on from
    there: one stream, no error, no text repeated or missing. (Before, the taker waited for a
    continuation nobody saved, and the stream ended with a 502 some ten seconds later.)"""
    redis = start_redis()
    model = f"stall-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis.url, model, "--scripted-tokens-per-second", "10", "--claim-idle", "1")
    gateway = start_gateway(redis.url)
    procs = [gateway, worker, redis]
    try:
        wait_until_served(gateway, model)
        body = {**_chat(model, stream=True, max_tokens=60, temperature=temperature),
                "stream_options": {"include_usage": True}}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(12)]  # the role chunk and some tokens, with their blank lines
            os.kill(redis.pid, signal.SIGSTOP)
            try:
                time.sleep(keys.LEASE_TTL_S + 2)
            finally:
                os.kill(redis.pid, signal.SIGCONT)
            events = [line[6:] for line in [*seen, *lines] if line.startswith("data: ")]
        chunks = [json.loads(event) for event in events[:-1]]
        assert not [chunk for chunk in chunks if "error" in chunk], events[-3:]
        text = "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])
        assert text == " ".join(["ping", "pong"] * 30)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        assert chunks[-1]["usage"]["completion_tokens"] == 60
        log = worker.log()
        assert "publishing nothing more for it" in log and "its worker stopped mid-stream; continuing it" in log
    finally:
        for proc in procs:
            proc.stop()
