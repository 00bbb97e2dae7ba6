"""Stops that end: a gateway and a worker told to stop (SIGTERM) while Redis hangs (its process
SIGSTOPped: connections stay open, nothing is answered) or is gone (killed) exit within their
grace, with a request in flight on both.

Each side's grace, from its own bounds:
- gateway: `--drain-grace` for open requests, then uvicorn's graceful shutdown (5 s, gateway/main.py),
  then `Fleet.stop` (at most STOP_GRACE_S + 2 * STOP_CANCEL_S + REDIS_CLOSE_S).
- worker: its request ends once its lease may have lapsed (no renewal reaches Redis: LEASE_TTL_S
  less the margin, then ABORT_GRACE_S for the abort), after the claim loop's stop (CLAIM_STOP_S +
  STOP_CANCEL_S); then the loops (STOP_CANCEL_S), deregistering and closing the pool (each bounded,
  plus a second to end a cancelled task).
Before issue #13 a worker waited on a hung Redis for redis-py's retries of each command (5 s read
timeout, 10 retries) in its claim loop and again to deregister: minutes, not seconds.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import httpx
import pytest

from gateway.fleet import runs as fleet
from shared.stopping import CANCEL_WITHIN_S
from tests.procs import Proc, start_gateway, start_redis, start_worker, wait_until_served
from worker import main as worker_main

pytestmark = pytest.mark.integration

DRAIN_GRACE_S = 3.0
UVICORN_GRACEFUL_S = 5.0  # timeout_graceful_shutdown in gateway/main.py
GATEWAY_GRACE_S = (DRAIN_GRACE_S + UVICORN_GRACEFUL_S + fleet.STOP_GRACE_S + 2 * fleet.STOP_CANCEL_S
                   + fleet.REDIS_CLOSE_S)
WORKER_GRACE_S = worker_main.STOP_BOUND_S + 2 * CANCEL_WITHIN_S
SLACK_S = 3.0  # process exit and a loaded machine's scheduling


def _hang(redis: Proc) -> None:
    os.kill(redis.pid, signal.SIGSTOP)


def _kill(redis: Proc) -> None:
    redis.kill()


def _stream_in_background(gateway: Proc, model: str) -> tuple[threading.Thread, threading.Event]:
    """A long streaming request; the event is set once its first tokens arrived (it runs on the worker)."""
    running = threading.Event()
    body = {"model": model, "messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 2000,
            "stream": True}

    def stream() -> None:
        try:
            with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
                for n, _line in enumerate(response.iter_lines()):
                    if n == 4:
                        running.set()
        except httpx.HTTPError:
            pass  # the gateway went away mid-stream: what this test expects, not what it checks

    thread = threading.Thread(target=stream, daemon=True)
    thread.start()
    return thread, running


def _exit_times(procs: list[Proc], limit_s: float) -> dict[str, float]:
    """SIGTERM each process at once; seconds until each exited (those still running after `limit_s` are absent)."""
    started = time.monotonic()
    for proc in procs:
        proc.popen.terminate()
    exited: dict[str, float] = {}
    while len(exited) < len(procs) and time.monotonic() - started < limit_s:
        for proc in procs:
            if proc.name not in exited and not proc.alive():
                exited[proc.name] = time.monotonic() - started
        time.sleep(0.05)
    return exited


@pytest.mark.parametrize("break_redis", [_hang, _kill], ids=["redis-hung", "redis-gone"])
def test_gateway_and_worker_stop_within_their_grace_while_redis_is_broken(break_redis) -> None:
    redis = start_redis()
    model = f"stops-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis.url, model, "--scripted-tokens-per-second", "20")
    gateway = start_gateway(redis.url, "--drain-grace", str(DRAIN_GRACE_S))
    try:
        wait_until_served(gateway, model)
        client, running = _stream_in_background(gateway, model)
        assert running.wait(15), "the request did not start streaming"
        break_redis(redis)
        exited = _exit_times([gateway, worker], max(GATEWAY_GRACE_S, WORKER_GRACE_S) + SLACK_S + 30)
        print(f"{break_redis.__name__}: exited after " + ", ".join(f"{name} {s:.2f}s" for name, s in exited.items())
              + f" (graces: gateway {GATEWAY_GRACE_S:.1f}s, worker {WORKER_GRACE_S:.1f}s)")
        assert exited.get(gateway.name, float("inf")) <= GATEWAY_GRACE_S + SLACK_S, gateway.log()[-3000:]
        assert exited.get(worker.name, float("inf")) <= WORKER_GRACE_S + SLACK_S, worker.log()[-3000:]
        assert worker.popen.returncode == 0, worker.log()[-3000:]
        assert gateway.popen.returncode == 0, gateway.log()[-3000:]
        client.join(10)
        assert not client.is_alive(), "the client's stream did not end when the gateway exited"
    finally:
        if redis.alive():
            os.kill(redis.pid, signal.SIGCONT)
        for proc in (gateway, worker, redis):
            proc.kill()
