"""Fair share between tenants (shared/fair_queue.py) on a real Redis with real scripted workers.

The gateway's side runs in the test process (`Fleet.submit` with envelopes whose tenant and
priority are set here, as `new_envelope` sets them from the API key); the workers are processes.
A worker with one slot serves one request at a time, so the order of the requests' `finished_at`
is the order they were served in.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import httpx
import pytest

from gateway.fleet.runs import Fleet
from shared import keys
from shared.envelopes import GenerationChunk, RequestEnvelope, SamplingOptions
from shared.errors import Overloaded
from tests.conftest import leftover_keys
from tests.procs import in_process_fleet, metric_value, start_gateway, start_worker, wait_for
from tests.test_keys import create_key

pytestmark = pytest.mark.integration

TOKENS_PER_SECOND = 100  # a 5-token request takes 50 ms


@pytest.fixture
def model() -> str:
    return f"fair-{uuid.uuid4().hex[:8]}"


def one_slot_worker(redis_url: str, model: str, *args: str):
    return start_worker(redis_url, model, "--scripted-tokens-per-second", str(TOKENS_PER_SECOND),
                        "--max-concurrency", "1", *args)


def envelope(model: str, tenant: str = "", priority: str = "normal", max_tokens: int = 5,
             words: str = "one two three", queue_timeout_s: float = 120) -> RequestEnvelope:
    now = time.time()
    return RequestEnvelope(
        request_id=uuid.uuid4().hex, model=model, kind="chat", reply_to="", arrival=now, deadline=now + 120,
        queue_deadline=now + queue_timeout_s, body={"messages": [{"role": "user", "content": words}]},
        params=SamplingOptions(max_tokens=max_tokens), batch_replies=True, tenant=tenant, priority=priority)


@contextlib.asynccontextmanager
async def submitted(fleet: Fleet, request: RequestEnvelope):
    """`fleet.submit`'s run, for the time of the block (the one owner of its registration)."""
    async with fleet.submit(request) as run:
        yield run


async def follow(fleet: Fleet, request: RequestEnvelope, queued: asyncio.Event,
                 leave: asyncio.Event | None = None) -> GenerationChunk | None:
    """Submit `request` (set `queued` once it is) and return its terminal chunk; with `leave`, go
    away without reading once it is set, as a client that disconnects."""
    async with submitted(fleet, request) as run:
        queued.set()
        if leave is not None:
            await leave.wait()
            return None
        last = None
        async for chunk in run.chunks():
            last = chunk
        return last


async def submit_all(fleet: Fleet, requests: list[RequestEnvelope],
                     leave: asyncio.Event | None = None) -> list[asyncio.Task]:
    """Each request followed by its own task, queued one after another: arrival order is list order."""
    tasks = []
    for request in requests:
        queued = asyncio.Event()
        task = asyncio.create_task(follow(fleet, request, queued, leave))
        await asyncio.wait([asyncio.create_task(queued.wait()), task], return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            task.result()  # raises what the submit raised
        tasks.append(task)
    return tasks


def service_order(requests: dict[str, RequestEnvelope], endings: dict[str, GenerationChunk]) -> list[str]:
    """The tenants of `requests` (by request id) in the order a one-slot worker finished them."""
    done = sorted(endings, key=lambda rid: endings[rid].timings["finished_at"])
    return [requests[rid].tenant for rid in done]


async def wait_running(redis_client, request: RequestEnvelope) -> None:
    """Until a worker has started `request` (it holds the request's lease)."""
    await asyncio.to_thread(wait_for, lambda: redis_client.exists(keys.lease_key(request.request_id)), 20,
                            "a worker to start the first request", 0.01)


def model_keys_left(redis_client, model: str) -> list[str]:
    return [k for k in leftover_keys(redis_client) if model in k]


async def light_position(redis_url: str, redis_client, model: str, fair_share: bool) -> int:
    """Where a light tenant's one request is served among a heavy tenant's 20 queued before it."""
    async with in_process_fleet(redis_url, fair_share=fair_share) as fleet:
        # The first runs for a second, so that the rest are all queued behind it however slowly
        # they are sent (a busy machine once took longer than a short first request's 50 ms).
        heavy = [envelope(model, "heavy", max_tokens=100)] + [envelope(model, "heavy") for _ in range(19)]
        runs = await submit_all(fleet, heavy[:1])
        await wait_running(redis_client, heavy[0])
        light = envelope(model, "light")
        runs += await submit_all(fleet, [*heavy[1:], light])
        endings = await asyncio.wait_for(asyncio.gather(*runs), 60)
    requests = {e.request_id: e for e in [*heavy, light]}
    order = service_order(requests, {e.request_id: end for e, end in zip([*heavy, light], endings, strict=True)})
    assert all(e.finish_reason == "length" for e in endings)
    return order.index("light") + 1


@pytest.mark.cluster
async def test_a_light_tenant_is_served_in_turn_not_behind_a_heavy_tenants_backlog(redis_url, redis_client, model):
    worker = one_slot_worker(redis_url, model)
    try:
        # Heavy's first request runs (its queue empty again); heavy's second and light's each start a
        # new turn, in arrival order; heavy's other 18 wait in the turns, behind them.
        assert await light_position(redis_url, redis_client, model, fair_share=True) == 3
        # The same fleet in arrival order: light waits behind the whole backlog.
        assert await light_position(redis_url, redis_client, model, fair_share=False) == 21
        await asyncio.to_thread(wait_for, lambda: not model_keys_left(redis_client, model), 10,
                                "the model's queue keys to be gone or bounded")
        assert redis_client.hlen(keys.bound_requests(model)) == 0
    finally:
        worker.stop()


async def test_high_is_served_before_normal_before_low(redis_url, redis_client, model):
    worker = one_slot_worker(redis_url, model)
    try:
        async with in_process_fleet(redis_url) as fleet:
            blocker = envelope(model, "first", max_tokens=50)  # 0.5 s: the others queue behind it
            runs = await submit_all(fleet, [blocker])
            await wait_running(redis_client, blocker)
            queued = [envelope(model, f"{p}-{i}", p) for i in range(2) for p in ("low", "normal", "high")]
            runs += await submit_all(fleet, queued)
            endings = await asyncio.wait_for(asyncio.gather(*runs), 60)
        order = service_order({e.request_id: e for e in [blocker, *queued]},
                              {e.request_id: end for e, end in zip([blocker, *queued], endings, strict=True)})
        assert order == ["first", "high-0", "high-1", "normal-0", "normal-1", "low-0", "low-1"]
    finally:
        worker.stop()


async def light_beside_a_running_backlog(redis_url: str, redis_client, model: str,
                                        *worker_args: str) -> tuple[list[str], dict[str, float]]:
    """A heavy tenant's 5 one-second requests queued, one running on a one-slot worker; then a
    light tenant's one 50 ms request. Returns the order they finished in, and the worker's claims
    by source."""
    heavy = [envelope(model, "heavy", max_tokens=100) for _ in range(5)]
    light = envelope(model, "light")
    worker = None
    try:
        async with in_process_fleet(redis_url) as fleet:
            runs = await submit_all(fleet, heavy)
            worker = one_slot_worker(redis_url, model, *worker_args)
            await wait_running(redis_client, heavy[0])
            runs += await submit_all(fleet, [light])
            endings = await asyncio.wait_for(asyncio.gather(*runs), 60)
        claims = {source: metric_value(worker.url, "llmfleet_worker_claims_total", model=model, source=source)
                  for source in ("shared", "express")}
    finally:
        if worker is not None:
            worker.stop()
    assert all(e.finish_reason == "length" for e in endings)
    requests = {e.request_id: e for e in [*heavy, light]}
    return service_order(requests, {e.request_id: end for e, end in zip([*heavy, light], endings, strict=True)}), claims


async def test_an_express_slot_starts_a_light_tenants_request_while_every_slot_is_busy(redis_url, redis_client,
                                                                                       model):
    order, claims = await light_beside_a_running_backlog(redis_url, redis_client, model, "--express-slots", "1")
    # Started beside heavy's running request, light's short one ends first; the heavy tenant's
    # backlog never takes the express slot: one request at a time, in turn.
    assert order == ["light", *["heavy"] * 5]
    assert claims == {"shared": 5, "express": 1}
    # Without it, light waits for the slot: it takes the next turn, after heavy's running request.
    order, claims = await light_beside_a_running_backlog(redis_url, redis_client, f"{model}-b")
    assert order == ["heavy", "light", *["heavy"] * 4]
    assert claims == {"shared": 6, "express": 0}


@pytest.mark.cluster
async def test_a_dead_workers_tickets_run_their_own_requests_on_another_worker(redis_url, redis_client, model):
    slow = ("--scripted-tokens-per-second", "5", "--max-concurrency", "4", "--claim-idle", "1")
    victim = start_worker(redis_url, model, *slow)
    rescuer = None
    try:
        async with in_process_fleet(redis_url) as fleet:
            requests = [envelope(model, f"t{i % 2}", max_tokens=10, words=f"request {i}") for i in range(6)]
            runs = await submit_all(fleet, requests)
            await asyncio.to_thread(wait_for, lambda: redis_client.hlen(keys.bound_requests(model)) == 4, 20,
                                    "the victim to claim four tickets")
            victim.kill()
            rescuer = start_worker(redis_url, model, *slow)
            endings = await asyncio.wait_for(asyncio.gather(*runs), 90)
        for request, ending in zip(requests, endings, strict=True):
            words = request.body["messages"][0]["content"].split()
            assert ending.error is None and ending.finish_reason == "length"
            assert ending.candidates[0].text == " ".join(words[i % 2] for i in range(10))
        await asyncio.to_thread(wait_for, lambda: not model_keys_left(redis_client, model), 10,
                                "the model's queue keys to be gone or bounded")
        assert redis_client.hlen(keys.bound_requests(model)) == 0
    finally:
        victim.kill()
        if rescuer is not None:
            rescuer.stop()


@pytest.mark.cluster
async def test_queued_tickets_keep_cancels_queue_timeouts_and_the_backlog_bound(redis_url, redis_client, model):
    async with in_process_fleet(redis_url, max_queue=3) as fleet:
        # No worker yet: the bound counts tickets as it counts envelopes.
        blocker, gone, behind = envelope(model, "a", max_tokens=200), envelope(model, "b"), envelope(model, "c")
        leave = asyncio.Event()
        runs = [*await submit_all(fleet, [blocker]), *await submit_all(fleet, [gone], leave),
                *await submit_all(fleet, [behind])]
        with pytest.raises(Overloaded):
            async with submitted(fleet, envelope(model, "d")):
                pass
        assert redis_client.xlen(keys.request_stream(model)) == 3
        leave.set()  # the client went away before any worker: its request leaves the queue, ticket and all
        await asyncio.wait_for(runs[1], 10)
        await asyncio.to_thread(wait_for, lambda: redis_client.xlen(keys.request_stream(model)) == 2, 5,
                                "the request to be withdrawn")
        assert not redis_client.exists(keys.tenant_queue(model, "normal", "b"))
        worker = one_slot_worker(redis_url, model)
        try:
            await wait_running(redis_client, blocker)
            await asyncio.to_thread(wait_for, lambda: fleet.registry.serves(model), 5, "the gateway to see the worker")
            # Past its queue timeout behind the running blocker and `behind`, with a live worker: the
            # gateway waits, and the worker that claims it drops it unstarted.
            stale = envelope(model, "e", queue_timeout_s=0.2)
            runs += await submit_all(fleet, [stale])
            first, second, third = await asyncio.wait_for(asyncio.gather(runs[0], runs[2], runs[3]), 60)
            assert first.finish_reason == second.finish_reason == "length"
            assert third.error is not None and third.error.code == "queue_timeout"
            await asyncio.to_thread(wait_for, lambda: not model_keys_left(redis_client, model), 10,
                                    "every ticket to be acknowledged and its binding removed")
            assert redis_client.hlen(keys.bound_requests(model)) == 0
            assert redis_client.xlen(keys.request_stream(model)) == 0
            assert metric_value(worker.url, "llmfleet_worker_claims_total", model=model) == 3
        finally:
            worker.stop()


async def test_real_keys_over_two_gateways_are_served_in_turn_and_by_priority(redis_url, redis_client, model):
    """End to end: managed keys (`llmfleet keys create --priority`), gateways that require them."""
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--max-concurrency", "1")
    gateways = [start_gateway(redis_url, "--require-keys") for _ in range(2)]
    (_, heavy), (_, light), (_, vip) = (create_key(redis_url, "--priority", p) for p in ("normal", "normal", "high"))
    finished: list[str] = []
    try:
        async with httpx.AsyncClient(timeout=120) as client:
            async def chat(who: str, secret: str, gateway) -> None:
                response = await client.post(f"{gateway.url}/v1/chat/completions", headers={
                    "Authorization": f"Bearer {secret}"}, json={
                    "model": model, "messages": [{"role": "user", "content": "one two"}], "max_tokens": 4})
                assert response.status_code == 200, response.text
                finished.append(who)

            await asyncio.to_thread(wait_for, lambda: all(httpx.get(f"{g.url}/ready").status_code == 200
                                                          for g in gateways), 15, "the gateways")
            flood = [asyncio.create_task(chat("heavy", heavy, gateways[i % 2])) for i in range(20)]
            await asyncio.to_thread(wait_for, lambda: redis_client.xlen(keys.request_stream(model)) >= 18, 30,
                                    "the heavy key's requests to be queued")
            late = [asyncio.create_task(chat("light", light, gateways[1])),
                    asyncio.create_task(chat("vip", vip, gateways[0]))]
            await asyncio.wait_for(asyncio.gather(*flood, *late), 120)
        # 200 ms a request: the two late ones are served within a few turns, not after the backlog.
        assert finished.index("vip") < 5 and finished.index("light") < 6, finished
    finally:
        for proc in [*gateways, worker]:
            proc.stop()
