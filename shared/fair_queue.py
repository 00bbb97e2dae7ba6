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
- A gateway that gives up on a request no worker has claimed (its queue timeout, its deadline, its
  client gone) takes it back (`WITHDRAW`, atomic), so the backlog counts only requests someone
  still waits for: an envelope entry leaves its stream (the model's, or a worker's own:
  `shared.affinity`); a tenant's request leaves its queue (and its turn, if that empties the
  queue) together with one waiting ticket, its own if no worker has read it yet, else another:
  tickets are interchangeable, and every waiting ticket must keep an envelope to bind, or each
  later binding would be one off. A request already claimed or bound is left to its worker, which
  drops it unstarted (the gateway's cancel is stashed for it).

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
# queue that was empty takes a new turn and rings the doorbell). Returns {accepted, depth[, entry id]}.
ENQUEUE = """
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[1]) then return {0, depth} end
if #KEYS == 1 then
  return {1, depth, redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[3], ARGV[4])}
end
if redis.call('RPUSH', KEYS[2], ARGV[4]) == 1 then
  redis.call('RPUSH', KEYS[3], KEYS[2])
  redis.call('RPUSH', KEYS[4], 1)
  redis.call('LTRIM', KEYS[4], -1, -1)
  redis.call('EXPIRE', KEYS[4], ARGV[6])
end
redis.call('EXPIRE', KEYS[2], ARGV[6])
redis.call('EXPIRE', KEYS[3], ARGV[6])
return {1, depth, redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[2], '*', ARGV[5], '1')}
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

# KEYS: the stream the request was added to [, its tenant's queue, that priority's new turns, its
# turns]. ARGV: group, the entry id its add returned [, its envelope, ticket field]. Takes back a
# request no worker has claimed: its entry, or (with four keys) its envelope and a waiting ticket,
# its own if still unread, else the newest one unread. Returns 1 if it did; 0 if a worker has it
# (claimed, or bound to some ticket), which ends it itself.
WITHDRAW = """
local function later(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  a_ms, b_ms = tonumber(a_ms), tonumber(b_ms)
  return a_ms > b_ms or (a_ms == b_ms and tonumber(a_seq) > tonumber(b_seq))
end
local read = '0-0'  -- the group's last delivered entry: those after it no worker has read
local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', KEYS[1])
for _, g in ipairs(ok and groups or {}) do
  local state = {}
  for i = 1, #g, 2 do state[g[i]] = g[i + 1] end
  if state['name'] == ARGV[1] then read = state['last-delivered-id'] end
end
local function unread(id)
  return later(id, read) and #redis.call('XRANGE', KEYS[1], id, id) == 1
end
if #KEYS == 1 then
  if not unread(ARGV[2]) then return 0 end
  redis.call('XDEL', KEYS[1], ARGV[2])
  return 1
end
if redis.call('LREM', KEYS[2], 1, ARGV[3]) == 0 then return 0 end  -- bound: a worker has it
if redis.call('LLEN', KEYS[2]) == 0 then  -- an empty queue has no turn
  redis.call('LREM', KEYS[3], 0, KEYS[2])
  redis.call('LREM', KEYS[4], 0, KEYS[2])
end
local ticket = unread(ARGV[2]) and ARGV[2]
local high = '+'
while not ticket do
  local page = redis.call('XREVRANGE', KEYS[1], high, '(' .. read, 'COUNT', 100)
  if #page == 0 then break end  -- none unread: a claimed ticket not bound yet binds none, and is dropped
  for _, entry in ipairs(page) do
    if entry[2][1] == ARGV[4] then ticket = entry[1] break end
  end
  high = '(' .. page[#page][1]
end
if ticket then redis.call('XDEL', KEYS[1], ticket) end
return 1
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


def withdraw_keys(stream: str, model: str = "", tenant: str = "", priority: str = "normal") -> list[str]:
    """The keys of `WITHDRAW` for a request added to `stream`: as an envelope entry, or (`tenant`)
    as a ticket of the model's stream, its envelope in the tenant's queue."""
    if not tenant:
        return [stream]
    priority = priority if priority in PRIORITIES else "normal"
    return [stream, keys.tenant_queue(model, priority, tenant), keys.tenant_turns(model, priority, new=True),
            keys.tenant_turns(model, priority)]


def withdraw_args(entry_id: str, envelope: bytes | None = None) -> list:
    """`WITHDRAW`'s arguments: the entry id the add returned, and for a ticket its request's envelope."""
    args = [keys.WORKER_GROUP, entry_id]
    return args if envelope is None else [*args, envelope, keys.TICKET_FIELD]


def bind_keys(model: str) -> list[str]:
    return [keys.bound_requests(model),
            *(keys.tenant_turns(model, p, new) for p in PRIORITIES for new in (True, False))]


def express_keys(model: str) -> list[str]:
    return [keys.request_stream(model), *(keys.tenant_turns(model, p, new=True) for p in PRIORITIES)]
