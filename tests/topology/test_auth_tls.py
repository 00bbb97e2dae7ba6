"""A Redis that asks who is calling: a password, an ACL user, TLS; real gateways and workers.

Each test runs a scripted worker and a gateway on a redis-server of its own, and checks that a
request makes the whole trip. A wrong credential must leave a gateway up but not ready, saying
why in its log, rather than failing requests one by one or not at all.
"""

from __future__ import annotations

import sys

import httpx
import pytest

from shared import redis_pool
from tests.conftest import leftover_keys
from tests.procs import free_port, spawn, start_gateway, start_worker, wait_for, wait_until_answers, wait_until_served
from tests.topology.servers import chat, expected_text, make_certificates, require, start_server

pytestmark = [pytest.mark.topology, pytest.mark.integration]

MODEL = "topology-model"


def _round_trip(url: str, gateway_url: str | None = None, gateway_env: dict[str, str] | None = None) -> None:
    """A worker on `url` and a gateway on `gateway_url` (or `url`): one request through them,
    and nothing left behind."""
    worker = start_worker(url, MODEL, "--max-concurrency", "4")
    gateway = start_gateway(gateway_url or url, env=gateway_env)
    try:
        wait_until_served(gateway, MODEL)
        answer = chat(gateway, MODEL, "who goes there", 7)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == expected_text("who goes there", 7)
        client = redis_pool.connect_sync(url)
        wait_for(lambda: not leftover_keys(client), 10, "the request's keys to be cleaned up")
    finally:
        gateway.stop()
        assert worker.stop() == 0, worker.log()[-3000:]


def _not_ready(url: str, *args: str, log_says: str) -> None:
    """A gateway whose Redis refuses it: alive, /ready 503, and its log says why."""
    port = free_port()
    gateway = spawn("gateway", [sys.executable, "-m", "llmfleet", "gateway", "--host", "127.0.0.1", "--port", str(port),
                                "--redis-url", url, *args])
    gateway.url = f"http://127.0.0.1:{port}"
    try:
        wait_until_answers(gateway, "/health", 30)
        assert httpx.get(f"{gateway.url}/ready").status_code == 503
        wait_for(lambda: log_says in gateway.log(), 10, f"the gateway to log {log_says!r}")
    finally:
        gateway.stop()


def test_requirepass():
    require("redis-server")
    server = start_server("--requirepass", "s3cret", url="redis://:s3cret@127.0.0.1:{port}/0")
    try:
        _round_trip(server.url)
        _not_ready(server.url.replace("s3cret", "wrong"), log_says="invalid username-password pair")
    finally:
        server.stop()


def test_acl_user_limited_to_llmfleet_keys_and_channels():
    """The default user is off; ours may touch only `llmfleet:*` keys and channels, and no
    @dangerous command (FLUSHALL, KEYS, CLIENT KILL, CONFIG ...)."""
    require("redis-server")
    server = start_server("--user", "default", "off",
                          "--user", "fleet", "on", ">pw", "~llmfleet:*", "&llmfleet:*", "+@all", "-@dangerous",
                          url="redis://fleet:pw@127.0.0.1:{port}/0")
    try:
        _round_trip(server.url)
        _not_ready(server.url.replace("fleet:pw", "fleet:nope"), log_says="invalid username-password pair")
    finally:
        server.stop()


def test_tls_with_a_ca_of_our_own(tmp_path):
    """No plain port at all: the worker names the CA in its URL, the gateway with
    LLMFLEET_REDIS_CA_FILE; a gateway that does not trust the CA is not ready."""
    require("redis-server", "openssl")
    certs = make_certificates(tmp_path)
    port = free_port()
    server = start_server("--port", "0", "--tls-port", str(port), "--tls-cert-file", str(certs.cert),
                          "--tls-key-file", str(certs.key), "--tls-ca-cert-file", str(certs.ca),
                          "--tls-auth-clients", "no", port=free_port(),
                          url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={certs.ca}")
    url = f"rediss://127.0.0.1:{port}/0"
    try:
        _round_trip(server.url, url, gateway_env={"LLMFLEET_REDIS_CA_FILE": str(certs.ca)})
        _not_ready(url, log_says="certificate verify failed")
    finally:
        server.stop()

