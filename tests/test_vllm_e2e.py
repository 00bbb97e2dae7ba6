"""End to end on a real vLLM worker serving the tiny random-weight model.

The model's text is gibberish, so assertions are made exact with greedy decoding, seeds and
logit_bias, and token counts are checked against the model's own tokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from shared import keys
from tests.conftest import leftover_keys
from tests.parity.harness import VLLM_SLOTS
from tests.procs import metric_value, wait_for

pytestmark = pytest.mark.vllm

MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def client(vllm_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{vllm_stack.gateway.url}/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(vllm_stack):
    return AutoTokenizer.from_pretrained(vllm_stack.model_dir)


def _stream_chat(client, **kwargs) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


def test_chat_stream_joins_to_the_non_streaming_text(client, tokenizer, vllm_stack):
    request = dict(model=vllm_stack.model, messages=MESSAGES, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**request)
    text, finish, usage = _stream_chat(client, **request)
    assert whole.choices[0].message.content and text == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason == "length"
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert whole.usage.prompt_tokens == usage.prompt_tokens == len(prompt_ids)
    assert whole.usage.completion_tokens == usage.completion_tokens == 24


def test_completion_stream_joins_to_the_non_streaming_text(client, tokenizer, vllm_stack):
    request = dict(model=vllm_stack.model, prompt="The harbour at dawn", max_tokens=20, temperature=0, logprobs=2)
    whole = client.completions.create(**request)
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **request))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == whole.choices[0].text
    assert len(whole.choices[0].logprobs.tokens) == whole.usage.completion_tokens == 20
    assert "".join(whole.choices[0].logprobs.tokens) == whole.choices[0].text
    assert whole.usage.prompt_tokens == len(tokenizer("The harbour at dawn").input_ids)
    assert chunks[-1].usage.completion_tokens == 20


def test_logit_bias_forces_a_known_token(client, tokenizer, vllm_stack):
    token_id = tokenizer.convert_tokens_to_ids(tokenizer.tokenize(" sea")[0])
    result = client.chat.completions.create(model=vllm_stack.model, messages=MESSAGES, max_tokens=5,
                                            logit_bias={str(token_id): 100})
    assert tokenizer.encode(result.choices[0].message.content, add_special_tokens=False) == [token_id] * 5


def test_seeded_sampling_repeats_and_n_gives_distinct_choices(client, vllm_stack):
    request = dict(model=vllm_stack.model, messages=MESSAGES, max_tokens=12, temperature=1.0, seed=1234)
    first = client.chat.completions.create(**request).choices[0].message.content
    assert client.chat.completions.create(**request).choices[0].message.content == first
    several = client.chat.completions.create(n=3, **request)
    assert [c.index for c in several.choices] == [0, 1, 2]
    assert several.usage.completion_tokens == 36


def test_async_sdk_concurrent_streams(vllm_stack):
    async def main():
        client = openai.AsyncOpenAI(base_url=f"{vllm_stack.gateway.url}/v1", api_key="x", max_retries=0)

        async def one(i: int) -> str:
            stream = await client.chat.completions.create(
                model=vllm_stack.model, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=16,
                temperature=0, stream=True)
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        streamed = await asyncio.gather(*(one(i) for i in range(8)))
        whole = [(await client.chat.completions.create(
            model=vllm_stack.model, messages=[{"role": "user", "content": f"number {i}"}], max_tokens=16,
            temperature=0)).choices[0].message.content for i in range(8)]
        return streamed, whole

    streamed, whole = asyncio.run(main())
    assert streamed == whole
    assert len(set(whole)) > 1  # different prompts, different greedy text


@pytest.mark.parametrize("stream", [False, True])
def test_prompt_longer_than_the_context_is_a_400(vllm_stack, redis_client, stream):
    long_prompt = " ".join(["harbour"] * 3000)
    response = httpx.post(f"{vllm_stack.gateway.url}/v1/completions", timeout=60, json={
        "model": vllm_stack.model, "prompt": long_prompt, "max_tokens": 4, "stream": stream})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "BadRequestError" and "maximum context length" in error["message"]
    wait_for(lambda: not leftover_keys(redis_client), 5, "the request entry to be acknowledged")


def test_max_tokens_beyond_context_is_a_400(vllm_stack):
    response = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", json={
        "model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 5000})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == (
        "max_tokens=5000 cannot be greater than max_model_len=2048. Please request fewer output tokens.")


def test_default_max_tokens_is_the_room_left_in_the_context(client, vllm_stack):
    messages = [{"role": "user", "content": " ".join(["harbour"] * 300)}]
    chat = client.chat.completions.create(model=vllm_stack.model, messages=messages, temperature=0)
    assert chat.usage.prompt_tokens + chat.usage.completion_tokens == 2048
    assert chat.choices[0].finish_reason == "length"
    # Legacy completions default to 16 tokens, as on vllm serve.
    completion = client.completions.create(model=vllm_stack.model, prompt="harbour", temperature=0)
    assert completion.usage.completion_tokens == 16


def _worker_metric(vllm_stack, name, **labels):
    return metric_value(vllm_stack.worker.url, name, **labels)


@pytest.mark.parametrize("stream, n", [(True, 1), (False, 2)])
def test_disconnect_aborts_the_engine_request(vllm_stack, stream, n):
    tokens_before = _worker_metric(vllm_stack, "llmfleet_worker_generated_tokens_total")
    cancels_before = _worker_metric(vllm_stack, "llmfleet_worker_cancels_total", cause="disconnect")
    body = {"model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 1900, "n": n, "temperature": 1.0,
            "stream": stream}
    if stream:
        with httpx.stream("POST", f"{vllm_stack.gateway.url}/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            for _ in range(4):
                next(lines)
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", json=body, timeout=1.0)
    _wait_for_idle_engine(vllm_stack)
    assert _worker_metric(vllm_stack, "llmfleet_worker_cancels_total", cause="disconnect") == cancels_before + 1
    generated = _worker_metric(vllm_stack, "llmfleet_worker_generated_tokens_total") - tokens_before
    assert generated < 1900 * n  # aborted long before the end


def test_explicit_cancel_returns_what_was_generated(vllm_stack):
    body = {"model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 1900, "temperature": 0,
            "stream": True, "cancel_id": "vllm-run", "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{vllm_stack.gateway.url}/v1/chat/completions", json=body) as response:
        lines = response.iter_lines()
        text = ""
        for line in lines:
            if line.startswith("data: {"):
                for choice in json.loads(line[6:])["choices"]:
                    text += choice["delta"].get("content") or ""
            if len(text) > 20:
                break
        assert httpx.post(f"{vllm_stack.gateway.url}/v1/cancel", json={"cancel_id": "vllm-run"}).json() == {
            "cancelled": 1}
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["cancelled"]
    assert 0 < events[-1]["usage"]["completion_tokens"] < 1900
    _wait_for_idle_engine(vllm_stack)


def _wait_for_idle_engine(vllm_stack) -> None:
    """The worker's in-flight count and vLLM's own running-request gauge both reach zero."""
    wait_for(lambda: _worker_metric(vllm_stack, "llmfleet_worker_in_flight") == 0, 10, "the worker to go idle")
    wait_for(lambda: _worker_metric(vllm_stack, "vllm:num_requests_running") == 0, 10, "the engine to go idle")


def test_disconnect_while_queued_never_reaches_the_engine(vllm_stack, redis_client):
    claims_before = _worker_metric(vllm_stack, "llmfleet_worker_claims_total")
    hang_ups_before = metric_value(vllm_stack.gateway.url, "llmfleet_gateway_cancels_total", cause="disconnect")
    long_run = {"model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 1900, "temperature": 1.0,
                "stream": True}
    with contextlib.ExitStack() as streams:
        for i in range(VLLM_SLOTS):  # fill every slot of the worker
            response = streams.enter_context(httpx.stream(
                "POST", f"{vllm_stack.gateway.url}/v1/chat/completions", json={**long_run, "cancel_id": f"fill-{i}"}))
            lines = response.iter_lines()
            next(lines)
            streams.callback(lines.close)
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", json={**long_run, "stream": False},
                       timeout=0.5)
        # No worker claimed the one whose client hung up: its gateway takes it back from the queue.
        # Its hang-up counted means the gateway is done with it (queued, then taken back): until then,
        # on a loaded machine, it may not even have reached the queue.
        wait_for(lambda: metric_value(vllm_stack.gateway.url, "llmfleet_gateway_cancels_total",
                                      cause="disconnect") == hang_ups_before + 1, 10, "the gateway to see the hang-up")
        assert redis_client.xlen(keys.request_stream(vllm_stack.model)) == VLLM_SLOTS
        for i in range(VLLM_SLOTS):
            httpx.post(f"{vllm_stack.gateway.url}/v1/cancel", json={"cancel_id": f"fill-{i}"})
    _wait_for_idle_engine(vllm_stack)
    assert _worker_metric(vllm_stack, "llmfleet_worker_claims_total") == claims_before + VLLM_SLOTS


def test_cancel_before_send_and_stale_cancel_on_vllm(client, vllm_stack):
    assert httpx.post(f"{vllm_stack.gateway.url}/v1/cancel", json={"cancel_id": "early-v"}).json() == {"cancelled": 0}
    early = client.chat.completions.create(model=vllm_stack.model, messages=MESSAGES, max_tokens=8,
                                           extra_body={"cancel_id": "early-v"})
    assert (early.choices[0].finish_reason, early.usage.completion_tokens) == ("cancelled", 0)
    done = client.chat.completions.create(model=vllm_stack.model, messages=MESSAGES, max_tokens=8, temperature=0,
                                          extra_body={"cancel_id": "stale-v"})
    assert httpx.post(f"{vllm_stack.gateway.url}/v1/cancel", json={"cancel_id": "stale-v"}).json() == {"cancelled": 0}
    later = client.chat.completions.create(model=vllm_stack.model, messages=MESSAGES, max_tokens=8, temperature=0,
                                           extra_body={"cancel_id": "later-v"})
    assert later.choices[0].finish_reason == "length"
    assert later.choices[0].message.content == done.choices[0].message.content


def test_a_whole_answers_time_to_first_token_is_its_first_tokens(vllm_stack):
    """A non-streamed answer arrives at its end; its timings still split at the engine's first token."""
    answer = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", timeout=120, json={
        "model": vllm_stack.model, "messages": MESSAGES, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
        "include_timings": True}).json()
    timings = answer["timings"]
    assert answer["usage"]["completion_tokens"] == 200
    # The first of 200 tokens came well before the last: the whole answer's time is not its TTFT.
    assert timings["decode_s"] > 0 and timings["ttft_s"] < timings["total_s"] - timings["decode_s"] / 2, timings


def test_vllm_bench_serve_completes_every_request_against_a_default_gateway(vllm_stack, tmp_path):
    """`vllm bench serve`, the field's standard client, reads a default gateway's streams as vllm
    serve's: its completions and its chat backends, run side by side (each CLI spends ~20 s
    importing vLLM)."""
    from bench.engine_path import VENV_BIN, vllm_cli_env

    prompts = 12
    runs: dict[str, subprocess.Popen] = {}
    with vllm_cli_env() as env, contextlib.ExitStack() as stack:
        stack.callback(lambda: [run.kill() for run in runs.values() if run.poll() is None])
        for backend, endpoint in [("vllm", "/v1/completions"), ("openai-chat", "/v1/chat/completions")]:
            runs[backend] = subprocess.Popen([
                str(VENV_BIN / "vllm"), "bench", "serve", "--backend", backend, "--endpoint", endpoint,
                "--base-url", vllm_stack.gateway.url, "--model", vllm_stack.model,
                "--tokenizer", vllm_stack.model_dir, "--dataset-name", "random", "--random-input-len", "32",
                "--random-output-len", "16", "--num-prompts", str(prompts), "--max-concurrency", "4",
                "--ignore-eos", "--seed", "0", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                "--result-filename", f"{backend}.json"],
                env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        outputs = {backend: run.communicate(timeout=300)[0] for backend, run in runs.items()}
    for backend, run in runs.items():
        assert run.returncode == 0, (backend, outputs[backend][-3000:])
        result = json.loads((tmp_path / f"{backend}.json").read_text())
        assert result["completed"] == prompts and result["total_output_tokens"] == prompts * 16, (backend, result)
