"""The Responses battery: POST /v1/responses to `vllm serve` and to llmfleet, compared as a client
reads them, and llmfleet's answers checked against the API's own types (the openai SDK's).

Compared: the status code; for an error its `param`; for an answer the response's status,
incomplete_details and usage (input, output, reasoning tokens), and each output item as a
client reads it (message text, reasoning text, function name and arguments as parsed JSON);
for a stream also the sequence of event types, consecutive deltas of one kind counted once
(where one delta ends is an engine detail), and that each .done carries the joined deltas.
Not compared: ids, timestamps, and the echo of request fields (both echo them).

Where `vllm serve` departs from the API, the comparison reads both sides past it and the
departure is checked on llmfleet's side against the SDK's types instead (docs/parity.md,
"Responses"): a stream cut by max_output_tokens ends with `response.completed` on vllm serve,
with `response.incomplete` in the API and on llmfleet.
"""

from __future__ import annotations

import json
from typing import Any

import pydantic
from openai.types.responses import Response, ResponseStreamEvent

from tests.parity.battery import CALL_ENDS, NOT_JSON, PERSON_SCHEMA, THINK_MODEL, TOOLS_MODEL, Battery, Case
from tests.parity.compare import Answer, differences

PATH = "/v1/responses"
TERMINAL = ("response.completed", "response.incomplete", "response.failed")
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
TIME = {"type": "function", "name": "get_time", "description": "Local time in a timezone",
        "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                       "required": ["tz"], "additionalProperties": False}, "strict": True}
HELLO = "Hello there, how are you today?"


def tools(**extra) -> dict[str, Any]:
    return {"model": TOOLS_MODEL, "input": HELLO, "temperature": 0, "max_output_tokens": 8, **extra}


def think(**extra) -> dict[str, Any]:
    return {"model": THINK_MODEL, "input": HELLO, "temperature": 0, "max_output_tokens": 24, **extra}


def build() -> list[Case]:
    b = Battery()
    R = PATH
    user = lambda text: {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}  # noqa: E731

    b.add("responses", "string input", R, tools(), both=True)
    b.add("responses", "instructions", R, tools(instructions="Answer briefly."), both=True)
    b.add("responses", "message items with input_text", R, tools(input=[user(HELLO)]), both=True)
    b.add("responses", "multi-turn items", R, tools(input=[
        user("Hi"), {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        {"role": "user", "content": "Tell me more."}]), both=True)
    b.add("responses", "developer message", R, tools(input=[{"role": "developer", "content": "Be terse."},
                                                             {"role": "user", "content": HELLO}]))
    b.add("responses", "seeded sampling", R, tools(temperature=0.8, top_p=0.9, seed=7), both=True)
    b.add("responses", "stop string", R, tools(stop=["a"], max_output_tokens=16), both=True)
    b.add("responses", "max_output_tokens 1", R, tools(max_output_tokens=1), both=True)
    b.add("responses", "metadata and user echoed", R, tools(metadata={"k": "v"}, user="u1"))
    b.add("structured", "text.format json_schema", R, tools(
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA, "strict": True}},
        max_output_tokens=40), both=True)
    b.add("structured", "text.format json_object", R, tools(text={"format": {"type": "json_object"}},
                                                            max_output_tokens=12))

    both_tools = [WEATHER, TIME]
    b.add("tools", "tool_choice required", R,
          tools(tools=both_tools, tool_choice="required", max_output_tokens=CALL_ENDS), both=True)
    b.add("tools", "tool_choice required, cut inside a second call", R,  # whole only: tests/parity/battery.py
          tools(tools=both_tools, tool_choice="required", max_output_tokens=60, stream=False))
    b.add("tools", "tool_choice named", R, tools(tools=both_tools, tool_choice={"type": "function", "name": "get_time"},
                                                 max_output_tokens=40), both=True)
    b.add("tools", "tool_choice auto", R, tools(tools=both_tools, max_output_tokens=12), both=True)
    b.add("tools", "tool_choice none", R, tools(tools=both_tools, tool_choice="none"))
    b.add("tools", "required, parallel_tool_calls false", R,
          tools(tools=both_tools, tool_choice="required", parallel_tool_calls=False, max_output_tokens=60))
    b.add("tools", "function call and its output as input", R, tools(tools=both_tools, input=[
        user("What is the weather in Paris?"),
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]), both=True)

    b.add("reasoning", "reasoning split", R, think(), both=True, profile="think")
    b.add("reasoning", "enable_thinking false", R, think(chat_template_kwargs={"enable_thinking": False}), both=True,
          profile="think")
    b.add("reasoning", "include_reasoning false", R, think(include_reasoning=False), profile="think")
    b.add("reasoning", "reasoning item in the input", R, think(input=[
        user("Hi"), {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "greet"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello!"}]},
        user(HELLO)]), profile="think")
    b.add("reasoning", "instructions with thinking", R, think(instructions="Think, then answer.", stream=True),
          profile="think")

    bad = {"invalid": True}
    b.add("errors", "missing input", R, {"model": TOOLS_MODEL}, **bad)
    b.add("errors", "input of the wrong type", R, tools(input=42), **bad)
    b.add("errors", "tool_choice required without tools", R, tools(tool_choice="required"), **bad)
    b.add("errors", "named tool not in tools", R, tools(tools=[WEATHER], tool_choice={"type": "function",
                                                                                       "name": "nope"}), **bad)
    b.add("errors", "background without store", R, tools(background=True, store=False), **bad)
    b.add("errors", "prompt template", R, tools(prompt={"id": "p1"}), **bad)
    b.add("errors", "temperature 3", R, tools(temperature=3), **bad)
    b.add("errors", "max_output_tokens 0", R, tools(max_output_tokens=0), **bad)
    b.add("errors", "unknown model", R, tools(model="nope"), **bad)
    b.add("errors", "malformed JSON", R, b'{"model": "tiny-tools", "input": ', **bad, ours=NOT_JSON)
    b.add("errors", "unknown previous_response_id", R, tools(previous_response_id="resp_unknown"), **bad)
    b.add("errors", "encrypted reasoning input", R, tools(input=[
        {"type": "reasoning", "summary": [], "encrypted_content": "xyz"}, user("Hi")]), **bad)
    return b.cases


# --- as a client reads it ------------------------------------------------------------------------

def _item_view(item: dict[str, Any]) -> dict[str, Any]:
    kind = item.get("type")
    if kind == "message":
        return {"type": kind, "text": "".join(p.get("text", "") for p in item.get("content") or ())}
    if kind == "reasoning":
        return {"type": kind, "text": "".join(p.get("text", "") for p in item.get("content") or ())}
    if kind == "function_call":
        try:
            arguments = json.loads(item.get("arguments") or "")
        except ValueError:
            arguments = {"<not JSON>": item.get("arguments")}
        return {"type": kind, "name": item.get("name"), "arguments": arguments, "has_call_id": bool(item.get("call_id"))}
    return {"type": kind}


def response_view(response: dict[str, Any]) -> dict[str, Any]:
    usage = response.get("usage") or {}
    return {
        "status": response.get("status"),
        "incomplete_details": response.get("incomplete_details"),
        "output": [_item_view(item) for item in response.get("output") or ()],
        "usage": {"input_tokens": usage.get("input_tokens"), "output_tokens": usage.get("output_tokens"),
                  "reasoning_tokens": (usage.get("output_tokens_details") or {}).get("reasoning_tokens")},
    }


def _event_types(events: list[dict[str, Any]]) -> list[str]:
    """The event types in order, a run of deltas of one kind counted once, the terminal event
    named by what it ends (vllm serve names it `response.completed` whatever the status)."""
    types: list[str] = []
    for event in events:
        kind = event.get("type", "?")
        if kind in TERMINAL:
            kind = "<terminal>"
        if not (kind.endswith(".delta") and types and types[-1] == kind):
            types.append(kind)
    return types


def stream_view(events: list[Any]) -> dict[str, Any]:
    events = [e for e in events if isinstance(e, dict)]
    terminal = next((e for e in reversed(events) if e.get("type") in TERMINAL), None)
    joined: dict[int, str] = {}
    done: dict[int, str] = {}
    for event in events:
        kind = event.get("type", "")
        if kind.endswith(".delta"):
            joined[event["output_index"]] = joined.get(event["output_index"], "") + event.get("delta", "")
        elif kind in ("response.output_text.done", "response.reasoning_text.done"):
            done[event["output_index"]] = event.get("text")
        elif kind == "response.function_call_arguments.done":
            done[event["output_index"]] = event.get("arguments")
    return {
        "types": _event_types(events),
        "errors": [e.get("code") for e in events if e.get("type") == "error"],
        "final": response_view(terminal["response"]) if terminal else None,
        "done_is_joined_deltas": done == {k: v for k, v in joined.items() if k in done},
    }


def responses_view(answer: Answer) -> Any:
    if answer.status != 200:
        error = answer.body.get("error", answer.body) if isinstance(answer.body, dict) else {}
        return {"status": answer.status, "param": error.get("param") if isinstance(error, dict) else None}
    return stream_view(answer.body) if answer.stream else response_view(answer.body)


# --- llmfleet against the API's types --------------------------------------------------------------

_EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def spec_problems(answer: Answer) -> list[str]:
    """Where llmfleet's answer is not what the API's types (the openai SDK's) say."""
    if answer.status != 200:
        return []
    problems = []
    try:
        if not answer.stream:
            Response.model_validate(answer.body)
            return []
        events = [e for e in answer.body if isinstance(e, dict)]
        for number, event in enumerate(events):
            _EVENT.validate_python(event)
            if event.get("sequence_number") != number:
                problems.append(f"spec: event {number} has sequence_number {event.get('sequence_number')}")
        last = events[-1]
        status = last["response"]["status"] if "response" in last else None
        expected = {"completed": "response.completed", "incomplete": "response.incomplete",
                    "failed": "response.failed"}.get(status, last["type"])
        if last["type"] != expected:
            problems.append(f"spec: a {status} response ends with {last['type']}, not {expected}")
    except pydantic.ValidationError as exc:
        problems.append(f"spec: {str(exc)[:300]}")
    return problems


def responses_differences(expected: Answer, actual: Answer) -> list[str]:
    return differences(responses_view(expected), responses_view(actual)) + spec_problems(actual)
