"""Requests `vllm serve` accepts that llmfleet once refused with a 400 (issue #12): more than four
stop strings, several prompts in one completion, media content parts. Scripted workers here; the
vLLM worker's answers are in tests/test_vllm_e2e.py and the parity battery (tests/parity)."""

from __future__ import annotations

import json
from collections import defaultdict

import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL
from worker.media import check_media_urls

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
