"""Poison messages on a request stream are dead-lettered with the reason; the worker keeps serving."""

from __future__ import annotations

import msgpack
import openai
import pytest

from shared import keys
from tests.conftest import SCRIPTED_MODEL, leftover_keys
from tests.procs import wait_for

pytestmark = pytest.mark.integration

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
