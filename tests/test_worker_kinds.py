"""Workers say what they serve: the request kinds in each heartbeat, and a gateway that queues no
kind that no live worker of the model accepts (real gateway, real workers, real Redis)."""

from __future__ import annotations

import time
import uuid

import httpx
import msgpack
import pytest

from shared import keys
from shared.codec import decode, encode
from shared.envelopes import GENERATION_KINDS, TOKENIZER_KINDS, ChunkEnvelope, RequestEnvelope, WorkerInfo
from tests.procs import start_gateway, start_worker, wait_for, wait_until_served


def test_a_heartbeat_without_kinds_is_from_a_worker_that_accepts_the_kinds_of_its_time():
    """Older than the field, it generated and tokenized; it served no encoder kind (they came later)."""
    old = {"worker_id": "w", "model": "m", "max_model_len": 8, "capacity": 1, "v": 1}
    assert decode(WorkerInfo, msgpack.packb(old)).kinds == [*GENERATION_KINDS, *TOKENIZER_KINDS]
    assert decode(WorkerInfo, msgpack.packb({**old, "kinds": ["chat"]})).kinds == ["chat"]


@pytest.fixture(scope="module")
def chat_only(redis_url):
    """A gateway and a scripted worker of a fresh model started with `--kinds chat`."""
    model = f"chat-only-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--kinds", "chat")
    gateway = start_gateway(redis_url)
    wait_until_served(gateway, model)
    yield gateway, worker, model
    gateway.stop()
    worker.stop()


def _requests_added(redis_client, model: str) -> int:
    return redis_client.xinfo_stream(keys.request_stream(model))["entries-added"]


@pytest.mark.integration
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "one two"}),
    ("/v1/completions", {"prompt": "one two", "stream": True}),
    ("/tokenize", {"prompt": "one two"}),  # the scripted engine has no tokenizer at all
])
def test_a_kind_no_live_worker_accepts_is_a_503_at_once(chat_only, redis_client, path, body):
    gateway, _worker, model = chat_only
    queued_before = _requests_added(redis_client, model)
    started = time.monotonic()
    response = httpx.post(f"{gateway.url}{path}", json={"model": model, **body}, timeout=30)
    assert time.monotonic() - started < 5  # not the queue timeout (60 s)
    assert response.status_code == 503
    error = response.json()["error"]
    assert error["type"] == "ServiceUnavailableError" and error["code"] == 503
    kind = "tokenize" if path == "/tokenize" else "completion"
    assert f"accepts {kind} requests" in error["message"] and model in error["message"]
    assert _requests_added(redis_client, model) == queued_before  # never queued


@pytest.mark.integration
def test_the_kinds_a_worker_accepts_are_served(chat_only):
    gateway, _worker, model = chat_only
    response = httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30,
                          json={"model": model, "messages": [{"role": "user", "content": "a b"}], "max_tokens": 2})
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] == "a b"


@pytest.mark.integration
def test_a_worker_answers_a_kind_it_does_not_accept_with_a_503(chat_only, redis_client):
    """A gateway that has not yet heard of the worker may still queue it a completion: the worker
    answers at once, rather than leaving the client to wait out its deadline."""
    _gateway, worker, model = chat_only
    reply_to = f"llmfleet:replies:{{test-{uuid.uuid4().hex[:6]}}}"
    redis_client.xadd(reply_to, {"x": "1"})  # workers write only to reply streams that exist
    redis_client.expire(reply_to, 60)
    envelope = RequestEnvelope(request_id=uuid.uuid4().hex, model=model, kind="completion", reply_to=reply_to,
                               arrival=time.time(), deadline=time.time() + 30, body={"prompt": "a"})
    redis_client.xadd(keys.request_stream(model), {keys.ENVELOPE_FIELD: encode(envelope)})

    def answer():
        entries = redis_client.xrange(reply_to, "-", "+")
        return [decode(ChunkEnvelope, fields[keys.ENVELOPE_FIELD]) for _id, fields in entries
                if keys.ENVELOPE_FIELD in fields]

    replies = wait_for(answer, 10, "the worker's answer")
    terminal = replies[0].chunks[-1]
    assert terminal.done and terminal.error is not None
    assert (terminal.error.status, terminal.error.code) == (503, "kind_not_served")
    assert "serves only chat requests" in terminal.error.message
    assert worker.alive()
    wait_for(lambda: redis_client.xlen(keys.request_stream(model)) == 0, 5, "the request to be acknowledged")


def test_a_worker_refuses_kinds_its_engine_cannot_answer(redis_url):
    with pytest.raises(RuntimeError, match="cannot answer tokenize"):
        start_worker(redis_url, "never-served", "--kinds", "chat,tokenize")
