"""The processes' Redis client on a real Redis Cluster keeps the manners of the single-server one.

A bounded pool that waits (redis-py's cluster client would fail at once), connections named after
their process, uvloop's closed-socket error read as a ConnectionError, scripts that survive a
SCRIPT FLUSH through shared pipelines, and pipelines that span nodes. The fleet itself runs on a
cluster in the integration tier with LLMFLEET_TEST_REDIS=cluster.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import uvloop
from redis.crc import key_slot
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import keys, redis_pool
from shared.redis_batch import BatchedRedis
from tests.procs import start_redis_cluster
from tests.test_redis_pool import CLOSED_UNDER_A_WRITE
from tests.topology.servers import require

pytestmark = pytest.mark.topology

PING = b"*1\r\n$4\r\nPING\r\n"


@pytest.fixture(scope="module")
def cluster_url():
    require("redis-server", "redis-cli")
    cluster = start_redis_cluster()
    yield cluster.url
    cluster.stop()


def _run(scenario):
    uvloop.run(scenario())


def test_a_burst_waits_for_permits_instead_of_failing(cluster_url):
    async def scenario():
        client = redis_pool.connect(cluster_url, max_connections=2, wait_s=5, client_name="burst")
        try:
            started = time.monotonic()
            # Each read blocks 200 ms and holds its connection: 10 of them on 2 permits take ~1 s.
            replies = await asyncio.gather(*(client.xread({f"llmfleet:test:{{t}}:{i}": "$"}, block=200)
                                             for i in range(10)))
            assert replies == [[]] * 10 or all(not reply for reply in replies)
            assert time.monotonic() - started >= 0.9
            assert {c["name"] for c in await client.client_list()} == {"burst"}
        finally:
            await client.aclose()

    _run(scenario)


def test_a_command_gives_up_after_wait_s_with_a_connection_error(cluster_url):
    async def scenario():
        client = redis_pool.connect(cluster_url, max_connections=1, wait_s=0.2, client_name="starved")
        try:
            holder = asyncio.create_task(client.xread({"llmfleet:test:{t}": "$"}, block=1000))
            await asyncio.sleep(0.1)
            with pytest.raises(RedisConnectionError, match="No connection available"):
                await client.get("llmfleet:test:{t}:x")
            await holder
        finally:
            await client.aclose()

    _run(scenario)


def test_a_write_to_a_socket_closed_under_it_is_a_connection_error(cluster_url):
    async def scenario():
        client = redis_pool.connect(cluster_url, max_connections=2, wait_s=1, client_name="closed")
        try:
            await client.ping()
            node = client.get_nodes()[0]
            connection = node.acquire_connection()
            await connection.connect()
            connection._writer.transport.abort()  # the socket is gone, as when a node restarts
            with pytest.raises(RedisConnectionError, match=CLOSED_UNDER_A_WRITE):
                await connection.send_packed_command(PING, check_health=False)
            node.release(connection)
        finally:
            await client.aclose()

    _run(scenario)


def test_shared_pipelines_span_nodes_and_scripts_survive_a_flush(cluster_url):
    """Per-request commands of many requests share one pipeline: on a cluster it goes to
    several nodes; a script unknown to a node (NOSCRIPT) is loaded on every primary."""
    async def scenario():
        client = redis_pool.connect(cluster_url, max_connections=8, wait_s=1, client_name="batched")
        batched = BatchedRedis(client)
        sender = asyncio.create_task(batched.run())
        script = batched.register_script("return redis.call('SET', KEYS[1], ARGV[1], 'EX', 60)")
        request_ids = [f"{n:032x}" for n in range(40)]
        try:
            await client.initialize()  # learn the slots
            nodes = {client.get_node_from_key(keys.lease_key(r)).name for r in request_ids}
            assert len(nodes) == 3, "the test's keys must span every node"
            for node in client.get_nodes():
                await client.execute_command("SCRIPT", "FLUSH", target_nodes=node)
            assert await asyncio.gather(*(script(keys=[keys.lease_key(r)], args=["w"]) for r in request_ids)) \
                == [b"OK"] * len(request_ids)
            leased = await asyncio.gather(*(batched.pipeline(transaction=False)
                                            .set(keys.lease_key(r), "w2", nx=True, ex=60)
                                            .getdel(keys.cancelled_key(r))
                                            .exists(keys.streamed_key(r)).execute() for r in request_ids))
            assert leased == [[None, None, 0]] * len(request_ids)  # each already leased by the script
            pipe = client.pipeline(transaction=False)
            for r in request_ids:
                pipe.delete(keys.cancelled_key(r), keys.lease_key(r), keys.streamed_key(r))
            assert await pipe.execute() == [1] * len(request_ids)
        finally:
            sender.cancel()
            await asyncio.gather(sender, return_exceptions=True)
            await client.aclose()

    _run(scenario)


def test_a_cancel_notice_published_on_any_node_reaches_a_subscriber_on_another(cluster_url):
    async def scenario():
        client = redis_pool.connect(cluster_url, max_connections=8, wait_s=1, client_name="pubsub")
        try:
            await client.initialize()  # learn the slots
            subscriber_node = client.get_node_from_key(keys.CANCEL_CHANNEL)
            pubsub = client.pubsub()
            await pubsub.subscribe(keys.CANCEL_CHANNEL)
            assert (await pubsub.get_message(timeout=2))["type"] == "subscribe"
            for node in client.get_nodes():
                await client.execute_command("PUBLISH", keys.CANCEL_CHANNEL, node.name, target_nodes=node)
            received = set()
            while len(received) < 3:
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=2)
                assert message is not None, f"only {received} arrived"
                received.add(message["data"].decode())
            assert received == {node.name for node in client.get_nodes()}
            assert len({node.name for node in client.get_nodes()} - {subscriber_node.name}) == 2
            await pubsub.aclose()
        finally:
            await client.aclose()

    _run(scenario)


def test_every_heartbeat_is_in_one_slot_and_requests_are_not():
    assert len({key_slot(keys.worker_key(f"host-{n}-abc").encode()) for n in range(50)}) == 1
    assert len({key_slot(keys.request_stream(f"model-{n}").encode()) for n in range(50)}) > 40
