"""OpenTelemetry tracing, off unless asked for: one trace per request, from the client's
`traceparent` through the gateway, the queue, the worker's generation and the relay back.

On with `--otlp-endpoint URL` (LLMFLEET_OTLP_ENDPOINT: an OTLP/HTTP collector, e.g.
http://collector:4318/v1/traces) or `--trace-file PATH` (LLMFLEET_TRACE_FILE: one JSON span per
line). Needs the `otel` extra (opentelemetry-sdk and its OTLP exporter); the worker's vLLM
brings them anyway.

Spans: the gateway's `POST /v1/...` (server span, the client's trace continued), and under it
`queue` and `relay`; the worker's `generate` (its parent travels in the envelope's
`traceparent`), with `prefill` and `decode` under it. The stage spans are made when the request
ends, from the times the worker measured (`GenerationChunk.timings`), so tracing costs nothing
per token.
"""

from __future__ import annotations

import atexit
import os
from typing import Any

_tracer: Any = None  # an opentelemetry Tracer once `setup` turned tracing on


def setup(service: str) -> bool:
    """Turn tracing on for this process if an exporter is configured; True if it is on."""
    global _tracer
    endpoint, path = os.environ.get("LLMFLEET_OTLP_ENDPOINT"), os.environ.get("LLMFLEET_TRACE_FILE")
    if not endpoint and not path:
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": service}))
    if endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    if path:
        out = open(path, "a", buffering=1)  # noqa: SIM115 - open for the life of the process
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter(
            out=out, formatter=lambda span: span.to_json(indent=None) + "\n")))
    atexit.register(provider.shutdown)
    _tracer = provider.get_tracer("llmfleet")
    return True


def enabled() -> bool:
    return _tracer is not None


def start_request_span(name: str, headers: list[tuple[bytes, bytes]]):
    """The gateway's span of one HTTP request, continuing the client's `traceparent` if any."""
    from opentelemetry.trace import SpanKind
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier = {name.decode("latin-1"): value.decode("latin-1") for name, value in headers
               if name in (b"traceparent", b"tracestate")}
    parent = TraceContextTextMapPropagator().extract(carrier)
    return _tracer.start_span(name, context=parent, kind=SpanKind.SERVER)


def use(span):
    """Make `span` the current one (a context manager), so what happens inside belongs to it."""
    from opentelemetry.trace import use_span

    return use_span(span, end_on_exit=False)


def current_traceparent() -> str:
    """The W3C traceparent of the current span, for the envelope; "" when tracing is off."""
    if _tracer is None:
        return ""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier)
    return carrier.get("traceparent", "")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def gateway_stages(span, arrival: float, timings: dict[str, float] | None, now: float) -> None:
    """`queue` (arrival to a worker's claim), `migration` (from when a takeover's pause began, for
    as long as the takeovers paused the stream, where it was taken over) and `relay` (the worker's
    end to this gateway) under the request's span."""
    if not timings:
        return
    from opentelemetry.trace import set_span_in_context

    context = set_span_in_context(span)
    if (queued := timings.get("queue_s")) is not None:
        _tracer.start_span("queue", context=context, start_time=_ns(arrival)).end(end_time=_ns(arrival + queued))
    if migrated_at := timings.get("migrated_at"):
        _tracer.start_span("migration", context=context, start_time=_ns(migrated_at),
                           attributes={"llmfleet.migrations": timings.get("migrations", 1)}).end(
            end_time=_ns(migrated_at + timings.get("migration_s", 0.0)))
    if (finished := timings.get("finished_at")) is not None:
        _tracer.start_span("relay", context=context, start_time=_ns(finished)).end(end_time=_ns(max(now, finished)))


def worker_generation(traceparent: str, timings: dict[str, float], attributes: dict[str, Any]) -> None:
    """The worker's `generate` span with `prefill` and `decode` under it, in the trace the
    gateway began, from the times the worker measured."""
    if _tracer is None or not traceparent:
        return
    from opentelemetry.trace import SpanKind, set_span_in_context
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    parent = TraceContextTextMapPropagator().extract({"traceparent": traceparent})
    end = timings["finished_at"]
    decode_start = end - timings.get("decode_s", 0.0)
    start = decode_start - timings.get("prefill_s", 0.0)
    span = _tracer.start_span("generate", context=parent, kind=SpanKind.CONSUMER, start_time=_ns(start),
                              attributes={k: v for k, v in attributes.items() if v is not None})
    context = set_span_in_context(span)
    _tracer.start_span("prefill", context=context, start_time=_ns(start)).end(end_time=_ns(decode_start))
    _tracer.start_span("decode", context=context, start_time=_ns(decode_start)).end(end_time=_ns(end))
    span.end(end_time=_ns(end))
