"""The Anthropic Messages battery: requests to `vllm serve`'s /v1/messages and llmfleet's.

Answers are compared as the `anthropic` SDK reads them (`view`): the content blocks (text,
thinking, tool calls with their parsed input), stop_reason and stop_sequence, usage, and for a
stream the message it accumulates to plus the sequence of event types (pings left out, and a
run of content_block_delta counted as one: where deltas split is not fixed). An error is
compared by its status.

Where `vllm serve` departs from Anthropic's API (docs/parity.md, "Anthropic Messages"), llmfleet
is held to the API instead, on its own answers (`client_problems`): ids `msg_...`,
`stop_sequence` always present, errors in Anthropic's shape with the type of their status, and
every answer read back through the SDK.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic

from tests.parity.battery import CALL_ENDS, THINK_MODEL, TOO_LONG, TOOLS_MODEL, Battery, Case
from tests.parity.compare import Answer
from tests.parity.replay import replaying

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city", "strict": True,
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                            "required": ["city"], "additionalProperties": False}}
TIME = {"name": "get_time", "description": "Local time in a timezone", "strict": True,
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                         "required": ["tz"], "additionalProperties": False}}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
IMAGE = {"type": "base64", "media_type": "image/png",
         "data": "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="}
TOOL_HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me check."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                       "input": {"city": "Paris"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21 C"}]},
]
# Anthropic's error type for each status (https://docs.anthropic.com/en/api/errors)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
               504: "timeout_error", 529: "overloaded_error"}


def message(**extra) -> dict[str, Any]:
    return {"model": TOOLS_MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 8, **extra}


def think(**extra) -> dict[str, Any]:
    return {"model": THINK_MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 24, **extra}


def build() -> list[Case]:
    b = Battery()
    M = MESSAGES

    b.add("anthropic text", "greedy", M, message(), both=True)
    b.add("anthropic text", "system string", M, message(system="You are tiny."), both=True)
    b.add("anthropic text", "system blocks", M, message(system=[
        {"type": "text", "text": "You are "}, {"type": "text", "text": "tiny."}]), both=True)
    b.add("anthropic text", "multi-turn with text blocks", M, message(messages=[
        *HELLO, {"role": "assistant", "content": [{"type": "text", "text": "Fine."}]},
        {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "now?"}]}]),
        both=True)
    b.add("anthropic text", "top_p, top_k, metadata", M,
          message(top_p=0.5, top_k=5, metadata={"user_id": "u-1"}, max_tokens=12))
    b.add("anthropic text", "max_tokens 1", M, message(max_tokens=1), both=True)
    b.add("anthropic text", "unknown fields tolerated", M, message(some_future_field={"x": 1}))
    b.add("anthropic text", "inline system message", M, message(messages=[
        *HELLO, {"role": "assistant", "content": "Fine."}, {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Again?"}]))

    b.add("anthropic stop", "stop_sequences hit", M, message(stop_sequences=["e", "t"], max_tokens=30), both=True)
    b.add("anthropic stop", "stop_sequences missed", M, message(stop_sequences=["qqqq"], max_tokens=6), both=True)

    tools = [WEATHER, TIME]
    b.add("anthropic tools", "tool_choice tool", M,
          message(tools=tools, tool_choice={"type": "tool", "name": "get_time"}, max_tokens=40), both=True)
    b.add("anthropic tools", "tool_choice any", M,
          message(tools=tools, tool_choice={"type": "any"}, max_tokens=CALL_ENDS), both=True)
    b.add("anthropic tools", "tool_choice any, cut inside a second call", M,  # whole only: tests/parity/battery.py
          message(tools=tools, tool_choice={"type": "any"}, max_tokens=60, stream=False))
    b.add("anthropic tools", "tool_choice any, no parallel calls", M,
          message(tools=tools, tool_choice={"type": "any", "disable_parallel_tool_use": True}, max_tokens=60),
          both=True)
    b.add("anthropic tools", "tool_choice auto", M, message(tools=tools, tool_choice={"type": "auto"}, max_tokens=12),
          both=True)
    b.add("anthropic tools", "tools without tool_choice", M, message(tools=tools, max_tokens=12))
    b.add("anthropic tools", "tool_choice none", M, message(tools=tools, tool_choice={"type": "none"}))
    b.add("anthropic tools", "tool_use and tool_result in history", M,
          message(messages=TOOL_HISTORY, tools=tools, max_tokens=8), both=True)
    b.add("anthropic tools", "tool_result with blocks", M, message(tools=tools, max_tokens=8, messages=[
        *TOOL_HISTORY[:2], {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "sunny"}, {"type": "text", "text": "21 C"}]},
            {"type": "text", "text": "Thanks."}]}]))

    b.add("anthropic thinking", "thinking", M, think(), both=True, profile="think")
    b.add("anthropic thinking", "thinking disabled", M, think(thinking={"type": "disabled"}), both=True,
          profile="think")
    b.add("anthropic thinking", "thinking blocks in history", M, think(messages=[
        *HELLO, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Greet back.", "signature": "x"},
                                                  {"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "And now?"}]), profile="think")
    b.add("anthropic thinking", "output_config effort", M, think(output_config={"effort": "low"}), profile="think")

    b.add("anthropic json", "output_config json_schema", M,
          message(output_config={"format": {"type": "json_schema", "schema": PERSON}}, max_tokens=40), both=True)

    count = {"model": TOOLS_MODEL, "messages": HELLO}
    b.add("anthropic count_tokens", "plain", COUNT, count)
    b.add("anthropic count_tokens", "system and blocks", COUNT, {**count, "system": "You are tiny.", "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " there"}]}]})
    b.add("anthropic count_tokens", "tools and history", COUNT, {**count, "tools": tools, "messages": TOOL_HISTORY})
    b.add("anthropic count_tokens", "thinking disabled", COUNT,
          {"model": THINK_MODEL, "messages": HELLO, "thinking": {"type": "disabled"}}, profile="think")

    bad = {"invalid": True}
    b.add("anthropic errors", "missing max_tokens", M, {"model": TOOLS_MODEL, "messages": HELLO}, **bad)
    b.add("anthropic errors", "max_tokens 0", M, message(max_tokens=0), **bad)
    b.add("anthropic errors", "max_tokens beyond the context", M, message(max_tokens=5000), **bad)
    b.add("anthropic errors", "unknown model", M, message(model="no-such-model"), **bad)
    b.add("anthropic errors", "temperature -1", M, message(temperature=-1), **bad)
    b.add("anthropic errors", "unknown role", M, message(messages=[{"role": "wizard", "content": "hi"}]), **bad)
    b.add("anthropic errors", "five stop sequences", M, message(stop_sequences=list("abcde")), **bad)
    b.add("anthropic errors", "tool_choice tool without a name", M,
          message(tools=tools, tool_choice={"type": "tool"}), **bad)
    b.add("anthropic errors", "tool without input_schema", M, message(tools=[{"name": "f"}]), **bad)
    b.add("anthropic errors", "messages as a string", M, message(messages="hello"), **bad)
    b.add("anthropic errors", "broken JSON", M, b'{"model": "tiny-tools", "messages": [', **bad)
    b.add("anthropic errors", "prompt longer than the context", M,
          message(messages=[{"role": "user", "content": TOO_LONG}]), **bad)
    b.add("anthropic errors", "prompt longer than the context (stream)", M,
          message(messages=[{"role": "user", "content": TOO_LONG}], stream=True), **bad)
    b.add("anthropic errors", "count_tokens unknown model", COUNT, {"model": "no-such-model", "messages": HELLO},
          **bad)
    b.add("anthropic errors", "count_tokens without messages", COUNT, {"model": TOOLS_MODEL}, **bad)
    # Rules of Anthropic's API that vllm serve does not check: held to the API's answer.
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}
    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}
    for name, blocks, param in (
            ("tool_result without tool_use_id", [use, {k: v for k, v in result.items() if k != "tool_use_id"}],
             "messages.2.content.0.tool_result.tool_use_id"),
            ("tool_use whose input is not an object", [{**use, "input": "Paris"}, result],
             "messages.1.content.0.tool_use.input")):
        history = [HELLO[0], {"role": "assistant", "content": blocks[:1]}, {"role": "user", "content": blocks[1:]}]
        b.add("anthropic errors", name, M, message(tools=tools, messages=history), invalid=True,
              api=(400, "invalid_request_error", param))
    return b.cases


def owns(case: Case) -> bool:
    return case.path.startswith(MESSAGES)


# How a client reads an answer


def _block(block: dict[str, Any], partial_json: str | None = None) -> dict[str, Any]:
    kind = block.get("type")
    if kind == "text":
        return {"type": kind, "text": block.get("text")}
    if kind == "thinking":
        return {"type": kind, "thinking": block.get("thinking"), "signed": bool(block.get("signature"))}
    if kind == "tool_use":
        return {"type": kind, "name": block.get("name"), "input": _tool_input(block, partial_json),
                "has_id": bool(block.get("id"))}
    return {"type": kind}


def _tool_input(block: dict[str, Any], partial_json: str | None) -> Any:
    """The streamed input as parsed JSON, or as its text where it was cut short (max_tokens)."""
    if not partial_json:
        return block.get("input")
    try:
        return json.loads(partial_json)
    except ValueError:
        return {"unparsed": partial_json}


def _message_view(body: dict[str, Any]) -> dict[str, Any]:
    return {"type": body.get("type"), "role": body.get("role"), "model": body.get("model"),
            "content": [_block(b) for b in body.get("content") or ()], "stop_reason": body.get("stop_reason"),
            "stop_sequence": body.get("stop_sequence"), "usage": body.get("usage")}


def _stream_view(events: list[Any]) -> dict[str, Any]:
    """The message a stream accumulates to, as the SDK's MessageStream builds it, and its events."""
    events = [e for e in events if isinstance(e, dict) and e.get("type") != "ping"]
    names: list[str] = []
    for event in events:
        if not (event["type"] == "content_block_delta" and names and names[-1] == event["type"]):
            names.append(event["type"])
    start = next((e["message"] for e in events if e["type"] == "message_start"), {})
    blocks: dict[int, dict[str, Any]] = {}
    arguments: dict[int, str] = {}
    final = {**start, "content": [], "usage": dict(start.get("usage") or {})}
    for event in events:
        if event["type"] == "content_block_start":
            blocks[event["index"]] = dict(event["content_block"])
        elif event["type"] == "content_block_delta":
            _apply(blocks[event["index"]], event["delta"], arguments, event["index"])
        elif event["type"] == "message_delta":
            final.update(event["delta"])
            final["usage"].update(event.get("usage") or {})
    view = _message_view({**final, "content": []})
    view["content"] = [_block(blocks[i], arguments.get(i)) for i in sorted(blocks)]
    view["events"] = names
    view["errors"] = [e["error"].get("type") is not None for e in events if e["type"] == "error"]
    return view


def _apply(block: dict[str, Any], delta: dict[str, Any], arguments: dict[int, str], index: int) -> None:
    kind = delta.get("type")
    if kind == "text_delta":
        block["text"] = (block.get("text") or "") + delta["text"]
    elif kind == "thinking_delta":
        block["thinking"] = (block.get("thinking") or "") + delta["thinking"]
    elif kind == "signature_delta":
        block["signature"] = delta["signature"]
    elif kind == "input_json_delta":
        arguments[index] = arguments.get(index, "") + delta["partial_json"]


def view(answer: Answer) -> Any:
    """The comparable form of an answer: an error by its status (its shape is checked against
    Anthropic's API on llmfleet alone, see `client_problems`)."""
    if answer.status != 200:
        return {"status": answer.status}
    if answer.stream:
        return _stream_view(answer.body)
    if "input_tokens" in answer.body:  # count_tokens
        return answer.body
    return _message_view(answer.body)


# llmfleet against Anthropic's API, through the SDK


def client_problems(case: Case, base_url: str, answer: Answer) -> list[str]:
    """Read llmfleet's answer to the case as Anthropic's API and SDK say it must read (the SDK
    makes the case's request and reads the answer llmfleet gave it: tests/parity/replay.py)."""
    if case.invalid:
        return _error_problems(answer)
    client = anthropic.Anthropic(base_url=base_url, api_key="sk-unused", max_retries=0, timeout=300,
                                 http_client=replaying(case, answer))
    try:
        if case.path == COUNT:
            body = {k: v for k, v in case.body.items() if k not in ("model", "messages")}
            counted = client.messages.count_tokens(model=case.body["model"], messages=case.body["messages"],
                                                   extra_body=body)
            return [] if counted.input_tokens > 0 else [f"count_tokens: {counted}"]
        body = {k: v for k, v in case.body.items() if k not in ("model", "max_tokens", "messages", "stream")}
        request = dict(model=case.body["model"], max_tokens=case.body["max_tokens"], messages=case.body["messages"],
                       extra_body=body)
        if case.stream:
            with client.messages.stream(**request) as stream:
                result = stream.get_final_message()
        else:
            result = client.messages.create(**request)
    except Exception as exc:  # noqa: BLE001 - whatever the SDK raises is the finding
        return [f"anthropic SDK: {type(exc).__name__}: {exc}"]
    problems = [] if result.id.startswith("msg_") else [f"id {result.id!r} is not msg_..."]
    if not case.stream:
        problems += [] if "stop_sequence" in answer.body else ["no stop_sequence key in the message"]
    return problems


def _error_problems(answer: Answer) -> list[str]:
    response = answer.response
    try:
        body = response.json()
    except ValueError:
        return [f"error body is not JSON: {response.text[:200]!r}"]
    expected = ERROR_TYPES.get(response.status_code)
    error = body.get("error") if isinstance(body, dict) else None
    if body.get("type") != "error" or not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return [f"not Anthropic's error shape: {body}"]
    if error.get("type") != expected:
        return [f"error type {error.get('type')!r} for status {response.status_code}, Anthropic's is {expected!r}"]
    return []
