"""Prometheus metrics of a worker (vLLM's own `vllm:*` series share the same registry)."""

from prometheus_client import Counter, Gauge, Histogram

from shared.envelopes import ENCODER_KINDS

REQUESTS = Counter("llmfleet_worker_requests_total", "Requests answered, by finish reason",
                   ["model", "finish_reason"])
IN_FLIGHT = Gauge("llmfleet_worker_in_flight", "Requests running on this worker", ["model"])
QUEUE_TIME = Histogram("llmfleet_worker_queue_seconds", "Time from gateway arrival to claim", ["model"],
                       buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
LEASE_WAIT = Histogram("llmfleet_worker_lease_wait_seconds", "From a claimed request's start on the worker to its "
                       "lease held: the lease's round trip, and the worker's loop before it reads the reply", ["model"],
                       buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
PUBLISH_WAIT = Histogram("llmfleet_worker_publish_wait_seconds", "From the oldest reply a write carries being "
                         "queued to the write: the pause that merges deltas under load (at most 6 ms), and the "
                         "worker's loop; one per write", ["model"],
                         buckets=(0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.01, 0.02, 0.05, 0.1, 0.25, 1))
GENERATED_TOKENS = Counter("llmfleet_worker_generated_tokens_total", "Completion tokens generated", ["model"])
POISON_MESSAGES = Counter("llmfleet_worker_poison_messages_total", "Malformed request envelopes dropped",
                          ["model"])
CANCELS = Counter("llmfleet_worker_cancels_total", "Requests cancelled, by cause and phase",
                  ["model", "cause", "phase"])
CANCELS_FROM_STASH = Counter("llmfleet_worker_cancels_from_stash_total",
                             "Running requests cancelled from their stash because the pub/sub notice was lost",
                             ["model"])
TOKENS_AFTER_CANCEL = Counter("llmfleet_worker_tokens_after_cancel_total",
                              "Tokens the engine produced after a cancel reached the worker", ["model"])
QUEUE_TIMEOUTS = Counter("llmfleet_worker_queue_timeouts_total", "Requests dropped unstarted after their queue "
                         "timeout", ["model"])
CANCEL_LATENCY = Histogram("llmfleet_worker_cancel_seconds",
                           "From the gateway's cancel to the engine's last output", ["model"],
                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2))
CLAIMS = Counter("llmfleet_worker_claims_total", "Requests claimed, by where from: this worker's own stream "
                 "(affinity), the model's, another worker's own after a wait (stolen), a dead worker's (reclaimed), or "
                 "past the slots for a tenant with nothing else queued (express)",
                 ["model", "source"])
MIGRATIONS = Counter("llmfleet_worker_migrations_total", "Streams another worker had begun (it died, or handed them "
                     "over at its drain deadline) taken over here: greedy or seeded ones run again from their start for "
                     "their gateway to join, sampled ones continued from what their client was sent "
                     "(--migration-limit); the gateway's counter says why", ["model"])
HANDED_OVER = Counter("llmfleet_worker_handed_over_total", "Requests a draining worker handed to other workers at its "
                      "--drain-timeout instead of finishing them", ["model"])
RECLAIMED = Counter("llmfleet_worker_reclaimed_total", "Requests taken over from a worker that died", ["model"])
PREFILL_TIME = Histogram("llmfleet_worker_time_to_first_token_seconds", "From the engine taking the request to its "
                         "first generated token (prefill, and any wait inside the engine)", ["model"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
DECODE_TIME = Histogram("llmfleet_worker_decode_seconds", "From the first generated token to the last (decode)",
                        ["model"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
ENCODED_INPUTS = Counter("llmfleet_worker_encoded_inputs_total", "Inputs (or pairs scored) an encoder answered, by "
                         "kind of request (embed, score, rerank, classify, pooling)", ["model", "kind"])
ENCODED_TOKENS = Counter("llmfleet_worker_encoded_tokens_total", "Input tokens an encoder pooled, by kind of request",
                         ["model", "kind"])
ENCODE_TIME = Histogram("llmfleet_worker_encode_seconds", "From the engine taking an encoder request to its answer, "
                        "by kind of request", ["model", "kind"],
                        buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
ENCODE_CALL_REQUESTS = Histogram("llmfleet_worker_encode_call_requests", "Requests answered by one call of the "
                                 "engine's handler (a vLLM encoder worker encodes requests of the same options that "
                                 "come together in one; the scripted encoder each alone), by kind of request",
                                 ["model", "kind"],
                                 buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))


def start_series(model: str, kinds: tuple[str, ...]) -> None:
    """Export at 0 the series of the kinds this worker answers, before its first request: a
    series that first appears with its first count holds no increase for `rate()` to see (the
    dashboard's encode time would stay empty after a worker's first encodings)."""
    for kind in kinds:
        if kind in ENCODER_KINDS:
            ENCODED_INPUTS.labels(model, kind)
            ENCODED_TOKENS.labels(model, kind)
            ENCODE_TIME.labels(model, kind)
            ENCODE_CALL_REQUESTS.labels(model, kind)
