"""The live worker registry, as each gateway sees it.

Workers write a heartbeat key with a short TTL; a gateway refreshes its view every REFRESH_S
(half a second) by scanning those keys. A model is *served* while some live worker announces it, and *known* while
it is configured on the gateway (`--models`), remembered by this gateway (served within the last
hour), or its `model:{name}` key lives (an hour after the last heartbeat). An unknown model is a
404. A known model with no live worker is queued like any other: its backlog is what wakes a
worker (KEDA scales workers from zero on the request stream's length), and if none starts, the
gateway ends the request with a 503 at its queue timeout and takes it back from the queue
(`Run` and `Fleet._withdraw` in runs.py), as it does any request it gives up on before a worker
claims it: the backlog counts only requests a client still waits for. Remembering served
models keeps a Redis restart (which loses every key) from reading as a 404.

Each heartbeat says which request kinds its worker accepts (chat, completion, tokenize,
detokenize; embed, score, rerank, classify, pooling of an encoder); while a model has live
workers, a request of a kind none of them accepts is refused at once (`check_kind`), never
queued: a 400 when they do the other kind of work (embeddings of a generation model), else a 503.

A worker that dies is noticed sooner than its heartbeat's TTL where its process closed its
connections (a crash, a kill): a run whose worker has been silent for SUSPECT_AFTER_S asks
(`suspect`), and the registry counts at once the subscribers of the worker's presence channel
(`WorkerInfo.presence`, keys.presence_channel: PUBSUB NUMSUB); a worker with none is dead
(`found_gone`). A host that vanishes without closing its connections is noticed at its
heartbeat's lapse, as before. So is every worker while this gateway's own link to Redis is
younger than PRESENCE_TRUST_S (after a restart or a failover, a live worker may not have
subscribed again yet), and on a Redis Cluster, whose nodes count subscribers each for itself.

Each refresh also reads every known model's request stream, and the own stream of each of its
live workers (`shared/affinity.py`), in one pipeline, for the backlog gauges and `/fleet/load`:
requests waiting for a worker and requests running on one. On one server that pipeline shares a
batch with the heartbeats' read (a script: a step of the scan, and the read of what it found): in a
small keyspace a refresh is one round trip while no worker comes or goes, and a second one when the
streams to read changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from gateway import metrics
from shared import keys, redis_pool
from shared.codec import decode
from shared.envelopes import API_NAMES, ENCODER_KINDS, WorkerInfo, work_of
from shared.errors import EnvelopeError, InvalidRequest, ModelNotFound, ServiceUnavailable

log = logging.getLogger(__name__)

REFRESH_S = 0.5  # with the heartbeat TTL and the silence check, bounds how late a dead worker is noticed
GONE_MEMORY_S = 60.0  # a worker found gone is remembered as such this long
PRESENCE_TRUST_S = 5.0  # how long this gateway's link to Redis must have lasted to judge by presence
DRAINED_MEMORY_S = 60.0  # a worker seen draining is remembered as such this long after its last heartbeat
# The context length of a model no live worker announces and this gateway never saw served: the
# gateway cannot check `max_tokens` against it, so it leaves that check to the worker's engine.
UNKNOWN_MAX_MODEL_LEN = 2**31 - 1

# ARGV: a cursor, the heartbeat keys' pattern. One step of the scan of the heartbeat keys: the next cursor,
# and the values of the keys found. In a small keyspace one step is the whole scan, so a refresh is one round
# trip (this and the backlog's reads share a batch), not three; a step is as long as a SCAN's in any keyspace.
_HEARTBEATS = """
local found = redis.call('SCAN', ARGV[1], 'MATCH', ARGV[2], 'COUNT', 500)
local values = {}
if #found[2] > 0 then values = redis.call('MGET', unpack(found[2])) end
return {found[1], values}
"""


@dataclass(slots=True)
class ModelView:
    name: str
    max_model_len: int
    workers: list[WorkerInfo] = field(default_factory=list)
    drain_rate: float = 0.0  # requests answered per second by the fleet, smoothed

    @property
    def capacity(self) -> int:
        return sum(w.capacity for w in self.workers if not w.draining)


@dataclass(slots=True)
class Load:
    """A model's requests in the fleet, from its streams: waiting for a worker, and running on one."""

    waiting: int = 0
    running: int = 0


@dataclass(slots=True)
class _Remembered:
    seen_at: float  # monotonic time this gateway last saw the model served
    max_model_len: int


class WorkerRegistry:
    def __init__(self, redis: aioredis.Redis, configured_models: Iterable[str] = ()):
        self.redis = redis
        # A cluster's client scans each node itself: there, a scan and a read (keys on every node).
        self._read_heartbeats = redis.register_script(_HEARTBEATS) if redis_pool.pipelines_run_in_order(redis) else None
        self.models: dict[str, ModelView] = {}
        self.configured = frozenset(configured_models)
        self._remembered: dict[str, _Remembered] = {}
        self._reported: set[str] = set()  # models with backlog series on /metrics
        self._draining: dict[str, float] = {}  # worker id -> when (monotonic) last seen draining
        self._presence: set[str] = set()  # live workers that hold a presence channel
        self._suspects: set[str] = set()  # workers a run found silent, to look for (`suspect`)
        self._suspected = asyncio.Event()
        self._gone: dict[str, float] = {}  # worker id -> when (monotonic) it was found gone
        self.on_gone: Callable[[], None] = lambda: None  # some worker was found gone: its runs look around
        self.linked_since: Callable[[], float] = time.monotonic  # since when (monotonic) the link to Redis holds
        self.load: dict[str, Load] = {}  # by known model, as of the last refresh
        self._refreshed = 0.0
        self.stopping = asyncio.Event()

    async def refresh(self) -> None:
        # The backlog of the streams known before, read beside the heartbeats (one batch), and read
        # again only if this refresh finds a model or a worker come or gone.
        streams = self._streams()
        values, replies = await asyncio.gather(self._heartbeats(), self._read_backlog(streams))
        models: dict[str, ModelView] = {}
        for value in values:
            if value is None:
                continue
            try:
                info = decode(WorkerInfo, value)
            except EnvelopeError as exc:
                log.warning("ignoring malformed heartbeat: %s", exc)
                continue
            view = models.setdefault(info.model, ModelView(info.model, info.max_model_len))
            view.workers.append(info)
        now = time.monotonic()
        for view in models.values():
            view.drain_rate = self._drain_rate(view, now)
            self._draining.update((w.worker_id, now) for w in view.workers if w.draining)
        self._draining = {w: at for w, at in self._draining.items() if now - at < DRAINED_MEMORY_S}
        self.models = models
        self._presence = {w.worker_id for view in models.values() for w in view.workers if w.presence}
        self._gone = {w: at for w, at in self._gone.items() if now - at < GONE_MEMORY_S}
        self._refreshed = now
        self._remember(now)
        if (now_known := self._streams()) != streams:
            streams, replies = now_known, await self._read_backlog(now_known)
        self._report_backlog(streams, replies)

    async def _heartbeats(self) -> list[bytes | None]:
        """The value of every worker's heartbeat key."""
        if self._read_heartbeats is not None:
            values, cursor = [], 0
            while True:
                cursor, found = await self._read_heartbeats(keys=[], args=[cursor, keys.WORKER_KEY_PATTERN])
                values += found
                if int(cursor) == 0:
                    return values
        names = [key async for key in self.redis.scan_iter(match=keys.WORKER_KEY_PATTERN, count=500)]
        return await self.redis.mget(names) if names else []

    def _remember(self, now: float) -> None:
        self._remembered.update((v.name, _Remembered(now, v.max_model_len)) for v in self.models.values())
        self._remembered = {name: memory for name, memory in self._remembered.items()
                            if now - memory.seen_at < keys.MODEL_MEMORY_TTL_S}

    def _drain_rate(self, view: ModelView, now: float) -> float:
        """Completions per second since the last refresh, by worker counters, smoothed (EWMA)."""
        old = self.models.get(view.name)
        if old is None or now <= self._refreshed:
            return 0.0
        before = {w.worker_id: w.completed for w in old.workers}
        done = sum(w.completed - before[w.worker_id] for w in view.workers if w.worker_id in before)
        return 0.7 * old.drain_rate + 0.3 * max(done, 0) / (now - self._refreshed)

    def _streams(self) -> dict[str, list[str]]:
        """Every known model's request streams: its own, and each of its live workers'."""
        streams = {model: [keys.request_stream(model)] for model in sorted(self.known_models())}
        for model, view in self.models.items():
            streams[model] += [keys.worker_stream(model, w.worker_id) for w in view.workers]
        return streams

    async def _read_backlog(self, streams: dict[str, list[str]]) -> list:
        """The streams' lengths and groups, in one pipeline: what `_report_backlog` reports."""
        if not streams:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for stream in (stream for names in streams.values() for stream in names):
            pipe.xlen(stream)
            pipe.xinfo_groups(stream)
        return await pipe.execute(raise_on_error=False)

    def _report_backlog(self, streams: dict[str, list[str]], replies: list) -> None:
        """Set the backlog and live-worker gauges of every known model from its request streams.

        Answered requests are deleted from a stream, so its length is waiting + running, and the
        group's pending count is running (workers claim only what their free slots can run).
        Redis's own `lag` is not used: it reads NULL whenever a request answered (and deleted)
        after the last claim lies between still-unanswered ones, the usual state of a busy
        stream. A model's figures add its stream's and its live workers' own streams'. Every
        gateway reports the same fleet-wide figures: aggregate with max().
        """
        replies = iter(replies)
        load = {}
        for model, names in streams.items():
            load[model] = Load()
            for _stream in names:
                length, groups = next(replies), next(replies)
                if isinstance(length, ResponseError):
                    continue
                running = _pending(groups)
                load[model].waiting += max(0, length - running)
                load[model].running += running
            metrics.BACKLOG.labels(model, "waiting").set(load[model].waiting)
            metrics.BACKLOG.labels(model, "running").set(load[model].running)
            view = self.models.get(model)
            metrics.LIVE_WORKERS.labels(model).set(len(view.workers) if view else 0)
        for model in set(streams) - self._reported:
            # Rare events' series exist from the start, at 0, so that a rate sees the first event (a
            # series born at 1 shows no increase).
            metrics.MIGRATION_PAUSE.labels(model)
            metrics.WORKERS_FOUND_GONE.labels(model)
        for gone in self._reported - set(streams):
            for series in ((gone, "waiting"), (gone, "running")):
                metrics.BACKLOG.remove(*series)
            metrics.LIVE_WORKERS.remove(gone)
        self._reported = set(streams)
        self.load = load

    async def run(self) -> None:
        """Refresh every REFRESH_S, and look at a suspect's presence channel as soon as a run names one."""
        refresh_at = 0.0
        while not self.stopping.is_set():
            self._suspected.clear()
            try:
                if time.monotonic() >= refresh_at:
                    refresh_at = time.monotonic() + REFRESH_S
                    await self.refresh()
                await self._look_for_suspects()
            except RedisError as exc:
                log.warning("refreshing the worker registry failed: %s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._suspected.wait(), max(0.0, refresh_at - time.monotonic()))

    async def _look_for_suspects(self) -> None:
        """Find the suspects that no longer hold their presence channel: their process is gone."""
        suspects, self._suspects = self._suspects, set()
        if not suspects or time.monotonic() - self.linked_since() < PRESENCE_TRUST_S:
            return
        channels = {keys.presence_channel(w): w for w in suspects}
        counts = await self.redis.pubsub_numsub(*channels)
        now, found = time.monotonic(), False
        for channel, subscribers in counts:
            worker_id = channels[channel.decode() if isinstance(channel, bytes) else channel]
            if subscribers == 0 and worker_id not in self._gone:
                self._gone[worker_id] = now
                model = next((m for m, view in self.models.items() if any(w.worker_id == worker_id
                                                                           for w in view.workers)), "")
                metrics.WORKERS_FOUND_GONE.labels(model).inc()
                log.warning("worker %s of %s is gone: its connections closed", worker_id, model)
                found = True
        if found:
            self.on_gone()

    def suspect(self, worker_id: str) -> None:
        """A run's worker has been silent a while: count its presence channel's subscribers now
        (see `found_gone`)."""
        if worker_id not in self._gone and worker_id in self._presence:
            self._suspects.add(worker_id)
            self._suspected.set()

    def found_gone(self, worker_id: str) -> bool:
        """The worker's presence channel was found without a subscriber: its process died."""
        return worker_id in self._gone

    def stop(self) -> None:
        """End `run` at its next turn."""
        self.stopping.set()
        self._suspected.set()

    def known_models(self) -> set[str]:
        """Models served now, configured on this gateway, or seen served by it within the hour."""
        return set(self.models) | self.configured | set(self._remembered)

    def is_live(self, worker_id: str) -> bool:
        return any(w.worker_id == worker_id for view in self.models.values() for w in view.workers)

    def was_draining(self, worker_id: str) -> bool:
        """The worker was stopping (SIGTERM) when last heard from, within DRAINED_MEMORY_S: it hands
        its long runs to other workers at its deadline, then exits."""
        return worker_id in self._draining

    def note_draining(self, worker_id: str) -> None:
        """The worker said it is stopping (it handed a stream over): a drain shorter than a refresh
        may never show in its heartbeat here."""
        self._draining[worker_id] = time.monotonic()

    def serves(self, model: str) -> bool:
        """Some live worker (draining or not) announces `model`."""
        view = self.models.get(model)
        return view is not None and bool(view.workers)

    def takes_work(self, model: str) -> bool:
        """Some live worker of `model` is not draining: it claims what is queued for the model."""
        view = self.models.get(model)
        return view is not None and any(not w.draining for w in view.workers)

    def kinds_of(self, model: str | None) -> set[str] | None:
        """What the live workers of `model` answer (of the only model served, when none is named, as
        `resolve` reads it), or None when no worker of it is live."""
        view = self.models.get(model) if model is not None else \
            next(iter(self.models.values())) if len(self.models) == 1 else None
        if view is None or not view.workers:
            return None
        return {kind for worker in view.workers for kind in worker.kinds}

    def check_kind(self, model: str, kind: str) -> None:
        """Refuse at once (400 for the other kind of work, else 503) a request of a kind that no live
        worker of `model` accepts: queued, it would wait out its deadline, or be refused by whichever
        worker claimed it. A model with no live worker at all queues every kind, as ever: the worker
        that starts for it may accept it."""
        view = self.models.get(model)
        if view is None or not view.workers or any(kind in w.kinds for w in view.workers):
            return
        accepted = sorted({k for w in view.workers for k in w.kinds})
        # The model cannot do it: the other kind of work, or an encoder task not its own (embed of a classifier).
        if kind in ENCODER_KINDS or not any(k in work_of(kind) for k in accepted):
            raise InvalidRequest(f"The model `{model}` does not support the {API_NAMES.get(kind, kind)} API: it "
                                 f"serves {', '.join(accepted)} requests.", code="kind_not_supported")
        raise ServiceUnavailable(f"No live worker of the model `{model}` accepts {kind} requests (they accept: "
                                 f"{', '.join(accepted)}).", code="kind_not_served")

    async def resolve(self, model: str | None) -> ModelView:
        """The view of `model` to queue a request for, or the error a client should get for it.

        A known model without free workers gets a view too, possibly with no workers at all: its
        requests wait in the queue for a worker to start.
        """
        if model is None and len(self.models) == 1:
            return next(iter(self.models.values()))
        view = self.models.get(model) if model is not None else None
        if view is not None and view.capacity > 0:
            return view
        if model is not None and (view is not None or model in self.configured or model in self._remembered
                                  or await self.redis.exists(keys.model_key(model))):
            return view or self._unserved_view(model)
        raise ModelNotFound(f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _unserved_view(self, model: str) -> ModelView:
        memory = self._remembered.get(model)
        return ModelView(model, memory.max_model_len if memory else UNKNOWN_MAX_MODEL_LEN)


def _pending(groups) -> int:
    """The pending count of the workers' group, from XINFO GROUPS (0 before a worker made it)."""
    if isinstance(groups, ResponseError):  # no such key: no request was ever queued
        return 0
    for group in groups:
        name = group["name"]
        if (name.decode() if isinstance(name, bytes) else name) == keys.WORKER_GROUP:
            return int(group["pending"])
    return 0
