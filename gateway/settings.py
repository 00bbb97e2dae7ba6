"""A gateway's settings and their defaults, in one place: `llmfleet gateway` builds its options
from these fields (`--request-timeout` sets `request_timeout_s`, each with the help given here;
llmfleet.py's `options_of`), the environment's `LLMFLEET_<OPTION>` reads the same, and the deploy
files set only what they change. A new setting needs one line here and nothing in the CLI.

A field with `help` is an option named after it, less a `_s` suffix, with dashes; a tuple takes
a comma-separated list; a bool is a `--x/--no-x` flag. `redis_url` comes from the shared Redis
options; `gateway_id` is made at start. Keep this module free of heavy imports: the CLI reads it.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"


def setting(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(slots=True)
class GatewaySettings:
    redis_url: str = DEFAULT_REDIS_URL
    request_timeout_s: float = setting(600.0, "Seconds before a request is abandoned (default and cap of a "
                                       "request's `timeout`).")
    queue_timeout_s: float = setting(60.0, "Seconds a request may wait for a worker to start it; then a 503: at "
                                     "once (and it leaves the queue) if no worker of its model is alive, else from "
                                     "the worker that takes it, which drops it unstarted.")
    drain_grace_s: float = setting(30.0, "On SIGTERM, seconds open requests may take to finish.")
    max_body_bytes: int = setting(4 * 1024 * 1024, "Larger request bodies get a 413.")
    max_encoder_inputs: int = setting(2048, "Inputs one embeddings, classify or pooling request may hold, and texts "
                                      "one score or rerank request may (OpenAI's bound on embeddings); past it a 400.")
    encoder_part_inputs: int = setting(256, "An embeddings, classify or pooling request of more inputs is split into "
                                       "parts of this many, queued as requests of their own, so that the model's "
                                       "workers encode it together; its answer is theirs in input order (0: never "
                                       "split).")
    max_queue: int = setting(1000, "Waiting requests per model (beyond those running) before new ones get a 429.")
    max_open_requests: int = setting(20000, "Requests this gateway follows at once before a 429.")
    max_buffered_chunks: int = setting(1024, "Reply batches held for a client that stopped reading; past it "
                                       "the request is cancelled.")
    models: tuple[str, ...] = setting((), "Comma-separated models served by workers that may be scaled to zero: "
                                      "with no live worker, their requests queue (up to --queue-timeout) "
                                      "instead of getting a 404.")
    resume_grace_s: float = setting(30.0, "Seconds a resumable stream runs on with no client reading it, before "
                                    "it is cancelled.")
    event_log_keep_s: float = setting(600.0, "Seconds a resumable stream's events stay replayable after it ended.")
    response_store_ttl_s: float = setting(24 * 3600.0, "Seconds a stored Response is kept.")
    response_store_max_entries: int = setting(10_000, "Stored Responses kept at most; the oldest go first.")
    response_store_max_bytes: int = setting(1024 * 1024, "A larger Response is not stored.")
    session_ttl_s: float = setting(24 * 3600.0, "Seconds a session (POST /v1/sessions) is kept after its last turn.")
    session_max_messages: int = setting(1000, "Messages a session holds at most; a turn past it gets a 400.")
    session_max_bytes: int = setting(1024 * 1024, "Bytes of messages a session holds at most (checked before "
                                     "each turn); a turn past it gets a 400.")
    max_sessions: int = setting(10_000, "Sessions kept at most; the least recently used go first.")
    snapshot_ttl_s: float = setting(7 * 24 * 3600.0, "Seconds a session snapshot is kept.")
    max_snapshots: int = setting(1000, "Session snapshots kept at most; the oldest go first.")
    fair_share: bool = setting(True, "Serve the tenants (API keys) of one priority in turn when a model's queue is "
                               "contended; false: in arrival order.")
    affinity: bool = setting(True, "Send a long prompt's request to the worker that served its conversation (or "
                             "prefix) before, whose cache holds it, while that worker has room (README: Cache affinity).")
    api_key: str = setting("", "A key every API request must present (Authorization: Bearer KEY, or x-api-key), "
                           "as vllm serve has it; off when empty.")
    require_keys: bool = setting(False, "Require a managed API key (llmfleet keys create) on every API request, "
                                 "with its limits and priority.")
    open_paths: tuple[str, ...] = setting(("/health", "/ready", "/metrics", "/fleet/load"), "Comma-separated paths "
                                          "answered without a key.")
    max_output_tokens: int = setting(0, "The most output tokens a request may ask for (max_tokens and its kin): "
                                     "above it a 400; a request that asks for none gets it (or the room left in the "
                                     "context, if less). 0: no ceiling but the context. A key's --max-tokens may "
                                     "lower it.")
    rate_window_s: float = setting(60.0, "Seconds over which a key's --rpm and --tpm limits count.")
    sse_event_ids: bool = setting(False, "Give every SSE event an `id:` line (its index). Off: streams are framed "
                                  "exactly as `vllm serve` frames them (clients that read SSE line by line, such as "
                                  "`vllm bench serve`, need that), and only resumable streams carry ids.")
    enable_log_requests: bool = setting(False, "Log one line per generation request at its end (ids, tenant, model, "
                                        "tokens, stage times, outcome) on `llmfleet.requests`, as vllm serve's "
                                        "option of that name.")
    gateway_id: str = ""

    def __post_init__(self) -> None:
        self.gateway_id = self.gateway_id or uuid.uuid4().hex[:12]
