"""One id from client to engine (issue #13): `X-Request-Id` accepted or made, echoed, carried to
the worker, on every log line about the request in both processes, and one access line per
request; `--log-format json` writes one JSON object per line."""

from __future__ import annotations

import json
import logging

import httpx
import pytest

from shared import logs
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

MODEL = "traced-model"
JSON_LOGS = {"LLMFLEET_LOG_FORMAT": "json", "LLMFLEET_LOG_LEVEL": "debug"}


def _json_lines(text: str) -> list[dict]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            lines.append(json.loads(line))
    return lines


@pytest.fixture(scope="module")
def fleet(redis_url: str):
    worker = start_worker(redis_url, MODEL, env=JSON_LOGS)
    gateway = start_gateway(redis_url, env=JSON_LOGS)
    wait_until_served(gateway, MODEL)
    yield gateway, worker
    for proc in (gateway, worker):
        proc.stop()


@pytest.mark.integration
def test_a_client_request_id_is_echoed_and_on_every_log_line_of_both_sides(fleet) -> None:
    gateway, worker = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 3}
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, headers={"X-Request-Id": "client-id-42"},
                        timeout=30)
    assert answer.status_code == 200 and answer.headers["x-request-id"] == "client-id-42"
    engine_id = answer.json()["id"].removeprefix("chatcmpl-")

    access = wait_for(lambda: [e for e in _json_lines(gateway.log()) if e["logger"] == "gateway.access"
                               and e.get("request_id") == "client-id-42"], 10, "the gateway's access line")
    assert len(access) == 1
    line = access[0]
    assert (line["level"], line["message"], line["family"], line["model"], line["status"]) == (
        "info", "POST /v1/chat/completions 200", "openai", MODEL, 200)
    assert line["completion_tokens"] == 3 and line["request"] == engine_id and line["worker"]
    assert 0 < line["ttft_s"] <= line["total_s"]

    finished = wait_for(lambda: [e for e in _json_lines(worker.log()) if engine_id in e["message"]], 10,
                        "the worker's line about the request")
    assert [(e["request_id"], e["finish_reason"], e["completion_tokens"]) for e in finished] == [
        ("client-id-42", "length", 3)]


@pytest.mark.integration
def test_without_a_sane_id_the_gateway_makes_one(fleet) -> None:
    gateway, _ = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    made = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30).headers["x-request-id"]
    hostile = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30,
                         headers={"X-Request-Id": "x" * 129}).headers["x-request-id"]
    refused = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "nope"}, timeout=30,
                         headers={"X-Request-Id": "bad id\twith spaces"})
    assert refused.status_code in (400, 404)
    ids = [made, hostile, refused.headers["x-request-id"]]
    assert all(len(i) == 32 and i.isalnum() for i in ids) and len(set(ids)) == 3


def test_text_lines_carry_the_request_id_and_fields(capsys) -> None:
    logs.setup("info", "text")
    token = logs.REQUEST_ID.set("abc")
    try:
        logging.getLogger("gateway.access").info("POST /x 200", extra={"fields": {"model": "m", "total_s": 0.5,
                                                                                  "worker": None, "note": "a b"}})
    finally:
        logs.REQUEST_ID.reset(token)
        logging.getLogger().handlers.clear()
    line = capsys.readouterr().err.strip()
    assert line.endswith('INFO gateway.access: [abc] POST /x 200 model=m total_s=0.5000 note="a b"'), line


@pytest.mark.integration
def test_a_stream_is_timed_at_every_stage(fleet) -> None:
    """Inter-token latency and relay delay at the gateway; the lease's wait, prefill and decode at the worker."""
    gateway, worker = fleet
    series = {"itl": (gateway.url, "llmfleet_gateway_inter_token_seconds_count", {"model": MODEL}),
              "relay": (gateway.url, "llmfleet_gateway_relay_seconds_count", {}),
              "lease": (worker.url, "llmfleet_worker_lease_wait_seconds_count", {"model": MODEL}),
              "prefill": (worker.url, "llmfleet_worker_time_to_first_token_seconds_count", {"model": MODEL}),
              "decode": (worker.url, "llmfleet_worker_decode_seconds_count", {"model": MODEL})}
    before = {key: metric_value(url, name, **labels) for key, (url, name, labels) in series.items()}
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 5,
            "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as answer:
        events = [line for line in answer.iter_lines() if line.startswith("data: {")]
    tokens = sum(1 for e in events if '"content":"' in e and '"content":""' not in e)
    assert tokens >= 2
    after = {key: metric_value(url, name, **labels) for key, (url, name, labels) in series.items()}
    grown = {key: after[key] - before[key] for key in series}
    # A gap between each pair of token events; at least one reply entry; one lease, one prefill and one decode.
    assert grown["itl"] == tokens - 1 and grown["relay"] >= 1, grown
    assert (grown["lease"], grown["prefill"], grown["decode"]) == (1, 1, 1), grown


PACED_MODEL = "timed-model"


@pytest.fixture(scope="module")
def paced(redis_url: str, fleet):
    """A worker that takes 0.2 s to its first token, then 50 tokens a second."""
    gateway, _ = fleet
    worker = start_worker(redis_url, PACED_MODEL, "--scripted-first-token-delay", "0.2",
                          "--scripted-tokens-per-second", "50")
    wait_until_served(gateway, PACED_MODEL)
    yield gateway, worker
    worker.stop()


def _histogram_sums(worker_url: str) -> dict[str, float]:
    return {stage: metric_value(worker_url, f"llmfleet_worker_{name}_seconds_sum", model=PACED_MODEL)
            for stage, name in (("queue_s", "queue"), ("prefill_s", "time_to_first_token"), ("decode_s", "decode"))}


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_a_request_gets_its_own_stage_timings_and_they_agree_with_the_histograms(paced, stream) -> None:
    gateway, worker = paced
    before = _histogram_sums(worker.url)
    body = {"model": PACED_MODEL, "messages": [{"role": "user", "content": "a b c d e f"}], "max_tokens": 6}
    if stream:
        body |= {"stream": True, "stream_options": {"include_timings": True}}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as answer:
            events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: {")]
        assert [e for e in events[:-1] if "timings" in e] == [] and events[-1]["choices"] == []
        timings = events[-1]["timings"]
    else:
        timings = httpx.post(f"{gateway.url}/v1/chat/completions", json=body | {"include_timings": True},
                             timeout=30).json()["timings"]
    observed = {stage: value - before[stage] for stage, value in _histogram_sums(worker.url).items()}
    # The request's own times are the ones the worker's histograms observed (to the millisecond).
    for stage, value in observed.items():
        assert timings[stage] == pytest.approx(value, abs=0.002), (stage, timings, observed)
    assert 0.19 <= timings["prefill_s"] < 1.0 and 0.08 <= timings["decode_s"] < 2.0  # 0.2 s, then 5 gaps of 20 ms
    assert 0 <= timings["relay_s"] < 0.5
    assert timings["total_s"] >= timings["queue_s"] + timings["prefill_s"] + timings["decode_s"]
    assert timings["completion_tokens_per_s"] == pytest.approx(6 / timings["decode_s"])


@pytest.mark.integration
def test_timings_only_when_asked(fleet) -> None:
    gateway, _ = fleet
    body = {"model": MODEL, "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2}
    assert "timings" not in httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30).json()
    streamed = httpx.post(f"{gateway.url}/v1/chat/completions", json=body | {"stream": True}, timeout=30).text
    assert "timings" not in streamed
