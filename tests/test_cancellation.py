"""Cancellation and the request lifecycle, on scripted workers (real processes, real Redis).

Each test gets its own model name and worker, so counts on the worker's metrics belong to it.
Assertions wait on observable state (the worker's in-flight gauge, its cancel counters), not
on sleeps.
"""

from __future__ import annotations

import contextlib
import json
import threading
import uuid

import httpx
import pytest

from shared import keys
from tests.conftest import SCRIPTED_MODEL, leftover_keys
from tests.procs import metric_value, server_clients, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


@pytest.fixture
def slow_worker(redis_url, request):
    """A worker of a fresh model that streams 20 tokens/s with at most 2 requests at once."""
    model = f"slow-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--max-concurrency", "1")
    yield worker
    worker.stop()


@pytest.fixture(scope="module")
def gateways(redis_url):
    procs = [start_gateway(redis_url, "--queue-timeout", "3"), start_gateway(redis_url)]
    yield procs
    for proc in procs:
        proc.stop()


def _served(gateways, worker):
    for gateway in gateways:
        wait_until_served(gateway, worker.extra["model"])
    return worker.extra["model"]


def _in_flight(worker) -> float:
    return metric_value(worker.url, "llmfleet_worker_in_flight")


def _cancels(worker, **labels) -> float:
    return metric_value(worker.url, "llmfleet_worker_cancels_total", **labels)


def _events(lines):
    """Parse SSE `data:` lines into JSON events, stopping at [DONE]."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            yield "[DONE]"
            return
        yield json.loads(line[6:])


def _finishes(events) -> list[str]:
    """The finish reasons in a stream's events, in order ([DONE] skipped)."""
    return [c["finish_reason"] for e in events if e != "[DONE]" for c in e["choices"] if c["finish_reason"]]


def _chat(model, **extra):
    return {"model": model, "messages": [{"role": "user", "content": "tick tock"}], "max_tokens": 200, **extra}


@pytest.mark.parametrize("n", [1, 2])
def test_disconnect_during_decode_stops_the_generation(gateways, slow_worker, n):
    model = _served(gateways, slow_worker)
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, n=n, temperature=1.0)) as response:
        events = _events(response.iter_lines())
        for _ in range(3 + n):  # role chunk(s), then some content
            next(events)
        wait_for(lambda: _in_flight(slow_worker) == 1, 5, "the request to be running")
    wait_for(lambda: _in_flight(slow_worker) == 0, 5, "the worker to abort the request")
    assert _cancels(slow_worker, cause="disconnect", phase="decode") == 1


def test_disconnect_of_a_non_streaming_request(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    done = threading.Event()

    def call():
        with contextlib.suppress(httpx.TimeoutException):  # the client gives up: its connection closes
            httpx.post(f"{gateways[1].url}/v1/chat/completions", json=_chat(model), timeout=1.0)
        done.set()

    threading.Thread(target=call).start()
    wait_for(done.is_set, 10, "the client to give up")
    wait_for(lambda: _in_flight(slow_worker) == 0, 5, "the worker to abort the request")
    assert _cancels(slow_worker, cause="disconnect") == 1


@pytest.mark.cluster
def test_disconnect_while_queued_never_starts_the_request(gateways, slow_worker, redis_client):
    model = _served(gateways, slow_worker)
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, cancel_id="first")) as busy:
        busy_events = _events(busy.iter_lines())  # kept referenced: dropping it closes the stream
        next(busy_events)  # the only slot is taken
        with pytest.raises(httpx.ReadTimeout):  # the second request waits in the queue; we hang up
            httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model), timeout=0.5)
        # No worker claimed it: the gateway takes it back from the queue, which holds the busy one only.
        wait_for(lambda: redis_client.xlen(keys.request_stream(model)) == 1, 5, "the queued request to leave")
        assert httpx.post(f"{gateways[1].url}/v1/cancel", json={"cancel_id": "first"}).json() == {"cancelled": 1}
        list(busy_events)
    wait_for(lambda: _in_flight(slow_worker) == 0, 5, "the busy request to end")
    assert metric_value(slow_worker.url, "llmfleet_worker_claims_total", model=model) == 1
    assert _cancels(slow_worker, phase="queued") == 0
    assert metric_value(slow_worker.url, "llmfleet_worker_generated_tokens_total") < 200
    wait_for(lambda: _in_flight(slow_worker) == 0 and not leftover_keys(redis_client), 5, "a clean queue")


@pytest.mark.cluster
def test_explicit_cancel_through_the_other_replica(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    cancel_id = uuid.uuid4().hex
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, cancel_id=cancel_id,
                                 stream_options={"include_usage": True})) as response:
        events = _events(response.iter_lines())
        for _ in range(3):
            next(events)
        answer = httpx.post(f"{gateways[1].url}/v1/cancel", json={"cancel_id": cancel_id})
        assert answer.json() == {"cancelled": 1}
        rest = list(events)
    assert _finishes(rest) == ["cancelled"]
    assert rest[-1] == "[DONE]"
    assert 2 <= rest[-2]["usage"]["completion_tokens"] < 200
    assert _cancels(slow_worker, cause="explicit", phase="decode") == 1


def _cancelled_stream(gateways, model, lose_the_notice) -> list:
    """Stream a run, lose its cancel's pub/sub notice with `lose_the_notice(request_id)`, and
    return the events after it."""
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, stream_options={"include_usage": True})) as response:
        events = _events(response.iter_lines())
        response_id = next(events)["id"]
        next(events)
        lose_the_notice(response_id.removeprefix("chatcmpl-"))
        return list(events)


def _ending(rest) -> tuple[list[str], int]:
    """The finish reasons and the completion tokens of a stream's last events."""
    return _finishes(rest), rest[-2]["usage"]["completion_tokens"]


@pytest.mark.cluster
def test_a_cancel_whose_notice_never_came_still_stops_the_run(gateways, slow_worker, redis_client):
    """Pub/sub is at most once; the stash the gateway writes beside each notice is not."""
    model = _served(gateways, slow_worker)
    # The gateway's cancel, minus its notice: only the stash.
    rest = _cancelled_stream(gateways, model, lambda request_id: redis_client.set(
        keys.cancelled_key(request_id), "explicit", ex=60))
    finishes, tokens = _ending(rest)
    assert finishes == ["cancelled"] and tokens < 200
    assert metric_value(slow_worker.url, "llmfleet_worker_cancels_from_stash_total") == 1
    assert _cancels(slow_worker, cause="explicit", phase="decode") == 1


def test_a_cancel_sent_while_the_worker_resubscribes_still_stops_the_run(gateways, slow_worker, redis_client):
    model = _served(gateways, slow_worker)

    def cut_the_subscription_then_cancel(request_id):
        subscriptions = [(server, c) for server in server_clients(redis_client)
                         for c in server.client_list(_type="pubsub") if f"-{slow_worker.pid}-" in c["name"]]
        assert len(subscriptions) == 1, "the worker's connections are named after it"
        server, subscription = subscriptions[0]
        server.client_kill_filter(_id=subscription["id"])
        # The worker waits before it subscribes again: this notice reaches nobody.
        answer = httpx.post(f"{gateways[1].url}/v1/cancel", json={"id": f"chatcmpl-{request_id}"})
        assert answer.json() == {"cancelled": 1}

    finishes, tokens = _ending(_cancelled_stream(gateways, model, cut_the_subscription_then_cancel))
    assert finishes == ["cancelled"] and tokens < 200
    assert _cancels(slow_worker, cause="explicit", phase="decode") == 1


@pytest.mark.cluster
def test_cancel_by_response_id(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    with httpx.stream("POST", f"{gateways[1].url}/v1/chat/completions", json=_chat(model, stream=True)) as response:
        events = _events(response.iter_lines())
        response_id = next(events)["id"]
        assert httpx.post(f"{gateways[0].url}/v1/cancel", json={"id": response_id}).json() == {"cancelled": 1}
        rest = list(events)
    assert _finishes(rest) == ["cancelled"]


@pytest.mark.parametrize("prefix", ["msg_", "resp_"])
def test_cancel_by_the_id_of_another_family(gateways, slow_worker, prefix):
    """Anthropic message ids and Responses ids name the same request: `msg_<id>`, `resp_<id>`."""
    model = _served(gateways, slow_worker)
    with httpx.stream("POST", f"{gateways[1].url}/v1/chat/completions", json=_chat(model, stream=True)) as response:
        events = _events(response.iter_lines())
        request_id = next(events)["id"].removeprefix("chatcmpl-")
        answer = httpx.post(f"{gateways[0].url}/v1/cancel", json={"id": f"{prefix}{request_id}"})
        assert answer.json() == {"cancelled": 1}
        rest = list(events)
    assert _finishes(rest) == ["cancelled"]


FAMILY_STREAMS = {  # path, body, the key of the response id in the first event with one
    "messages": ("/v1/messages", lambda model, **extra: {
        "model": model, "max_tokens": 200, "stream": True, "messages": [{"role": "user", "content": "tick tock"}],
        **extra}),
    "responses": ("/v1/responses", lambda model, **extra: {
        "model": model, "max_output_tokens": 200, "stream": True, "input": "tick tock", "store": False, **extra}),
}


def _first_id(lines) -> str:
    """The response id of a named-event stream (Anthropic's message_start, Responses' response.created)."""
    for line in lines:
        if line.startswith("data: "):
            event = json.loads(line[6:])
            found = (event.get("message") or event.get("response") or {}).get("id")
            if found:
                return found
    raise AssertionError("the stream ended before naming its response")


@pytest.mark.parametrize("family", sorted(FAMILY_STREAMS))
@pytest.mark.parametrize("by", ["cancel_id", "id"])
def test_cancel_works_on_every_family(gateways, slow_worker, family, by):
    """`cancel_id` and the `msg_...`/`resp_...` ids the client saw both stop the run, from the other replica."""
    model = _served(gateways, slow_worker)
    path, body = FAMILY_STREAMS[family]
    cancel_id = uuid.uuid4().hex
    with httpx.stream("POST", f"{gateways[0].url}{path}", json=body(model, cancel_id=cancel_id)) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()
        response_id = _first_id(lines)
        wait_for(lambda: _in_flight(slow_worker) == 1, 5, "the request to be running")
        target = {"cancel_id": cancel_id} if by == "cancel_id" else {"id": response_id}
        assert httpx.post(f"{gateways[1].url}/v1/cancel", json=target).json() == {"cancelled": 1}
        list(lines)
    wait_for(lambda: _in_flight(slow_worker) == 0, 5, "the worker to abort the request")
    assert _cancels(slow_worker, cause="explicit") == 1


@pytest.fixture
def two_slot_worker(redis_url):
    model = f"pair-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--max-concurrency", "2")
    yield worker
    worker.stop()


@pytest.mark.cluster
def test_a_cancel_id_shared_by_two_runs_cancels_both(gateways, two_slot_worker, redis_client):
    model = _served(gateways, two_slot_worker)
    cancel_id = uuid.uuid4().hex
    body = _chat(model, stream=True, cancel_id=cancel_id)
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions", json=body) as first, \
            httpx.stream("POST", f"{gateways[1].url}/v1/chat/completions", json=body) as second:
        streams = [_events(first.iter_lines()), _events(second.iter_lines())]
        for events in streams:
            next(events), next(events)
        wait_for(lambda: _in_flight(two_slot_worker) == 2, 5, "both runs to be running")
        assert httpx.post(f"{gateways[1].url}/v1/cancel", json={"cancel_id": cancel_id}).json() == {"cancelled": 2}
        assert [_finishes(list(events)) for events in streams] == [["cancelled"], ["cancelled"]]
    assert _cancels(two_slot_worker, cause="explicit", phase="decode") == 2
    assert 0 < redis_client.ttl(keys.cancel_id_key(keys.cancel_group("", cancel_id=cancel_id))) <= 600 + 5


def test_the_first_run_to_finish_leaves_the_other_cancellable(gateways, two_slot_worker):
    model = _served(gateways, two_slot_worker)
    cancel_id = uuid.uuid4().hex
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, cancel_id=cancel_id)) as long_run:
        events = _events(long_run.iter_lines())
        next(events), next(events)
        short = httpx.post(f"{gateways[1].url}/v1/chat/completions",
                           json=_chat(model, cancel_id=cancel_id, max_tokens=2)).json()
        assert short["choices"][0]["finish_reason"] == "length"
        assert httpx.post(f"{gateways[1].url}/v1/cancel", json={"cancel_id": cancel_id}).json() == {"cancelled": 1}
        assert _finishes(list(events)) == ["cancelled"]
    # Both finished: a late cancel is a no-op, and stashes nothing for a later run.
    assert httpx.post(f"{gateways[0].url}/v1/cancel", json={"cancel_id": cancel_id}).json() == {"cancelled": 0}
    later = httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model, cancel_id=cancel_id, max_tokens=2))
    assert later.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.cluster
def test_cancel_before_the_request_is_sent(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    cancel_id = uuid.uuid4().hex
    assert httpx.post(f"{gateways[0].url}/v1/cancel", json={"cancel_id": cancel_id}).json() == {"cancelled": 0}
    result = httpx.post(f"{gateways[1].url}/v1/chat/completions", json=_chat(model, cancel_id=cancel_id)).json()
    assert result["choices"][0]["finish_reason"] == "cancelled"
    assert result["usage"]["completion_tokens"] == 0
    assert metric_value(slow_worker.url, "llmfleet_worker_requests_total") == 0  # never reached the worker


@pytest.mark.cluster
def test_stale_cancel_id_touches_no_later_run(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    short = {"max_tokens": 3}
    first = httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model, cancel_id="run-a", **short))
    assert first.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.post(f"{gateways[1].url}/v1/cancel", json={"cancel_id": "run-a"}).json() == {"cancelled": 0}
    second = httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model, cancel_id="run-b", **short))
    assert second.json()["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body, error_type", [
    ({}, "BadRequestError"),  # the rule "give cancel_id or id"
    ({"cancel_id": ""}, "Bad Request"),  # a schema error
    ({"unrelated": 1}, "BadRequestError"),
])
def test_an_empty_cancel_is_a_400(gateways, body, error_type):
    response = httpx.post(f"{gateways[0].url}/v1/cancel", json=body)
    assert response.status_code == 400
    assert response.json()["error"]["type"] == error_type


def test_queue_timeout_is_a_clear_503(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, cancel_id="hog")) as busy:
        busy_events = _events(busy.iter_lines())
        next(busy_events)
        waited = httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model), timeout=30)
        httpx.post(f"{gateways[0].url}/v1/cancel", json={"cancel_id": "hog"})
    assert waited.status_code == 503
    assert "queue timeout" in waited.json()["error"]["message"]


def test_request_deadline_ends_the_generation(gateways, slow_worker):
    model = _served(gateways, slow_worker)
    result = httpx.post(f"{gateways[1].url}/v1/chat/completions", json=_chat(model, timeout=1.0), timeout=30).json()
    choice = result["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("cancelled", "deadline")
    assert 5 <= result["usage"]["completion_tokens"] <= 40
    assert _cancels(slow_worker, cause="deadline") == 1


def test_worker_drain_finishes_open_streams(redis_url, redis_client, gateways):
    model = f"drain-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "50")
    _served(gateways, worker)
    with httpx.stream("POST", f"{gateways[0].url}/v1/chat/completions",
                      json=_chat(model, stream=True, max_tokens=40)) as response:
        events = _events(response.iter_lines())
        next(events)
        worker.popen.terminate()
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert _finishes(rest) == ["length"]
    assert worker.popen.wait(10) == 0
    assert not list(redis_client.scan_iter(match=f"llmfleet:worker:*-{worker.pid}-*"))


def _refuses_connections(url: str) -> bool:
    try:
        httpx.get(f"{url}/health", timeout=1)
    except httpx.ConnectError:
        return True
    return False


def test_gateway_drain_refuses_new_requests_and_finishes_open_ones(redis_url, slow_worker):
    """A draining gateway refuses new connections at once (a load balancer moves on to another
    replica); a request on a connection kept alive from before gets a 503 and that connection ends."""
    gateway = start_gateway(redis_url)
    model = _served([gateway], slow_worker)
    with httpx.Client(base_url=gateway.url) as client, \
            client.stream("POST", "/v1/chat/completions", json=_chat(model, stream=True, max_tokens=30)) as response:
        events = _events(response.iter_lines())
        next(events)
        assert client.get("/health").status_code == 200  # a second connection, idle in the pool
        gateway.popen.terminate()
        wait_for(lambda: _refuses_connections(gateway.url), 5, "the gateway to refuse new connections")
        refused = client.post("/v1/chat/completions", json=_chat(model))
        assert refused.status_code == 503
        assert refused.headers["connection"] == "close"
        rest = list(events)
    assert rest[-1] == "[DONE]"
    assert _finishes(rest) == ["length"]
    assert gateway.popen.wait(15) == 0


def test_disconnect_during_prefill(redis_url, gateways):
    model = f"prefill-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-first-token-delay", "30")
    try:
        _served(gateways, worker)
        with pytest.raises(httpx.ReadTimeout):  # no first token (so no headers) before we hang up
            httpx.post(f"{gateways[0].url}/v1/chat/completions", json=_chat(model, stream=True), timeout=1.0)
        wait_for(lambda: _in_flight(worker) == 0, 5, "the worker to abort the request")
        assert _cancels(worker, cause="disconnect", phase="prefill") == 1
    finally:
        worker.stop()


def test_a_timeout_that_runs_out_in_the_queue_ends_like_any_deadline(scripted_fleet):
    """A client's own `timeout` that passes before a worker starts the request: finish_reason
    cancelled, stop_reason deadline (as a run cut by its deadline), never a 5xx."""
    gateway = scripted_fleet[0][0]
    body = {"model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "late"}], "timeout": 1e-9}
    whole = httpx.post(f"{gateway.url}/v1/chat/completions", json=body, timeout=30)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("cancelled", "deadline")
    streamed = httpx.post(f"{gateway.url}/v1/chat/completions", json=body | {"stream": True}, timeout=30)
    assert streamed.status_code == 200 and '"finish_reason":"cancelled"' in streamed.text
