"""vLLM workers that die: SIGKILLed mid-generation, or their engine core dying under them. Never a hang.

- A worker SIGKILLed mid-generation: its non-streaming request is rerun by another vLLM worker of
  the model with the same answer; its streams are continued by that worker from the engine's
  tokens their clients were sent (gateway/fleet/replay.py). The greedy stream goes on as it would
  have: the text, finish reason and usage of the uninterrupted answer. The sampled streams (a chat
  of two choices and a completion, with logprobs) are continued from where each choice stood, to
  their full length, counted once, a logprob for every token. The workers run a reasoning parser
  (deepseek_r1) and a tool parser (hermes): the chat's answer is all reasoning text, its parsers'
  state rebuilt from the tokens (one of them offers a tool).
- A worker whose engine core dies under a running request: the request fails, the worker exits
  non-zero and leaves the registry.

A vLLM worker takes ~30 s to start: both workers of the model start with the session's other
engines (tests/conftest.py `mortal_worker`, `mortal_spare`). The spare is paused (SIGSTOP) while
the first takes both requests, then takes them over; it is the second test's victim. The drain
test's worker (`mortal_drainer`) starts when the first victim dies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import MORTAL_MODEL, start_if_the_session_needs
from tests.parity.battery import WEATHER_TOOL
from tests.parity.harness import ENGINE_START_S
from tests.procs import metric_value, start_gateway, wait_for, wait_registered, wait_until_served
from worker.consumer import CLAIM_BLOCK_MS

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "user", "content": "Write about lighthouses."}]
PROMPT = "Lighthouses stand on the rocks"
FROM_TOKENS = "continuing it from the engine's tokens"  # the line of a takeover continued from them (worker/runner.py)


def _children(pid: int) -> list[tuple[int, str]]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                child = int(stat.parent.name)
                found.append((child, (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()))
        except (OSError, ValueError, IndexError):
            continue
    return found


def _kill_with_engine(worker) -> None:
    children = [pid for pid, _cmd in _children(worker.pid)]
    worker.kill()
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def test_vllm_worker_killed_mid_generation(vllm_stack, mortal_worker, mortal_spare, request):
    # Without thinking, the reasoning parser's answer is content, as on the stack's worker (no such parser).
    greedy = {"messages": MESSAGES, "max_tokens": 1500, "temperature": 0,
               "chat_template_kwargs": {"enable_thinking": False}}
    expected = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", timeout=120,
                          json={**greedy, "model": vllm_stack.model}).json()["choices"][0]["message"]["content"]
    doomed = wait_registered(mortal_worker, ENGINE_START_S)
    rescuer = wait_registered(mortal_spare, ENGINE_START_S)
    by_tokens = rescuer.log().count(FROM_TOKENS)
    try:
        url = f"{vllm_stack.gateway.url}/v1/chat/completions"
        wait_until_served(vllm_stack.gateway, MORTAL_MODEL)
        # The rescuer sits out the first part, paused: it claims nothing, and its last blocking read
        # has ended in Redis (after CLAIM_BLOCK_MS) before the requests are sent.
        os.kill(rescuer.pid, signal.SIGSTOP)
        time.sleep(2 * CLAIM_BLOCK_MS / 1000)
        result: dict = {}

        def whole_answer() -> None:  # waits through the death and the takeover
            try:
                result["response"] = httpx.post(url, json={**greedy, "model": MORTAL_MODEL}, timeout=400)
            except httpx.HTTPError as exc:
                result["response"] = exc

        streaming = {path: threading.Event() for path in ("/v1/chat/completions", "/v1/completions", "top_k 1")}

        def sampled_stream(path: str, body: dict, key: str = "") -> None:  # continued by the rescuer after the death
            key = key or path
            body = {**body, "max_tokens": 1500, "temperature": 1.0, "ignore_eos": True, "model": MORTAL_MODEL,
                    "stream": True, "stream_options": {"include_usage": True}}
            chunks = result[key] = []
            try:
                with httpx.stream("POST", f"{vllm_stack.gateway.url}{path}", json=body, timeout=60) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            chunks.append(json.loads(line[6:]))
                            if any(choice.get("text") or choice.get("delta", {}).get("content")
                                   or choice.get("delta", {}).get("reasoning")
                                   for choice in chunks[-1].get("choices", ())):
                                streaming[key].set()  # its text has begun: the kill is mid-stream
            except httpx.HTTPError as exc:
                result[key] = exc

        no_tags = {str(tag): -100 for tag in range(5, 9)}  # <tool_call>, <think> and their ends: all reasoning
        prompt_tokens = httpx.post(f"{vllm_stack.gateway.url}/v1/completions", timeout=60, json={
            "model": vllm_stack.model, "prompt": PROMPT, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        tools = {"tools": [WEATHER_TOOL], "tool_choice": "auto"}  # its tool parser runs too (after the reasoning)
        thinking_answer = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", timeout=120, json={
            "model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "logit_bias": no_tags, **tools}).json()
        thinking = thinking_answer["choices"][0]["message"]["content"]
        chat_prompt_tokens = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", timeout=60, json={
            "model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 1}).json()["usage"]["prompt_tokens"]
        rerun = threading.Thread(target=whole_answer)
        rerun.start()
        sampled = [threading.Thread(target=sampled_stream, args=("/v1/chat/completions", {
                       "messages": MESSAGES, "n": 2, "logprobs": True, "top_logprobs": 2, "logit_bias": no_tags})),
                   threading.Thread(target=sampled_stream, args=("/v1/completions", {"prompt": PROMPT, "logprobs": 2})),
                   # Sampled, so continued, not replayed; but from one candidate a token, the greedy answer: continued
                   # from the engine's tokens, it goes on exactly where the client stood.
                   threading.Thread(target=sampled_stream, args=("/v1/chat/completions", {
                       "messages": MESSAGES, "top_k": 1, "logit_bias": no_tags, **tools}, "top_k 1"))]
        for thread in sampled:
            thread.start()
        streamed = {**greedy, "model": MORTAL_MODEL, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url, json=streamed, timeout=60) as stream:
            lines = stream.iter_lines()
            data = [next(lines)]
            wait_for(lambda: metric_value(doomed.url, "llmfleet_worker_in_flight") == 5, 20,
                     "the doomed worker to run the five requests")
            assert all(begun.wait(60) for begun in streaming.values()), "the sampled streams to begin"
            _kill_with_engine(doomed)
            killed_at = time.monotonic()
            os.kill(rescuer.pid, signal.SIGCONT)
            # The drain test's worker starts in the victim's room. It claims nothing of this test's:
            # the rescuer has claimed all within a second (--claim-idle 1), long before it serves.
            start_if_the_session_needs(request, "mortal_drainer")
            gaps, last = [], killed_at
            for line in lines:
                if line.startswith("data: "):
                    data.append(line)
                    gaps.append(time.monotonic() - last)
                    last = time.monotonic()
        print(f"the longest wait for a chunk after the kill: {max(gaps):.2f}s")
        chunks = [json.loads(line[6:]) for line in data if line != "data: [DONE]"]
        assert not [c for c in chunks if "error" in c], chunks[-1]
        # The answer's text, whichever side of the reasoning parser it is read on (vLLM's parser reads a
        # whole answer without "</think>" as reasoning, a stream whose prompt closed thinking as content).
        text = "".join(c["choices"][0]["delta"].get("content") or c["choices"][0]["delta"].get("reasoning") or ""
                       for c in chunks if c["choices"])
        rerun.join(400)
        answer = result["response"]
        assert isinstance(answer, httpx.Response) and answer.status_code == 200, answer
        whole = answer.json()
        message = whole["choices"][0]["message"]
        assert (message["content"] or message["reasoning"]) == expected  # the same greedy answer
        # The stream goes on where it stood: the uninterrupted answer, its finish and its usage.
        assert text == expected
        assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == whole["choices"][0][
            "finish_reason"]
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [chunks[-1]["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]
        # The sampled streams, chat (two choices) and completion: each choice continued, not repeated,
        # to its full length, with a logprob for every token; the prompt counted once.
        for thread in sampled:
            thread.join(60)
        chat, completion = result["/v1/chat/completions"], result["/v1/completions"]
        for path, prompt, choices in (("/v1/chat/completions", chat_prompt_tokens, 2),
                                      ("/v1/completions", prompt_tokens, 1)):
            continued = result[path]
            assert not [c for c in continued if "error" in c], (path, continued[-1])
            finishes = [(choice["index"], choice["finish_reason"]) for c in continued for choice in c["choices"]
                        if choice["finish_reason"]]
            assert sorted(finishes) == [(index, "length") for index in range(choices)], path
            usage = continued[-1]["usage"]
            assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt, 1500 * choices), path
        for index in (0, 1):
            logprobs = [entry for c in chat for choice in c["choices"] if choice["index"] == index
                        for entry in (choice.get("logprobs") or {}).get("content") or ()]
            assert len(logprobs) == 1500 and all(len(entry["top_logprobs"]) == 2 for entry in logprobs), index
            deltas = [choice["delta"] for c in chat for choice in c["choices"] if choice["index"] == index]
            assert "".join(d.get("reasoning") or "" for d in deltas) and not any(d.get("content") for d in deltas)
        # A completion's logprob offsets count on across the break as vLLM counts them: each token's
        # offset is the one before it plus that token's text (which can outrun the text itself).
        entries = [entry for c in completion if c["choices"] and c["choices"][0]["logprobs"]
                   for entry in zip(c["choices"][0]["logprobs"]["text_offset"], c["choices"][0]["logprobs"]["tokens"])]
        assert len(entries) == 1500 and entries[0][0] == 0
        assert [at for at, _token in entries[1:]] == [at + len(token) for at, token in entries[:-1]]
        exact = result["top_k 1"]
        assert not [c for c in exact if "error" in c], exact[-1]
        assert "".join(choice["delta"].get("reasoning") or "" for c in exact for choice in c["choices"]) == thinking
        assert exact[-1]["usage"]["completion_tokens"] == 1500
        assert metric_value(rescuer.url, "llmfleet_worker_reclaimed_total") == 5
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == 4
        assert rescuer.log().count(FROM_TOKENS) == by_tokens + 4  # every stream continued from its tokens
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rescuer.pid, signal.SIGCONT)
        _kill_with_engine(doomed)


def test_vllm_worker_drained_mid_generation(vllm_stack, mortal_spare, mortal_drainer):
    """SIGTERM to a vLLM worker (`--drain-timeout 0.2`) running two streams of 1,900 tokens: at its
    deadline it hands both to the other worker and exits, which continues each from the engine's
    tokens its client was sent: a greedy one, and a reasoning one sampled from one candidate a token
    (`top_k: 1`), its parser's state rebuilt from them. Each ends as its uninterrupted greedy answer,
    with no error, its usage counted once."""
    rescuer = wait_registered(mortal_spare, ENGINE_START_S)
    by_tokens = rescuer.log().count(FROM_TOKENS)
    stopping = wait_registered(mortal_drainer, ENGINE_START_S)
    no_tags = {str(tag): -100 for tag in range(5, 9)}  # <tool_call>, <think> and their ends: all reasoning
    bodies = {"greedy": {"messages": MESSAGES, "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                         "chat_template_kwargs": {"enable_thinking": False}},
              "top_k 1": {"messages": MESSAGES, "max_tokens": 1900, "temperature": 1.0, "top_k": 1,
                          "ignore_eos": True, "logit_bias": no_tags}}
    url = f"{vllm_stack.gateway.url}/v1/chat/completions"
    expected = {name: httpx.post(url, timeout=120, json={**body, "model": vllm_stack.model, "temperature": 0})
                .json()["choices"][0]["message"]["content"] for name, body in bodies.items()}
    gateway_migrations = metric_value(vllm_stack.gateway.url, "llmfleet_gateway_migrations_total", model=MORTAL_MODEL)
    gateway_drains = metric_value(vllm_stack.gateway.url, "llmfleet_gateway_migrations_total", model=MORTAL_MODEL,
                                  cause="drain")
    rescuer_migrations = metric_value(rescuer.url, "llmfleet_worker_migrations_total")
    result: dict = {name: [] for name in bodies}
    begun = {name: threading.Event() for name in bodies}

    def stream(name: str) -> None:
        body = {**bodies[name], "model": MORTAL_MODEL, "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        result[name].append(json.loads(line[6:]))
                        if any(c["delta"].get("content") or c["delta"].get("reasoning")
                               for c in result[name][-1].get("choices", ())):
                            begun[name].set()
        except httpx.HTTPError as exc:
            result[name].append({"error": str(exc)})

    threads = [threading.Thread(target=stream, args=(name,)) for name in bodies]
    try:
        # Both go to the stopping worker: the rescuer sits out, paused, until they have begun.
        os.kill(rescuer.pid, signal.SIGSTOP)
        time.sleep(2 * CLAIM_BLOCK_MS / 1000)
        for thread in threads:
            thread.start()
        assert all(event.wait(60) for event in begun.values()), "the streams to begin"
        assert metric_value(stopping.url, "llmfleet_worker_in_flight") == 2
        os.kill(rescuer.pid, signal.SIGCONT)  # live again before the stopping worker's deadline looks for it
        wait_for(lambda: metric_value(vllm_stack.gateway.url, "llmfleet_gateway_live_workers", model=MORTAL_MODEL) == 2,
                 10, "the rescuer to be live again")
        sent = {name: len(chunks) for name, chunks in result.items()}
        signalled = time.monotonic()
        assert stopping.stop(timeout=60) == 0
        print(f"the drained worker exited {time.monotonic() - signalled:.1f}s after SIGTERM, {sent} chunks sent")
        for thread in threads:
            thread.join(120)
        for name, chunks in result.items():
            assert not [c for c in chunks if "error" in c], (name, chunks[-1])
            text = "".join(c["delta"].get("content") or c["delta"].get("reasoning") or ""
                           for chunk in chunks for c in chunk["choices"])
            assert text == expected[name], name
            assert chunks[-1]["usage"]["completion_tokens"] == 1900, name
        assert metric_value(rescuer.url, "llmfleet_worker_migrations_total") == rescuer_migrations + 2
        assert metric_value(vllm_stack.gateway.url, "llmfleet_gateway_migrations_total",
                            model=MORTAL_MODEL) == gateway_migrations + 2
        assert rescuer.log().count(FROM_TOKENS) == by_tokens + 2
        # The streams' worker said it handed them over.
        assert metric_value(vllm_stack.gateway.url, "llmfleet_gateway_migrations_total", model=MORTAL_MODEL,
                            cause="drain") == gateway_drains + 2
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(rescuer.pid, signal.SIGCONT)
        stopping.kill()


def test_engine_death_fails_requests_and_exits_non_zero(redis_url, redis_client, mortal_spare):
    worker = wait_registered(mortal_spare, ENGINE_START_S)
    gateway = start_gateway(redis_url)
    try:
        wait_until_served(gateway, MORTAL_MODEL)
        body = {"model": MORTAL_MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 1900,
                "stream": True}
        with httpx.stream("POST", f"{gateway.url}/v1/chat/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
            engines = [pid for pid, cmd in _children(worker.pid) if "resource_tracker" not in cmd]
            assert engines, f"no engine process under the worker: {_children(worker.pid)}"
            for pid in engines:
                os.kill(pid, signal.SIGKILL)
            killed_at = time.monotonic()
            rest = [line for line in lines if line.startswith("data: ")]
        error = json.loads(rest[-2][6:])["error"]
        assert error["code"] in (500, 502) and rest[-1] == "data: [DONE]"
        print(f"engine death surfaced to the client after {time.monotonic() - killed_at:.2f}s")
        assert worker.popen.wait(60) != 0
        assert not list(redis_client.scan_iter(match=f"llmfleet:worker:*-{worker.pid}-*"))
        wait_for(lambda: MORTAL_MODEL not in {m["id"] for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]},
                 10, "the dead worker to leave the registry")
    finally:
        gateway.stop()
        worker.kill()
