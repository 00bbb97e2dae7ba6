"""Bad input gets vLLM's status and error type, in the OpenAI error shape, and touches no queue."""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL, leftover_keys
from tests.procs import metric_value

pytestmark = pytest.mark.integration

M = SCRIPTED_MODEL
USER = [{"role": "user", "content": "hi"}]
BAD_REQUEST = (400, "Bad Request")  # types and required fields, as vLLM's pydantic layer answers them
BAD_PARAM = (400, "BadRequestError")  # rules vLLM checks itself (request model, SamplingParams)
OPENAI_RULE = (400, "invalid_request_error")  # rules of the OpenAI API that vLLM leaves to the chat template
CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}

CASES = [
    # (name, path, body (dict, or raw bytes), expected (status, type), expected param or None)
    ("broken json", "chat", b'{"model": "x", "messages": [', BAD_PARAM, None),  # said in words, not a repr
    ("body is a list", "chat", b"[1, 2]", BAD_REQUEST, None),
    ("missing messages", "chat", {"model": M}, BAD_REQUEST, "body.messages"),
    ("messages is a string", "chat", {"model": M, "messages": "hi"}, BAD_REQUEST, "body.messages"),
    ("messages empty", "chat", {"model": M, "messages": []}, BAD_REQUEST, "body.messages"),
    ("user without content", "chat", {"model": M, "messages": [{"role": "user"}]}, BAD_PARAM, "content"),
    ("content is a number", "chat", {"model": M, "messages": [{"role": "user", "content": 5}]}, BAD_REQUEST, None),
    ("unknown content part", "chat",
     {"model": M, "messages": [{"role": "user", "content": [{"type": "video", "url": "x"}]}]}, BAD_REQUEST, None),
    ("model is a number", "chat", {"model": 7, "messages": USER}, BAD_REQUEST, "body.model"),
    ("unknown model", "chat", {"model": "no-such-model", "messages": USER}, (404, "NotFoundError"), "model"),
    ("temperature negative", "chat", {"model": M, "messages": USER, "temperature": -1}, BAD_PARAM, "temperature"),
    ("temperature above 2", "chat", {"model": M, "messages": USER, "temperature": 3}, BAD_PARAM, "temperature"),
    ("temperature a word", "chat", {"model": M, "messages": USER, "temperature": "hot"}, BAD_REQUEST,
     "body.temperature"),
    ("top_p zero", "chat", {"model": M, "messages": USER, "top_p": 0}, BAD_PARAM, "top_p"),
    ("top_p above 1", "chat", {"model": M, "messages": USER, "top_p": 1.5}, BAD_PARAM, "top_p"),
    ("presence_penalty 3", "chat", {"model": M, "messages": USER, "presence_penalty": 3}, BAD_PARAM, None),
    ("frequency_penalty -3", "chat", {"model": M, "messages": USER, "frequency_penalty": -3}, BAD_PARAM, None),
    ("repetition_penalty 0", "chat", {"model": M, "messages": USER, "repetition_penalty": 0}, BAD_PARAM, None),
    ("min_p 2", "chat", {"model": M, "messages": USER, "min_p": 2}, BAD_PARAM, None),
    ("n zero", "chat", {"model": M, "messages": USER, "n": 0}, BAD_PARAM, None),
    ("n 2 with greedy", "chat", {"model": M, "messages": USER, "n": 2, "temperature": 0}, BAD_PARAM, None),
    ("max_tokens zero", "chat", {"model": M, "messages": USER, "max_tokens": 0}, BAD_PARAM, "max_tokens"),
    ("max_tokens beyond context", "chat", {"model": M, "messages": USER, "max_tokens": 5000}, BAD_PARAM,
     "max_tokens"),
    ("max_completion_tokens beyond context", "chat",
     {"model": M, "messages": USER, "max_completion_tokens": 4097}, BAD_PARAM, "max_completion_tokens"),
    ("min_tokens above max_tokens", "chat", {"model": M, "messages": USER, "max_tokens": 2, "min_tokens": 3},
     BAD_PARAM, None),
    ("stream_options without stream", "chat",
     {"model": M, "messages": USER, "stream_options": {"include_usage": True}}, BAD_PARAM, "stream_options"),
    ("top_logprobs without logprobs", "chat", {"model": M, "messages": USER, "top_logprobs": 2}, BAD_PARAM,
     "top_logprobs"),
    ("tools empty", "chat", {"model": M, "messages": USER, "tools": []}, BAD_PARAM, "tools"),
    ("tool_choice without tools", "chat", {"model": M, "messages": USER, "tool_choice": "required"}, BAD_PARAM,
     "tool_choice"),
    # Several prompts and media parts are served, as on vllm serve, and the worker's engine bounds the
    # stop strings (tests/test_parity_edges.py); more prompts than vllm serve takes are refused here.
    ("1025 prompts", "completions", {"model": M, "prompt": ["a"] * 1025}, BAD_PARAM, "prompt"),
    ("empty stop string", "chat", {"model": M, "messages": USER, "stop": [""]}, BAD_PARAM, None),
    ("logit_bias key not a token id", "chat", {"model": M, "messages": USER, "logit_bias": {"abc": 1}}, BAD_PARAM,
     "logit_bias"),
    ("stream is a list", "chat", {"model": M, "messages": USER, "stream": [1]}, BAD_REQUEST, "body.stream"),
    ("seed too large", "chat", {"model": M, "messages": USER, "seed": 2**70}, BAD_REQUEST, "body.seed"),
    ("completion without prompt", "completions", {"model": M}, BAD_PARAM, "prompt"),
    ("completion empty prompt", "completions", {"model": M, "prompt": ""}, BAD_PARAM, "prompt"),
    ("completion with suffix", "completions", {"model": M, "prompt": "a", "suffix": "b"}, BAD_PARAM, "suffix"),
    ("completion logprobs a word", "completions", {"model": M, "prompt": "a", "logprobs": "many"}, BAD_REQUEST,
     "body.logprobs"),
    ("completion max_tokens beyond context", "completions", {"model": M, "prompt": "a", "max_tokens": 9999},
     BAD_PARAM, "max_tokens"),
    ("tool message without tool_call_id", "chat", {"model": M, "messages": [
        *USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "sunny"}]}, OPENAI_RULE,
     "messages[2].tool_call_id"),
    ("assistant message with neither content nor tool_calls", "chat", {"model": M, "messages": [
        *USER, {"role": "assistant"}, *USER]}, OPENAI_RULE, "messages[1].content"),
    ("tool_calls on a user message", "chat", {"model": M, "messages": [{"role": "user", "content": "hi",
                                                                       "tool_calls": [CALL]}]}, OPENAI_RULE,
     "messages[0].tool_calls"),
]


@pytest.mark.parametrize("name, path, body, expected, param", CASES, ids=[c[0] for c in CASES])
def test_invalid_request(scripted_fleet, redis_client, name, path, body, expected, param):
    gateway = scripted_fleet[0][0]
    # What reached the queue, counted at the gateway (the stream's length would not show a request
    # that was wrongly queued: its worker deletes the entry once answered).
    submitted_before = metric_value(gateway.url, "llmfleet_gateway_submitted_total", model=M)
    url = f"{gateway.url}/v1/{'chat/completions' if path == 'chat' else 'completions'}"
    if isinstance(body, bytes):
        response = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        response = httpx.post(url, json=body)
    assert (response.status_code, response.json()["error"]["type"]) == expected, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == (None if expected == OPENAI_RULE else expected[0]) and error["message"]
    if param is not None:
        assert error["param"] == param
    assert metric_value(gateway.url, "llmfleet_gateway_submitted_total", model=M) == submitted_before
    assert not leftover_keys(redis_client)
