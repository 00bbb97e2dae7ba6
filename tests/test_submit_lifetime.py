"""One owner for a request's life (issue #13): `async with fleet.submit(envelope) as run:` opens,
registers and queues the request, and on every way out closes its reply route and unregisters it.

The gateway's side runs in the test process on a real Redis. Each await of a submit is parked in
turn (before and after the real call) and the submit is cancelled there, as a client that hangs
up at that moment cancels its handler: the route must be closed, the `run:{id}` key gone, the
cancel_id set left with no member for the request, and a request that was queued must leave the
queue (`fair_queue.WITHDRAW`), or where the submit never learnt where it went, be cancelled (its
`cancelled:{id}` stash), so that no worker runs it for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.fleet.runs import Fleet
from shared import keys, redis_pool
from shared.codec import encode
from shared.envelopes import ChunkEnvelope, GenerationChunk, RequestEnvelope, SamplingOptions
from tests.procs import in_process_fleet, recorded_batches, start_redis, wait_for

pytestmark = pytest.mark.integration


# A Redis of this module's own: its requests are queued for models no worker serves, and stay in
# their streams, which the session Redis's leftover checks in later tests would count.
@pytest.fixture(scope="module")
def redis_url():
    redis = start_redis()
    yield redis.url
    redis.stop()


@pytest.fixture(scope="module")
def redis_client(redis_url):
    return redis_pool.connect_sync(redis_url)

# The awaits of a submit, by the attribute of the fleet each one calls.
AWAITS = ["cancels.register", "_enqueue"]


def envelope(model: str) -> RequestEnvelope:
    now = time.time()
    return RequestEnvelope(
        request_id=uuid.uuid4().hex, model=model, kind="chat", reply_to="", arrival=now, deadline=now + 60,
        queue_deadline=now + 60, body={"messages": [{"role": "user", "content": "hello"}]},
        params=SamplingOptions(max_tokens=5), batch_replies=True, cancel_id=uuid.uuid4().hex)


def park(owner, name: str, when: str, parked: asyncio.Event) -> None:
    """Replace `owner.name` by a call that stops for good before or after the real one."""
    real = getattr(owner, name)

    async def parked_call(*args, **kwargs):
        result = None
        if when == "after":
            result = await real(*args, **kwargs)
        parked.set()
        await asyncio.Event().wait()  # until cancelled
        return result

    setattr(owner, name, parked_call)


def left_behind(redis_client, fleet: Fleet, request: RequestEnvelope) -> list[str]:
    found = []
    if fleet.router.open_requests:
        found.append(f"{fleet.router.open_requests} open routes")
    if redis_client.exists(keys.run_key(request.request_id)):
        found.append("run key")
    if redis_client.sismember(keys.cancel_id_key(keys.cancel_group(request.tenant, cancel_id=request.cancel_id)),
                              request.request_id):
        found.append("cancel_id registration")
    return found


@pytest.mark.parametrize("when", ["before", "after"])
@pytest.mark.parametrize("step", AWAITS)
async def test_a_submit_cancelled_at_any_await_leaves_nothing_behind(redis_url, redis_client, step, when):
    model = f"life-{uuid.uuid4().hex[:8]}"
    request = envelope(model)
    async with in_process_fleet(redis_url) as fleet:
        owner, _, name = step.rpartition(".")
        parked = asyncio.Event()
        park(getattr(fleet, owner) if owner else fleet, name, when, parked)

        async def client():
            async with fleet.submit(request):
                raise AssertionError("a parked submit never gets here")

        task = asyncio.create_task(client())
        await asyncio.wait_for(parked.wait(), 10)
        assert fleet.router.open_requests == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)  # the unregistering, in the background
        assert left_behind(redis_client, fleet, request) == []
        queued = step == "_enqueue" and when == "after"
        if queued:  # in the stream with nobody to read its answer: cancelled before a worker takes it
            assert redis_client.get(keys.cancelled_key(request.request_id)) == b"disconnect"


async def test_every_way_out_of_the_block_ends_the_run(redis_url, redis_client):
    model = f"life-{uuid.uuid4().hex[:8]}"
    async with in_process_fleet(redis_url) as fleet:
        for way_out in ("return", "error", "cancel"):
            request = envelope(model)

            async def client():
                async with fleet.submit(request) as run:
                    assert fleet.router.open_requests == 1 and redis_client.exists(keys.run_key(run.request_id))
                    if way_out == "error":
                        raise ValueError("the handler failed")
                    if way_out == "cancel":
                        await asyncio.Event().wait()

            task = asyncio.create_task(client())
            if way_out == "cancel":
                await asyncio.to_thread(wait_for, lambda: redis_client.exists(keys.run_key(request.request_id)), 10,
                                        "the run to be registered")
                task.cancel()
            with contextlib.suppress(ValueError, asyncio.CancelledError):
                await task
            await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)
            assert left_behind(redis_client, fleet, request) == [], way_out
            # An unended run no worker claimed leaves the queue, whatever the way out: nothing to cancel.
            assert redis_client.xlen(keys.request_stream(model)) == 0, way_out
            assert not redis_client.exists(keys.cancelled_key(request.request_id)), way_out


async def test_a_detached_run_cancelled_before_its_first_step_still_ends(redis_url, redis_client):
    """A resumable run's relay task owns its ending from its first step; cancelled before that (the
    gateway stopping at once), its done callback ends the run instead: route closed, the run
    unregistered and taken back from the queue, the event log ended, nothing left in `fleet.detached`."""
    from gateway.api.openai.chat import ChatFormatter
    from gateway.api.openai.protocol import ChatCompletionRequest
    from gateway.serve.life import RequestLife
    from gateway.serve.resumable import DetachedRun

    request = envelope(f"life-{uuid.uuid4().hex[:8]}")
    request.stream = True
    body = ChatCompletionRequest(model=request.model, messages=request.body["messages"], stream=True)
    async with in_process_fleet(redis_url) as fleet:
        detached = DetachedRun(fleet, RequestLife(fleet, request, "chat"), ChatFormatter(body, request))
        await detached.start()
        detached.task.cancel()  # before the loop runs it: its coroutine never starts
        with pytest.raises(asyncio.CancelledError):
            await detached.task
        await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)  # the ending, in the background
        await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)  # and the unregistering it started
        assert left_behind(redis_client, fleet, request) == []
        assert redis_client.xlen(keys.request_stream(request.model)) == 0
        assert not redis_client.exists(keys.cancelled_key(request.request_id))
        assert detached.response_id not in fleet.detached
        assert redis_client.ttl(keys.event_log_key(detached.response_id)) > 0


@pytest.mark.parametrize("failure", ["gone at the start", "cancelled at the start"])
async def test_a_stream_whose_client_is_gone_before_its_first_byte_still_ends_its_run(failure):
    """An SSE body that owns a run ends it on every way out; a body never started would never
    run its ending, so the response enters it before it sends anything."""
    from gateway.serve.sse import SSEResponse

    ended = asyncio.Event()

    async def body():
        try:
            yield b"data: {}\n\n"
        finally:
            ended.set()  # as `_sse_body` ends its run (`Fleet.submit`'s exit)

    async def send(message):
        if message["type"] == "http.response.start":
            if failure == "gone at the start":
                raise OSError("the client closed the connection")
            raise asyncio.CancelledError

    response = SSEResponse(body())
    with pytest.raises((OSError, asyncio.CancelledError)):
        await response.stream_response(send)
    assert ended.is_set()


async def test_a_run_is_registered_and_queued_in_one_round_trip(redis_url, redis_client):
    """With nothing that can have cancelled it first (no cancel_id, no session), a run's key and its
    request's queueing reach Redis in the same batch: the queueing script is queued at the call,
    in the batch of the registering before it, not one round trip later."""
    model = f"life-{uuid.uuid4().hex[:8]}"
    request = msgspec.structs.replace(envelope(model), cancel_id=None)
    async with in_process_fleet(redis_url) as fleet:
        batches = recorded_batches(fleet.batched)
        async with fleet.submit(request):
            assert redis_client.xlen(keys.request_stream(model)) == 1
        await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)
    registered = [batch for batch in batches if ("SET", keys.run_key(request.request_id)) in
                  [command[:2] for command in batch]]
    assert len(registered) == 1
    names = [command[0] for command in registered[0]]
    assert names.index("SET") < names.index("EVALSHA"), names


async def _answered(redis_url: str, redis_client, answer) -> tuple[RequestEnvelope, list[list[tuple]], bool, int]:
    """A run without cancel groups, answered by `answer(request, entry_id)` (a worker's terminal write):
    the request, the gateway's batches, whether its run read that the worker unregistered it, and
    how many background tasks the gateway had left once the run's block was over."""
    model = f"life-{uuid.uuid4().hex[:8]}"
    request = msgspec.structs.replace(envelope(model), cancel_id=None)
    async with in_process_fleet(redis_url) as fleet:
        batches = recorded_batches(fleet.batched)
        async with fleet.submit(request) as run:
            assert redis_client.exists(keys.run_key(request.request_id))
            [(entry_id, _fields)] = redis_client.xrange(keys.request_stream(model))
            await answer(request, entry_id.decode())
            chunks = [chunk async for chunk in run.chunks()]
            assert chunks[-1].finish_reason == "stop"
        spawned = len(fleet._tasks)
        await asyncio.wait_for(asyncio.gather(*fleet._tasks), 10)
    return request, batches, run.unregistered, spawned


async def test_a_run_its_worker_answered_is_unregistered_by_the_worker(redis_url, redis_client):
    """A worker ends a run's registration (its `run:{id}` key, which a cancel by id reads) in the
    write of its answer, ahead of it, and says so: the gateway sends nothing to unregister it."""
    from tests.test_reply_path import running
    from worker.publisher import ReplyPublisher

    publisher = ReplyPublisher(aioredis.Redis.from_url(redis_url), "w1")

    async def answer(request: RequestEnvelope, entry_id: str) -> None:
        publisher.hold(request.request_id, 1, (keys.request_stream(request.model), entry_id))
        async with running(publisher):
            await publisher.finish(request, GenerationChunk(done=True, finish_reason="stop"),
                                   (keys.request_stream(request.model), entry_id, request.request_id))

    request, batches, unregistered, spawned = await _answered(redis_url, redis_client, answer)
    assert unregistered and not redis_client.exists(keys.run_key(request.request_id))
    assert not [command for batch in batches for command in batch if keys.run_key(request.request_id) in command[1:]
                and command[0] != "SET"], batches
    assert spawned == 0  # nothing left to send: its ending starts no task


async def test_a_run_an_older_worker_answered_is_unregistered_by_its_gateway(redis_url, redis_client):
    """A worker of an older version leaves the key: its answer does not say it removed it, and the
    gateway removes it, as before."""
    async def answer(request: RequestEnvelope, _entry_id: str) -> None:
        terminal = ChunkEnvelope(request.request_id, 0, [GenerationChunk(done=True, finish_reason="stop")], "old")
        redis_client.xadd(request.reply_to, {keys.ENVELOPE_FIELD: encode(terminal)})

    request, batches, unregistered, spawned = await _answered(redis_url, redis_client, answer)
    assert not unregistered and not redis_client.exists(keys.run_key(request.request_id))
    assert ["DEL", keys.run_key(request.request_id)] in [list(command) for batch in batches for command in batch]
    assert spawned == 1  # the task that waits for the DEL's reply
