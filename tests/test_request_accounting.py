"""`llmfleet_gateway_requests_total` counts every HTTP response, refusals before the queue included
(issue #13): a gateway's error ratio must see the outages it is for."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import metric_value, start_gateway, start_redis, start_worker, wait_until_served

pytestmark = pytest.mark.integration

MODEL = "accounted-model"
IDLE_MODEL = "accounted-idle-model"  # configured, never served: its requests wait, then 503
DOOMED_MODEL = "accounted-doomed-model"  # its worker is killed mid-stream: a 502 inside a 200

# What each kind of request below is counted under.
SERIES = {
    "ok": {"family": "openai", "endpoint": "chat", "model": MODEL, "status": "200"},
    "bad": {"family": "openai", "endpoint": "chat", "model": "", "status": "400"},
    "unknown": {"family": "openai", "endpoint": "chat", "model": "", "status": "404"},
    "too_large": {"family": "openai", "endpoint": "completions", "status": "413"},
    "no_worker": {"family": "openai", "endpoint": "chat", "model": IDLE_MODEL, "status": "503"},
    "lost_in_stream": {"family": "openai", "endpoint": "completions", "model": DOOMED_MODEL, "status": "502"},
    "streamed_ok": {"family": "openai", "endpoint": "completions", "model": DOOMED_MODEL, "status": "200"},
    "models": {"family": "llmfleet", "endpoint": "/v1/models", "status": "200"},
    "unmatched": {"family": "llmfleet", "endpoint": "unmatched", "status": "404"},
}


@pytest.fixture(scope="module")
def fleet():
    # A Redis of its own: the requests that wait out their queue timeout, and the one whose worker
    # is killed, stay in their streams, which the session Redis's leftover checks would count.
    redis = start_redis()
    worker = start_worker(redis.url, MODEL)
    doomed = start_worker(redis.url, DOOMED_MODEL, "--scripted-tokens-per-second", "20")
    gateway = start_gateway(redis.url, "--models", IDLE_MODEL, "--queue-timeout", "0.5",
                            "--max-body-bytes", "20000")
    for model in (MODEL, DOOMED_MODEL):
        wait_until_served(gateway, model)
    yield gateway, doomed
    for proc in (gateway, worker, doomed, redis):
        proc.stop()


def _count(url: str, **labels: str) -> float:
    return metric_value(url, "llmfleet_gateway_requests_total", **labels)


def test_answers_and_refusals_are_all_counted_by_family_endpoint_model_and_status(fleet) -> None:
    gateway, doomed = fleet
    url = gateway.url
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 2}
    before = {key: _count(url, **labels) for key, labels in SERIES.items()}

    with httpx.Client(base_url=url, timeout=30) as client:
        statuses = [client.post("/v1/chat/completions", json=chat).status_code for _ in range(3)]
        statuses.append(client.post("/v1/chat/completions", json={**chat, "stream": True}).status_code)
        statuses.append(client.post("/v1/chat/completions", json={**chat, "max_tokens": "many"}).status_code)
        statuses.append(client.post("/v1/chat/completions", json={**chat, "model": "no-such-model"}).status_code)
        statuses.append(client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 30000}).status_code)
        statuses += [client.post("/v1/chat/completions", json={**chat, "model": IDLE_MODEL}).status_code
                     for _ in range(2)]
        # The worker dies after the stream started: 200, then a 502 error event.
        request = {"model": DOOMED_MODEL, "prompt": "a b", "max_tokens": 1000, "stream": True}
        with client.stream("POST", "/v1/completions", json=request) as streamed:
            statuses.append(streamed.status_code)
            lines = streamed.iter_lines()
            assert next(lines).startswith("data: {")
            doomed.kill()
            lost = "\n".join(lines)
        statuses.append(client.get("/v1/models").status_code)
        statuses.append(client.get("/v1/no-such-route").status_code)
    assert statuses == [200, 200, 200, 200, 400, 404, 413, 503, 503, 200, 200, 404]
    frames = [line[6:] for line in lost.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == 502

    after = {key: _count(url, **labels) for key, labels in SERIES.items()}
    assert {key: after[key] - before[key] for key in after} == {
        "ok": 4, "bad": 1, "unknown": 1, "too_large": 1, "no_worker": 2, "lost_in_stream": 1, "streamed_ok": 0,
        "models": 1,
        "unmatched": 1}
