"""Poison messages on a request stream are dead-lettered with the reason; the worker keeps serving."""

from __future__ import annotations

import msgpack
import openai
import pytest

from shared import keys
from tests.conftest import SCRIPTED_MODEL, leftover_keys
from tests.procs import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.cluster]

POISON = [
    ({b"e": b"\xc1 not msgpack"}, "not a msgpack envelope"),
    ({b"e": msgpack.packb({"v": 99, "request_id": "r", "model": "m", "kind": "chat", "reply_to": "x",
                           "arrival": 0})}, "unsupported wire version"),
    ({b"e": msgpack.packb({"v": 1, "model": "m"})}, "malformed RequestEnvelope"),
    ({b"e": b"\x00" * (9 * 1024 * 1024)}, "exceeds"),
    ({b"something-else": b"1"}, "not a msgpack envelope"),
]


def test_poison_messages_are_dead_lettered(scripted_fleet, redis_client):
    gateways, _workers = scripted_fleet
    stream, dead = keys.request_stream(SCRIPTED_MODEL), keys.dead_letter_stream(SCRIPTED_MODEL)
    before = redis_client.xlen(dead)
    for fields, _reason in POISON:
        redis_client.xadd(stream, fields)
    wait_for(lambda: redis_client.xlen(dead) == before + len(POISON), 10, "every poison entry to be dead-lettered")
    letters = redis_client.xrange(dead)[-len(POISON):]
    reasons = sorted(fields[b"reason"].decode() for _id, fields in letters)
    for _fields, expected in POISON:
        assert any(expected in reason for reason in reasons), (expected, reasons)
    assert all(len(fields[b"data"]) <= 64 * 1024 for _id, fields in letters)
    client = openai.OpenAI(base_url=f"{gateways[0].url}/v1", api_key="x", max_retries=0)
    reply = client.chat.completions.create(model=SCRIPTED_MODEL, messages=[{"role": "user", "content": "still here"}],
                                           max_tokens=2)
    assert reply.choices[0].message.content == "still here"
    wait_for(lambda: not leftover_keys(redis_client), 5, "the request stream to be empty")


FUZZ_MODEL = "fuzz-envelopes"
FUZZ_ENTRIES = 300
GOOD = {"v": 1, "request_id": "0123abcd", "model": FUZZ_MODEL, "kind": "chat", "reply_to": "llmfleet:replies:{fuzz}",
        "arrival": 1.0, "deadline": 2.0, "stream": True, "body": {"messages": []}, "params": {"max_tokens": 4, "n": 1},
        "priority": "normal", "queue_deadline": 2.0}
# Per field, values a typed decoder must refuse (a wrong type, out of range, unknown).
WRONG = {"v": [2, "1", None], "request_id": [7, "", None, ["r"]], "model": [1.5, "", {}], "kind": ["transcribe", 3, None],
         "reply_to": [9, "", []], "arrival": ["soon", -1.0, None, {}], "deadline": ["later", -5, []],
         "stream": ["yes", 1, None], "body": [[1], "x", 5], "params": [[], "p", {"n": 0}, {"max_tokens": "many"},
                                                                     {"min_tokens": -1}, {"logit_bias": [1]}],
         "priority": ["urgent", 1], "queue_deadline": ["x", -2], "tenant": [5, []], "batch_replies": ["no", 0]}


def _poison(rng) -> dict[bytes, bytes]:
    """One stream entry no worker may run: garbage, a truncated envelope, or a valid one with one
    field made invalid or missing."""
    good = msgpack.packb(GOOD)
    choice = rng.randrange(6)
    if choice == 0:
        return {keys.ENVELOPE_FIELD: rng.randbytes(rng.randrange(1, 200))}
    if choice == 1:
        return {keys.ENVELOPE_FIELD: good[: rng.randrange(1, len(good))]}
    if choice == 2:
        return {keys.ENVELOPE_FIELD: msgpack.packb(rng.choice([[GOOD], "envelope", 42, None, [1, 2, 3]]))}
    if choice == 3:
        required = rng.choice(["request_id", "model", "kind", "reply_to", "arrival"])
        return {keys.ENVELOPE_FIELD: msgpack.packb({k: v for k, v in GOOD.items() if k != required})}
    if choice == 4:
        return {rng.choice([b"x", b"envelope", b"E"]): good}
    field = rng.choice(sorted(WRONG))
    return {keys.ENVELOPE_FIELD: msgpack.packb({**GOOD, field: rng.choice(WRONG[field])})}


def test_a_worker_dead_letters_hundreds_of_malformed_envelopes_and_serves_on(redis_url, redis_client):
    """Random and mutated entries written raw onto a worker's stream: the worker stays up,
    dead-letters every one (acknowledged, never redelivered: nothing left pending), counts them,
    and then serves a normal request."""
    import random

    from tests.procs import metric_value, start_gateway, start_worker, wait_until_served

    worker = start_worker(redis_url, FUZZ_MODEL, "--max-concurrency", "4", "--claim-idle", "1")
    gateway = start_gateway(redis_url)
    stream, dead = keys.request_stream(FUZZ_MODEL), keys.dead_letter_stream(FUZZ_MODEL)
    try:
        wait_until_served(gateway, FUZZ_MODEL)
        rng = random.Random(24)
        for _ in range(FUZZ_ENTRIES):
            redis_client.xadd(stream, _poison(rng))
        wait_for(lambda: redis_client.xlen(dead) == FUZZ_ENTRIES, 60, "every entry to be dead-lettered")
        assert redis_client.xlen(stream) == 0
        assert redis_client.xpending(stream, keys.WORKER_GROUP)["pending"] == 0
        # Nothing pending: nothing a reclaim could redeliver.
        assert metric_value(worker.url, "llmfleet_worker_poison_messages_total", model=FUZZ_MODEL) == FUZZ_ENTRIES
        assert worker.alive()
        reply = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0).chat.completions.create(
            model=FUZZ_MODEL, messages=[{"role": "user", "content": "still serving"}], max_tokens=2)
        assert reply.choices[0].message.content == "still serving"
    finally:
        gateway.stop()
        worker.stop()
        redis_client.delete(dead, stream)
