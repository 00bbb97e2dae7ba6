"""Workers killed with SIGKILL: a request is taken over, or ends with a clear error; never a hang."""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid

import httpx
import pytest

from gateway.fleet.registry import PRESENCE_TRUST_S
from shared import keys
from tests.conftest import leftover_keys
from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def gateway(redis_url):
    proc = start_gateway(redis_url)
    yield proc
    proc.stop()


def _body(model: str, stream: bool, max_tokens: int = 20) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "tick tock"}], "max_tokens": max_tokens,
            "stream": stream}


def _post_in_background(url: str, body: dict) -> dict:
    result: dict = {}

    def call():
        started = time.monotonic()
        response = httpx.post(url, json=body, timeout=60)
        result.update(status=response.status_code, body=response.text, seconds=time.monotonic() - started)

    result["thread"] = threading.Thread(target=call)
    result["thread"].start()
    return result


def _stream_text(body_text: str) -> str:
    text = ""
    for line in body_text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:]).get("choices", ()):
                text += choice["delta"].get("content") or ""
    return text


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.cluster
def test_worker_killed_before_the_first_token_is_replaced(redis_url, redis_client, gateway, stream):
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-first-token-delay", "60")
    wait_until_served(gateway, model)
    pending = _post_in_background(f"{gateway.url}/v1/chat/completions", _body(model, stream))
    wait_for(lambda: metric_value(doomed.url, "llmfleet_worker_in_flight") == 1, 10, "the doomed worker to claim it")
    doomed.kill()
    rescuer = start_worker(redis_url, model, "--claim-idle", "1")
    try:
        pending["thread"].join(30)
        print(f"request answered {pending['seconds']:.2f}s after it was sent (worker killed, rescuer started)")
        assert pending["status"] == 200, pending["body"]
        text = _stream_text(pending["body"]) if stream else json.loads(pending["body"])["choices"][0]["message"][
            "content"]
        assert text == " ".join(["tick", "tock"] * 10)
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 1
        wait_for(lambda: not leftover_keys(redis_client), 5, "the request entry to be acknowledged")
    finally:
        rescuer.stop()


@pytest.mark.cluster
def test_non_streaming_request_is_rerun_after_a_mid_generation_death(redis_url, gateway):
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-tokens-per-second", "10")
    rescuer = None
    try:
        wait_until_served(gateway, model)
        pending = _post_in_background(f"{gateway.url}/v1/chat/completions", _body(model, False))
        wait_for(lambda: metric_value(doomed.url, "llmfleet_worker_in_flight") == 1, 10, "the worker to claim it")
        time.sleep(0.5)  # mid-generation: some tokens made, none sent (non-streaming)
        doomed.kill()
        rescuer = start_worker(redis_url, model, "--claim-idle", "1")
        pending["thread"].join(30)
        assert pending["status"] == 200
        choice = json.loads(pending["body"])["choices"][0]
        assert (choice["finish_reason"], choice["message"]["content"]) == ("length", " ".join(["tick", "tock"] * 10))
    finally:
        if rescuer is not None:
            rescuer.stop()
        doomed.kill()


@pytest.mark.parametrize("stream", [False, True])
def test_a_killed_workers_silent_request_is_handed_to_another_at_once(redis_url, gateway, stream):
    """A generation that has sent nothing yet (a non-streaming one, 20 s long; a stream whose first
    token would take a minute) has its worker tell the gateway, after a quarter of a second, that
    it runs it: killed, the worker is found gone by its presence channel, and the request is rung
    for the other worker, whose sweep would not reclaim it for a minute."""
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    slow = ("--scripted-first-token-delay", "60") if stream else ("--scripted-tokens-per-second", "10")
    doomed = start_worker(redis_url, model, *slow)
    rescuer = None
    try:
        wait_until_served(gateway, model)
        pending = _post_in_background(f"{gateway.url}/v1/chat/completions", _body(model, stream, 200))
        wait_for(lambda: metric_value(doomed.url, "llmfleet_worker_in_flight") == 1, 10, "the worker to claim it")
        rescuer = start_worker(redis_url, model, "--claim-idle", "60")
        wait_for(lambda: metric_value(gateway.url, "llmfleet_gateway_live_workers", model=model) == 2, 10,
                 "the second worker to be live")
        time.sleep(max(0.0, PRESENCE_TRUST_S + 0.5 - (time.time() - metric_value(
            gateway.url, "process_start_time_seconds"))))
        doomed.kill()
        killed_at = time.monotonic()
        pending["thread"].join(30)
        print(f"answered {time.monotonic() - killed_at:.2f}s after the kill")
        assert pending.get("status") == 200, pending.get("body")
        text = _stream_text(pending["body"]) if stream else json.loads(pending["body"])["choices"][0]["message"][
            "content"]
        assert text == " ".join(["tick", "tock"] * 100)
        assert '"error"' not in pending["body"]
        assert metric_value(gateway.url, "llmfleet_gateway_workers_found_gone_total", model=model) == 1
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 1
    finally:
        if rescuer is not None:
            rescuer.stop()
        doomed.kill()


@pytest.mark.cluster
def test_worker_killed_mid_stream_ends_the_stream_with_an_error(redis_url, redis_client, gateway):
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-tokens-per-second", "10")
    wait_until_served(gateway, model)
    with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=_body(model, True, 200),
                      timeout=30) as response:
        lines = response.iter_lines()
        for _ in range(6):
            next(lines)
        doomed.kill()
        killed_at = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
        surfaced_after = time.monotonic() - killed_at
    error = json.loads(rest[-2][6:])["error"]
    assert (error["code"], error["type"]) == (502, "BadGatewayError")
    assert rest[-1] == "data: [DONE]"
    print(f"worker death surfaced to the client after {surfaced_after:.2f}s")
    assert surfaced_after < 6.0, f"the death took {surfaced_after:.1f}s to reach the client"
    # A worker that comes later must not run the half-sent request again.
    rescuer = start_worker(redis_url, model, "--claim-idle", "1")
    try:
        wait_for(lambda: not leftover_keys(redis_client), 10, "the dead worker's entry to be settled")
        assert metric_value(rescuer.url, "llmfleet_worker_generated_tokens_total") == 0
    finally:
        rescuer.stop()


def test_a_worker_sending_chunks_is_alive_while_its_heartbeat_key_is_missing(redis_url, redis_client, gateway):
    """A failover or a Redis restart loses the heartbeat key until the worker's next beat; a worker
    that is sending a stream's chunks meanwhile lives, and the stream finishes whole."""
    model = f"beatless-{uuid.uuid4().hex[:6]}"
    worker = start_worker(redis_url, model, "--scripted-tokens-per-second", "10")
    try:
        wait_until_served(gateway, model)
        heartbeat = next(key for key in redis_client.scan_iter(match=keys.worker_key("*"))
                         if f"-{worker.pid}-" in key.decode())
        erasing = threading.Event()

        def erase_the_heartbeat():  # faster than the worker writes it (every second)
            while erasing.is_set():
                redis_client.delete(heartbeat)
                time.sleep(0.02)

        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=_body(model, True, 30),
                          timeout=30) as response:
            lines = response.iter_lines()
            next(lines)
            erasing.set()
            threading.Thread(target=erase_the_heartbeat, daemon=True).start()
            try:
                body = "\n".join(lines)
            finally:
                erasing.clear()
        assert '"error"' not in body, body[-500:]
        assert _stream_text(body) == " ".join(["tick", "tock"] * 15)
    finally:
        worker.stop()


def _stream_chunks(body_text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in body_text.splitlines() if line.startswith("data: {")]


@contextlib.contextmanager
def _a_stream_whose_worker_dies(redis_url, gateway, path: str, body: dict, lines_before: int,
                                *rescuer_args: str, headers: dict | None = None, temperature: float = 0,
                                doomed_args: tuple[str, ...] = ()):
    """POST a stream of 60 tokens to `path` on a scripted worker (20 tokens/s, `doomed_args`),
    SIGKILL the worker after `lines_before` lines and start another; yields (model, rescuer, every
    line of the stream). `body` has no model: the model is new for each call. Greedy, or sampled
    with a `temperature` (the scripted engine's text is the same)."""
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", *doomed_args)
    rescuer = None
    try:
        wait_until_served(gateway, model)
        with httpx.stream("POST", f"{gateway.url}{path}", json={**body, "model": model, "temperature": temperature,
                                                                "stream": True},
                          headers=headers, timeout=60) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(lines_before)]
            doomed.kill()
            rescuer = start_worker(redis_url, model, "--claim-idle", "1", *rescuer_args)
            yield model, rescuer, [*seen, *lines]
    finally:
        if rescuer is not None:
            rescuer.stop()
        doomed.kill()


def _events(lines: list[str]) -> list[dict]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


FROM_TOKENS, FROM_TEXT, AGAIN = "continuing it from the engine's tokens", "continuing it from its text", \
    "running it again"  # the rescuer's word for how it takes a stream over (worker/runner.py)


@pytest.mark.parametrize(("sampling", "engine_tokens", "migration_limit", "how"), [
    ({"temperature": 0}, True, 3, FROM_TOKENS), ({"temperature": 0}, False, 3, AGAIN),
    ({"temperature": 0.8}, True, 3, FROM_TOKENS), ({"temperature": 0.8}, False, 3, FROM_TEXT),
    ({"temperature": 0.8, "seed": 7}, True, 3, AGAIN),
    ({"temperature": 0}, True, 0, None), ({"temperature": 0.8}, True, 0, None)])
def test_a_stream_goes_on_on_another_worker_when_its_worker_dies(redis_url, redis_client, gateway, sampling,
                                                                 engine_tokens, migration_limit, how):
    """SIGKILL of the worker streaming a request: the worker that takes it over continues it from
    the engine's tokens its client was sent, which its worker sent with each delta (the scripted
    engine, as vLLM's worker, goes on after them). From a worker that did not send them, a greedy
    stream is run again, and the gateway joins that replay where the client's stream stood; a
    sampled one is continued from the text its gateway saved (the scripted engine goes on with its
    script after that text); a seeded one is run again whatever it sent (the same sample):
    gateway/fleet/replay.py. Either way one stream, no error, no text repeated or missing, usage
    counted once. With --migration-limit 0 the stream ends with the error it had before."""
    body = {**_body("", True, 60), "stream_options": {"include_usage": True, "include_timings": True}, **sampling}
    tokens = () if engine_tokens else ("--no-scripted-engine-tokens",)
    # 12 lines: the role chunk and some tokens, with their blank lines.
    with _a_stream_whose_worker_dies(redis_url, gateway, "/v1/chat/completions", body, 12, "--migration-limit",
                                     str(migration_limit), *tokens, temperature=sampling["temperature"],
                                     doomed_args=tokens) as (model, rescuer, lines):
        text = "\n".join(lines)
        chunks = _stream_chunks(text)
        if migration_limit == 0:
            error = chunks[-1]["error"]
            assert (error["code"], error["type"]) == (502, "BadGatewayError")
            assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 0
            return
        assert not any("error" in c for c in chunks), text[-500:]
        assert _stream_text(text) == " ".join(["tick", "tock"] * 30)
        assert [c["choices"][0]["delta"].get("role") for c in chunks if c["choices"]].count("assistant") == 1
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 60)
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1
        assert metric_value(gateway.url, "llmfleet_gateway_migrations_total", model=model) == 1
        # The takeover's own prefill is timed once (its first token), for a replay and a continuation alike.
        assert metric_value(rescuer.url, "llmfleet_worker_time_to_first_token_seconds_count") == 1
        assert how in rescuer.log()
        # One request's timings, the takeover a stage of them: the queue and prefill are the first
        # worker's (at once, not the rescuer's wait for the death to be seen), the pause the client saw is
        # the migration, and the decode is the rest.
        timings = chunks[-1]["timings"]
        assert timings["queue_s"] < 0.5 and timings["prefill_s"] < 0.5, timings
        assert timings["migration_s"] > 0.3, timings
        stages = sum(timings[stage] for stage in ("queue_s", "prefill_s", "migration_s", "decode_s", "relay_s"))
        assert stages == pytest.approx(timings["total_s"], abs=0.1), timings
        wait_for(lambda: not leftover_keys(redis_client), 10, "the request's keys to be settled")


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_killed_workers_stream_is_taken_over_once_its_connection_closes(redis_url, gateway, temperature):
    """SIGKILL closes the worker's connections: its gateway, finding no subscriber left on the
    worker's presence channel, takes the lease back and rings the model's takeover doorbell, and
    the waiting worker takes the stream over at once, before the lease could lapse. The stream goes
    on whole."""
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-tokens-per-second", "20")
    rescuer = None
    try:
        wait_until_served(gateway, model)
        body = {**_body(model, True, 200), "temperature": temperature}  # 10 s
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(6)]
            rescuer = start_worker(redis_url, model)  # with the default sweep (--claim-idle 3)
            wait_for(lambda: metric_value(gateway.url, "llmfleet_gateway_live_workers", model=model) == 2, 10,
                     "the second worker to be live")
            # A gateway judges by presence once its own link to Redis is PRESENCE_TRUST_S old.
            time.sleep(max(0.0, PRESENCE_TRUST_S + 0.5 - (time.time() - metric_value(
                gateway.url, "process_start_time_seconds"))))
            doomed.kill()
            last, gaps, rest = time.monotonic(), [], []
            for line in lines:
                rest.append(line)
                if line.startswith("data: "):
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
        text = "\n".join([*seen, *rest])
        assert '"error"' not in text, text[-500:]
        assert _stream_text(text) == " ".join(["tick", "tock"] * 100)
        print(f"the longest wait for a chunk after the kill: {max(gaps):.2f}s")
        assert metric_value(gateway.url, "llmfleet_gateway_workers_found_gone_total", model=model) == 1
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1
        assert metric_value(gateway.url, "llmfleet_gateway_migration_pause_seconds_count", model=model) == 1
    finally:
        if rescuer is not None:
            rescuer.stop()
        doomed.kill()


def test_a_taken_over_stream_goes_ahead_of_new_work_on_a_full_worker(redis_url, gateway):
    """The only other worker has every slot busy (one, with a 100 s stream): it takes the dead
    worker's stream over in the slot it keeps for takeovers (`--takeover-slots`, default 1), and
    the stream ends whole while the long one still runs. Without that slot it would wait for the
    long stream's end."""
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    rescuer = start_worker(redis_url, model, "--max-concurrency", "1", "--claim-idle", "60",
                           "--scripted-tokens-per-second", "20")
    doomed = None
    try:
        wait_until_served(gateway, model)
        url = f"{gateway.url}/v1/chat/completions"
        with httpx.stream("POST", url, json=_body(model, True, 2000), timeout=60) as long_one:  # 100 s
            long_lines = long_one.iter_lines()
            next(long_lines)
            doomed = start_worker(redis_url, model, "--max-concurrency", "1", "--scripted-tokens-per-second", "20")
            wait_for(lambda: metric_value(gateway.url, "llmfleet_gateway_live_workers", model=model) == 2, 10,
                     "the second worker to be live")
            time.sleep(max(0.0, PRESENCE_TRUST_S + 0.5 - (time.time() - metric_value(
                gateway.url, "process_start_time_seconds"))))
            body = {**_body(model, True, 200), "temperature": 0.8}  # 10 s, on the only free slot: the doomed one's
            with httpx.stream("POST", url, json=body, timeout=httpx.Timeout(60, read=20)) as response:
                lines = response.iter_lines()
                seen = [next(lines) for _ in range(6)]
                doomed.kill()
                text = "\n".join([*seen, *lines])
            assert metric_value(rescuer.url, "llmfleet_worker_in_flight") == 1  # the long stream runs on
        assert '"error"' not in text, text[-500:]
        assert _stream_text(text) == " ".join(["tick", "tock"] * 100)
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1
    finally:
        rescuer.stop()
        if doomed is not None:
            doomed.kill()


def test_each_choice_of_a_sampled_stream_goes_on_where_it_stood_with_its_logprobs(redis_url, redis_client, gateway):
    """A sampled stream of two choices with logprobs, its worker SIGKILLed: the worker that takes it
    over continues each choice from the text its client was sent, as a request of its own; every
    token comes once with its logprobs, and the usage counts both choices' tokens once. (The
    scripted engine writes a continued choice's words without its "1:" mark.)"""
    body = {**_body("", True, 60), "n": 2, "logprobs": True, "top_logprobs": 1,
            "stream_options": {"include_usage": True}}
    with _a_stream_whose_worker_dies(redis_url, gateway, "/v1/chat/completions", body, 12,
                                     temperature=0.8) as (model, rescuer, lines):
        text = "\n".join(lines)
        chunks = _stream_chunks(text)
        assert not any("error" in c for c in chunks), text[-500:]
        choices = [choice for c in chunks for choice in c["choices"]]
        for index in (0, 1):
            mine = [choice for choice in choices if choice["index"] == index]
            words = "".join(choice["delta"].get("content") or "" for choice in mine).split()
            assert [word.removeprefix("1:") for word in words] == ["tick", "tock"] * 30, index
            logprobs = [entry for choice in mine for entry in (choice.get("logprobs") or {}).get("content") or ()]
            assert len(logprobs) == 60, index
            assert [choice["finish_reason"] for choice in mine if choice["finish_reason"]] == ["length"]
        usage = chunks[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (2, 120)
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1
        # Two engine requests, one first token: the continuation's prefill is timed once.
        assert metric_value(rescuer.url, "llmfleet_worker_time_to_first_token_seconds_count") == 1
        wait_for(lambda: not leftover_keys(redis_client), 10, "the request's keys to be settled")


def test_a_stop_string_across_the_break_ends_a_continued_choice(redis_url, gateway):
    """A stop string begun in the text a client was sent and ended by the continuation is found
    (the engine sees that text as prompt). The scripted engine writes choice 1's words as "1:tick"
    and a continued choice's without the mark, so "tick tock" and "tock tick", which end choice 0
    at once, can occur in choice 1 only across the break: choice 1 ends there, with no unmarked word."""
    body = {**_body("", True, 60), "n": 2, "stop": ["tick tock", "tock tick"]}
    with _a_stream_whose_worker_dies(redis_url, gateway, "/v1/chat/completions", body, 12,
                                     temperature=0.8) as (_model, _rescuer, lines):
        text = "\n".join(lines)
        chunks = _stream_chunks(text)
        assert not any("error" in c for c in chunks), text[-500:]
        second = [choice for c in chunks for choice in c["choices"] if choice["index"] == 1]
        words = "".join(choice["delta"].get("content") or "" for choice in second).split()
        assert len(words) >= 2 and all(word.startswith("1:") for word in words), words
        assert [choice["finish_reason"] for choice in second if choice["finish_reason"]] == ["stop"]


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_stopping_worker_hands_its_long_runs_over_at_its_drain_deadline(redis_url, redis_client, gateway,
                                                                         temperature):
    """SIGTERM to a worker running a stream and a non-streaming request, each 10 s long, with
    --drain-timeout 1: at its deadline it hands both to the other worker and exits, instead of
    holding the stop for 10 s. Both are rung on the takeover doorbell (the other worker's sweep
    would not reclaim them for a minute). The stream goes on: a greedy one joined where it stood,
    a sampled one continued from there (its worker's last chunk tells its gateway to save what
    was sent, and the gateway rings it); the other request is answered whole."""
    model = f"draining-{uuid.uuid4().hex[:6]}"
    stopping = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--drain-timeout", "1")
    rescuer = None
    try:
        wait_until_served(gateway, model)
        whole = _post_in_background(f"{gateway.url}/v1/chat/completions", _body(model, False, 200))
        body = {**_body(model, True, 200), "temperature": temperature}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(6)]
            wait_for(lambda: metric_value(stopping.url, "llmfleet_worker_in_flight") == 2, 10, "both to run")
            rescuer = start_worker(redis_url, model, "--claim-idle", "60")
            signalled = time.monotonic()
            assert stopping.stop(timeout=20) == 0
            stopped_after = time.monotonic() - signalled
            text = "\n".join([*seen, *lines])
        print(f"the stopping worker exited {stopped_after:.1f}s after SIGTERM")
        assert stopped_after < 6, "the worker held its stop for the runs instead of handing them over"
        assert '"error"' not in text, text[-500:]
        assert _stream_text(text) == " ".join(["tick", "tock"] * 100)
        whole["thread"].join(30)
        assert whole.get("status") == 200, whole.get("body")
        assert json.loads(whole["body"])["choices"][0]["message"]["content"] == " ".join(["tick", "tock"] * 100)
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1  # the stream; the other reruns
        assert metric_value(gateway.url, "llmfleet_gateway_migrations_total", model=model, cause="drain") == 1
        wait_for(lambda: not leftover_keys(redis_client), 10, "the requests' keys to be settled")
    finally:
        if rescuer is not None:
            rescuer.stop()
        stopping.kill()


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_an_anthropic_stream_goes_on_as_one_message_when_its_worker_dies(redis_url, gateway, temperature):
    """The join and the continuation are below the APIs: an Anthropic Messages stream, greedy or
    sampled, whose worker is SIGKILLed mid-stream is one message, its text whole, with no error
    event."""
    body = {"max_tokens": 60, "messages": [{"role": "user", "content": "tick tock"}]}
    headers = {"x-api-key": "sk-any", "anthropic-version": "2023-06-01"}
    # 16 lines: message_start, the block's start, some deltas.
    with _a_stream_whose_worker_dies(redis_url, gateway, "/v1/messages", body, 16, headers=headers,
                                     temperature=temperature) as (_model, _rescuer, lines):
        events = _events(lines)
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds.count("message_start") == 1 and kinds[-1] == "message_stop", kinds
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == " ".join(["tick", "tock"] * 30)
    assert [e["usage"]["output_tokens"] for e in events if e["type"] == "message_delta"] == [60]


def test_a_stopping_worker_with_no_other_worker_finishes_its_runs(redis_url, gateway):
    """At its drain deadline a worker hands runs over only if another worker of the model takes work:
    alone, it finishes its greedy stream itself rather than leave the client waiting for a new one."""
    model = f"alone-{uuid.uuid4().hex[:6]}"
    alone = start_worker(redis_url, model, "--scripted-tokens-per-second", "20", "--drain-timeout", "0.5")
    try:
        wait_until_served(gateway, model)
        body = {**_body(model, True, 60), "temperature": 0}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            seen = [next(lines) for _ in range(6)]
            assert alone.stop(timeout=20) == 0  # returns once its stream is answered
            text = "\n".join([*seen, *lines])
        assert '"error"' not in text, text[-500:]
        assert _stream_text(text) == " ".join(["tick", "tock"] * 30)
        assert metric_value(gateway.url, "llmfleet_gateway_migrations_total", model=model) == 0
    finally:
        alone.kill()


@pytest.mark.parametrize("temperature", [0, 0.8])
def test_a_responses_stream_goes_on_as_one_response_when_its_worker_dies(redis_url, gateway, temperature):
    """The same below the Responses API: a Responses stream, greedy or sampled, whose worker is
    SIGKILLed mid-stream is one response, its text whole, with no error event."""
    body = {"input": "tick tock", "max_output_tokens": 60}
    # 24 lines: the response's and the item's starts, some deltas.
    with _a_stream_whose_worker_dies(redis_url, gateway, "/v1/responses", body, 24,
                                     temperature=temperature) as (_m, _r, lines):
        events = _events(lines)
    kinds = [e["type"] for e in events]
    assert "error" not in kinds and kinds.count("response.created") == 1, kinds
    assert kinds[-1] == "response.incomplete", kinds  # max_output_tokens reached, as without the death
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert text == " ".join(["tick", "tock"] * 30)
    assert events[-1]["response"]["usage"]["output_tokens"] == 60


def test_a_resumed_stream_whose_worker_died_is_one_stream(redis_url, gateway):
    """A resumable greedy stream: its client hangs up, its worker is SIGKILLed, and the client
    resumes (Last-Event-ID) while another worker takes the run over. What it read before and
    after is one stream: event ids without a gap or a repeat, the text whole, one finish."""
    model = f"doomed-{uuid.uuid4().hex[:6]}"
    doomed = start_worker(redis_url, model, "--scripted-tokens-per-second", "20")
    rescuer = None
    try:
        wait_until_served(gateway, model)
        body = {**_body(model, True, 60), "temperature": 0, "resumable": True}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=30) as response:
            before = _sse_events(response.iter_lines(), count=6)  # the role chunk and some tokens; then hang up
        doomed.kill()
        rescuer = start_worker(redis_url, model, "--claim-idle", "1")
        stream_id = before[0][1]["id"]
        with httpx.stream("GET", f"{gateway.url}/v1/streams/{stream_id}", timeout=60,
                          headers={"Last-Event-ID": str(before[-1][0])}) as response:
            assert response.status_code == 200
            after = _sse_events(response.iter_lines())
        events = before + after
        assert [event_id for event_id, _ in events] == list(range(len(events)))
        assert after[-1][1] == "[DONE]"
        chunks = [data for _, data in events if data != "[DONE]"]
        assert not any("error" in chunk for chunk in chunks), chunks[-1]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        assert text == " ".join(["tick", "tock"] * 30)
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]] \
            == ["length"]
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 1
    finally:
        if rescuer is not None:
            rescuer.stop()
        doomed.kill()


def _sse_events(lines, count: int | None = None) -> list[tuple[int, object]]:
    """(event id, data) of each SSE event, the first `count` of them or all."""
    events, fields = [], {}
    for line in lines:
        if line:
            name, _, value = line.partition(": ")
            fields[name] = value
            continue
        if "data" in fields:
            data = fields["data"]
            events.append((int(fields["id"]), "[DONE]" if data == "[DONE]" else json.loads(data)))
            if len(events) == count:
                break
        fields = {}
    return events
