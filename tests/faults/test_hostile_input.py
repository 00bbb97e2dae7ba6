"""Large or hostile input gets a clear 4xx, never a 500, a hang or gateway memory growth."""

from __future__ import annotations

import itertools
from pathlib import Path

import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL, leftover_keys

pytestmark = pytest.mark.integration

USER = [{"role": "user", "content": "hi"}]


def _post(client: httpx.Client, gateway, **kwargs) -> httpx.Response:
    return client.post(f"{gateway.url}/v1/chat/completions", headers={"content-type": "application/json"},
                       timeout=30, **kwargs)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


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
    # Small bodies share a kept-alive connection (a window is 200 requests, not 200 connections). The 6 MB
    # ones take a connection each: on one kept alive, the allocator settled only after ~150.
    big = "over the limit" in name
    client = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0 if big else 1))

    def send() -> httpx.Response:
        kwargs = request_kwargs
        if name == "chunked body over the limit":
            kwargs = {"content": _chunks(6 * 1024 * 1024)}  # a fresh generator for each request
        response = _post(client, gateway, **kwargs)
        assert response.status_code == status, response.text[:300]
        return response

    error = send().json()["error"]
    assert error["code"] == status and error["message"]
    assert not leftover_keys(redis_client)
    # No memory growth: the gateway keeps nothing of a refused request. Its resident size moves in
    # one-off steps while the allocator settles (+43 MiB within the first 50 chunked bodies, then
    # flat; on another run, +19 and +23 MiB in two windows of 30, then flat), so send windows of
    # requests until one grows by less than 4 MiB: a leak grows every window (a leak of what these
    # requests parse, 50 kB-6 MB each, adds 10 MiB or more a window), a settling allocator stops.
    window = 30 if big else 200
    sizes = [_rss_bytes(gateway.pid)]
    for _ in range(6):
        for _ in range(window):
            send()
        sizes.append(_rss_bytes(gateway.pid))
        if sizes[-1] - sizes[-2] < 4 * 1024 * 1024:
            break
    else:
        growth = [(after - before) // 2**20 for before, after in itertools.pairwise(sizes)]
        raise AssertionError(f"the gateway grew in every window of {window} requests: {growth} MiB")
    client.close()
    assert httpx.get(f"{gateway.url}/health").status_code == 200
