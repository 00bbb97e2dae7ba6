"""Cache affinity in the pull model: a conversation's next turn goes to the worker that holds its
prefix in cache, and no worker idles while another's requests wait.

Every worker of a model has a stream of its own beside the model's shared request stream
(`keys.worker_stream`), in the same consumer group. A worker claims (`CLAIM`) the oldest waiting
entries of the two, so requests keep their arrival order: affinity chooses which worker serves a
request, never that it jumps the queue. The gateway chooses where a request goes:

- A request worth caching (a chat whose messages, or a prompt, pass `MIN_PROMPT_CHARS`) has an
  affinity key: a digest of its opening (the messages up to the first user message, which every
  later turn of the conversation repeats; or the prompt's first `PREFIX_CHARS`). Its workers are
  ranked by rendezvous hashing of that key (each worker's digest of key and worker id; the
  highest first), so a key keeps its worker while the fleet changes around it, and only the keys
  of a worker that leaves move.
- `ROUTE` adds the request to the first of its two best-ranked workers' streams that has room: a
  worker's stream holds what it runs of its own plus at most `waiting_allowance(slots)` waiting,
  and fewer than `LOAD_FACTOR` times the two streams' mean (bounded loads: a hot key, or keys that
  happen to rank one worker first, spill to their second worker, then to the shared stream). It
  is one script, so the check and the add are atomic. A request with no key, or no room, goes to the
  shared stream as before (`shared.fair_queue`).
- A worker with a free slot takes (`STEAL`) the entries that have waited `--steal-after-ms` in
  other workers' streams, oldest first. Once it has seen one waiting it takes it when it is due;
  while none waits it does not poll: it waits on the model's doorbell (`keys.affinity_doorbell`,
  BLPOP), rung with each request added to a worker's stream (`ROUTE`, `MOVE`). Each ring wakes one
  idle worker, which looks when that request is due (and once a second when nothing rings). The
  streams that may hold waiting entries are a sorted set (`keys.affinity_waiting`), scored no
  later than their oldest waiting entry: a busy or stopped preferred worker delays a request by
  that much, and never leaves it waiting while another worker has room.
- A request its gateway gives up on before a worker claims it leaves the worker's stream as it
  would the model's (`shared.fair_queue.WITHDRAW`).
- A dead worker's running requests are reclaimed from its stream like the shared stream's (its
  heartbeat's expiry is in `keys.affinity_streams`); its empty stream is then deleted (`FORGET`).

Every key here is of one model, so of one Redis Cluster slot.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import orjson

from shared import keys
from shared.envelopes import RequestEnvelope, WorkerInfo

MIN_PROMPT_CHARS = 1024  # about 256 tokens: shorter prompts gain little from a cached prefix
PREFIX_CHARS = 2048  # of a completion prompt, its affinity key
CANDIDATES = 2  # the preferred worker, then one to spill to
# Bounded loads: a candidate takes the request only while its stream holds fewer than LOAD_FACTOR times
# the candidates' mean (the request included), as consistent hashing with bounded loads (Mirrokni et al.):
# a hot key, or random keys that rank one worker first, cannot pile everything on it. Measured with
# bench.affinity: 1.25 moved conversations between their two workers as loads swung (cache hits 95% -> 92%,
# TTFT p50 gain 2.0-2.3x); 1.5 keeps them (94-95%, 2.2-2.3x); no reuse 1.04-1.11x either way.
LOAD_FACTOR = 1.5


def waiting_allowance(slots: int) -> int:
    """How many requests may wait in a worker's own stream beyond what its slots run."""
    return max(1, slots // 4)


# Lua: the undelivered (waiting) entries of a stream, from its length and its group's pending count.
_WAITING = """
local function group_state(stream, group)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  for _, g in ipairs(groups) do
    local state = {}
    for i = 1, #g, 2 do state[g[i]] = g[i + 1] end
    if state['name'] == group then return state end
  end
  return nil
end
"""

# ring(doorbell, arrival (ms), ttl): wake one idle worker, which takes the request when it is due;
# the doorbell keeps the last ring only.
_RING = """
local function ring(doorbell, arrival, ttl)
  redis.call('RPUSH', doorbell, arrival)
  redis.call('LTRIM', doorbell, -1, -1)
  redis.call('EXPIRE', doorbell, ttl)
end
"""

# KEYS: shared request stream, waiting set, doorbell, candidate streams (best first). ARGV: depth
# limit, maxlen, envelope field, envelope, group, now (ms), ttl, load factor, then each candidate's
# most waiting. Returns {candidate (1-based; 0: none had room, -1: the model's queue is full), depth[, the
# entry id in the candidate's stream]}.
ROUTE = _WAITING + _RING + """
local depth = redis.call('XLEN', KEYS[1])
if depth >= tonumber(ARGV[1]) then return {-1, depth} end
local lengths, total = {}, 1
for i = 4, #KEYS do
  lengths[i] = redis.call('XLEN', KEYS[i])
  total = total + lengths[i]
end
local bound = math.ceil(tonumber(ARGV[8]) * total / (#KEYS - 3))
for i = 4, #KEYS do
  local length = lengths[i]
  local state = length < bound and group_state(KEYS[i], ARGV[5])
  if state and length - state['pending'] < tonumber(ARGV[5 + i]) then
    local id = redis.call('XADD', KEYS[i], 'MAXLEN', '~', ARGV[2], '*', ARGV[3], ARGV[4])
    redis.call('EXPIRE', KEYS[i], ARGV[7])
    redis.call('ZADD', KEYS[2], 'NX', ARGV[6], KEYS[i])
    redis.call('EXPIRE', KEYS[2], ARGV[7])
    ring(KEYS[3], ARGV[6], ARGV[7])
    return {i - 3, depth, id}
  end
end
return {0, depth}
"""

# KEYS: waiting set. ARGV: group, consumer, most entries, now (ms), least wait (ms), own stream.
# Claims for the consumer the entries that waited at least that long in other workers' streams,
# oldest stream first; rescores each stream looked at by its oldest waiting entry, or removes it.
# Returns {{stream, entry id, fields} triples, when the oldest entry still waiting in another
# worker's stream arrived (ms), or -1}.
STEAL = _WAITING + """
local out = {}
local need = tonumber(ARGV[3])
local cutoff = tonumber(ARGV[4]) - tonumber(ARGV[5])
local streams = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', cutoff, 'LIMIT', 0, 8)
for _, stream in ipairs(streams) do
  if stream ~= ARGV[6] then
    local state = group_state(stream, ARGV[1])
    if state == nil then
      redis.call('ZREM', KEYS[1], stream)
    else
      if need > 0 then
        local old = redis.call('XRANGE', stream, '(' .. state['last-delivered-id'], cutoff, 'COUNT', need)
        if #old > 0 then
          local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', #old, 'STREAMS', stream, '>')
          for _, entry in ipairs(got[1][2]) do
            out[#out + 1] = {stream, entry[1], entry[2]}
            need = need - 1
          end
          state = group_state(stream, ARGV[1])
        end
      end
      local nxt = redis.call('XRANGE', stream, '(' .. state['last-delivered-id'], '+', 'COUNT', 1)
      if #nxt == 0 then
        redis.call('ZREM', KEYS[1], stream)
      else
        redis.call('ZADD', KEYS[1], 'XX', string.match(nxt[1][1], '^%d+'), stream)
      end
    end
  end
end
local first = redis.call('ZRANGE', KEYS[1], 0, 1, 'WITHSCORES')
for i = 1, #first, 2 do
  if first[i] ~= ARGV[6] then return {out, first[i + 1]} end
end
return {out, -1}
"""

# KEYS: own stream, model's stream. ARGV: group, consumer, most entries. Claims for the consumer the
# oldest waiting entries of the two streams (entry ids are arrival times); returns {stream, entry
# id, fields} triples, the own stream's first.
CLAIM = _WAITING + """
local function waiting(stream, count)
  local state = group_state(stream, ARGV[1])
  if state == nil then return {} end
  return redis.call('XRANGE', stream, '(' .. state['last-delivered-id'], '+', 'COUNT', count)
end
local function older(a, b)
  local a_ms, a_seq = string.match(a, '^(%d+)-(%d+)$')
  local b_ms, b_seq = string.match(b, '^(%d+)-(%d+)$')
  if #a_ms ~= #b_ms then return #a_ms < #b_ms end
  if a_ms ~= b_ms then return a_ms < b_ms end
  return tonumber(a_seq) < tonumber(b_seq)
end
local count = tonumber(ARGV[3])
local own, shared = waiting(KEYS[1], count), waiting(KEYS[2], count)
local i, j = 1, 1
while i + j - 2 < count and (i <= #own or j <= #shared) do
  if j > #shared or (i <= #own and older(own[i][1], shared[j][1])) then i = i + 1 else j = j + 1 end
end
local out = {}
for n, stream in ipairs({{KEYS[1], i - 1}, {KEYS[2], j - 1}}) do
  if stream[2] > 0 then
    local got = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', stream[2], 'STREAMS', stream[1], '>')
    for _, entry in ipairs(got[1][2]) do out[#out + 1] = {stream[1], entry[1], entry[2]} end
  end
end
return out
"""

# KEYS: the entries' stream, own stream, waiting set, doorbell [, bindings: when the entries are the
# model's stream's]. ARGV: group, now (ms), ttl, maxlen, envelope field, then (entry id, envelope)
# pairs of entries claimed beyond a worker's free slots: each moves to the worker's own stream (a
# ticket's binding goes with it), and the doorbell rings for them as `ROUTE` rings it.
MOVE = _RING + """
for i = 6, #ARGV, 2 do
  redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', ARGV[5], ARGV[i + 1])
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  if KEYS[5] then redis.call('HDEL', KEYS[5], ARGV[i]) end
end
redis.call('EXPIRE', KEYS[2], ARGV[3])
redis.call('ZADD', KEYS[3], 'NX', ARGV[2], KEYS[2])
redis.call('EXPIRE', KEYS[3], ARGV[3])
ring(KEYS[4], ARGV[2], ARGV[3])
"""

# KEYS: doorbell. ARGV: arrival (ms), ttl. Rings again for a request a worker saw waiting and can
# no longer take.
RING = _RING + "ring(KEYS[1], ARGV[1], ARGV[2])"

# KEYS: streams set, a dead worker's stream. Deletes the stream once nothing is left in it.
FORGET = """
if redis.call('XLEN', KEYS[2]) == 0 then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', KEYS[1], KEYS[2])
  return 1
end
return 0
"""


def key_of(envelope: RequestEnvelope) -> bytes | None:
    """The request's affinity key, or None when its prompt is too short to be worth a worker's cache."""
    body = envelope.body
    if envelope.kind == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        opening = next((i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"), 0)
        encoded = orjson.dumps(messages[: opening + 1], option=orjson.OPT_SORT_KEYS)
        if len(encoded) < MIN_PROMPT_CHARS and len(orjson.dumps(messages)) < MIN_PROMPT_CHARS:
            return None
    elif envelope.kind == "completion":
        prompt = body.get("prompt")
        if not isinstance(prompt, str) or len(prompt) < MIN_PROMPT_CHARS:
            return None  # token ids and several prompts: no key
        encoded = prompt[:PREFIX_CHARS].encode()
    else:
        return None
    return hashlib.blake2b(encoded, digest_size=16).digest()


def ranked(key: bytes, workers: Iterable[WorkerInfo]) -> list[WorkerInfo]:
    """The workers in the key's order of preference (rendezvous hashing)."""
    return sorted(workers, reverse=True,
                  key=lambda w: hashlib.blake2b(key + w.worker_id.encode(), digest_size=8).digest())


def route_keys(model: str, streams: list[str]) -> list[str]:
    return [keys.request_stream(model), keys.affinity_waiting(model), keys.affinity_doorbell(model), *streams]


def route_args(depth_limit: int, envelope: bytes, now_ms: int, allowances: list[int]) -> list[Any]:
    return [depth_limit, keys.REQUEST_STREAM_MAXLEN, keys.ENVELOPE_FIELD, envelope, keys.WORKER_GROUP, now_ms,
            keys.AFFINITY_STREAM_TTL_S, LOAD_FACTOR, *allowances]
