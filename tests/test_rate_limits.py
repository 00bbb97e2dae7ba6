"""Per-key limits held fleet-wide: two real gateways share one key's counters in Redis.

Figures (printed with -s): requests accepted of a burst against an rpm limit, and tokens served
by streams against a tpm limit.
"""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import anthropic
import httpx
import openai
import pytest

from tests.procs import metric_value, start_gateway, start_worker, wait_for
from tests.test_keys import create_key

pytestmark = pytest.mark.integration

MODEL = "limited-model"
TOKENS_PER_SECOND = 100  # the scripted worker's pace: a 20-token stream takes 0.2 s


@pytest.fixture(scope="module")
def limited_fleet(redis_url: str):
    worker = start_worker(redis_url, MODEL, "--max-concurrency", "64", "--scripted-tokens-per-second",
                          str(TOKENS_PER_SECOND))
    gateways = [start_gateway(redis_url, "--require-keys") for _ in range(2)]
    yield gateways
    for proc in [*gateways, worker]:
        proc.stop()


def _served(gateway, secret: str) -> bool:
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                        timeout=30, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                          "max_tokens": 1})
    return answer.status_code == 200


def _wait_until_served(gateways, secret: str) -> None:
    for gateway in gateways:  # each gateway's registry lists the worker within a second or so
        wait_for(lambda g=gateway: _served(g, secret), 15, "the model to be served")


@pytest.mark.cluster
async def test_rpm_holds_across_two_gateways(limited_fleet, redis_url):
    _name, warmup = create_key(redis_url)
    _wait_until_served(limited_fleet, warmup)
    _name, secret = create_key(redis_url, "--rpm", "60")
    clients = [httpx.AsyncClient(base_url=g.url, timeout=60, headers={"Authorization": f"Bearer {secret}"},
                                 limits=httpx.Limits(max_connections=20)) for g in limited_fleet]
    body = {"model": MODEL, "messages": [{"role": "user", "content": "one"}], "max_tokens": 1}
    try:
        started = time.monotonic()
        answers = await asyncio.gather(*(clients[i % 2].post("/v1/chat/completions", json=body)
                                         for i in range(200)))
        took = time.monotonic() - started
    finally:
        for client in clients:
            await client.aclose()
    accepted = [a for a in answers if a.status_code == 200]
    refused = [a for a in answers if a.status_code == 429]
    print(f"\nrpm 60, 200 requests over 2 gateways in {took:.2f}s: {len(accepted)} accepted, {len(refused)} refused")
    assert len(accepted) + len(refused) == 200
    assert abs(len(accepted) - 60) <= 0.02 * 60, len(accepted)
    assert len({a.request.url.port for a in accepted}) == 2  # both replicas served
    for answer in refused:
        assert int(answer.headers["retry-after"]) >= 1
        assert answer.headers["x-ratelimit-limit-requests"] == "60"
        assert answer.headers["x-ratelimit-remaining-requests"] == "0"
        assert answer.headers["x-ratelimit-reset-requests"].endswith("s")
        assert answer.json()["error"]["code"] == 429 and "60 requests" in answer.json()["error"]["message"]
    assert sorted(int(a.headers["x-ratelimit-remaining-requests"]) for a in accepted) == list(range(60))


async def test_tpm_with_streams_holds_within_5_percent(limited_fleet, redis_url):
    _name, warmup = create_key(redis_url)
    _wait_until_served(limited_fleet, warmup)
    limit = 2000
    _name, secret = create_key(redis_url, "--tpm", str(limit))
    clients = [openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key=secret, max_retries=0) for g in limited_fleet]
    served: list[int] = []  # prompt + completion tokens of each answered stream
    refusals = 0

    async def one_stream(client) -> bool:
        nonlocal refusals
        try:
            stream = await client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "alpha beta gamma delta epsilon"}],
                max_tokens=20, stream=True, stream_options={"include_usage": True})
        except openai.RateLimitError:
            refusals += 1
            return False
        async for chunk in stream:
            if chunk.usage is not None:
                served.append(chunk.usage.prompt_tokens + chunk.usage.completion_tokens)
        return True

    async def client_loop(client) -> None:
        while await one_stream(client):
            pass

    started = time.monotonic()
    await asyncio.gather(*(client_loop(clients[i % 2]) for i in range(4)))
    took = time.monotonic() - started
    total = sum(served)
    print(f"\ntpm {limit}, streams of 5 + 20 tokens, 4 clients over 2 gateways: {len(served)} streams, "
          f"{total} tokens served in {took:.2f}s ({total / limit - 1:+.1%}), {refusals} refused")
    assert refusals == 4
    assert abs(total - limit) <= 0.05 * limit, total


def _window_tokens(redis_client, name: str) -> int:
    return sum(int(v) for v in redis_client.hvals(f"llmfleet:rate:{{{name}}}:tokens"))


@pytest.mark.cluster
async def test_tokens_count_while_a_stream_flows(limited_fleet, redis_url, redis_client):
    name, secret = create_key(redis_url, "--tpm", "100000")
    _wait_until_served(limited_fleet, secret)
    before = _window_tokens(redis_client, name)
    client = openai.AsyncOpenAI(base_url=f"{limited_fleet[0].url}/v1", api_key=secret, max_retries=0)
    stream = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two"}],
                                                  max_tokens=300, stream=True)
    def counted_so_far() -> int | None:  # the prompt's 2 tokens and at least the 100 read
        counted = _window_tokens(redis_client, name) - before
        return counted if counted >= 102 else None

    text = ""  # a word a token; a loaded worker may merge neighbouring deltas into one chunk
    counted_midway = None
    async for chunk in stream:
        text += "".join(c.delta.content or "" for c in chunk.choices)
        if counted_midway is None and len(text.split()) >= 100:  # a third of the way: 2 s still to come
            counted_midway = await asyncio.to_thread(wait_for, counted_so_far, 1.5, "the stream's tokens to count")
    assert len(text.split()) == 300
    assert counted_midway is not None and counted_midway < 300
    wait_for(lambda: _window_tokens(redis_client, name) - before == 302, 5, "all 302 tokens to be counted")


def test_a_prompt_over_the_remaining_budget_is_refused_up_front(limited_fleet, redis_url):
    name, secret = create_key(redis_url, "--tpm", "50")
    _wait_until_served(limited_fleet, secret)  # 2 short requests: 2 prompt tokens and 2 completion
    gateway = limited_fleet[1]
    submitted = metric_value(gateway.url, "llmfleet_gateway_submitted_total", model=MODEL)
    answer = httpx.post(f"{gateway.url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                        timeout=30, json={"model": MODEL, "max_tokens": 1, "stream": True,
                                          "messages": [{"role": "user", "content": "word " * 80}]})
    assert answer.status_code == 429, answer.text
    assert "Request too large" in answer.json()["error"]["message"]
    assert answer.headers["x-ratelimit-limit-tokens"] == "50"
    assert int(answer.headers["x-ratelimit-remaining-tokens"]) == 46
    assert metric_value(gateway.url, "llmfleet_gateway_submitted_total", model=MODEL) == submitted  # never queued


@pytest.mark.cluster
async def test_max_parallel_frees_a_place_on_every_path(limited_fleet, redis_url):
    _name, secret = create_key(redis_url, "--max-parallel", "2")
    _wait_until_served(limited_fleet, secret)
    headers = {"Authorization": f"Bearer {secret}"}
    long_body = {"model": MODEL, "messages": [{"role": "user", "content": "one"}], "max_tokens": 2000, "stream": True}
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        streams = []
        for gateway in limited_fleet:  # one open stream on each replica
            request = client.build_request("POST", f"{gateway.url}/v1/chat/completions", json=long_body)
            response = await client.send(request, stream=True)
            assert response.status_code == 200
            lines = response.aiter_lines()  # kept: a dropped iterator closes the response
            await anext(lines)
            streams.append((response, lines))
        third = await client.post(f"{limited_fleet[0].url}/v1/chat/completions", json={**long_body, "stream": False})
        assert third.status_code == 429 and "in flight" in third.json()["error"]["message"]
        await streams[0][0].aclose()  # a client that goes away frees its place

        async def accepted() -> bool:
            answer = await client.post(f"{limited_fleet[1].url}/v1/chat/completions",
                                       json={**long_body, "max_tokens": 1, "stream": False})
            return answer.status_code == 200

        deadline = time.monotonic() + 5
        while not await accepted():
            assert time.monotonic() < deadline, "the disconnected stream's place was not freed"
            await asyncio.sleep(0.05)
        for _ in range(5):  # answered requests free theirs before the client reads the end
            assert await accepted()
        await streams[1][0].aclose()


def test_anthropic_clients_get_rate_limit_error(limited_fleet, redis_url):
    _name, secret = create_key(redis_url, "--rpm", "1")
    client = anthropic.Anthropic(base_url=limited_fleet[0].url, api_key=secret, max_retries=0)
    _wait_until_served(limited_fleet[:1], secret)  # the key's one request of the window
    with pytest.raises(anthropic.RateLimitError) as refused:
        client.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == "rate_limit_error"
    headers = refused.value.response.headers
    assert int(headers["retry-after"]) >= 1
    # Anthropic's own headers, the reset as an RFC 3339 time within the window; not OpenAI's.
    assert headers["anthropic-ratelimit-requests-limit"] == "1"
    assert headers["anthropic-ratelimit-requests-remaining"] == "0"
    reset = datetime.fromisoformat(headers["anthropic-ratelimit-requests-reset"])
    assert reset.tzinfo is not None and 0 < reset.timestamp() - time.time() <= 61
    assert "x-ratelimit-limit-requests" not in headers
