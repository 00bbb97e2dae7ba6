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


def test_stage_spans_with_the_sdks_in_memory_exporter() -> None:
    """The spans shared.tracing makes, read back from the SDK's in-memory exporter: the worker's
    generate/prefill/decode join the gateway's trace with the measured times."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from shared import tracing

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    before, tracing._tracer = tracing._tracer, provider.get_tracer("test")
    try:
        request = tracing.start_request_span("POST /v1/chat/completions",
                                             [(b"traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01".encode())])
        with tracing.use(request):
            traceparent = tracing.current_traceparent()
        timings = {"queue_s": 0.5, "prefill_s": 0.25, "decode_s": 1.0, "finished_at": 1000.0}
        tracing.worker_generation(traceparent, timings, {"llmfleet.model": "m", "llmfleet.worker": None})
        tracing.gateway_stages(request, 998.0, timings, 1000.125)
        request.end()
    finally:
        tracing._tracer = before
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"POST /v1/chat/completions", "generate", "prefill", "decode", "queue", "relay"}
    assert {span.context.trace_id for span in spans.values()} == {int(CLIENT_TRACE, 16)}
    request_id, generate_id = spans["POST /v1/chat/completions"].context.span_id, spans["generate"].context.span_id
    assert spans["POST /v1/chat/completions"].parent.span_id == int(CLIENT_SPAN, 16)
    assert {name: spans[name].parent.span_id for name in ("generate", "queue", "relay", "prefill", "decode")} == {
        "generate": request_id, "queue": request_id, "relay": request_id, "prefill": generate_id,
        "decode": generate_id}
    seconds = {name: (span.end_time - span.start_time) / 1e9 for name, span in spans.items()}
    assert {name: seconds[name] for name in ("queue", "prefill", "decode", "relay")} == pytest.approx(
        {"queue": 0.5, "prefill": 0.25, "decode": 1.0, "relay": 0.125})
    assert dict(spans["generate"].attributes) == {"llmfleet.model": "m"}
