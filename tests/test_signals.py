"""Signals an operator and a client read are true: time to first token of whole answers, the
output ceiling, SSE framing and headers, the request log, and vllm serve's /invocations and /load."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served
from tests.test_keys import create_key

pytestmark = pytest.mark.integration

MODEL = "signals-model"
TOKENS_PER_S = 100
CEILING = 300
KEY_CEILING = 5


@pytest.fixture(scope="module")
def fleet(redis_url: str):
    """A worker streaming 100 tokens/s; a default gateway; a gateway with an output ceiling,
    managed keys and the request log on (JSON logs, to read them)."""
    worker = start_worker(redis_url, MODEL, "--scripted-tokens-per-second", str(TOKENS_PER_S), "--max-concurrency",
                          "16", "--enable-log-requests", env={"LLMFLEET_LOG_FORMAT": "json"})
    plain = start_gateway(redis_url)
    capped = start_gateway(redis_url, "--max-output-tokens", str(CEILING), "--require-keys", "--enable-log-requests",
                           env={"LLMFLEET_LOG_FORMAT": "json"})
    try:
        wait_until_served(plain, MODEL)
        yield plain, capped, worker
    finally:
        for proc in (plain, capped, worker):
            proc.stop()


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "red green blue"}], **extra}


def _bucket(url: str, name: str, le: str) -> float:
    return metric_value(url, f"{name}_bucket", model=MODEL, le=le)


def test_a_whole_answers_time_to_first_token_is_its_first_tokens(fleet):
    """200 tokens at 100/s take 2 s; the first came at once, and every signal says so."""
    gateway, _, worker = fleet
    gateway_before = _bucket(gateway.url, "llmfleet_gateway_time_to_first_token_seconds", "0.5")
    worker_before = _bucket(worker.url, "llmfleet_worker_time_to_first_token_seconds", "0.5")
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                        json=chat(max_tokens=200, include_timings=True)).json()
    timings = answer["timings"]
    assert answer["usage"]["completion_tokens"] == 200 and timings["total_s"] >= 1.5, timings
    assert 0 <= timings["ttft_s"] < 0.5 and timings["decode_s"] >= 1.5, timings
    assert _bucket(gateway.url, "llmfleet_gateway_time_to_first_token_seconds", "0.5") == gateway_before + 1
    assert _bucket(worker.url, "llmfleet_worker_time_to_first_token_seconds", "0.5") == worker_before + 1


def test_the_output_ceiling_refuses_above_and_fills_in_when_omitted(fleet, redis_url):
    _, gateway, _ = fleet
    _, secret = create_key(redis_url)
    _, small_secret = create_key(redis_url, "--max-tokens", str(KEY_CEILING))
    with httpx.Client(base_url=gateway.url, timeout=60, headers={"Authorization": f"Bearer {secret}"}) as client, \
            httpx.Client(base_url=gateway.url, timeout=60,
                         headers={"Authorization": f"Bearer {small_secret}"}) as small:
        wait_for(lambda: client.get("/v1/models").json()["data"], 15, "the model to be listed")
        for path, body, field in (("/v1/chat/completions", chat(max_tokens=CEILING + 1), "max_tokens"),
                                  ("/v1/chat/completions", chat(max_completion_tokens=CEILING + 1),
                                   "max_completion_tokens"),
                                  ("/v1/completions", {"model": MODEL, "prompt": "a", "max_tokens": CEILING + 1},
                                   "max_tokens"),
                                  ("/v1/responses", {"model": MODEL, "input": "a", "max_output_tokens": CEILING + 1},
                                   "max_output_tokens")):
            refused = client.post(path, json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["param"] == field and f"at most {CEILING} output tokens" in error["message"], error
        refused = client.post("/v1/messages", json={"model": MODEL, "max_tokens": CEILING + 1,
                                                    "messages": [{"role": "user", "content": "a"}]})
        assert refused.status_code == 400 and f"at most {CEILING}" in refused.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=chat(max_tokens=CEILING)).status_code == 200
        # Omitted: the ceiling, the key's where it is lower; a completion keeps vLLM's default of 16.
        assert client.post("/v1/chat/completions", json=chat()).json()["usage"]["completion_tokens"] == CEILING
        assert small.post("/v1/chat/completions", json=chat()).json()["usage"]["completion_tokens"] == KEY_CEILING
        assert client.post("/v1/completions", json={"model": MODEL, "prompt": "a"}).json()["usage"][
            "completion_tokens"] == 16
        assert small.post("/v1/chat/completions", json=chat(max_tokens=KEY_CEILING + 1)).status_code == 400


def test_default_streams_are_framed_as_vllm_serve_frames_them(fleet):
    gateway, _, _ = fleet
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", timeout=60,
                      json=chat(max_tokens=3, stream=True)) as response:
        text = response.read().decode()
    assert response.headers["cache-control"] == "no-cache" and response.headers["x-accel-buffering"] == "no"
    assert response.headers["content-type"].startswith("text/event-stream")
    frames = text.split("\n\n")
    assert frames[-2:] == ["data: [DONE]", ""] and len(frames) >= 5, text
    assert all(frame.startswith("data: {") and "\n" not in frame for frame in frames[:-2]), text
    resumable = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60,
                           json=chat(max_tokens=3, stream=True, resumable=True))
    assert resumable.headers["cache-control"] == "no-cache"
    assert [frame.split("\n")[-1] for frame in resumable.text.split("\n\n") if frame][:2] == ["id: 0", "id: 1"]


def test_the_request_log_has_a_line_per_request_on_both_sides(fleet, redis_url):
    plain, gateway, worker = fleet
    _, secret = create_key(redis_url)
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=60, headers={"Authorization": f"Bearer {secret}"},
                        json=chat(max_tokens=4))
    request_id = answer.json()["id"].removeprefix("chatcmpl-")

    def line(proc) -> dict | None:
        for text in proc.log().splitlines():
            if text.startswith("{") and '"llmfleet.requests"' in text and request_id in text:
                return json.loads(text)
        return None

    gateway_line = wait_for(lambda: line(gateway), 10, "the gateway's request line")
    assert gateway_line["level"] == "info" and gateway_line["outcome"] == "length", gateway_line
    assert gateway_line["tenant"].startswith("k-") and gateway_line["model"] == MODEL
    assert gateway_line["completion_tokens"] == 4 and 0 < gateway_line["ttft_s"] <= gateway_line["total_s"]
    worker_line = wait_for(lambda: line(worker), 10, "the worker's request line")
    assert worker_line["level"] == "info" and worker_line["finish_reason"] == "length"
    assert worker_line["tenant"] == gateway_line["tenant"] and worker_line["completion_tokens"] == 4
    # Off by default: the plain gateway writes none.
    other = httpx.post(f"{plain.url}/v1/chat/completions", timeout=60, json=chat(max_tokens=2)).json()
    assert other["id"].removeprefix("chatcmpl-") not in "".join(
        text for text in plain.log().splitlines() if "llmfleet.requests" in text)


def test_invocations_dispatch_on_the_body_and_load_counts_open_requests(fleet):
    gateway, _, _ = fleet
    answer = httpx.post(f"{gateway.url}/invocations", timeout=60, json=chat(max_tokens=2)).json()
    assert answer["object"] == "chat.completion" and answer["usage"]["completion_tokens"] == 2
    answer = httpx.post(f"{gateway.url}/invocations", timeout=60,
                        json={"model": MODEL, "prompt": "x y", "max_tokens": 3}).json()
    assert answer["object"] == "text_completion" and answer["usage"]["completion_tokens"] == 3
    refused = httpx.post(f"{gateway.url}/invocations", timeout=60, json={"model": MODEL})
    assert refused.status_code == 400 and "ChatCompletionRequest" in refused.json()["error"]["message"]
    assert httpx.get(f"{gateway.url}/load").json() == {"server_load": 0}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", timeout=60,
                      json=chat(max_tokens=1000, stream=True)) as response:
        lines = response.iter_lines()  # kept: dropping the iterator would close the connection
        next(lines)
        assert httpx.get(f"{gateway.url}/load").json() == {"server_load": 1}
    wait_for(lambda: httpx.get(f"{gateway.url}/load").json() == {"server_load": 0}, 10, "the stream to be closed")


def test_an_early_cancelled_completion_answers_every_prompts_choices(fleet):
    gateway, _, _ = fleet
    httpx.post(f"{gateway.url}/v1/cancel", json={"cancel_id": "multi-prompt"})
    answer = httpx.post(f"{gateway.url}/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": ["a b", "c d", "e f"], "n": 2, "temperature": 1, "cancel_id": "multi-prompt"}).json()
    assert [c["index"] for c in answer["choices"]] == list(range(6))
    assert {c["finish_reason"] for c in answer["choices"]} == {"cancelled"}


def test_a_request_running_past_the_reclaim_sweeps_idle_time_is_not_counted_reclaimed(redis_url):
    """Every `claim_idle_s / 2` a worker's sweep takes back entries idle past `claim_idle_s`, a dead
    worker's to run again; XAUTOCLAIM returns those of requests still running too, which are left
    alone. They counted as reclaimed claims (the dashboard's "a dead worker's"): one request of 3 s on a
    healthy worker showed five."""
    model = "signals-long-model"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "100", "--claim-idle", "0.5")
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, model)
        answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
            "model": model, "messages": [{"role": "user", "content": "red"}], "max_tokens": 300})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 300
        claims = {source: metric_value(worker.url, "llmfleet_worker_claims_total", model=model, source=source)
                  for source in ("own", "shared", "stolen", "reclaimed", "express")}
        assert claims == {"own": 0, "shared": 1, "stolen": 0, "reclaimed": 0, "express": 0}
        assert metric_value(worker.url, "llmfleet_worker_reclaimed_total", model=model) == 0
    finally:
        gateway.stop()
        worker.stop()
