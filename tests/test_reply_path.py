"""The reply path on a real Redis: a worker's `ReplyPublisher` → a gateway's channel or reply
stream → its `ReplyRouter`, without processes in between: batched entries, old gateways, acks,
malformed data, a channel lost or gone quiet."""

from __future__ import annotations

import asyncio
import contextlib
import io
import uuid

import msgpack
import msgspec
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from gateway import metrics
from gateway.fleet.relay import READ_BLOCK_MS, ReplyRouter
from shared import keys
from shared.codec import decode, decode_batch, encode, encode_batch
from shared.envelopes import ChunkEnvelope, GenerationChunk, RequestEnvelope
from shared.redis_direct import Subscription
from worker.publisher import CHANNEL_ANSWER_LIMIT_BYTES, ReplyPublisher


def _request(gateway_id: str, batch: bool) -> RequestEnvelope:
    return RequestEnvelope(request_id=uuid.uuid4().hex, model="m", kind="chat", reply_to=keys.reply_stream(gateway_id),
                           arrival=0.0, stream=True, batch_replies=batch)


@contextlib.asynccontextmanager
async def reading(*routers: ReplyRouter):
    """Routers reading their reply streams (made, and read from their end on)."""
    async with running(*routers):
        for router in routers:
            await asyncio.wait_for(router.connected.wait(), 5)
        yield


STOP_WITHIN_S = 5.0  # a router sees its stop within one blocking read (1 s); a publisher at once


@contextlib.asynccontextmanager
async def running(*loops: ReplyRouter | ReplyPublisher):
    """Each loop's `run()` as a task. On the way out each is stopped through its stop event, not
    cancelled, and waited for STOP_WITHIN_S at most: a loop that does not end fails the test, saying
    where it sits, instead of hanging it."""
    tasks = [asyncio.create_task(loop.run(), name=type(loop).__name__) for loop in loops]
    try:
        yield
    finally:
        for loop in loops:
            loop.stop()
        _done, pending = await asyncio.wait(tasks, timeout=STOP_WITHIN_S)
        where = io.StringIO()
        for task in pending:
            task.print_stack(file=where)
            task.cancel()  # the test fails below; this only spares the rest of the session the task
        assert not pending, f"still running {STOP_WITHIN_S}s after stop():\n{where.getvalue()}"
        for task in tasks:
            task.result()  # a loop that failed fails the test


async def _entries(redis: aioredis.Redis, stream: str) -> list[dict[bytes, bytes]]:
    return [fields for _id, fields in await redis.xrange(stream) if b"hello" not in fields]


async def test_envelopes_for_one_gateway_share_an_entry_and_old_gateways_get_one_each(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    batching, old = uuid.uuid4().hex, uuid.uuid4().hex
    routers = {gateway: ReplyRouter(redis, gateway) for gateway in (batching, old)}
    requests = [_request(batching, True), _request(batching, True), _request(batching, True), _request(old, False),
                _request(old, False)]
    queues = [routers[batching if r.batch_replies else old].open(r.request_id) for r in requests]
    publisher = ReplyPublisher(redis, "w1")
    for i, request in enumerate(requests):  # all queued before the publisher's first turn: one write
        publisher.publish(request, GenerationChunk(text=f"t{i}", token_count=1))

    async with reading(*routers.values()), running(publisher):
        received = [await asyncio.wait_for(queue.get(), 5) for queue in queues]

    assert [(e.request_id, e.seq, e.worker_id, e.chunks[0].text) for e in received] == [
        (r.request_id, 0, "w1", f"t{i}") for i, r in enumerate(requests)]
    batched = await _entries(redis, keys.reply_stream(batching))
    assert [set(fields) for fields in batched] == [{keys.BATCH_FIELD}]
    assert [decode(ChunkEnvelope, d).request_id for d in decode_batch(batched[0][keys.BATCH_FIELD])] == [
        r.request_id for r in requests[:3]]
    assert [set(fields) for fields in await _entries(redis, keys.reply_stream(old))] == [{keys.ENVELOPE_FIELD}] * 2
    for request in requests:  # their first output is out: a rescuer must not run them again
        assert await redis.exists(keys.streamed_key(request.request_id))
        await redis.delete(keys.streamed_key(request.request_id))
    await redis.delete(*(keys.reply_stream(g) for g in routers))
    await redis.aclose()


async def test_terminal_chunks_acknowledge_their_requests_after_their_entry(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    gateway = uuid.uuid4().hex
    router = ReplyRouter(redis, gateway)
    stream = f"test:requests:{gateway}"
    await redis.xgroup_create(stream, keys.WORKER_GROUP, id="0", mkstream=True)
    await redis.expire(stream, 60)
    requests = [_request(gateway, True) for _ in range(2)]
    for request in requests:
        await redis.xadd(stream, {keys.ENVELOPE_FIELD: encode(request)})
    claimed = await redis.xreadgroup(keys.WORKER_GROUP, "w1", {stream: ">"}, count=10)
    entry_ids = [entry_id for entry_id, _fields in claimed[0][1]]
    queues = [router.open(r.request_id) for r in requests]
    publisher = ReplyPublisher(redis, "w1")

    async with reading(router), running(publisher):
        finished = [publisher.finish(r, GenerationChunk(done=True, finish_reason="stop"), (stream, e.decode(),
                                                                                           r.request_id))
                    for r, e in zip(requests, entry_ids, strict=True)]
        await asyncio.wait_for(asyncio.gather(*finished), 5)
        received = [await asyncio.wait_for(queue.get(), 5) for queue in queues]

    assert [e.chunks[0].finish_reason for e in received] == ["stop", "stop"]
    assert (await redis.xpending(stream, keys.WORKER_GROUP))["pending"] == 0
    assert await redis.xlen(stream) == 0
    assert not await redis.exists(*(keys.streamed_key(r.request_id) for r in requests))
    await redis.delete(stream, keys.reply_stream(gateway))
    await redis.aclose()


async def test_a_started_note_names_the_worker_and_entry_and_takes_no_seq(redis_url: str) -> None:
    """A worker that starts a non-streaming generation tells its gateway at once where the request's
    entry is pending, in an envelope of no chunks: no seq taken (its answer is seq 0) and no
    `streamed` mark (nothing reached the client: a takeover may run it again)."""
    redis = aioredis.Redis.from_url(redis_url)
    gateway = uuid.uuid4().hex
    router = ReplyRouter(redis, gateway)
    request = _request(gateway, True)
    queue = router.open(request.request_id)
    publisher = ReplyPublisher(redis, "w1")
    publisher.hold(request.request_id, 7, ("requests:m", "1-1"))
    async with reading(router), running(publisher):
        publisher.started(request)
        note = await asyncio.wait_for(queue.get(), 5)
        assert not await redis.exists(keys.streamed_key(request.request_id))
        publisher.finish(request, GenerationChunk(done=True, finish_reason="stop"), None)
        answer = await asyncio.wait_for(queue.get(), 5)
    assert (note.seq, note.chunks, note.worker_id, note.lease, note.stream, note.entry_id) == (
        0, [], "w1", 7, "requests:m", "1-1")
    assert (answer.seq, answer.chunks[0].finish_reason, answer.stream) == (0, "stop", "requests:m")
    await redis.delete(keys.reply_stream(gateway))
    await redis.aclose()


async def test_a_malformed_envelope_in_a_batch_does_not_lose_the_others(redis_url: str) -> None:
    redis = aioredis.Redis.from_url(redis_url)
    gateway = uuid.uuid4().hex
    router = ReplyRouter(redis, gateway)
    good = ChunkEnvelope("good", 0, [GenerationChunk(text="ok", token_count=1)], "w1")
    queue = router.open("good")
    async with reading(router):
        await redis.xadd(keys.reply_stream(gateway), {keys.BATCH_FIELD: b"\xc1 not msgpack"})
        await redis.xadd(keys.reply_stream(gateway), {keys.BATCH_FIELD: msgpack.packb({"not": "a list"})})
        await redis.xadd(keys.reply_stream(gateway), {keys.BATCH_FIELD: encode_batch([b"\xc1", encode(good)])})
        assert await asyncio.wait_for(queue.get(), 5) == good
    await redis.delete(keys.reply_stream(gateway))
    await redis.aclose()


async def test_a_router_whose_cancel_is_lost_still_stops_within_one_read(redis_url: str) -> None:
    """Cancelled the moment it sends its next XREAD (just after a delivery), a router on Python 3.11
    loses the cancel more often than not (shared.stopping); its stop event ends it anyway."""
    redis = aioredis.Redis.from_url(redis_url)
    lost = 0
    for _ in range(5):
        router = ReplyRouter(redis, uuid.uuid4().hex)
        queue = router.open("r")
        task = asyncio.create_task(router.run())
        await asyncio.wait_for(router.connected.wait(), 5)
        await redis.xadd(router.stream, {keys.ENVELOPE_FIELD: encode(ChunkEnvelope("r", 0, [GenerationChunk()], "w"))})
        await asyncio.wait_for(queue.get(), 5)
        router.stop()
        task.cancel()  # once, as a plain stop would
        done, _ = await asyncio.wait({task}, timeout=READ_BLOCK_MS / 1000 + 2)
        assert done, "the router outlived its stop event"
        lost += not task.cancelled()  # it ended by its stop event: the cancel was lost
        await redis.delete(router.stream)
    print(f"cancels lost: {lost} of 5")
    await redis.aclose()


async def test_the_silence_watch_sleeps_with_no_request_open_and_wakes_for_the_first(redis_url: str) -> None:
    """`watch_silence` waits for a route instead of waking every interval; a request opened later
    still hears its first silence within the interval, and a stop ends the watch while it sleeps."""
    redis = aioredis.Redis.from_url(redis_url)
    router = ReplyRouter(redis, uuid.uuid4().hex)
    watch = asyncio.create_task(router.watch_silence(0.05))
    await asyncio.sleep(0.2)  # asleep: no route to wake
    queue = router.open("r")
    assert await asyncio.wait_for(queue.get(), 1) is None  # SILENCE
    router.close("r")
    await asyncio.sleep(0.2)  # asleep again
    router.stop()
    await asyncio.wait_for(watch, 1)
    await redis.aclose()


@contextlib.asynccontextmanager
async def paused_a_minute(redis_url: str):
    """A publisher whose pause between writes is a minute, two stream requests for one gateway,
    and that gateway's queues for them, read while inside: (publisher, (streaming, newcomer), queues).
    A delta that did not wait out the pause would show; one that waited could not arrive."""
    redis = aioredis.Redis.from_url(redis_url)
    gateway = uuid.uuid4().hex
    router = ReplyRouter(redis, gateway)
    requests = _request(gateway, True), _request(gateway, True)
    queues = {r.request_id: router.open(r.request_id) for r in requests}
    publisher = ReplyPublisher(redis, "w1", coalesce_s=60.0, per_stream_s=60.0, most_s=60.0)
    try:
        async with reading(router), running(publisher):
            yield publisher, requests, queues
    finally:
        for request in requests:
            await redis.delete(keys.streamed_key(request.request_id))
        await redis.delete(keys.reply_stream(gateway))
        await redis.aclose()


async def test_a_first_output_queued_during_a_write_goes_out_next_without_a_pause(redis_url: str) -> None:
    """A request's first output that comes while a write is on the wire goes out right after it,
    not after the pause that follows a write."""
    async with paused_a_minute(redis_url) as (publisher, (streaming, newcomer), queues):
        publisher.publish(streaming, GenerationChunk(text="a", token_count=1))
        while not publisher._in_flight[0]:  # the write of "a" is under way
            await asyncio.sleep(0)
        publisher.publish(newcomer, GenerationChunk(text="x", token_count=1))
        first = await asyncio.wait_for(queues[streaming.request_id].get(), 5)
        other = await asyncio.wait_for(queues[newcomer.request_id].get(), 5)
    assert [(e.seq, [c.text for c in e.chunks]) for e in (first, other)] == [(0, ["a"]), (0, ["x"])]


def test_the_pause_between_writes_grows_with_the_requests_a_write_carried() -> None:
    publisher = ReplyPublisher(aioredis.Redis(), "w1", coalesce_s=0.002, per_stream_s=0.00075, most_s=0.006)
    assert [publisher.pause_s(n) for n in (0, 1, 2, 4, 8, 64)] == pytest.approx([0.002, 0.002, 0.002, 0.003, 0.006,
                                                                                  0.006])


async def test_deltas_wait_out_the_pause_merged_but_a_first_output_ends_it(redis_url: str) -> None:
    """After a write, a request's next deltas wait for the pause to end and go out merged, in one
    envelope; a request's first output ends the pause at once, taking them along."""
    async with paused_a_minute(redis_url) as (publisher, (streaming, newcomer), queues):
        publisher.publish(streaming, GenerationChunk(text="a", token_count=1))
        first = await asyncio.wait_for(queues[streaming.request_id].get(), 5)
        publisher.publish(streaming, GenerationChunk(text="b", token_count=1))
        publisher.publish(streaming, GenerationChunk(text="c", token_count=1))
        await asyncio.sleep(0.3)
        assert queues[streaming.request_id].empty()  # waiting out the pause
        publisher.publish(newcomer, GenerationChunk(text="x", token_count=1))
        merged = await asyncio.wait_for(queues[streaming.request_id].get(), 5)
        other = await asyncio.wait_for(queues[newcomer.request_id].get(), 5)
    assert [(e.seq, [c.text for c in e.chunks]) for e in (first, merged, other)] == [(0, ["a"]), (1, ["bc"]),
                                                                                     (0, ["x"])]


async def test_each_write_counts_what_its_oldest_reply_waited_for_it(redis_url: str) -> None:
    """One observation a write (llmfleet_worker_publish_wait_seconds): a first output goes out at
    once; the deltas queued after it wait out most of the pause, merged into the next write."""
    redis = aioredis.Redis.from_url(redis_url)
    gateway, model = uuid.uuid4().hex, uuid.uuid4().hex  # a series of this test's own
    router = ReplyRouter(redis, gateway)
    request = _request(gateway, True)
    queue = router.open(request.request_id)
    publisher = ReplyPublisher(redis, "w1", coalesce_s=0.3, per_stream_s=0.3, most_s=0.3, model=model)
    async with reading(router), running(publisher):
        publisher.publish(request, GenerationChunk(text="a", token_count=1))
        await asyncio.wait_for(queue.get(), 5)
        publisher.publish(request, GenerationChunk(text="b", token_count=1))
        publisher.publish(request, GenerationChunk(text="c", token_count=1))
        merged = await asyncio.wait_for(queue.get(), 5)
    assert [c.text for c in merged.chunks] == ["bc"]

    def observed(le: str | None = None) -> float | None:
        name = "llmfleet_worker_publish_wait_seconds_" + ("count" if le is None else "bucket")
        return REGISTRY.get_sample_value(name, {"model": model, **({"le": le} if le else {})})

    assert observed() == 2  # two writes
    assert observed("0.1") == 1  # the first output's, at once; the deltas waited 0.3 s less the first's trip
    await redis.delete(keys.streamed_key(request.request_id), keys.reply_stream(gateway))
    await redis.aclose()


@contextlib.asynccontextmanager
async def subscribed(redis: aioredis.Redis, gateway: str):
    """A router reading its reply stream and holding its channel (`hold_presence`), once both are in place."""
    router = ReplyRouter(redis, gateway)
    holding = asyncio.create_task(router.hold_presence())
    try:
        async with reading(router):
            await _until(lambda: router.presence)
            yield router
    finally:
        router.stop()
        await asyncio.wait_for(holding, STOP_WITHIN_S)


async def _until(condition, within_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + within_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "not within the time allowed"
        await asyncio.sleep(0.01)


async def test_replies_come_on_the_gateways_channel_but_a_large_whole_answer_by_its_stream(redis_url: str) -> None:
    """A request naming its gateway's channel has its replies published there, a stream's large
    deltas too (their order is one with the rest); only an answer in one envelope larger than
    CHANNEL_ANSWER_LIMIT_BYTES goes to the reply stream. Every reply reaches its route, in order."""
    redis = aioredis.Redis.from_url(redis_url)
    gateway = uuid.uuid4().hex
    big = "v" * (CHANNEL_ANSWER_LIMIT_BYTES + 1)
    async with subscribed(redis, gateway) as router:
        streaming, large, small = (msgspec.structs.replace(_request(gateway, True), reply_channel=router.presence,
                                                           stream=stream) for stream in (True, False, False))
        queues = {r.request_id: router.open(r.request_id) for r in (streaming, large, small)}
        publisher = ReplyPublisher(redis, "w1")
        async with running(publisher):
            publisher.publish(streaming, GenerationChunk(text="a", token_count=1))
            await asyncio.wait_for(queues[streaming.request_id].get(), 5)
            publisher.publish(streaming, GenerationChunk(text=big, token_count=1))
            publisher.finish(streaming, GenerationChunk(done=True, finish_reason="stop"), None)
            publisher.finish(large, GenerationChunk(done=True, finish_reason="stop", text=big), None)
            publisher.finish(small, GenerationChunk(done=True, finish_reason="stop", text="s"), None)
            received = {rid: [await asyncio.wait_for(queue.get(), 5)] for rid, queue in queues.items()}
    assert [(e.seq, [len(c.text) for c in e.chunks]) for e in received[streaming.request_id]] == [(1, [len(big), 0])]
    assert [len(e.chunks[0].text) for e in received[large.request_id] + received[small.request_id]] == [len(big), 1]
    in_stream = [decode(ChunkEnvelope, fields[keys.ENVELOPE_FIELD]).request_id
                 for fields in await _entries(redis, keys.reply_stream(gateway))]
    assert in_stream == [large.request_id]
    await redis.delete(keys.reply_stream(gateway), *(keys.streamed_key(streaming.request_id),))
    await redis.aclose()


async def test_a_lost_channel_fails_the_open_requests_and_is_subscribed_again(redis_url: str) -> None:
    """What was published while the subscription was down is gone: the requests open then end
    with a 503 error at once, not at their deadline; the gateway subscribes again within a second."""
    redis = aioredis.Redis.from_url(redis_url)
    lost_before = metrics.REPLY_CHANNEL_LOST._value.get()
    async with subscribed(redis, uuid.uuid4().hex) as router:
        channel = router.presence
        queue = router.open("r")
        host, port = router._subscription.transport.get_extra_info("sockname")[:2]
        assert await redis.client_kill_filter(addr=f"{host}:{port}") == 1  # this router's, no other's
        ended = await asyncio.wait_for(queue.get(), 5)
        assert (ended.seq, ended.chunks[0].finish_reason, ended.chunks[0].error.status) == (-1, "error", 503)
        assert metrics.REPLY_CHANNEL_LOST._value.get() == lost_before + 1
        assert router.presence == ""  # meanwhile, no request names it
        await _until(lambda: router.presence == channel)
        assert (await redis.pubsub_numsub(channel))[0][1] == 1
    await redis.aclose()


async def test_a_subscription_whose_redis_stops_answering_ends(redis_url: str) -> None:
    """A link that goes quiet without closing (a partition, a Redis stalled): `check` pings it,
    and ends the subscription once the ping has gone unanswered for the timeout."""
    redis = aioredis.Redis.from_url(redis_url)
    subscription = await Subscription.open(redis, f"test:{uuid.uuid4().hex}", lambda _message: None)
    subscription.check(quiet_s=0.0, timeout_s=0.3)  # pinged; answered
    await _until(lambda: not subscription.pinged_at)
    await redis.execute_command("CLIENT", "PAUSE", 1500, "ALL")
    subscription.check(quiet_s=0.0, timeout_s=0.3)  # pinged; held by the pause
    await asyncio.sleep(0.5)
    assert not subscription.lost.done()
    subscription.check(quiet_s=0.0, timeout_s=0.3)
    why = await asyncio.wait_for(subscription.lost, 5)
    assert "did not answer a PING" in str(why)
    await subscription.close()
    await redis.aclose()
