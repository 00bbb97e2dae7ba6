"""Every Redis key, stream and channel name llmfleet uses, with its bound.

A name's `{...}` is its Redis Cluster hash tag: Redis hashes only that part to pick the key's
slot, so keys with the same tag live on one node. Each command or script that names several
keys names keys of one tag (one request, one run's cancel_id, one model, or the worker
heartbeats), which is what Redis Cluster requires of it; on a single server the tags are just
part of the name. `<...>` is a placeholder.

| name                                 | type    | bound                                    |
|--------------------------------------|---------|------------------------------------------|
| llmfleet:requests:{<model>}          | stream  | MAXLEN ~REQUEST_STREAM_MAXLEN; entries   |
|                                      |         | are XDEL'd by the worker once answered,  |
|                                      |         | or by the gateway that gave up on one no |
|                                      |         | worker read (`fair_queue.WITHDRAW`)      |
| llmfleet:requests:{<model>}:worker:  | stream  | MAXLEN ~REQUEST_STREAM_MAXLEN, TTL       |
|   <worker_id>                        |         | AFFINITY_STREAM_TTL_S refreshed by its   |
|                                      |         | worker and every XADD; a worker's own    |
|                                      |         | requests (shared/affinity.py), at most   |
|                                      |         | its slots plus a few waiting; XDEL'd as  |
|                                      |         | the model's stream's                     |
| llmfleet:affinity:{<model>}:waiting  | zset    | TTL AFFINITY_STREAM_TTL_S, refreshed;    |
|                                      |         | worker streams that may hold waiting     |
|                                      |         | requests (one member per worker)         |
| llmfleet:affinity:{<model>}:streams  | zset    | TTL AFFINITY_STREAM_TTL_S, refreshed;    |
|                                      |         | worker stream -> its heartbeat's expiry  |
|                                      |         | (one member per worker, dead ones        |
|                                      |         | removed once their stream is empty)      |
| llmfleet:affinity:{<model>}:doorbell | list    | one element (LTRIM), TTL                 |
|                                      |         | AFFINITY_STREAM_TTL_S: rung when a       |
|                                      |         | request is added to a worker's stream;   |
|                                      |         | idle workers wait on it (BLPOP)          |
| llmfleet:dead-letter:{<model>}       | stream  | MAXLEN ~DEAD_LETTER_MAXLEN: envelopes no |
|                                      |         | worker could decode, with the reason     |
| llmfleet:model:{<model>}             | string  | TTL MODEL_MEMORY_TTL_S ("was served      |
|                                      |         | lately")                                 |
| llmfleet:replies:{<gateway_id>}      | stream  | MAXLEN ~REPLY_STREAM_MAXLEN, TTL         |
|                                      |         | refreshed by its gateway; workers never  |
|                                      |         | create it. Replies not on its channel:   |
|                                      |         | a large whole answer, a cluster's, an    |
|                                      |         | older worker's                           |
| llmfleet:worker:{workers}:<worker_id>| string  | TTL HEARTBEAT_TTL_S; one tag for all, so |
|                                      |         | a gateway reads them with one MGET       |
| llmfleet:run:{<request_id>}          | string  | TTL: the request's deadline (its gateway)|
|                                      |         | ; its tenant, checked by a cancel by id; |
|                                      |         | removed with its answer by the worker    |
|                                      |         | (one server), else by its gateway        |
| llmfleet:cancelled:{<request_id>}    | string  | TTL CANCEL_MEMORY_TTL_S; consumed by the |
|                                      |         | worker that claims the request           |
| llmfleet:lease:{<request_id>}        | string  | TTL LEASE_TTL_S, renewed by the worker   |
|                                      |         | running the request                      |
| llmfleet:streamed:{<request_id>}     | string  | TTL CANCEL_MEMORY_TTL_S; set with the    |
|                                      |         | first published chunk                    |
| llmfleet:continuation:{<request_id>} | string  | TTL CONTINUATION_TTL_S; what a stream's  |
|                                      |         | client was sent, for its takeover        |
| llmfleet:takeover:{<model>}:doorbell | list    | at most TAKEOVER_DOORBELL_MAX (LTRIM),   |
|                                      |         | TTL TAKEOVER_DOORBELL_TTL_S: the entries |
|                                      |         | of requests whose worker a gateway saw   |
|                                      |         | gone or a draining worker gave up; a     |
|                                      |         | worker with room pops (BLPOP) and claims |
|                                      |         | them (shared/takeover.py)                |
| llmfleet:cancel-id:{<group>}         | set     | TTL: the longest deadline of its runs;   |
|                                      |         | the runs not finished, and a finished    |
|                                      |         | mark. A group is a tenant's cancel_id or |
|                                      |         | session (`cancel_group`): one tenant's   |
|                                      |         | cancel_id never names another's runs     |
| llmfleet:cancel-early:{<group>}      | string  | TTL CANCEL_MEMORY_TTL_S; consumed when   |
|                                      |         | a run of that group registers            |
| llmfleet:cancel                      | pub/sub | no storage; in a cluster a PUBLISH       |
|                                      |         | reaches the subscribers of every node    |
| llmfleet:presence:<worker_id>        | pub/sub | no storage; its worker subscribes while  |
|                                      |         | it lives, nothing is published           |
| llmfleet:presence:gateway:<gw_id>    | pub/sub | no storage; its gateway subscribes while |
|                                      |         | it lives; workers publish its requests'  |
|                                      |         | replies there (one server only)          |
| llmfleet:events:{<response_id>}      | stream  | MAXLEN ~EVENT_LOG_MAXLEN; TTL: the run's |
|                                      |         | deadline, then the gateway's keep time   |
|                                      |         | once it ended (gateway/serve/resumable.py)       |
| llmfleet:reader:{<response_id>}      | string  | TTL STREAM_READER_TTL_S, refreshed while |
|                                      |         | a client follows the events elsewhere    |
| llmfleet:response:{<response_id>}    | hash    | TTL: the gateway's response store TTL;   |
|                                      |         | a stored Response (gateway/fleet/        |
|                                      |         | responses.py), at most its max bytes     |
| llmfleet:responses:{stored}          | zset    | TTL: the store's TTL, refreshed; at most |
|                                      |         | the store's max entries (oldest evicted, |
|                                      |         | with their hashes)                       |
| llmfleet:queue:{<model>}:<priority>: | list    | TTL FAIR_QUEUE_TTL_S, refreshed; one     |
|   <tenant>                           |         | envelope per ticket in the request stream|
|                                      |         | (so at most its length): a tenant's      |
|                                      |         | waiting requests (shared/fair_queue.py); |
|                                      |         | one withdrawn leaves with a ticket       |
| llmfleet:turns:{<model>}:<priority>  | list    | TTL FAIR_QUEUE_TTL_S, refreshed; the     |
|   [:new]                             |         | tenant queues not empty, each in one of  |
|                                      |         | the two once                             |
| llmfleet:bound:{<model>}             | hash    | TTL FAIR_QUEUE_TTL_S, refreshed; ticket  |
|                                      |         | -> envelope while claimed, HDEL'd with   |
|                                      |         | the ticket's XACK (at most its pending)  |
| llmfleet:turns:{<model>}:doorbell    | list    | one element (LTRIM), TTL                 |
|                                      |         | FAIR_QUEUE_TTL_S: rung when a tenant     |
|                                      |         | queue joins the new turns; busy workers  |
|                                      |         | with an express slot wait on it (BLPOP)  |
| llmfleet:key:{<name>}                | hash    | TTL: the key's lifetime (`llmfleet keys  |
|                                      |         | create --expires-in`); a managed API key |
|                                      |         | (gateway/fleet/api_keys.py), its secret's SHA-256  |
| llmfleet:key-digest:{<sha256>}       | string  | TTL: as its key; digest -> key name      |
| llmfleet:rate:{<name>}:requests      | hash    | TTL 2 rate windows, refreshed; requests  |
| llmfleet:rate:{<name>}:tokens        | hash    | per slot of the window (RATE_SLOTS at    |
|                                      |         | most: older slots are deleted as read)   |
| llmfleet:rate:{<name>}:inflight      | zset    | TTL: the latest deadline in it; request  |
|                                      |         | -> deadline, ZREM'd when it ends (an     |
|                                      |         | entry past its deadline is dropped)      |
| llmfleet:usage:{<name>}              | hash    | TTL USAGE_TTL_S, refreshed; requests and |
|                                      |         | tokens per model (one field per counter) |
| llmfleet:session:{<session_id>}      | hash    | TTL: the gateway's session TTL, renewed  |
|                                      |         | by each turn; a session's facts          |
|                                      |         | (gateway/fleet/sessions.py)                    |
| llmfleet:session:{<session_id>}      | list    | TTL: as its session; one JSON message    |
|   :messages                          |         | each, at most the session's max messages |
|                                      |         | and bytes (checked before each turn)     |
| llmfleet:session:{<session_id>}:turn | string  | TTL: the turn's deadline; the one turn   |
|                                      |         | running, deleted when it is stored       |
| llmfleet:sessions:{sessions}         | zset    | TTL: the session TTL, refreshed; by last |
|                                      |         | use, at most the max sessions (the least |
|                                      |         | recently used evicted, with their keys)  |
| llmfleet:snapshot:{<snapshot_id>}    | hash    | TTL: the snapshot TTL; a saved transcript|
| llmfleet:snapshots:{snapshots}       | zset    | TTL: the snapshot TTL, refreshed; at most|
|                                      |         | the max snapshots (oldest evicted)       |

The keys that share a slot, and the operation that needs it:
- `{<model>}`: a poison entry's XADD to the dead letters, XACK and XDEL, in order on one node;
  the fair-share scripts (`shared/fair_queue.py`), which add a ticket and queue its envelope,
  bind a claimed ticket to the envelope whose turn it is, and withdraw a request no worker has
  claimed (its entry, or its envelope, its turn and a ticket), each in one step; the affinity scripts
  (`shared/affinity.py`), which add to a worker's own stream or take another's waiting entries,
  and a worker's one XREADGROUP of its own stream and its model's.
- `{<request_id>}`: the worker's lease/cancel-stash/streamed check, and the one DEL of all three
  when the request ends.
- `{<group>}`: the register, finish and cancel-by-group scripts (`gateway/fleet/cancels.py`).
- `{workers}`: the registry's MGET of every heartbeat.
- `{<name>}` (an API key's): the admission and settling scripts of its limits and usage
  (`gateway/fleet/rate_limits.py`).
- `{<session_id>}`: the session scripts (`gateway/fleet/sessions.py`): a turn's lock, its end (the
  messages appended and the lock released in one step), rollback and a snapshot's load.
Commands on keys of different tags share pipelines, never a command or a script.
"""

from __future__ import annotations

import hashlib

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
CONTINUATION_TTL_S = 60  # a continuation's state: long enough for a takeover to read it
TAKEOVER_DOORBELL_TTL_S = 30  # a takeover not popped by then is left to the workers' reclaim sweeps
TAKEOVER_DOORBELL_MAX = 10_000
DEAD_LETTER_MAXLEN = 10_000
DEAD_LETTER_KEEP_BYTES = 64 * 1024  # of a poison envelope, kept for inspection
CANCEL_CHANNEL = f"{PREFIX}:cancel"
# A response's events kept for a client that reconnects (gateway/serve/resumable.py): past this many,
# the oldest go, and a resume from before them gets a 404.
EVENT_LOG_MAXLEN = 20_000
STREAM_READER_TTL_S = 3  # a follower on another replica refreshes it every second
ENVELOPE_FIELD = b"e"  # a stream entry's one envelope
# A reply entry that carries the envelopes of several requests (`codec.encode_batch`): one XADD
# per gateway per publish, not one per request. Only for gateways that asked for it
# (`RequestEnvelope.batch_replies`), so gateways older than it keep getting one envelope per entry.
BATCH_FIELD = b"b"
# A request stream entry that stands for one request of a tenant's queue, bound to the request
# whose turn it is when a worker claims it (shared/fair_queue.py).
TICKET_FIELD = b"t"
FAIR_QUEUE_TTL_S = 24 * 3600  # of the tenant queues, turns and bindings; refreshed by every write
# Of a worker's own stream and the affinity sets: a dead worker's stream is emptied by the others
# long before (its waiting entries after a few milliseconds, its running ones after --claim-idle).
AFFINITY_STREAM_TTL_S = 3600


def _tag(value: str) -> str:
    """`{value}`: the hash tag that puts every key of `value` in one cluster slot.

    Redis ignores an empty tag (it hashes the whole key instead), which a value starting with
    `}` would make: such a value is tagged with a digest of itself, `{digest}value:`. Names stay
    distinct: the part of an ordinary value ends in `}`, that of a digest-tagged one in `:`.
    """
    if not value or value[0] == "}":
        return "{" + hashlib.sha1(value.encode(), usedforsecurity=False).hexdigest()[:16] + "}" + value + ":"
    return "{" + value + "}"


def request_stream(model: str) -> str:
    return f"{PREFIX}:requests:{_tag(model)}"


def dead_letter_stream(model: str) -> str:
    return f"{PREFIX}:dead-letter:{_tag(model)}"


def model_key(model: str) -> str:
    return f"{PREFIX}:model:{_tag(model)}"


def reply_stream(gateway_id: str) -> str:
    return f"{PREFIX}:replies:{_tag(gateway_id)}"


WORKER_KEY_PATTERN = f"{PREFIX}:worker:{{workers}}:*"


def worker_stream(model: str, worker_id: str) -> str:
    return f"{request_stream(model)}:worker:{worker_id}"


def affinity_waiting(model: str) -> str:
    return f"{PREFIX}:affinity:{_tag(model)}:waiting"


def affinity_streams(model: str) -> str:
    return f"{PREFIX}:affinity:{_tag(model)}:streams"


def affinity_doorbell(model: str) -> str:
    return f"{PREFIX}:affinity:{_tag(model)}:doorbell"


def worker_key(worker_id: str) -> str:
    return f"{PREFIX}:worker:{{workers}}:{worker_id}"


def run_key(request_id: str) -> str:
    return f"{PREFIX}:run:{_tag(request_id)}"


def cancelled_key(request_id: str) -> str:
    return f"{PREFIX}:cancelled:{_tag(request_id)}"


# KEYS[1]: a request's lease; ARGV[1]: a worker id. Gives the lease up if that worker holds it (its
# own at a drain's hand-over, or a gone worker's taken back by a gateway), never another's.
RELEASE_LEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def lease_key(request_id: str) -> str:
    return f"{PREFIX}:lease:{_tag(request_id)}"


def streamed_key(request_id: str) -> str:
    return f"{PREFIX}:streamed:{_tag(request_id)}"


def continuation_key(request_id: str) -> str:
    """What a stream's client was sent when its worker was lost (`envelopes.Continuation`), for the
    worker that takes it over; written by its gateway, CONTINUATION_TTL_S."""
    return f"{PREFIX}:continuation:{_tag(request_id)}"


def takeover_doorbell(model: str) -> str:
    """The entries ("<stream> <entry id>") of requests whose worker a gateway saw gone or a draining
    worker gave up, for a worker of the model with room to claim at once (shared/takeover.py)."""
    return f"{PREFIX}:takeover:{_tag(model)}:doorbell"


def presence_channel(worker_id: str) -> str:
    """A channel its worker subscribes to while its process lives (WorkerInfo.presence); nothing is
    published there: a dead process's connection, and its subscription, are gone at once."""
    return f"{PREFIX}:presence:{worker_id}"


# How long a gateway's presence channel must have had no subscriber, every time it was counted, before
# the gateway is taken for gone: its requests are stopped (worker/cancels.py), and followers of the runs it
# relayed end (gateway/serve/resumable.py). A gateway subscribes again within a second of Redis coming back.
GATEWAY_GONE_S = 2.0


def gateway_presence_channel(gateway_id: str) -> str:
    """A channel its gateway subscribes to while its process lives (RequestEnvelope.gateway_presence):
    a worker whose running request's gateway has none left stops it, since nobody reads its replies.
    The workers publish the replies there too (RequestEnvelope.reply_channel)."""
    return f"{PREFIX}:presence:gateway:{gateway_id}"


def cancel_group(tenant: str, *, cancel_id: str | None = None, session_id: str | None = None) -> str:
    """The cancel group of a tenant's `cancel_id`, or of its session: the runs a cancel by that
    name stops. A tenant's name holds no `/` (gateway/fleet/api_keys.py NAME), so no two tenants' groups, and
    no cancel_id and session of one tenant, share a name."""
    if cancel_id is not None:
        return f"{tenant}/c/{cancel_id}"
    assert session_id is not None
    return f"{tenant}/s/{session_id}"


def cancel_id_key(group: str) -> str:
    return f"{PREFIX}:cancel-id:{_tag(group)}"


def early_cancel_key(group: str) -> str:
    return f"{PREFIX}:cancel-early:{_tag(group)}"


def response_key(response_id: str) -> str:
    return f"{PREFIX}:response:{_tag(response_id)}"


RESPONSE_INDEX = f"{PREFIX}:responses:{{stored}}"  # the stored responses by time, for the store's bound


def event_log_key(response_id: str) -> str:
    return f"{PREFIX}:events:{_tag(response_id)}"


def stream_reader_key(response_id: str) -> str:
    return f"{PREFIX}:reader:{_tag(response_id)}"


def tenant_queue(model: str, priority: str, tenant: str) -> str:
    return f"{PREFIX}:queue:{_tag(model)}:{priority}:{tenant}"


def tenant_turns(model: str, priority: str, new: bool = False) -> str:
    return f"{PREFIX}:turns:{_tag(model)}:{priority}" + (":new" if new else "")


def new_turn_doorbell(model: str) -> str:
    return f"{PREFIX}:turns:{_tag(model)}:doorbell"


def bound_requests(model: str) -> str:
    return f"{PREFIX}:bound:{_tag(model)}"


# Managed API keys (gateway/fleet/api_keys.py) and their limits and usage (gateway/fleet/rate_limits.py). A key's
# name is its tag: its rate windows, requests in flight and usage live on one node.
API_KEY_RECORD_PATTERN = f"{PREFIX}:key:*"
USAGE_PATTERN = f"{PREFIX}:usage:*"
USAGE_TTL_S = 400 * 24 * 3600  # refreshed by every request of the key
RATE_SLOTS = 60  # a rate window's slots: a count leaves the window one slot at a time


def api_key_record(name: str) -> str:
    return f"{PREFIX}:key:{_tag(name)}"


def api_key_digest(digest: str) -> str:
    return f"{PREFIX}:key-digest:{_tag(digest)}"


def rate_keys(name: str) -> list[str]:
    """An API key's request window, token window and requests in flight, in that order."""
    tag = _tag(name)
    return [f"{PREFIX}:rate:{tag}:requests", f"{PREFIX}:rate:{tag}:tokens", f"{PREFIX}:rate:{tag}:inflight"]


def usage_key(name: str) -> str:
    return f"{PREFIX}:usage:{_tag(name)}"


# Sessions and their snapshots (gateway/fleet/sessions.py): a session's keys share its id's tag, so
# its scripts run on one node.
SESSION_INDEX = f"{PREFIX}:sessions:{{sessions}}"  # session ids by last use, for the bound
SNAPSHOT_INDEX = f"{PREFIX}:snapshots:{{snapshots}}"  # snapshot ids by creation, for the bound


def session_keys(session_id: str) -> list[str]:
    """A session's facts, its messages and its running turn, in that order."""
    base = f"{PREFIX}:session:{_tag(session_id)}"
    return [base, base + ":messages", base + ":turn"]


def snapshot_key(snapshot_id: str) -> str:
    return f"{PREFIX}:snapshot:{_tag(snapshot_id)}"
