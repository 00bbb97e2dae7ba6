"""What a tenant makes, only that tenant touches: runs, cancel ids, sessions, stored responses and
streams, across two gateway replicas with managed keys required.

Each test has tenant B try something on tenant A's work, then has A do the same thing itself: A's
own attempt succeeds only if B's changed nothing (a run B had cancelled would have ended, and A's
cancel would find nothing), so every check here can fail.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import orjson
import pytest

from tests.procs import start_gateway, start_worker, wait_for
from tests.test_keys import create_key

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

MODEL = "tenant-model"
STATIC_KEY = "static-" + uuid.uuid4().hex
LONG = 2000  # tokens at 100/s: a run that lasts until it is cancelled


@pytest.fixture(scope="module")
def tenants(redis_url: str):
    """Two gateways requiring keys (and taking a static key, the anonymous tenant's), a paced
    scripted worker, and clients of tenants A and B, each on its own gateway."""
    worker = start_worker(redis_url, MODEL, "--scripted-tokens-per-second", "100", "--max-concurrency", "32")
    gateways = [start_gateway(redis_url, "--require-keys", "--api-key", STATIC_KEY) for _ in range(2)]
    (_, a_secret), (_, b_secret) = create_key(redis_url), create_key(redis_url)
    clients = [httpx.Client(base_url=gateway.url, timeout=60, headers={"Authorization": f"Bearer {secret}"})
               for gateway, secret in ((gateways[0], a_secret), (gateways[1], b_secret), (gateways[0], STATIC_KEY))]
    try:
        wait_for(lambda: any(m["id"] == MODEL for m in clients[0].get("/v1/models").json()["data"]), 15,
                 "the model to be listed")
        yield clients
    finally:
        for client in clients:
            client.close()
        for proc in [*gateways, worker]:
            proc.stop()


def chat(max_tokens: int = LONG, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "alpha beta gamma"}], "max_tokens": max_tokens,
            **extra}


class Stream:
    """A streaming request read event by event."""

    def __init__(self, client: httpx.Client, path: str, body: dict):
        self._context = client.stream("POST", path, json={**body, "stream": True})
        self.response = self._context.__enter__()
        assert self.response.status_code == 200, self.response.read()
        self._lines = self.response.iter_lines()

    def events(self) -> Iterator[dict]:
        for line in self._lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                yield orjson.loads(line[6:])

    def first(self) -> dict:
        return next(self.events())

    def finish_reasons(self) -> list[str]:
        """The finish reasons of the rest of the stream, read to its end."""
        reasons = [choice["finish_reason"] for event in self.events() for choice in event.get("choices", ())
                   if choice.get("finish_reason")]
        self._context.__exit__(None, None, None)
        return reasons


def cancel(client: httpx.Client, **target) -> httpx.Response:
    return client.post("/v1/cancel", json=target)


def test_another_tenants_cancel_id_cancels_nothing(tenants):
    a, b, _ = tenants
    cancel_id = "job-" + uuid.uuid4().hex[:8]
    stream = Stream(a, "/v1/chat/completions", chat(cancel_id=cancel_id))
    stream.first()
    assert cancel(b, cancel_id=cancel_id).json() == {"cancelled": 0}
    assert cancel(a, cancel_id=cancel_id).json() == {"cancelled": 1}  # A's run was still running
    assert stream.finish_reasons() == ["cancelled"]


def test_another_tenants_response_id_cancels_nothing(tenants):
    a, b, _ = tenants
    stream = Stream(a, "/v1/chat/completions", chat())
    response_id = stream.first()["id"]
    assert cancel(b, id=response_id).json() == {"cancelled": 0}
    assert cancel(a, id=response_id).json() == {"cancelled": 1}
    assert stream.finish_reasons() == ["cancelled"]


def test_an_early_cancel_waits_for_its_own_tenants_run_only(tenants):
    a, b, _ = tenants
    cancel_id = "early-" + uuid.uuid4().hex[:8]
    assert cancel(b, cancel_id=cancel_id).json() == {"cancelled": 0}  # stashed for B's next run of that id
    answer = a.post("/v1/chat/completions", json=chat(max_tokens=12, cancel_id=cancel_id)).json()
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 12
    mine = b.post("/v1/chat/completions", json=chat(max_tokens=12, cancel_id=cancel_id)).json()
    assert mine["choices"][0]["finish_reason"] == "cancelled"  # the stash was there all along, B's own


def test_cancel_by_session_id_stops_its_turn_for_its_tenant_only(tenants):
    a, b, _ = tenants
    session_id = "s-" + uuid.uuid4().hex[:8]
    assert a.post("/v1/sessions", json={"session_id": session_id}).status_code == 200
    stream = Stream(a, "/v1/chat/completions", chat(session_id=session_id))
    stream.first()
    refused = cancel(b, session_id=session_id)
    assert refused.status_code == 404 and refused.json()["error"]["param"] == "session_id"
    assert cancel(a, session_id=session_id).json() == {"cancelled": 1}
    assert stream.finish_reasons() == ["cancelled"]
    assert cancel(a, session_id=session_id).json() == {"cancelled": 0}  # nothing runs now


def test_the_anonymous_tenants_runs_are_its_own(tenants):
    """The static key serves the anonymous tenant, which a managed key cannot reach either."""
    _, b, anonymous = tenants
    cancel_id = "anon-" + uuid.uuid4().hex[:8]
    stream = Stream(anonymous, "/v1/chat/completions", chat(cancel_id=cancel_id))
    response_id = stream.first()["id"]
    assert cancel(b, cancel_id=cancel_id).json() == {"cancelled": 0}
    assert cancel(b, id=response_id).json() == {"cancelled": 0}
    assert cancel(anonymous, cancel_id=cancel_id).json() == {"cancelled": 1}
    assert stream.finish_reasons() == ["cancelled"]


def test_a_stored_response_is_its_tenants_alone(tenants):
    a, b, _ = tenants
    created = a.post("/v1/responses", json={"model": MODEL, "input": "one two three", "max_output_tokens": 4})
    assert created.status_code == 200, created.text
    response_id = created.json()["id"]
    for answer in (b.get(f"/v1/responses/{response_id}"), b.get(f"/v1/responses/{response_id}/input_items"),
                   b.post(f"/v1/responses/{response_id}/cancel"), b.delete(f"/v1/responses/{response_id}"),
                   b.post("/v1/responses", json={"model": MODEL, "input": "go on", "previous_response_id": response_id})):
        assert answer.status_code == 404, answer.text
        assert answer.json()["error"]["message"] == f"Response with id '{response_id}' not found."
    assert a.get(f"/v1/responses/{response_id}").json()["output"] == created.json()["output"]
    items = a.get(f"/v1/responses/{response_id}/input_items").json()
    assert [item["content"] for item in items["data"]] == [[{"type": "input_text", "text": "one two three"}]]
    follow = a.post("/v1/responses", json={"model": MODEL, "input": "go on", "previous_response_id": response_id})
    assert follow.status_code == 200, follow.text
    assert a.delete(f"/v1/responses/{response_id}").json()["deleted"] is True


def test_a_background_response_and_its_stream_are_its_tenants_alone(tenants):
    a, b, _ = tenants
    queued = a.post("/v1/responses", json={"model": MODEL, "input": "a b c", "background": True,
                                           "max_output_tokens": LONG}).json()
    response_id = queued["id"]
    assert b.post(f"/v1/responses/{response_id}/cancel").status_code == 404
    assert b.get(f"/v1/responses/{response_id}", params={"stream": "true"}).status_code == 404
    assert b.get(f"/v1/streams/{response_id}").status_code == 404
    with a.stream("GET", f"/v1/responses/{response_id}", params={"stream": "true"}) as events:
        assert events.status_code == 200 and next(events.iter_lines()).startswith("event: response.created")
    assert a.post(f"/v1/responses/{response_id}/cancel").json()["status"] == "cancelled"  # it was still running


def test_a_resumable_stream_is_resumed_by_its_tenant_alone(tenants):
    a, b, _ = tenants
    stream = Stream(a, "/v1/chat/completions", chat(resumable=True))
    response_id = stream.first()["id"]
    assert b.get(f"/v1/streams/{response_id}").status_code == 404
    with a.stream("GET", f"/v1/streams/{response_id}", headers={"Last-Event-ID": "0"}) as resumed:
        assert resumed.status_code == 200
        assert orjson.loads(next(line for line in resumed.iter_lines() if line.startswith("data: "))[6:])["id"] \
            == response_id
    assert cancel(a, id=response_id).json() == {"cancelled": 1}
    assert stream.finish_reasons() == ["cancelled"]


@pytest.mark.parametrize("target", [{}, {"cancel_id": "x", "id": "chatcmpl-y"}, {"session_id": "s", "cancel_id": "x"}])
def test_a_cancel_names_one_target(tenants, target):
    answer = cancel(tenants[0], **target)
    assert answer.status_code == 400 and answer.json()["error"]["param"] in ("cancel_id", "session_id", "id")
