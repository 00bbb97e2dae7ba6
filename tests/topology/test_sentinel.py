"""Sentinel failover under load: the primary is SIGKILLed while a gateway and a scripted worker
serve a steady stream of requests through a `redis+sentinel://` URL.

Nobody restarts or reconfigures anything: once the Sentinels promote the replica
(`+switch-master`), the fleet must serve again within 10 s. Requests caught by the outage may
fail, but only with a clear 503 (before the first byte) or an error event (after it), never a
500 or a hang.
"""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass
from typing import Self

import httpx
import pytest
import redis
import uvloop

from shared import redis_pool
from tests.procs import start_gateway, start_worker, wait_for, wait_until_served
from tests.test_redis_pool import CLOSED_UNDER_A_WRITE
from tests.topology.servers import SentinelSet, expected_text, require, start_sentinel_set

pytestmark = [pytest.mark.topology, pytest.mark.integration]

MODEL = "sentinel-model"
HEAL_LIMIT_S = 10.0
CLIENTS = 6
WORDS, MAX_TOKENS = "failover under load", 20


@pytest.fixture
def sentinels(tmp_path):
    require("redis-server", "redis-sentinel")
    found = start_sentinel_set(tmp_path)
    yield found
    found.stop()


@dataclass
class Outcome:
    started: float
    ended: float
    kind: str  # "ok", or what went wrong


def _one_request(client: httpx.Client, url: str) -> str:
    """Stream one chat completion; "ok" if its text is whole, else the kind of failure."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": WORDS}], "max_tokens": MAX_TOKENS,
            "stream": True}
    try:
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                response.read()
                return f"HTTP {response.status_code} {response.json()['error'].get('code')}"
            text = ""
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return f"error event {event['error'].get('code')}"
                text += "".join(choice["delta"].get("content") or "" for choice in event["choices"])
            return "ok" if text == expected_text(WORDS, MAX_TOKENS) else "wrong text"
    except httpx.HTTPError as exc:
        return f"client {type(exc).__name__}"


class Load:
    """`CLIENTS` threads sending requests back to back until stopped, recording each outcome."""

    def __init__(self, gateway_url: str):
        self.url = f"{gateway_url}/v1/chat/completions"
        self.outcomes: list[Outcome] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(CLIENTS)]

    def _client(self) -> None:
        with httpx.Client(timeout=60) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                kind = _one_request(client, self.url)
                self.outcomes.append(Outcome(started, time.monotonic(), kind))
                if kind != "ok":
                    time.sleep(0.05)  # a failing gateway answers at once: do not spin

    def __enter__(self) -> Self:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(90)
            assert not thread.is_alive(), "a request hung"


def _watch_switch(found: SentinelSet) -> dict:
    """Note the monotonic time of the first `+switch-master` a Sentinel announces."""
    seen = {}
    pubsub = found.sentinel_client().pubsub()
    pubsub.subscribe("+switch-master")

    def follow():
        for message in pubsub.listen():
            if message["type"] == "message":
                seen["at"] = time.monotonic()
                seen["message"] = message["data"].decode()
                pubsub.close()
                return

    threading.Thread(target=follow, daemon=True).start()
    wait_for(lambda: pubsub.subscribed, 5, "the +switch-master subscription")
    return seen


def test_the_fleet_heals_by_itself_after_a_failover(sentinels):
    worker = start_worker(sentinels.url, MODEL, "--scripted-tokens-per-second", "400", "--max-concurrency", "32")
    gateway = start_gateway(sentinels.url)
    try:
        wait_until_served(gateway, MODEL)
        switch = _watch_switch(sentinels)
        with Load(gateway.url) as load:
            wait_for(lambda: sum(o.kind == "ok" for o in load.outcomes) >= 20, 30, "steady load")
            killed_at = time.monotonic()
            sentinels.primary.kill()  # SIGKILL, by PID
            wait_for(lambda: "at" in switch, 60, "Sentinel to promote the replica", interval=0.1)
            wait_for(lambda: any(o.kind == "ok" and o.started > switch["at"] for o in load.outcomes), HEAL_LIMIT_S + 5,
                     "a request to succeed after the failover", interval=0.1)
            healed_at = min(o.ended for o in load.outcomes if o.kind == "ok" and o.started > switch["at"])
            steady_from = time.monotonic()
            wait_for(lambda: sum(o.started > steady_from for o in load.outcomes) >= 30, 30, "load after healing")
        _report(load.outcomes, killed_at, switch, healed_at)
        assert healed_at - switch["at"] <= HEAL_LIMIT_S
        after = [o.kind for o in load.outcomes if o.started > steady_from]
        assert after and all(kind == "ok" for kind in after), collections.Counter(after)
        for outcome in load.outcomes:
            assert outcome.kind == "ok" or outcome.kind.startswith(("HTTP 503", "error event")), outcome
        assert switch["message"].split()[-1] == str(sentinels.replica.extra["port"])
    finally:
        gateway.stop()
        assert worker.stop(timeout=60) == 0, worker.log()[-3000:]


def _report(outcomes: list[Outcome], killed_at: float, switch: dict, healed_at: float) -> None:
    phases = {"before the kill": (0, killed_at), "kill to +switch-master": (killed_at, switch["at"]),
              "after +switch-master": (switch["at"], float("inf"))}
    print(f"\nSentinel promoted the replica {switch['at'] - killed_at:.1f}s after the kill; the first request "
          f"started after it succeeded {healed_at - switch['at']:.2f}s after +switch-master")
    for phase, (start, end) in phases.items():
        counts = collections.Counter(o.kind for o in outcomes if start <= o.started < end)
        print(f"  requests started {phase}: {dict(counts)}")


def test_the_sentinel_pool_keeps_the_manners_of_the_single_server_one(sentinels):
    """A command waits for one of `max_connections`, then gives up with a ConnectionError;
    connections are named; uvloop's write to a closed socket is a ConnectionError."""
    async def scenario():
        client = redis_pool.connect(sentinels.url, max_connections=2, wait_s=0.3, client_name="bounded")
        try:
            blocking = [asyncio.create_task(client.blpop(["llmfleet:test:nothing"], timeout=1)) for _ in range(2)]
            await asyncio.sleep(0.2)
            started = time.monotonic()
            with pytest.raises(redis.ConnectionError, match="No connection available"):
                await client.ping()
            assert 0.25 < time.monotonic() - started < 1.0
            await asyncio.gather(*blocking)
            assert await client.client_getname() == "bounded"
            connection = await client.connection_pool.get_connection()
            try:
                connection._writer.transport.abort()  # the socket is gone, as when the primary dies
                with pytest.raises(redis.ConnectionError, match=CLOSED_UNDER_A_WRITE):
                    await connection.send_packed_command(b"*1\r\n$4\r\nPING\r\n", check_health=False)
            finally:
                await client.connection_pool.release(connection)
        finally:
            await client.aclose()

    uvloop.run(scenario())
