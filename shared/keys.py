"""Every Redis key, stream and channel name llmfleet uses, with its bound.

| name                              | type    | bound                                       |
|-----------------------------------|---------|---------------------------------------------|
| llmfleet:requests:{model}         | stream  | MAXLEN ~REQUEST_STREAM_MAXLEN; entries are   |
|                                   |         | XDEL'd by the worker once answered          |
| llmfleet:replies:{gateway_id}     | stream  | MAXLEN ~REPLY_STREAM_MAXLEN, TTL refreshed  |
|                                   |         | by its gateway; workers never create it     |
| llmfleet:worker:{worker_id}       | string  | TTL HEARTBEAT_TTL_S                         |
| llmfleet:model:{model}            | string  | TTL MODEL_MEMORY_TTL_S ("was served lately")|
| llmfleet:run:{request_id}         | string  | TTL: the request's deadline (its gateway)   |
| llmfleet:cancelled:{request_id}   | string  | TTL CANCEL_MEMORY_TTL_S; consumed by the    |
|                                   |         | worker that claims the request              |
| llmfleet:cancel-id:{cancel_id}    | string  | TTL: the run's deadline; "done" afterwards  |
| llmfleet:cancel-early:{cancel_id} | string  | TTL CANCEL_MEMORY_TTL_S; consumed when the  |
|                                   |         | run with that cancel_id registers           |
| llmfleet:lease:{request_id}       | string  | TTL LEASE_TTL_S, renewed by the worker      |
|                                   |         | running the request                         |
| llmfleet:streamed:{request_id}    | string  | TTL: the request's deadline; set with the   |
|                                   |         | first published chunk                       |
| llmfleet:dead-letter:{model}      | stream  | MAXLEN ~DEAD_LETTER_MAXLEN: envelopes no    |
|                                   |         | worker could decode, with the reason        |
| llmfleet:cancel                   | pub/sub | no storage                                  |
"""

from __future__ import annotations

PREFIX = "llmfleet"

WORKER_GROUP = "workers"  # the consumer group of every request stream

REQUEST_STREAM_MAXLEN = 100_000
REPLY_STREAM_MAXLEN = 100_000
REPLY_STREAM_TTL_S = 60  # refreshed every few seconds by the live gateway
HEARTBEAT_TTL_S = 3
LEASE_TTL_S = 3  # a running request's lease; lapses this long after its worker dies
HEARTBEAT_INTERVAL_S = 1.0
MODEL_MEMORY_TTL_S = 3600

CANCEL_MEMORY_TTL_S = 600  # how long a cancel waits for its run to show up
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_KEEP_BYTES = 64 * 1024  # of a poison envelope, kept for inspection
CANCEL_CHANNEL = f"{PREFIX}:cancel"
ENVELOPE_FIELD = b"e"  # a stream entry's one envelope
# A reply entry that carries the envelopes of several requests (`codec.encode_batch`): one XADD
# per gateway per publish, not one per request. Only for gateways that asked for it
# (`RequestEnvelope.batch_replies`), so gateways older than it keep getting one envelope per entry.
BATCH_FIELD = b"b"


def request_stream(model: str) -> str:
    return f"{PREFIX}:requests:{model}"


def reply_stream(gateway_id: str) -> str:
    return f"{PREFIX}:replies:{gateway_id}"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{worker_id}"


WORKER_KEY_PATTERN = f"{PREFIX}:worker:*"


def model_key(model: str) -> str:
    return f"{PREFIX}:model:{model}"


def run_key(request_id: str) -> str:
    return f"{PREFIX}:run:{request_id}"


def cancelled_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{request_id}"


def cancel_id_key(cancel_id: str) -> str:
    return f"{PREFIX}:cancel-id:{cancel_id}"


def early_cancel_key(cancel_id: str) -> str:
    return f"{PREFIX}:cancel-early:{cancel_id}"


def lease_key(request_id: str) -> str:
    return f"{PREFIX}:lease:{request_id}"


def streamed_key(request_id: str) -> str:
    return f"{PREFIX}:streamed:{request_id}"


def dead_letter_stream(model: str) -> str:
    return f"{PREFIX}:dead-letter:{model}"
