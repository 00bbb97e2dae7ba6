"""Hosts that fail apart: a worker cut off from Redis for 10 s, its requests taken over, then back.

Redis runs in the test's own network namespace; the gateway and two workers each run in a
namespace of their own, joined to it by a veth pair on a /30 of a private 10.250.X.0/24 that no
interface here uses. Cutting a worker off is `ip link set <its veth> down`, a pulled cable: its
TCP connections stall without an error, and what it had sent when the cable went arrives once
the link is back up (TCP retransmits it). The namespaces, links and processes are the test's
own and are removed by it. Needs root (`ip netns`); skips and says so without it.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass

import httpx
import pytest
import redis

from llmfleet import find_redis_server
from shared import keys
from shared.codec import decode, decode_batch
from shared.envelopes import ChunkEnvelope
from tests.conftest import leftover_keys
from tests.procs import Proc, free_port, metric_value, spawn, wait_for, wait_until_answers, wait_until_served

pytestmark = pytest.mark.integration

CUT_S = 10.0
# The victim's first token comes this long after it leases a request: late enough for the cut to
# come first (nothing has reached the client, so the stream can be taken over), early enough that
# its lease is still valid when the token's write goes out into the cut link.
FIRST_TOKEN_DELAY_S = 2.0
TOKENS_PER_SECOND = 5
STREAMED_TOKENS = 80  # 16 s on the rescuer: still streaming when the victim's link comes back
ANSWERED_TOKENS = 20


@dataclass
class Host:
    """A network namespace joined to the test's namespace by a veth pair."""
    name: str  # the namespace's name, and the name of its veth end on the test's side
    address: str  # its own address
    peer: str  # the test side's address on the link: where it reaches Redis

    def run(self, *args: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *args]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    used = subprocess.run(["ip", "-4", "addr"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-4", "route"], capture_output=True, text=True).stdout
    for third in random.sample(range(16, 250), 40):
        if f"10.250.{third}." not in used:
            return ipaddress.ip_network(f"10.250.{third}.0/24")
    pytest.skip("no free 10.250.X.0/24 for the test's links")


@contextlib.contextmanager
def _hosts(*roles: str):
    if os.geteuid() != 0:
        pytest.skip("needs root: the test makes network namespaces (ip netns)")
    tag = f"lfp{uuid.uuid4().hex[:4]}"
    addresses = list(_free_subnet().hosts())
    made: list[Host] = []
    try:
        for index, role in enumerate(roles):
            host = Host(f"{tag}-{role}", str(addresses[4 * index + 1]), str(addresses[4 * index]))
            try:
                _ip("netns", "add", host.name)
            except subprocess.CalledProcessError as exc:
                pytest.skip(f"ip netns is not permitted here: {exc.stderr.strip()}")
            made.append(host)
            _ip("link", "add", host.name, "type", "veth", "peer", "name", "eth1", "netns", host.name)
            _ip("addr", "add", f"{host.peer}/30", "dev", host.name)
            _ip("link", "set", host.name, "up")
            for command in (["addr", "add", f"{host.address}/30", "dev", "eth1"], ["link", "set", "eth1", "up"],
                            ["link", "set", "lo", "up"]):
                _ip("-n", host.name, *command)
        yield made
    finally:
        for host in made:  # deleting the namespace deletes its veth end, and so the pair
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)


def _start_redis(*hosts: Host) -> Proc:
    port = free_port()
    binds = ["127.0.0.1", *(host.peer for host in hosts)]
    proc = spawn("redis", [find_redis_server(), "--port", str(port), "--bind", *binds, "--protected-mode", "no",
                           "--save", "", "--appendonly", "no"])
    proc.url = f"redis://127.0.0.1:{port}/0"
    proc.extra["port"] = port
    client = redis.Redis.from_url(proc.url)

    def answers():
        with contextlib.suppress(redis.ConnectionError):
            return client.ping()

    wait_for(answers, 10, "redis-server to answer")
    return proc


def _redis_url(redis_proc: Proc, host: Host) -> str:
    return f"redis://{host.peer}:{redis_proc.extra['port']}/0"


def _start_gateway(redis_proc: Proc, host: Host) -> Proc:
    port = free_port()
    proc = spawn("gateway", host.run(sys.executable, "-m", "llmfleet", "gateway", "--host", host.address,
                                     "--port", str(port), "--redis-url", _redis_url(redis_proc, host)))
    proc.url = f"http://{host.address}:{port}"
    wait_until_answers(proc, "/ready", 30)
    return proc


def _start_worker(redis_proc: Proc, host: Host, model: str, *args: str) -> Proc:
    metrics_port = free_port()
    proc = spawn(f"worker-{host.name}", host.run(
        sys.executable, "-m", "llmfleet", "worker", "--model", model, "--engine", "scripted",
        "--redis-url", _redis_url(redis_proc, host), "--metrics-port", str(metrics_port), *args))
    proc.url = f"http://{host.address}:{metrics_port}"
    wait_for(lambda: _worker_id(redis_proc, proc), 30, f"{proc.name} to register", interval=0.2)
    return proc


def _worker_id(redis_proc: Proc, worker: Proc) -> str | None:
    if not worker.alive():
        raise RuntimeError(f"{worker.name} exited:\n{worker.log()[-3000:]}")
    prefix = keys.worker_key("")
    for key in redis.Redis.from_url(redis_proc.url).scan_iter(match=keys.worker_key("*")):
        if f"-{worker.pid}-" in key.decode():
            return key.decode()[len(prefix):]
    return None


def _lease_holders(client: redis.Redis) -> list[str]:
    """The worker holding each lease."""
    return [(client.get(key) or b"").decode() for key in client.scan_iter(match=keys.lease_key("*"))]


def _body(model: str, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tick tock"}], "max_tokens": max_tokens,
            "stream": stream}


def _expected(max_tokens: int) -> str:
    return " ".join(["tick", "tock"] * (max_tokens // 2))


def _in_background(call) -> dict:
    result: dict = {}
    result["thread"] = threading.Thread(target=lambda: result.update(call(result)), daemon=True)
    result["thread"].start()
    return result


def _answer(url: str, model: str):
    def call(_result: dict) -> dict:
        response = httpx.post(f"{url}/v1/chat/completions", json=_body(model, ANSWERED_TOKENS, False), timeout=90)
        return {"status": response.status_code, "body": response.text}
    return call


def _stream(url: str, model: str):
    """Read a stream, noting each event as it comes (`events`, shared with the test)."""
    def call(result: dict) -> dict:
        events = result.setdefault("events", [])
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=_body(model, STREAMED_TOKENS, True),
                          timeout=90) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
        return {"status": response.status_code}
    return call


def _stream_text(events: list[str]) -> str:
    return "".join(choice["delta"].get("content") or "" for event in events if event.startswith("{")
                   for choice in json.loads(event).get("choices", ()))


@contextlib.contextmanager
def _tapped_channels(client: redis.Redis):
    """Every message published on the gateways' channels while inside, as a list that fills as they
    come (a pattern subscription: presence counts subscribers of the channel itself, not this)."""
    messages: list[bytes] = []
    pubsub = client.pubsub()
    pubsub.psubscribe(**{keys.gateway_presence_channel("*"): lambda message: messages.append(message["data"])})
    thread = pubsub.run_in_thread(sleep_time=0.05, daemon=True)
    try:
        yield messages
    finally:
        thread.stop()
        thread.join(5)
        pubsub.close()


def _replies_by_worker(client: redis.Redis, messages: list[bytes]) -> dict[tuple[str, str], list[ChunkEnvelope]]:
    """Every envelope in the reply streams, then every one published on the gateways' channels
    (`messages`), by (request id, worker id), in the order of each."""
    batches = []
    for stream in client.scan_iter(match=keys.reply_stream("*")):
        for _entry_id, fields in client.xrange(stream):
            if keys.ENVELOPE_FIELD in fields:
                batches.append([fields[keys.ENVELOPE_FIELD]])
            elif keys.BATCH_FIELD in fields:
                batches.append(decode_batch(fields[keys.BATCH_FIELD]))
    batches += [decode_batch(message) for message in messages]
    found: dict[tuple[str, str], list[ChunkEnvelope]] = {}
    for batch in batches:
        for data in batch:
            envelope = decode(ChunkEnvelope, data)
            found.setdefault((envelope.request_id, envelope.worker_id), []).append(envelope)
    return found


def test_worker_cut_off_from_redis_is_taken_over_and_never_answers_twice():
    with _hosts("gw", "w1", "w2") as (gw, w1, w2), contextlib.ExitStack() as stops:
        redis_proc = _start_redis(gw, w1, w2)
        stops.callback(redis_proc.stop)
        client = redis.Redis.from_url(redis_proc.url)
        published = stops.enter_context(_tapped_channels(client))
        model = f"apart-{uuid.uuid4().hex[:6]}"
        gateway = _start_gateway(redis_proc, gw)
        stops.callback(gateway.stop)
        victim = _start_worker(redis_proc, w1, model, "--scripted-first-token-delay", str(FIRST_TOKEN_DELAY_S),
                               "--scripted-tokens-per-second", str(TOKENS_PER_SECOND))
        stops.callback(victim.stop)
        victim_id = _worker_id(redis_proc, victim)
        wait_until_served(gateway, model)

        answered = _in_background(_answer(gateway.url, model))
        streamed = _in_background(_stream(gateway.url, model))
        wait_for(lambda: len(_lease_holders(client)) == 2, 10, "the victim to lease both requests", interval=0.01)
        _ip("link", "set", w1.name, "down")
        cut_at = time.monotonic()
        stops.callback(lambda: subprocess.run(["ip", "link", "set", w1.name, "up"], capture_output=True))
        assert _stream_text(streamed.get("events", [])) == "", "the victim's first token came before the cut"

        rescuer = _start_worker(redis_proc, w2, model, "--claim-idle", "1",
                                "--scripted-tokens-per-second", str(TOKENS_PER_SECOND))
        stops.callback(rescuer.stop)
        rescuer_id = _worker_id(redis_proc, rescuer)
        wait_for(lambda: _lease_holders(client) == [rescuer_id] * 2, 20,
                 "the rescuer to take both requests over", interval=0.1)
        taken_over_after = time.monotonic() - cut_at
        time.sleep(max(0.0, CUT_S - (time.monotonic() - cut_at)))  # the cut lasts CUT_S: the scenario, not a wait
        _ip("link", "set", w1.name, "up")

        for pending in (answered, streamed):
            pending["thread"].join(90)
        done_after = time.monotonic() - cut_at
        print(f"taken over {taken_over_after:.1f}s after the cut; answers complete {done_after:.1f}s after it")

        assert answered["status"] == 200, answered["body"]
        choice = json.loads(answered["body"])["choices"][0]
        assert (choice["message"]["content"], choice["finish_reason"]) == (_expected(ANSWERED_TOKENS), "length")
        events = streamed["events"]
        assert not [event for event in events if '"error"' in event], events[-3:]
        assert _stream_text(events) == _expected(STREAMED_TOKENS)
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1

        # Once back, the victim wrote nothing more for the requests it lost. At most the write that was on
        # the wire when the cable went can land (TCP delivers it late; here it usually fails and is not
        # retried), and the gateway dropped whatever output landed while it followed the request. (The
        # victim's note that it had started a request, `ReplyPublisher.started`, holds no output: one
        # that came before the takeover was followed, a later one dropped.)
        wait_for(lambda: metric_value(victim.url, "llmfleet_worker_cancels_total", cause="lease_lost") == 2, 20,
                 "the victim to report both leases lost")
        replies = _replies_by_worker(client, list(published))
        from_victim = [envelope for (_rid, worker), envelopes in replies.items() if worker == victim_id
                       for envelope in envelopes]
        output = [envelope for envelope in from_victim if envelope.chunks]
        assert not [envelope for envelope in output if any(chunk.done for chunk in envelope.chunks)]
        assert [envelope.seq for envelope in output] in ([], [0]), from_victim
        assert len(output) <= metric_value(gateway.url, "llmfleet_gateway_stale_replies_total") <= len(from_victim)
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 2
        wait_for(lambda: not leftover_keys(client), 10, "the requests to be settled")
