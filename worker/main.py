"""The worker process: load an engine, then claim and run requests until SIGTERM.

SIGTERM or SIGINT stops claiming; in-flight requests finish, the heartbeat is removed, and the
process exits 0. Every step of the stop is bounded (`RequestConsumer.run`): a slow or vanished
Redis delays the exit by seconds, never for ever.
"""

from __future__ import annotations

import asyncio
import logging
import signal

from prometheus_client import start_http_server
from redis.exceptions import RedisError

from shared import redis_pool, tracing
from shared.stopping import within
from worker.adapter import GenerationAdapter
from worker.consumer import RequestConsumer, new_worker_id

log = logging.getLogger(__name__)

REDIS_CONNECTIONS = 32
REDIS_POOL_WAIT_S = 10.0
REDIS_CLOSE_S = 2.0


async def serve(adapter: GenerationAdapter, redis_url: str, max_concurrency: int, metrics_port: int = 0,
                claim_idle_s: float = 3.0, kinds: tuple[str, ...] = (), steal_after_s: float = 0.01,
                express_slots: int = 0, log_requests: bool = False) -> None:
    await adapter.start()
    if tracing.setup("llmfleet-worker"):
        log.info("tracing on (OpenTelemetry)")
    if metrics_port:
        start_http_server(metrics_port)
    # A handful of connections suffice: claims, cancels, replies, heartbeat, the batch of per-request commands.
    worker_id = new_worker_id()
    redis = redis_pool.connect(redis_url, max_connections=REDIS_CONNECTIONS, wait_s=REDIS_POOL_WAIT_S,
                               client_name=worker_id)
    consumer = RequestConsumer(redis, adapter, max_concurrency, worker_id, claim_idle_s=claim_idle_s, kinds=kinds,
                               steal_after_s=steal_after_s, express_slots=express_slots, log_requests=log_requests)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, consumer.stop)
    log.info("worker %s serving %s (max concurrency %d; %s requests)", consumer.worker_id,
             adapter.served_model_name, max_concurrency, ", ".join(consumer.kinds))
    try:
        await consumer.run()
    finally:
        try:
            await within(REDIS_CLOSE_S, redis.aclose(), "closing the worker's Redis pool")
        except (TimeoutError, RedisError, OSError) as exc:
            log.warning("closing the Redis pool failed: %s", exc)
        await adapter.shutdown()
    if consumer.fatal is not None:
        raise SystemExit(f"worker {consumer.worker_id} stopped: the engine died ({consumer.fatal})")
    log.info("worker %s stopped", consumer.worker_id)
