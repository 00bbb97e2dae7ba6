"""Anthropic Messages on the fleet, read by the official `anthropic` SDK.

Three parts:
- the conversion: a Messages request becomes the chat request `vllm serve` builds from it
  (checked against vLLM's own converter, in-process);
- scripted workers behind two gateways (integration): create and stream across replicas, stop
  sequences, the events and their names, errors with Anthropic's types and statuses;
- a real vLLM worker on the tiny model (vllm): tool use round trips, thinking, count_tokens.
  One vLLM worker at a time, shared by the module's tests (see `TinyWorker`).

The scripted engine repeats the words of the last user message, one per token, and counts
every message's words as prompt tokens, so what reached the worker shows in the answer.
"""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest

from tests.conftest import SCRIPTED_MODEL
from tests.procs import Proc, start_gateway, start_redis, start_worker, wait_until_served

WORDS = "alpha beta gamma delta"


def _client(gateway: Proc) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key="sk-any", max_retries=0, timeout=120)


def _user(text: str = WORDS) -> list[dict]:
    return [{"role": "user", "content": text}]


def _events(gateway: Proc, body: dict) -> list[tuple[str, dict]]:
    """The (event name, data) pairs of a raw Messages stream."""
    response = httpx.post(f"{gateway.url}/v1/messages", json={**body, "stream": True}, timeout=120,
                          headers={"x-api-key": "sk-any", "anthropic-version": "2023-06-01"})
    assert response.status_code == 200, response.text
    events = []
    for block in response.text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((fields["event"], json.loads(fields["data"])))
    return events


def _collapsed(names: list[str]) -> list[str]:
    """Event names with runs of content_block_delta as one (where deltas split is not fixed)."""
    out: list[str] = []
    for name in names:
        if not (name == "content_block_delta" and out and out[-1] == name):
            out.append(name)
    return out


# The conversion, against vLLM's own


TOOLS = [{"name": "get_weather", "description": "Weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                           "required": ["city"]}},
         {"name": "get_time", "input_schema": {"properties": {"tz": {"type": "string"}}}}]
IMAGE = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
CONVERSATIONS = {
    "plain": {"messages": _user()},
    "system string, sampling, stops": {"system": "Be brief.", "messages": _user(), "temperature": 0.5, "top_p": 0.9,
                                       "top_k": 20, "stop_sequences": ["gamma", "x"], "metadata": {"user_id": "u1"}},
    "system blocks, billing header dropped": {
        "system": [{"type": "text", "text": "x-anthropic-billing-header: cc=1"}, {"type": "text", "text": "Be "},
                   {"type": "text", "text": "brief."}], "messages": _user()},
    "blocks: text, image, thinking": {"messages": [
        {"role": "user", "content": [{"type": "text", "text": "Look:"}, {"type": "image", "source": IMAGE},
                                     {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm", "signature": "s"},
                                          {"type": "redacted_thinking", "data": "zz"},
                                          {"type": "text", "text": "A cat."}]},
        {"role": "user", "content": [{"type": "text", "text": "And?"}]}]},
    "tool use round trip": {"tools": TOOLS, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
            {"type": "tool_result", "tool_use_id": "toolu_2",
             "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"},
                         {"type": "image", "source": IMAGE}]},
            {"type": "text", "text": "Thanks"}]}]},
    "tool_choice any, no parallel": {"tools": TOOLS, "messages": _user(),
                                     "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    "tool_choice tool": {"tools": TOOLS, "messages": _user(), "tool_choice": {"type": "tool", "name": "get_time"}},
    "tool_choice none": {"tools": TOOLS, "messages": _user(), "tool_choice": {"type": "none"}},
    "inline system message": {"messages": [*_user(), {"role": "assistant", "content": "ok"},
                                           {"role": "system", "content": "Now in French."}, *_user("encore")]},
    "thinking disabled": {"messages": _user(), "thinking": {"type": "disabled"}},
    "thinking enabled": {"messages": _user(), "thinking": {"type": "enabled", "budget_tokens": 1024},
                         "max_tokens": 2000},
    "output_config": {"messages": _user(), "output_config": {
        "effort": "low", "format": {"type": "json_schema", "schema": {"type": "object"}}}},
}
COMPARED = ("messages", "model", "max_tokens", "max_completion_tokens", "stop", "temperature", "top_p", "top_k",
            "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "thinking_token_budget",
            "response_format", "chat_template_kwargs", "stream")


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_the_chat_request_is_the_one_vllm_serve_builds(name):
    """Our chat body, read by vLLM's own chat request model, equals what vLLM's converter makes."""
    serving = pytest.importorskip("vllm.entrypoints.anthropic.serving")
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    from gateway.api.anthropic.protocol import MessagesRequest

    body = {"model": "m", "max_tokens": 50, **CONVERSATIONS[name]}
    theirs = serving.AnthropicServingMessages.to_chat_completion_request(
        AnthropicMessagesRequest.model_validate(body), merge_inline_system=False).model_dump()
    ours = ChatCompletionRequest.model_validate(MessagesRequest.model_validate(body).chat_body("m")).model_dump()
    theirs["stop"] = theirs["stop"] or []  # vLLM sets None where the default is []: the same stops
    assert {k: ours[k] for k in COMPARED} == {k: theirs[k] for k in COMPARED}


# Scripted workers, two gateways


@pytest.mark.integration
def test_create_then_stream_on_the_other_replica(scripted_fleet):
    (first, second), _ = scripted_fleet
    request = dict(model=SCRIPTED_MODEL, max_tokens=6, system="be brief", messages=_user())
    message = _client(first).messages.create(**request)
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == SCRIPTED_MODEL
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == "alpha beta gamma delta alpha beta"
    assert (message.stop_reason, message.stop_sequence) == ("max_tokens", None)
    assert (message.usage.input_tokens, message.usage.output_tokens) == (2 + 4, 6)  # system and user words

    with _client(second).messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == message.content[0].text
    assert final.id.startswith("msg_") and final.id != message.id
    assert final.model_dump(exclude={"id"}) == message.model_dump(exclude={"id"})


@pytest.mark.integration
def test_stream_events_are_named_and_ordered(scripted_fleet):
    (gateway, _), _ = scripted_fleet
    events = _events(gateway, {"model": SCRIPTED_MODEL, "max_tokens": 5, "messages": _user()})
    assert all(name == data["type"] for name, data in events)
    assert _collapsed([name for name, _ in events]) == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == [] and start["stop_reason"] is None
    assert start["usage"] == {"input_tokens": 4, "output_tokens": 0}
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[-2][1] == {"type": "message_delta", "delta": {"stop_reason": "max_tokens", "stop_sequence": None},
                             "usage": {"input_tokens": 4, "output_tokens": 5}}


@pytest.mark.integration
@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(scripted_fleet, stream):
    (gateway, _), _ = scripted_fleet
    request = dict(model=SCRIPTED_MODEL, max_tokens=12, messages=_user(), stop_sequences=["delta", "zeta"])
    if stream:
        with _client(gateway).messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = _client(gateway).messages.create(**request)
    assert message.content[0].text == "alpha beta gamma "
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "delta")


@pytest.mark.integration
def test_blocks_and_tool_results_reach_the_worker(scripted_fleet):
    """System blocks, tool_use and tool_result blocks become chat messages the worker counts."""
    (gateway, _), _ = scripted_fleet
    message = _client(gateway).messages.create(
        model=SCRIPTED_MODEL, max_tokens=3, system=[{"type": "text", "text": "one two"}],
        messages=[{"role": "user", "content": "three"},
                  {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "f",
                                                     "input": {"x": 1}}]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_a",
                                                "content": "four five"},
                                               {"type": "text", "text": "six seven"}]}],
        metadata={"user_id": "someone"}, extra_body={"temperature": 0.3, "top_p": 0.9, "top_k": 5})
    assert message.content[0].text == "six seven six"  # the last user message's words
    assert message.usage.input_tokens == 7  # system, user, tool result and user again


@pytest.mark.integration
def test_errors_have_anthropic_types(scripted_fleet):
    (gateway, _), _ = scripted_fleet
    client = _client(gateway)
    cases = [
        (dict(model=SCRIPTED_MODEL, messages=_user()), anthropic.BadRequestError),  # no max_tokens
        (dict(model=SCRIPTED_MODEL, max_tokens=0, messages=_user()), anthropic.BadRequestError),
        (dict(model=SCRIPTED_MODEL, max_tokens=5, messages=_user(), temperature=5), anthropic.BadRequestError),
        (dict(model=SCRIPTED_MODEL, max_tokens=5, messages=[{"role": "wizard", "content": "x"}]),
         anthropic.BadRequestError),
        (dict(model=SCRIPTED_MODEL, max_tokens=5, messages=_user(), stop_sequences=list("abcde")),
         anthropic.BadRequestError),
        (dict(model="no-such-model", max_tokens=5, messages=_user()), anthropic.NotFoundError),
    ]
    for body, error in cases:
        with pytest.raises(error) as raised:
            client.post("/v1/messages", body=body, cast_to=httpx.Response)
        assert raised.value.body["type"] == "error", body
        expected = "not_found_error" if error is anthropic.NotFoundError else "invalid_request_error"
        assert raised.value.body["error"]["type"] == expected, raised.value.body
        assert raised.value.body["error"]["message"]
    with pytest.raises(anthropic.NotFoundError) as raised:  # an unknown route under /v1/messages
        client.post("/v1/messages/nothing", body={}, cast_to=httpx.Response)
    assert raised.value.body["error"]["type"] == "not_found_error"
    # Streaming requests are refused before the stream, in the same shape.
    with pytest.raises(anthropic.NotFoundError):
        with client.messages.stream(model="no-such-model", max_tokens=5, messages=_user()) as stream:
            stream.get_final_message()
    # Scripted workers do not tokenize: the fleet refuses the kind at once (its 503, Anthropic's 529).
    with pytest.raises(anthropic.OverloadedError) as raised:
        client.messages.count_tokens(model=SCRIPTED_MODEL, messages=_user())
    assert "tokenize" in raised.value.body["error"]["message"]
    huge = httpx.post(f"{gateway.url}/v1/messages", content=b"x" * (5 * 1024 * 1024),
                      headers={"content-type": "application/json"}, timeout=60)
    assert huge.status_code == 413 and huge.json()["error"]["type"] == "request_too_large"
    # Other routes keep OpenAI's shape.
    response = httpx.post(f"{gateway.url}/v1/chat/completions", json={"model": "no-such-model", "messages": _user()})
    assert response.status_code == 404 and "type" in response.json()["error"]


@pytest.mark.integration
def test_rate_limited_and_overloaded():
    """The fleet's 429 is rate_limit_error; its 503 (no worker took the request in time) is 529."""
    redis = start_redis()  # its own: the request left queued for a model without workers stays here
    gateways = [start_gateway(redis.url, "--models", "ghost", "--max-open-requests", "0"),
                start_gateway(redis.url, "--models", "ghost", "--queue-timeout", "1")]
    try:
        request = dict(model="ghost", max_tokens=5, messages=_user())
        with pytest.raises(anthropic.RateLimitError) as raised:
            _client(gateways[0]).messages.create(**request)
        assert raised.value.body["error"]["type"] == "rate_limit_error"
        assert raised.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.OverloadedError) as raised:
            _client(gateways[1]).messages.create(**request)
        assert raised.value.status_code == 529 and raised.value.body["error"]["type"] == "overloaded_error"
    finally:
        for proc in [*gateways, redis]:
            proc.stop()


# A real vLLM worker on the tiny model (gibberish text; greedy, so streams equal whole answers)

WEATHER = {**TOOLS[0], "strict": True, "input_schema": {**TOOLS[0]["input_schema"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def tiny(parser_workers):
    """The session's vLLM workers of the tiny model, one per parser profile (tests/conftest.py)."""
    return parser_workers


GREEDY = {"extra_body": {"temperature": 0}}


@pytest.mark.vllm
def test_tool_use_round_trip(tiny):
    model = tiny.serve("tools")
    client = _client(tiny.gateway)
    request = dict(model=model, max_tokens=60, tools=[WEATHER], messages=_user("Weather in Paris?"),
                   tool_choice={"type": "tool", "name": "get_weather"}, **GREEDY)
    message = client.messages.create(**request)
    assert [b.type for b in message.content] == ["tool_use"] and message.stop_reason == "tool_use"
    call = message.content[0]
    assert call.id and call.name == "get_weather" and set(call.input) == {"city"}, call
    assert call.id and call.name == "get_weather" and call.input["city"] in ("Paris", "Tokyo")

    with client.messages.stream(**request) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert deltas and set(deltas) == {"input_json_delta"}
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", call.name, call.input)]
    assert final.stop_reason == "tool_use" and final.usage == message.usage

    # The result goes back as a tool_result; the worker renders it (its prompt grows by it).
    history = [*_user("Weather in Paris?"), {"role": "assistant", "content": [call.model_dump()]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "sunny"}]}]
    answer = client.messages.create(model=model, max_tokens=8, tools=[WEATHER], messages=history, **GREEDY)
    assert answer.stop_reason in ("max_tokens", "end_turn") and answer.content[0].type == "text"
    counted = client.messages.count_tokens(model=model, tools=[WEATHER], messages=history)
    assert counted.input_tokens == answer.usage.input_tokens > message.usage.input_tokens


@pytest.mark.vllm
def test_thinking_blocks(tiny):
    model = tiny.serve("think")
    client = _client(tiny.gateway)
    request = dict(model=model, max_tokens=24, messages=_user("Tell me about the sea."), **GREEDY)
    message = client.messages.create(**request)
    thinking = message.content[0]
    assert thinking.type == "thinking" and thinking.thinking and thinking.signature
    assert message.usage.output_tokens == 24 and message.stop_reason == "max_tokens"

    events = _events(tiny.gateway, {"model": model, "max_tokens": 24, "temperature": 0,
                                    "messages": _user("Tell me about the sea.")})
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    joined = "".join(d.get("thinking", "") for d in deltas)
    assert joined == thinking.thinking and deltas[-1]["type"] == "signature_delta"
    with client.messages.stream(**request) as stream:
        final = stream.get_final_message()
    assert final.content[0].thinking == thinking.thinking and final.content[0].signature

    # Thinking disabled: the template is asked for no thinking (it writes an empty think block
    # into the prompt; deepseek_r1 still reads this model's gibberish as reasoning).
    plain = client.messages.create(**request, thinking={"type": "disabled"})
    counted = [client.messages.count_tokens(model=model, messages=request["messages"], **extra).input_tokens
               for extra in ({}, {"thinking": {"type": "disabled"}})]
    assert counted == [message.usage.input_tokens, plain.usage.input_tokens]
    assert counted[1] > counted[0]  # the empty think block the template adds


@pytest.mark.integration
def test_an_error_mid_stream_is_an_error_event():
    """A worker killed mid-stream: the stream ends with Anthropic's error event, no message_stop."""
    redis = start_redis()  # its own: a killed worker's request is left behind here
    worker = start_worker(redis.url, "paced", "--scripted-tokens-per-second", "10")
    gateway = start_gateway(redis.url)
    try:
        wait_until_served(gateway, "paced")
        body = {"model": "paced", "max_tokens": 200, "stream": True, "messages": _user()}
        events = []
        with httpx.stream("POST", f"{gateway.url}/v1/messages", json=body, timeout=60) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("event: "):
                    events.append(line[7:])
                    if line == "event: content_block_delta" and worker.alive():
                        worker.kill()
                elif line.startswith("data: ") and events[-1] == "error":
                    error = json.loads(line[6:])
        assert events[-1] == "error" and "message_stop" not in events
        assert error["type"] == "error" and error["error"]["type"] == "api_error", error
    finally:
        for proc in (gateway, worker, redis):
            proc.stop()
