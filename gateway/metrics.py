"""Prometheus metrics of a gateway process."""

from prometheus_client import Counter, Gauge, Histogram

REQUESTS = Counter("llmfleet_gateway_requests_total", "HTTP responses, refusals included, by API family, endpoint, "
                   "model (empty before it is resolved) and status (an error inside a stream by its own)",
                   ["family", "endpoint", "model", "status"])
REQUEST_PARTS = Counter("llmfleet_gateway_request_parts_total", "Parts queued for requests served in parts (an "
                        "encoding of more than --encoder-part-inputs inputs), by model", ["model"])
SUBMITTED = Counter("llmfleet_gateway_submitted_total", "Requests queued for workers", ["model"])
OPEN_STREAMS = Gauge("llmfleet_gateway_open_requests", "Requests waiting on workers in this process")
TIME_TO_FIRST_TOKEN = Histogram(
    "llmfleet_gateway_time_to_first_token_seconds", "Gateway arrival to first generated token", ["model"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60))
REQUEST_LATENCY = Histogram(
    "llmfleet_gateway_request_seconds", "Gateway arrival to last byte", ["model", "endpoint"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
RELAYED_TOKENS = Counter("llmfleet_gateway_completion_tokens_total", "Completion tokens relayed", ["model"])
CANCELS = Counter("llmfleet_gateway_cancels_total", "Cancels sent to workers, by cause", ["cause"])
OVERLOADED = Counter("llmfleet_gateway_overloaded_total", "Requests refused with 429: the model's queue was full",
                     ["model"])
AFFINITY = Counter("llmfleet_gateway_affinity_total", "Requests with an affinity key, by where they were queued: "
                   "their preferred worker, the next one (spilled), or the shared stream (no room)", ["model", "route"])
SLOW_CLIENTS = Counter("llmfleet_gateway_slow_client_cancels_total",
                       "Requests cancelled because their client stopped reading")
MIGRATIONS = Counter("llmfleet_gateway_migrations_total", "Streams whose worker stopped mid-stream that went on: "
                     "a takeover's replay joined where the client stood, or its continuation of what the client was "
                     "sent (gateway/fleet/replay.py)", ["model", "cause"])
WORKERS_FOUND_GONE = Counter("llmfleet_gateway_workers_found_gone_total", "Workers found dead, before their leases "
                             "lapsed, by no subscriber left on their presence channel (gateway/fleet/registry.py)",
                             ["model"])
MIGRATION_PAUSE = Histogram("llmfleet_gateway_migration_pause_seconds", "What a stream taken over mid-stream "
                            "added: from the last reply of its worker that died or drained to the first new output "
                            "its client got from the worker that took it over", ["model"],
                            buckets=(0.25, 0.5, 0.75, 1, 1.5, 2, 3, 4, 6, 8, 12, 20))
REPLY_CHANNEL_LOST = Counter("llmfleet_gateway_reply_channel_lost_total", "Times this gateway lost the subscription "
                             "its replies come on (Redis restarted or dropped it: its client-output-buffer-limit for "
                             "pub/sub, the network); the requests open here then failed with a 503")
STALE_REPLIES = Counter("llmfleet_gateway_stale_replies_total", "Reply envelopes dropped because they came from a "
                        "worker that had lost the request's lease (another worker had taken it over)")
# Fleet-wide figures read from Redis with each registry refresh (every half second): every gateway
# reports the same values, so aggregate them with max(), not sum().
BACKLOG = Gauge("llmfleet_gateway_backlog", "Requests in the model's queue: waiting for a worker's free slot, "
                "or running on a worker (claimed, not yet answered)", ["model", "state"])
LIVE_WORKERS = Gauge("llmfleet_gateway_live_workers", "Workers with a live heartbeat serving the model "
                     "(draining ones included)", ["model"])
RELAY_DELAY = Histogram("llmfleet_gateway_relay_seconds", "From a worker's write of replies (on the gateway's "
                        "channel: the write's time, by the worker's clock; on its reply stream: the entry's id, by "
                        "Redis's) to this gateway reading them", buckets=(0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1,
                                                                    0.25, 0.5, 1, 2.5))
INTER_TOKEN_LATENCY = Histogram("llmfleet_gateway_inter_token_seconds", "Gaps between a stream's token events as "
                                "this gateway relays them (what a client sees)", ["model"],
                                buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1, 2.5))
# Per managed API key (gateway/fleet/rate_limits.py): labelled by key name, which only an operator makes
# (`llmfleet keys create`), never by secret, so the series stay bounded.
KEY_REQUESTS = Counter("llmfleet_gateway_key_requests_total", "Requests admitted, by API key name and model",
                       ["key", "model"])
KEY_PROMPT_TOKENS = Counter("llmfleet_gateway_key_prompt_tokens_total", "Prompt tokens (the worker's count), by API "
                            "key name and model", ["key", "model"])
KEY_COMPLETION_TOKENS = Counter("llmfleet_gateway_key_completion_tokens_total", "Completion tokens relayed, by API "
                                "key name and model", ["key", "model"])
