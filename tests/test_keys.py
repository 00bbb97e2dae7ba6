"""API keys on real gateways: the static --api-key, managed keys made with `llmfleet keys`,
refusals in each family's shape, revocation on every replica, restricted models, usage."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import anthropic
import httpx
import openai
import pytest

from tests.conftest import leftover_keys
from tests.procs import ROOT, metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration

MODEL = "keyed-model"
STATIC_KEY = "static-" + uuid.uuid4().hex


def llmfleet_keys(redis_url: str, *args: str) -> str:
    """Run `llmfleet keys ARGS`; its standard output."""
    done = subprocess.run([sys.executable, "-m", "llmfleet", "keys", *args, "--redis-url", redis_url],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def create_key(redis_url: str, *options: str) -> tuple[str, str]:
    """A new managed key: (its name, its secret, the last line `keys create` printed)."""
    name = "k-" + uuid.uuid4().hex[:10]
    secret = llmfleet_keys(redis_url, "create", "--name", name, *options).strip().splitlines()[-1]
    return name, secret


@pytest.fixture(scope="module")
def keyed_fleet(redis_url: str):
    """Two gateways that require keys (and accept a static one), and a scripted worker."""
    worker = start_worker(redis_url, MODEL, "--max-concurrency", "64")
    gateways = [start_gateway(redis_url, "--require-keys", "--api-key", STATIC_KEY) for _ in range(2)]
    headers = {"Authorization": f"Bearer {STATIC_KEY}"}
    for gateway in gateways:
        wait_for(lambda g=gateway: any(m["id"] == MODEL for m in httpx.get(
            f"{g.url}/v1/models", headers=headers, timeout=5).json()["data"]), 15, "the model to be listed")
    yield gateways
    for proc in [*gateways, worker]:
        proc.stop()


def _chat(gateway, key: str | None, model: str = MODEL, **extra) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{gateway.url}/v1/chat/completions", headers=headers, timeout=30, json={
        "model": model, "messages": [{"role": "user", "content": "one two three"}], "max_tokens": 4, **extra})


def test_no_key_or_a_wrong_one_is_a_401_in_openai_shape(keyed_fleet):
    gateway = keyed_fleet[0]
    for key in (None, "sk-wrong"):
        answer = _chat(gateway, key)
        assert answer.status_code == 401, answer.text
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
    assert httpx.get(f"{gateway.url}/v1/models", timeout=5).status_code == 401
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2)


def test_anthropic_routes_refuse_in_anthropic_shape(keyed_fleet):
    gateway = keyed_fleet[1]
    answer = httpx.post(f"{gateway.url}/v1/messages", timeout=10, headers={"x-api-key": "sk-wrong"},
                        json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert answer.status_code == 401
    assert answer.json() == {"type": "error", "error": {"type": "authentication_error",
                                                        "message": "Incorrect API key provided."}}
    client = anthropic.Anthropic(base_url=gateway.url, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError):
        client.messages.create(model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_probes_and_metrics_stay_open(keyed_fleet):
    for path in ("/health", "/ready", "/metrics"):
        assert httpx.get(f"{keyed_fleet[0].url}{path}", timeout=5).status_code == 200, path


def test_the_static_key_serves_both_families(keyed_fleet):
    gateway = keyed_fleet[0]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=STATIC_KEY, max_retries=0)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "one two"}],
                                            max_tokens=3)
    assert answer.choices[0].message.content == "one two one"
    message = anthropic.Anthropic(base_url=gateway.url, api_key=STATIC_KEY, max_retries=0).messages.create(
        model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "alpha beta"}])
    assert message.content[0].text == "alpha beta"


@pytest.mark.cluster
def test_a_managed_key_works_on_every_replica_until_revoked(keyed_fleet, redis_url):
    name, secret = create_key(redis_url, "--priority", "high")
    assert secret.startswith("sk-llmfleet-") and len(secret) > 40
    listed = llmfleet_keys(redis_url, "list")
    assert name in listed and secret not in listed
    for gateway in keyed_fleet:
        assert _chat(gateway, secret).status_code == 200
        # Anthropic's SDK sends x-api-key
        anthropic.Anthropic(base_url=gateway.url, api_key=secret, max_retries=0).messages.create(
            model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "alpha beta"}])
    llmfleet_keys(redis_url, "revoke", name)
    revoked_at = time.monotonic()
    for gateway in keyed_fleet:
        wait_for(lambda g=gateway: _chat(g, secret).status_code == 401, 5, "the revoked key to be refused")
    took = time.monotonic() - revoked_at
    print(f"\na revoked key was refused by both gateways {took:.2f}s after `llmfleet keys revoke`")
    assert took < 2.0, f"a revoked key still worked {took:.2f}s later"
    assert name not in llmfleet_keys(redis_url, "list")


def test_a_key_sees_only_its_models(keyed_fleet, redis_url):
    _name, secret = create_key(redis_url, "--models", "some-other-model")
    answer = _chat(keyed_fleet[0], secret)
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert "does not exist or you do not have access to it" in error["message"] and error["param"] == "model"
    listed = httpx.get(f"{keyed_fleet[0].url}/v1/models", headers={"Authorization": f"Bearer {secret}"}, timeout=5)
    assert listed.json()["data"] == []
    _name, allowed = create_key(redis_url, "--models", f"some-other-model,{MODEL}")
    assert _chat(keyed_fleet[0], allowed).status_code == 200
    listed = httpx.get(f"{keyed_fleet[0].url}/v1/models", headers={"Authorization": f"Bearer {allowed}"}, timeout=5)
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]


@pytest.mark.cluster
def test_usage_per_key_and_model_in_redis_and_prometheus(keyed_fleet, redis_url, redis_client):
    name, secret = create_key(redis_url)
    for i, gateway in enumerate([*keyed_fleet, keyed_fleet[0]]):
        streamed = i == 1
        answer = _chat(gateway, secret, stream=streamed, stream_options={"include_usage": True} if streamed else None)
        assert answer.status_code == 200, answer.text
    # Every call: 3 prompt tokens (the scripted worker counts words) and 4 completion tokens.
    expected = f"{name}  {MODEL}  3         9              12"

    def usage_shows_all():
        return expected in llmfleet_keys(redis_url, "usage", name)

    wait_for(usage_shows_all, 5, f"usage to read {expected!r}", interval=0.2)
    assert name in llmfleet_keys(redis_url, "usage")
    totals = {metric: sum(metric_value(g.url, f"llmfleet_gateway_key_{metric}_total", key=name, model=MODEL)
                          for g in keyed_fleet) for metric in ("requests", "prompt_tokens", "completion_tokens")}
    assert totals == {"requests": 3, "prompt_tokens": 9, "completion_tokens": 12}
    assert not [k for k in leftover_keys(redis_client) if ":key" in k or ":rate:" in k or ":usage:" in k]


def test_secrets_are_never_logged(keyed_fleet, redis_url):
    _name, secret = create_key(redis_url)
    assert _chat(keyed_fleet[0], secret).status_code == 200
    assert _chat(keyed_fleet[0], secret + "x").status_code == 401
    for gateway in keyed_fleet:
        assert secret not in gateway.log()


def test_a_gateway_without_keys_needs_none(scripted_fleet_free_gateway):
    assert _chat(scripted_fleet_free_gateway, None).status_code == 200


@pytest.fixture
def scripted_fleet_free_gateway(keyed_fleet, redis_url):
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, MODEL)
        yield gateway
    finally:
        gateway.stop()
