"""Many gateways, many workers: requests flow through Redis and come back whole."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import redis

from shared import keys
from tests.conftest import SCRIPTED_MODEL, leftover_keys
from tests.procs import metric_value, wait_for

pytestmark = pytest.mark.integration


def expected_text(words: str, max_tokens: int) -> str:
    """The scripted engine repeats the last user message's words, one per token."""
    tokens = words.split()
    return " ".join(tokens[i % len(tokens)] for i in range(max_tokens))


@pytest.mark.cluster
async def test_100_concurrent_streams_through_two_gateways(scripted_fleet, redis_client):
    gateways, workers = scripted_fleet
    served_before = [metric_value(w.url, "llmfleet_worker_requests_total") for w in workers]
    in_streams_before = reply_stream_lengths(redis_client)
    # A minute for each call: a loaded CI machine (image builds beside this pass) stalls a connect past the SDK's 5 s.
    clients = [openai.AsyncOpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=60) for g in gateways]

    async def one(i: int) -> tuple[str, str | None, int]:
        words = f"request {i} says hello"
        stream = await clients[i % 2].chat.completions.create(
            model=SCRIPTED_MODEL, messages=[{"role": "user", "content": words}], max_tokens=12, stream=True,
            stream_options={"include_usage": True})
        text, finish, completion_tokens = "", None, 0
        async for chunk in stream:
            if chunk.usage is not None:
                completion_tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
        return text, finish, completion_tokens

    results = await asyncio.gather(*(one(i) for i in range(100)))
    for i, (text, finish, completion_tokens) in enumerate(results):
        assert text == expected_text(f"request {i} says hello", 12)
        assert finish == "length"
        assert completion_tokens == 12
    served = [metric_value(w.url, "llmfleet_worker_requests_total") - before
              for w, before in zip(workers, served_before, strict=True)]
    assert sum(served) == 100
    assert all(count > 0 for count in served), f"one worker served nothing: {served}"
    # On one server every reply came on its gateway's channel; a cluster's go to the reply streams.
    # (Compared stream by stream: earlier tests' gateways' streams expire meanwhile, and their entries with them.)
    grew = any(length > in_streams_before.get(stream, 0) for stream, length in reply_stream_lengths(redis_client).items())
    assert grew == isinstance(redis_client, redis.RedisCluster)
    wait_for(lambda: not leftover_keys(redis_client), 30, "request entries to be acknowledged")


def reply_stream_lengths(client: redis.Redis | redis.RedisCluster) -> dict[bytes, int]:
    return {stream: client.xlen(stream) for stream in client.scan_iter(match=keys.reply_stream("*"))}


@pytest.mark.cluster
def test_sync_sdk_non_streaming_and_streaming_agree(scripted_fleet):
    gateways, _ = scripted_fleet
    client = openai.OpenAI(base_url=f"{gateways[0].url}/v1", api_key="x", max_retries=0)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "one two three"}]
    whole = client.chat.completions.create(model=SCRIPTED_MODEL, messages=messages, max_tokens=5)
    assert whole.choices[0].message.content == "one two three one two"
    assert whole.choices[0].finish_reason == "length"
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (5, 5)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=SCRIPTED_MODEL, messages=messages, max_tokens=5, stream=True) if chunk.choices)
    assert streamed == whole.choices[0].message.content


def test_completions_with_n_and_stop(scripted_fleet):
    gateways, _ = scripted_fleet
    client = openai.OpenAI(base_url=f"{gateways[1].url}/v1", api_key="x", max_retries=0)
    result = client.completions.create(model=SCRIPTED_MODEL, prompt="alpha beta gamma", max_tokens=8, n=2,
                                       stop=["gamma"])
    assert [c.text for c in result.choices] == ["alpha beta ", "1:alpha 1:beta 1:"]
    assert [c.finish_reason for c in result.choices] == ["stop", "stop"]
    streamed = {0: "", 1: ""}
    for chunk in client.completions.create(model=SCRIPTED_MODEL, prompt="alpha beta gamma", max_tokens=8, n=2,
                                           stop=["gamma"], stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert [streamed[0], streamed[1]] == [c.text for c in result.choices]


def test_models_lists_live_models_and_health_endpoints(scripted_fleet):
    gateway = scripted_fleet[0][0]
    models = {m["id"]: m for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]}
    assert models[SCRIPTED_MODEL]["max_model_len"] == 4096  # other tests' models may be listed too
    assert models[SCRIPTED_MODEL]["object"] == "model"
    assert httpx.get(f"{gateway.url}/health").status_code == 200
    assert httpx.get(f"{gateway.url}/ready").status_code == 200
    # /metrics counts: one more answer for the model (prometheus_client prints a metric's name
    # even with nothing counted, so look at the sample).
    answered = {"family": "openai", "endpoint": "chat", "model": SCRIPTED_MODEL, "status": "200"}
    before = metric_value(gateway.url, "llmfleet_gateway_requests_total", **answered)
    httpx.post(f"{gateway.url}/v1/chat/completions", timeout=30, json={
        "model": SCRIPTED_MODEL, "messages": [{"role": "user", "content": "count me"}], "max_tokens": 2})
    assert metric_value(gateway.url, "llmfleet_gateway_requests_total", **answered) == before + 1
