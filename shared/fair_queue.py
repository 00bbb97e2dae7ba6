"""Fair share between tenants in the pull model: tickets in the request stream, envelopes in
tenant queues, bound to each other when a worker claims a ticket.

A model's request stream stays the one thing workers block on, count and recover from: every
waiting request has one entry there, so the backlog bound, the gauges, KEDA's scaling, XREADGROUP's
"no idle worker while work waits" and XAUTOCLAIM's recovery of a dead worker's requests all work
as before. What changes is which request an entry stands for:

- An anonymous request (keys off, or fair share turned off) is its own entry, carrying its
  envelope (`keys.ENVELOPE_FIELD`): served in arrival order, one XADD and one XREADGROUP.
- A tenant's request is a *ticket* entry (`keys.TICKET_FIELD`), and its envelope goes to the end of
  its tenant's queue (`keys.tenant_queue`). A queue that was empty joins the end of its
  priority's *new turns* (`keys.tenant_turns(..., new=True)`), which come before the *turns* of
  the queues already waiting: a tenant with nothing queued is owed the next turn, as in start-time
  fair queueing, where a newly active flow starts at the virtual time of the one in service, so
  ahead of every backlogged flow's next request. It takes one turn that way; what else it queued
  waits at the end of the turns like everyone's. Each non-empty queue is in one of the two lists,
  once. `ENQUEUE` does both atomically.
- A worker that claims tickets binds each (`BIND`, atomic) to the head of the first queue in
  turn (new turns first), of the highest priority that has one, and puts that queue at the end of
  its priority's turns if it still holds requests. The binding (`keys.bound_requests`, ticket -> envelope) is kept
  until the ticket is acknowledged, so a ticket reclaimed from a dead worker runs the same
  request again, and binding is idempotent.

- A worker whose slots are all busy may still start a few requests (`--express-slots`): only
  while a queue waits in a new turn, that is a tenant with nothing else queued (`EXPRESS`). Its
  arrival rings the model's doorbell (`keys.new_turn_doorbell`, in `ENQUEUE`), which such a worker
  waits on. A light tenant's request then starts at once instead of at the next slot that frees,
  while a tenant with a backlog waits for its turns as before. Tickets are interchangeable, so the
  ticket an express claim reads is bound like any other (`BIND`: by priority, new turns first).

So tenants of one priority are served in turn (round robin, one request each), whatever their
arrival order: a tenant's single request waits for the next free slot, not behind another
tenant's 1,000 queued requests. `high` is served before `normal` before `low`
(strictly: a lower priority waits while a higher one has requests queued). Tickets are claimed
only by workers with a free slot, so a request is bound at the moment it can start, never queued
on a busy worker. No process schedules: the order lives in Redis and each worker's claim takes
the next turn.

Every key here is of one model, so of one Redis Cluster slot (its `{model}` tag); the tenant
queues named in the turns are reached from inside the scripts, on that same node.
"""

from __future__ import annotations

from shared import keys

PRIORITIES = ("high", "normal", "low")  # served in this order (gateway.tenancy.PRIORITIES)

# KEYS: request stream [, tenant queue, its priority's new turns, the new-turn doorbell]. ARGV: depth
# limit, maxlen, envelope field, envelope [, ticket field, ttl]. With one key, the envelope is the entry
# (arrival order); with four, the entry is a ticket and the envelope waits in its tenant's queue (a
# queue that was empty takes a new turn and rings the doorbell). Returns {accepted, depth}.
ENQUEUE = """
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[1]) then return {0, depth} end
if #KEYS == 1 then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[3], ARGV[4])
  return {1, depth}
end
if redis.call('RPUSH', KEYS[2], ARGV[4]) == 1 then
  redis.call('RPUSH', KEYS[3], KEYS[2])
  redis.call('RPUSH', KEYS[4], 1)
  redis.call('LTRIM', KEYS[4], -1, -1)
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[5], '1')
return {1, depth}
"""

# KEYS: bindings, then the new turns and the turns of each priority, highest first. ARGV: ttl,
# ticket ids.
# Returns the envelope of each ticket: the one bound to it before, else the next in turn ('' when
# no queue holds one: a ticket whose request is gone, which the worker acknowledges).
BIND = """
local out = {}
for i = 2, #ARGV do
  local ticket = ARGV[i]
  local envelope = redis.call('HGET', KEYS[1], ticket)
  if not envelope then
    envelope = ''
    for p = 2, #KEYS do
      local queue = redis.call('LPOP', KEYS[p])
      while queue do
        local head = redis.call('LPOP', queue)
        if head then
          local turns = KEYS[p + (p % 2 == 0 and 1 or 0)]  -- a new turn's queue waits in the turns
          if redis.call('LLEN', queue) > 0 then redis.call('RPUSH', turns, queue) end
          envelope = head
          break
        end
        queue = redis.call('LPOP', KEYS[p])  -- expired or emptied: no longer in turn
      end
      if envelope ~= '' then break end
    end
    if envelope ~= '' then
      redis.call('HSET', KEYS[1], ticket, envelope)
      redis.call('EXPIRE', KEYS[1], ARGV[1])
    end
  end
  out[#out + 1] = envelope
end
return out
"""

# KEYS: request stream, then the new turns of each priority, highest first. ARGV: group, consumer.
# Claims one entry for the consumer if a queue waits in a new turn; returns {stream, entry id,
# fields} triples (none or one), as `shared.affinity.CLAIM`. The worker binds a ticket as any other.
EXPRESS = """
for i = 2, #KEYS do
  if redis.call('LLEN', KEYS[i]) > 0 then
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
    if not got then return {} end
    local entry = got[1][2][1]
    return {{KEYS[1], entry[1], entry[2]}}
  end
end
return {}
"""


def enqueue_keys(model: str, tenant: str, priority: str) -> list[str]:
    """The keys of `ENQUEUE` for a request of `tenant` ("" : anonymous, its own stream entry)."""
    if not tenant:
        return [keys.request_stream(model)]
    priority = priority if priority in PRIORITIES else "normal"
    return [keys.request_stream(model), keys.tenant_queue(model, priority, tenant),
            keys.tenant_turns(model, priority, new=True), keys.new_turn_doorbell(model)]


def enqueue_args(depth_limit: int, envelope: bytes, fair: bool) -> list:
    args = [depth_limit, keys.REQUEST_STREAM_MAXLEN, keys.ENVELOPE_FIELD, envelope]
    return [*args, keys.TICKET_FIELD, keys.FAIR_QUEUE_TTL_S] if fair else args


def bind_keys(model: str) -> list[str]:
    return [keys.bound_requests(model),
            *(keys.tenant_turns(model, p, new) for p in PRIORITIES for new in (True, False))]


def express_keys(model: str) -> list[str]:
    return [keys.request_stream(model), *(keys.tenant_turns(model, p, new=True) for p in PRIORITIES)]
