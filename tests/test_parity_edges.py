"""Requests llmfleet once refused with a 400 of its own (issue #12): more than four stop strings,
several prompts in one completion, media content parts. They now reach the worker's engine, which
answers them as `vllm serve` does: vLLM 0.32 itself refuses more than VLLM_MAX_STOP_STRINGS (4)
stop strings, with its own message; the scripted engine takes any number. Scripted and vLLM
workers here; the parity battery (tests/parity) compares the vLLM answers with `vllm serve`'s."""

from __future__ import annotations

import http.server
import json
import threading
from collections import defaultdict

import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL
from worker.adapters.media import check_media_urls

M = SCRIPTED_MODEL


def _gateway(scripted_fleet) -> str:
    return scripted_fleet[0][0].url


def _sse(response: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]


@pytest.mark.integration
def test_more_than_four_stop_strings(scripted_fleet):
    body = {"model": M, "messages": [{"role": "user", "content": "one two three four"}], "max_tokens": 10,
            "stop": ["#1", "#2", "#3", "#4", "#5", "three"]}
    response = httpx.post(f"{_gateway(scripted_fleet)}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"], choice["stop_reason"]) == \
        ("one two ", "stop", "three")


def _completion(**extra):
    return {"model": M, "prompt": ["a b", "c d e"], "max_tokens": 3, "n": 2, "temperature": 1.0, **extra}


@pytest.mark.integration
def test_several_prompts_get_n_choices_each(scripted_fleet):
    response = httpx.post(f"{_gateway(scripted_fleet)}/v1/completions", json=_completion(), timeout=30)
    assert response.status_code == 200, response.text
    result = response.json()
    assert [(c["index"], c["text"], c["finish_reason"]) for c in result["choices"]] == [
        (0, "a b a", "length"), (1, "1:a 1:b 1:a", "length"), (2, "c d e", "length"), (3, "1:c 1:d 1:e", "length")]
    assert result["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17,
                               "prompt_tokens_details": None, "completion_tokens_details": None}


@pytest.mark.integration
def test_several_prompts_streamed_join_to_the_whole_answer(scripted_fleet):
    gateway = _gateway(scripted_fleet)
    whole = httpx.post(f"{gateway}/v1/completions", json=_completion(), timeout=30).json()
    with httpx.stream("POST", f"{gateway}/v1/completions", timeout=30,
                      json=_completion(stream=True, stream_options={"include_usage": True})) as response:
        events = _sse(response)
    texts, finishes = defaultdict(str), {}
    for event in events:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert dict(texts) == {c["index"]: c["text"] for c in whole["choices"]}
    assert finishes == {0: "length", 1: "length", 2: "length", 3: "length"}
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}


@pytest.mark.integration
def test_several_token_id_prompts(scripted_fleet):
    body = {"model": M, "prompt": [[7, 8], [9]], "max_tokens": 2}
    result = httpx.post(f"{_gateway(scripted_fleet)}/v1/completions", json=body, timeout=30).json()
    assert [c["text"] for c in result["choices"]] == ["7 8", "9 9"]
    assert result["usage"]["prompt_tokens"] == 3


@pytest.mark.integration
@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
])
def test_media_parts_reach_the_worker(scripted_fleet, part):
    """The scripted engine reads only text parts; what matters is that the gateway lets the part
    through to the worker, as vllm serve passes it to its model."""
    body = {"model": M, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "look here"}, part]}]}
    response = httpx.post(f"{_gateway(scripted_fleet)}/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == "look here"


@pytest.mark.parametrize("part", [
    {"type": "image_url", "image_url": {"url": "http://169.254.169.254/latest/meta-data"}},
    {"type": "image_url", "image_url": {"url": " HTTPS://example.org/cat.png"}},
    {"type": "video_url", "video_url": {"url": "https://example.org/v.mp4"}},
    {"type": "audio_url", "audio_url": {"url": "http://example.org/a.wav"}},
    {"image_url": "http://example.org/cat.png"},  # vLLM's shorthand part
])
def test_no_media_url_is_fetched_unless_domains_are_allowed(part):
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}]}
    with pytest.raises(Exception, match="fetches no media from URLs"):
        check_media_urls(body, None)
    check_media_urls(body, ["example.org"])  # then vLLM checks each URL against the list


def test_inline_media_is_not_a_fetch():
    body = {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}}]}]}
    check_media_urls(body, None)


@pytest.fixture
def recording_http_server():
    """A local HTTP server that records every path asked of it."""
    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # the stdlib names it
            hits.append(self.path)
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", hits
    server.shutdown()
    thread.join(5)


@pytest.mark.vllm
def test_a_vllm_worker_fetches_no_media_url_by_default(vllm_stack, recording_http_server):
    base, hits = recording_http_server
    body = {"model": vllm_stack.model, "max_tokens": 2, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": f"{base}/cat.png"}}]}]}
    response = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert "fetches no media from URLs" in response.json()["error"]["message"]
    assert hits == []


@pytest.mark.vllm
def test_a_text_only_vllm_model_answers_its_own_error_for_an_image(vllm_stack):
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    body = {"model": vllm_stack.model, "max_tokens": 2,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}]}
    response = httpx.post(f"{vllm_stack.gateway.url}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    assert "fetches no media" not in response.json()["error"]["message"]


@pytest.mark.vllm
@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_on_vllm_answer_as_one_request_each(vllm_stack, stream):
    """Greedy: each prompt's choice is what a request with that prompt alone answers."""
    url = f"{vllm_stack.gateway.url}/v1/completions"
    prompts = ["The harbour at dawn", "A quiet street"]
    common = {"model": vllm_stack.model, "max_tokens": 5, "temperature": 0}
    alone = [httpx.post(url, json={**common, "prompt": p}, timeout=120).json() for p in prompts]
    if stream:
        with httpx.stream("POST", url, timeout=120, json={**common, "prompt": prompts, "stream": True,
                                                           "stream_options": {"include_usage": True}}) as response:
            events = _sse(response)
        texts = defaultdict(str)
        for event in events:
            for choice in event["choices"]:
                texts[choice["index"]] += choice["text"]
        usage = events[-1]["usage"]
    else:
        together = httpx.post(url, json={**common, "prompt": prompts}, timeout=120).json()
        texts = {c["index"]: c["text"] for c in together["choices"]}
        usage = together["usage"]
    assert dict(texts) == {i: answer["choices"][0]["text"] for i, answer in enumerate(alone)}
    assert usage["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in alone)
    assert usage["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in alone)


@pytest.mark.vllm
def test_the_stop_string_limit_is_the_vllm_workers(vllm_stack):
    """vLLM's own limit (VLLM_MAX_STOP_STRINGS, 4 by default), in vLLM's words, as `vllm serve` answers."""
    body = {"model": vllm_stack.model, "prompt": "The harbour", "max_tokens": 2, "stop": ["#1", "#2", "#3", "#4", "#5"]}
    response = httpx.post(f"{vllm_stack.gateway.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("Bad Request", "body.stop")
    assert "List should have at most 4 items after validation, not 5" in error["message"]
