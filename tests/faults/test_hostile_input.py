"""Large or hostile input gets a clear 4xx, never a 500, a hang or gateway memory growth."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL, leftover_keys

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


def _post(gateway, **kwargs) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/chat/completions", headers={"content-type": "application/json"},
                      timeout=30, **kwargs)


def _chunks(total: int, size: int = 64 * 1024):
    for _ in range(total // size):
        yield b" " * size


CASES = [
    ("declared body over the limit", {"content": b'{"x": "' + b"a" * (5 * 1024 * 1024) + b'"}'}, 413),
    ("chunked body over the limit", {"content": _chunks(6 * 1024 * 1024)}, 413),
    ("deeply nested json", {"content": b"[" * 200_000 + b"]" * 200_000}, 400),
    ("invalid utf-8", {"content": b'{"model": "\xff\xfe", "messages": []}'}, 400),
    ("huge n", {"json": {"model": SCRIPTED_MODEL, "messages": USER, "n": 10**9}}, 400),
    ("huge max_tokens", {"json": {"model": SCRIPTED_MODEL, "messages": USER, "max_tokens": 10**12}}, 400),
    ("huge logit_bias", {"json": {"model": SCRIPTED_MODEL, "messages": USER,
                                  "logit_bias": {str(i): 1 for i in range(5000)}}}, 400),
    ("too many messages", {"json": {"model": SCRIPTED_MODEL, "messages": USER * 5000}}, 400),
]


@pytest.mark.parametrize("name, request_kwargs, status", CASES, ids=[c[0] for c in CASES])
def test_hostile_input(scripted_fleet, redis_client, name, request_kwargs, status):
    gateway = scripted_fleet[0][0]
    if name == "chunked body over the limit":
        request_kwargs = {"content": _chunks(6 * 1024 * 1024)}  # a fresh generator for each run
    response = _post(gateway, **request_kwargs)
    assert response.status_code == status, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == status and error["message"]
    assert not leftover_keys(redis_client)
    assert httpx.get(f"{gateway.url}/health").status_code == 200
