"""OpenTelemetry tracing (issue #13), off by default: a client's `traceparent` is continued by the
gateway's request span, carried in the envelope, and the worker's generation joins the same
trace; the stage spans last what the request's own timings say. Each process writes its spans
to a file with the SDK's exporter (`--trace-file`)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.procs import start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

MODEL = "traced-by-otel"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


def _spans(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _seconds(span: dict) -> float:
    start, end = (datetime.fromisoformat(span[key].replace("Z", "+00:00")) for key in ("start_time", "end_time"))
    return (end - start).total_seconds()


@pytest.fixture(scope="module")
def traced(redis_url: str, tmp_path_factory):
    files = tmp_path_factory.mktemp("traces")
    worker = start_worker(redis_url, MODEL, "--scripted-first-token-delay", "0.1", "--scripted-tokens-per-second",
                          "100", env={"LLMFLEET_TRACE_FILE": str(files / "worker.jsonl")})
    plain = start_gateway(redis_url)
    gateway = start_gateway(redis_url, env={"LLMFLEET_TRACE_FILE": str(files / "gateway.jsonl")})
    wait_until_served(gateway, MODEL)
    wait_until_served(plain, MODEL)
    yield gateway, plain, files
    for proc in (gateway, plain, worker):
        proc.stop()


def test_one_trace_from_the_client_through_gateway_queue_worker_and_relay(traced) -> None:
    gateway, _, files = traced
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                        headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "a b c d"}],
                              "max_tokens": 4, "include_timings": True})
    assert answer.status_code == 200
    timings = answer.json()["timings"]

    def trace() -> dict[str, dict]:
        spans = [s for s in _spans(files / "gateway.jsonl") + _spans(files / "worker.jsonl")
                 if s["context"]["trace_id"] == f"0x{CLIENT_TRACE}"]
        return {s["name"]: s for s in spans} if len(spans) == 6 else {}

    spans = wait_for(trace, 10, "the six spans of the request")
    request = spans["POST /v1/chat/completions"]
    assert request["parent_id"] == f"0x{CLIENT_SPAN}" and request["kind"] == "SpanKind.SERVER"
    assert request["resource"]["attributes"]["service.name"] == "llmfleet-gateway"
    assert request["attributes"]["http.response.status_code"] == 200
    request_span = request["context"]["span_id"]
    generate = spans["generate"]
    assert generate["resource"]["attributes"]["service.name"] == "llmfleet-worker"
    assert {name: spans[name]["parent_id"] for name in ("queue", "relay", "generate", "prefill", "decode")} == {
        "queue": request_span, "relay": request_span, "generate": request_span,
        "prefill": generate["context"]["span_id"], "decode": generate["context"]["span_id"]}
    assert generate["attributes"]["llmfleet.request_id"] == answer.json()["id"].removeprefix("chatcmpl-")
    assert generate["attributes"]["llmfleet.completion_tokens"] == 4
    # The spans last what the request's own timings say (to the microsecond the spans keep).
    for stage in ("queue", "prefill", "decode"):
        assert _seconds(spans[stage]) == pytest.approx(timings[f"{stage}_s"], abs=1e-5), stage
    assert _seconds(request) >= timings["total_s"] - 0.001


def test_without_an_exporter_there_is_no_tracing(traced) -> None:
    _, plain, files = traced
    before = len(_spans(files / "worker.jsonl"))
    answer = httpx.post(f"{plain.url}/v1/chat/completions", timeout=30,
                        headers={"traceparent": f"00-{'1' * 32}-{'2' * 16}-01"},
                        json={"model": MODEL, "messages": [{"role": "user", "content": "a"}], "max_tokens": 1})
    assert answer.status_code == 200
    # The untraced gateway sent no traceparent: the worker (which traces, and writes its spans
    # before it answers) made none for it.
    assert [s for s in _spans(files / "worker.jsonl")[before:] if s["context"]["trace_id"] == f"0x{'1' * 32}"] == []
