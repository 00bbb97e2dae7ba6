"""Per-key limits that hold across every replica, and usage per key and model.

A managed key (`gateway.keys`) may limit its requests per window (`rpm`), tokens per window
(`tpm`, prompt plus completion) and requests in flight (`max_parallel`); the window is a minute
unless the gateway's `--rate-window` says otherwise. The counters live in Redis, so every gateway
reads and writes the same ones, and each check-and-count is one Lua script: two replicas cannot
both take the last request of a window.

Windows slide: each counter is a hash of RATE_SLOTS slots (one second each in a minute), on the
Redis server's clock (every replica agrees on it); a slot's count leaves the window when the slot
does. Requests in flight are a sorted set, request id -> deadline: one that ends is removed when
its run closes (`release`, on every path: `Fleet.submit` failing, a client gone, an answer
complete), and one a crashed gateway never removed is dropped at its deadline.

Tokens. A gateway has no tokenizer (the workers do), so a request's prompt is first charged as an
estimate, a token per 4 characters of its text (OpenAI's rule of thumb for English), and
admission refuses it when that estimate alone exceeds what is left of the window ("a request
whose prompt alone exceeds the remaining budget is refused up front"). The worker's count replaces
the estimate as soon as a chunk carries it (the first chunk of a stream, the answer otherwise).
Completion tokens are charged as the relay sees them (`Grant.count`, from `Run.chunks`), sent
every FLUSH_INTERVAL_S in one batch, and the rest when the run is released: a long stream counts
while it flows, not at its end. Streams already running when a window's tokens run out finish (a
stream cannot be refused half-way), so the tokens served can pass `tpm` by what those streams
generate after it; new requests are refused until the window has room again.

A refusal is a 429 (`RateLimited`, with Retry-After) in the family's error shape. Every answer to
a request that reached admission, refused or not, carries the key's limits in its family's
headers: OpenAI's x-ratelimit-*, or Anthropic's anthropic-ratelimit-* on /v1/messages
(`FrontDoor`, gateway/http/auth.py, adds them to the response's start, from the request's `KeyUse`).

Usage: every admitted request of a managed key, and its prompt and completion tokens (the
worker's counts), are added per model to the key's usage hash in Redis (`llmfleet keys usage`)
and to Prometheus counters labelled by key name (names an operator made: bounded).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from redis.exceptions import RedisError

from gateway import metrics
from gateway.fleet.api_keys import ApiKey
from shared import keys as redis_keys
from shared.envelopes import ENCODER_KINDS, GENERATION_KINDS, GenerationChunk, RequestEnvelope
from shared.errors import ModelNotFound, Overloaded
from shared.redis_batch import BatchedRedis
from shared.stopping import pause

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.1
CHARS_PER_TOKEN = 4
# The kinds whose prompt is charged before the worker counts it: generations, and encodings (their inputs).
ESTIMATED_KINDS = frozenset({*GENERATION_KINDS, *ENCODER_KINDS})
# The fields of a body that hold its prompt: a generation's, and an encoding's inputs and pairs.
PROMPT_FIELDS = ("messages", "prompt", "tools", "input", "query", "documents", "queries", "items", "text_1",
                 "text_2", "data_1", "data_2")

# Shared by both scripts: the current slot on the server's clock, and the live total of a window.
_WINDOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local window = tonumber(ARGV[1])
local slots = tonumber(ARGV[2])
local slot_s = window / slots
local current = math.floor(now / slot_s)
local ttl = math.ceil(window * 2)
local function used(key)  -- {live total, ms until its oldest live count leaves}; drops dead slots
  local total, oldest = 0, nil
  local flat = redis.call('HGETALL', key)
  for i = 1, #flat, 2 do
    local slot = tonumber(flat[i])
    if slot <= current - slots then
      redis.call('HDEL', key, flat[i])
    else
      local n = tonumber(flat[i + 1])
      total = total + n
      if n > 0 and (oldest == nil or slot < oldest) then oldest = slot end
    end
  end
  local reset = 0
  if oldest ~= nil then reset = math.max(0, math.ceil(((oldest + slots) * slot_s - now) * 1000)) end
  return total, reset
end
"""

# KEYS: requests window, tokens window, in flight, usage. ARGV: window s, slots, rpm, tpm, max
# parallel, prompt estimate, request id, deadline (unix s), model, usage ttl.
# Returns {refused by ('' if admitted), requests used, requests reset ms, tokens used, tokens
# reset ms, in flight}; the counts are those after admission.
_ADMIT = _WINDOW + """
local rpm, tpm, parallel = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local estimate = tonumber(ARGV[6])
local requests, requests_reset = used(KEYS[1])
local tokens, tokens_reset = used(KEYS[2])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local running = redis.call('ZCARD', KEYS[3])
local refused = ''
if rpm > 0 and requests + 1 > rpm then refused = 'requests'
elseif tpm > 0 and (tokens >= tpm or tokens + estimate > tpm) then refused = 'tokens'
elseif parallel > 0 and running >= parallel then refused = 'parallel' end
if refused ~= '' then return {refused, requests, requests_reset, tokens, tokens_reset, running} end
redis.call('HINCRBY', KEYS[1], current, 1)
redis.call('EXPIRE', KEYS[1], ttl)
if estimate > 0 then
  redis.call('HINCRBY', KEYS[2], current, estimate)
  redis.call('EXPIRE', KEYS[2], ttl)
end
if requests_reset == 0 then requests_reset = math.ceil(window * 1000) end
if tokens_reset == 0 and estimate > 0 then tokens_reset = math.ceil(window * 1000) end
redis.call('ZADD', KEYS[3], ARGV[8], ARGV[7])
local latest = redis.call('ZRANGE', KEYS[3], -1, -1, 'WITHSCORES')
redis.call('EXPIREAT', KEYS[3], math.ceil(tonumber(latest[2])) + 1)
redis.call('HINCRBY', KEYS[4], 'requests:' .. ARGV[9], 1)
redis.call('EXPIRE', KEYS[4], ARGV[10])
return {'', requests + 1, requests_reset, tokens + estimate, tokens_reset, running + 1}
"""

# KEYS: tokens window, usage, in flight. ARGV: window s, slots, tokens to charge (may be negative:
# an estimate corrected), model, prompt tokens, completion tokens, usage ttl, request id to
# release ('' for none).
_SETTLE = _WINDOW + """
local charge = tonumber(ARGV[3])
if charge ~= 0 then
  redis.call('HINCRBY', KEYS[1], current, charge)
  redis.call('EXPIRE', KEYS[1], ttl)
end
if tonumber(ARGV[5]) ~= 0 then redis.call('HINCRBY', KEYS[2], 'prompt_tokens:' .. ARGV[4], ARGV[5]) end
if tonumber(ARGV[6]) ~= 0 then redis.call('HINCRBY', KEYS[2], 'completion_tokens:' .. ARGV[4], ARGV[6]) end
redis.call('EXPIRE', KEYS[2], ARGV[7])
if ARGV[8] ~= '' then redis.call('ZREM', KEYS[3], ARGV[8]) end
return 1
"""


@dataclass(slots=True)
class KeyUse:
    """A request's managed key, and its limits as the admission found them (for the answer's headers)."""

    key: ApiKey
    limits: list[Limit] = field(default_factory=list)


class RateLimited(Overloaded):
    """A key's limit is reached: a 429 with Retry-After and the x-ratelimit-* headers."""
    code = "rate_limit_exceeded"


@dataclass(slots=True, eq=False)  # eq=False: hashed by identity, kept in a set
class Grant:
    """One admitted request of a managed key: what it was charged, what is still to send."""
    key: ApiKey
    request_id: str
    model: str
    prompt_estimate: int
    prompt_known: bool = False
    completion: int = 0  # completion tokens charged so far
    # Not yet sent to Redis: window charge (may be negative), prompt and completion usage.
    unsent: list[int] = field(default_factory=lambda: [0, 0, 0])
    released: bool = False

    def count(self, chunk: GenerationChunk) -> None:
        """Charge what `chunk` shows was served: the prompt's real size once known, new tokens."""
        usage = chunk.usage
        if usage is not None and not self.prompt_known and (usage.prompt_tokens or chunk.done):
            self.prompt_known = True
            self._charge(usage.prompt_tokens - self.prompt_estimate, usage.prompt_tokens, 0)
        if chunk.done:
            served = usage.completion_tokens if usage is not None else self.completion
            new = max(0, served - self.completion)
        else:
            new = chunk.token_count
        if new:
            self.completion += new
            self._charge(new, 0, new)

    def _charge(self, window: int, prompt: int, completion: int) -> None:
        self.unsent[0] += window
        self.unsent[1] += prompt
        self.unsent[2] += completion
        if prompt:
            metrics.KEY_PROMPT_TOKENS.labels(self.key.name, self.model).inc(prompt)
        if completion:
            metrics.KEY_COMPLETION_TOKENS.labels(self.key.name, self.model).inc(completion)

    def take_unsent(self) -> list[int]:
        unsent, self.unsent = self.unsent, [0, 0, 0]
        return unsent


class RateLimits:
    """The gateway's side of every key's limits: admit, count, release; `run()` sends the counts."""

    def __init__(self, redis: BatchedRedis, window_s: float):
        self.redis = redis
        self.window_s = window_s
        self._admit = redis.register_script(_ADMIT)
        self._settle = redis.register_script(_SETTLE)
        self._running: set[Grant] = set()
        self._busy = asyncio.Event()  # set while requests run (or to stop): `run` has something to send
        self._stopping = asyncio.Event()

    async def admit(self, envelope: RequestEnvelope, use: KeyUse | None) -> Grant | None:
        """Check and count the request against its key's limits (None: no managed key); raise
        ModelNotFound for a model the key may not use, RateLimited past a limit. The limits it
        finds are reported on `use`, for the answer's headers."""
        if use is None:
            return None
        key = use.key
        if key.models and envelope.model not in key.models:
            # As OpenAI answers a model a key has no access to: a 404 that does not say it exists.
            raise ModelNotFound(f"The model `{envelope.model}` does not exist or you do not have access to it.",
                                param="model", code="model_not_found")
        estimate = prompt_estimate(envelope) if envelope.kind in ESTIMATED_KINDS else 0
        refused, requests, requests_reset, tokens, tokens_reset, _running = await self._admit(
            keys=[*redis_keys.rate_keys(key.name), redis_keys.usage_key(key.name)],
            args=[self.window_s, redis_keys.RATE_SLOTS, key.rpm, key.tpm, key.max_parallel, estimate,
                  envelope.request_id, envelope.deadline + 1, envelope.model, redis_keys.USAGE_TTL_S])
        refused = refused.decode() if isinstance(refused, bytes) else refused
        use.limits = [Limit(kind, limit, max(0, limit - used), reset_ms / 1000) for kind, limit, used, reset_ms in
                      (("requests", key.rpm, requests, requests_reset), ("tokens", key.tpm, tokens, tokens_reset))
                      if limit > 0]
        if refused:
            raise _refusal(key, refused, estimate, requests_reset, tokens_reset)
        metrics.KEY_REQUESTS.labels(key.name, envelope.model).inc()
        grant = Grant(key, envelope.request_id, envelope.model, estimate)
        self._running.add(grant)
        self._busy.set()
        return grant

    def release(self, grant: Grant | None) -> Awaitable[None]:
        """The request ended (however): send its last counts and free its place in flight. Once.
        Queued at this call (`BatchedRedis.call_now`): a request of the key that this gateway
        admits after it finds the place free. Awaited: until Redis has it."""
        if grant is None or grant.released:
            return asyncio.sleep(0)
        grant.released = True
        self._running.discard(grant)
        return _logged(self._send(grant, grant.take_unsent(), release=True), grant)

    async def run(self) -> None:
        """Every FLUSH_INTERVAL_S while requests run, send what their streams served since the last
        time; idle, wait for the next request instead of waking for nothing."""
        while not self._stopping.is_set():
            if not self._running:
                self._busy.clear()
                await self._busy.wait()
                continue
            if await pause(self._stopping, FLUSH_INTERVAL_S):
                break
            sends = [self._send(grant, unsent) for grant in list(self._running)
                     if any(unsent := grant.take_unsent())]
            results = await asyncio.gather(*sends, return_exceptions=True)
            for error in results:
                if isinstance(error, Exception):
                    log.warning("counting tokens of running requests failed: %s", error)

    def stop(self) -> None:
        self._stopping.set()
        self._busy.set()

    def _send(self, grant: Grant, unsent: list[int], release: bool = False) -> asyncio.Task:
        """The grant's counts not sent yet (and with `release`, its place in flight freed), queued at this call."""
        window, prompt, completion = unsent
        _requests, tokens_key, in_flight = redis_keys.rate_keys(grant.key.name)
        return self.redis.call_now(self._settle, [tokens_key, redis_keys.usage_key(grant.key.name), in_flight],
                                   [self.window_s, redis_keys.RATE_SLOTS, window, grant.model, prompt, completion,
                                    redis_keys.USAGE_TTL_S, grant.request_id if release else ""])


async def _logged(sent: Awaitable, grant: Grant) -> None:
    try:
        await sent
    except (RedisError, OSError) as exc:  # its place frees itself at its deadline
        log.warning("releasing request %s of key %s failed: %s", grant.request_id, grant.key.name, exc)


def prompt_estimate(envelope: RequestEnvelope) -> int:
    """The prompt's tokens as the gateway guesses them: a token per CHARS_PER_TOKEN characters of
    its text (messages, prompt, tools; an encoding's inputs), a token per token id."""
    body = envelope.body
    chars = sum(_text_chars(body.get(field)) for field in PROMPT_FIELDS)
    return math.ceil(chars / CHARS_PER_TOKEN)


def _text_chars(value) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return CHARS_PER_TOKEN  # a token id
    if isinstance(value, list):
        return sum(_text_chars(item) for item in value)
    if isinstance(value, dict):
        return sum(_text_chars(item) for name, item in value.items() if name not in ("role", "type"))
    return 0


@dataclass(slots=True)
class Limit:
    """One of a key's limits as an answer reports it."""
    kind: str  # requests, tokens
    limit: int
    remaining: int
    reset_s: float  # until the window has room again


def openai_headers(limits: list[Limit]) -> list[tuple[bytes, bytes]]:
    """OpenAI's x-ratelimit-{limit,remaining,reset}-{requests,tokens}: the reset as a duration."""
    return [header for lim in limits for header in (
        (f"x-ratelimit-limit-{lim.kind}".encode(), str(lim.limit).encode()),
        (f"x-ratelimit-remaining-{lim.kind}".encode(), str(lim.remaining).encode()),
        (f"x-ratelimit-reset-{lim.kind}".encode(), duration(lim.reset_s).encode()))]


def anthropic_headers(limits: list[Limit], now: float) -> list[tuple[bytes, bytes]]:
    """Anthropic's anthropic-ratelimit-{requests,tokens}-{limit,remaining,reset}: the reset as an
    RFC 3339 time."""
    return [header for lim in limits for header in (
        (f"anthropic-ratelimit-{lim.kind}-limit".encode(), str(lim.limit).encode()),
        (f"anthropic-ratelimit-{lim.kind}-remaining".encode(), str(lim.remaining).encode()),
        (f"anthropic-ratelimit-{lim.kind}-reset".encode(),
         datetime.fromtimestamp(math.ceil(now + lim.reset_s), UTC).isoformat().replace("+00:00", "Z").encode()))]


def duration(seconds: float) -> str:
    """A reset time as OpenAI writes it: `250ms`, `1.5s`, `6m0s`."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(seconds, 60)
    rest_text = f"{rest:.3f}".rstrip("0").rstrip(".") + "s"
    return f"{int(minutes)}m{rest_text}" if minutes else rest_text


def _refusal(key: ApiKey, refused: str, estimate: int, requests_reset_ms: int,
             tokens_reset_ms: int) -> RateLimited:
    if refused == "requests":
        message = f"Rate limit reached for key `{key.name}`: {key.rpm} requests per window."
        retry_after = requests_reset_ms / 1000
    elif refused == "tokens" and estimate > key.tpm:
        message = (f"Request too large for key `{key.name}`: its prompt (about {estimate} tokens) exceeds the "
                   f"key's limit of {key.tpm} tokens per window.")
        retry_after = tokens_reset_ms / 1000
    elif refused == "tokens":
        message = f"Rate limit reached for key `{key.name}`: {key.tpm} tokens per window."
        retry_after = tokens_reset_ms / 1000
    else:
        message = f"Too many requests in flight for key `{key.name}`: at most {key.max_parallel} at once."
        retry_after = 1.0
    return RateLimited(message, retry_after=retry_after)
