"""Compare two servers' answers to the same request, field by field.

Ignored: response ids, `created` timestamps and tool-call ids (random on both sides; whether an
id is present is still compared). Everything else must be equal.

Non-streaming answers are compared as whole JSON documents. A stream is compared as what a
client makes of it, plus its shape: per choice, the joined text, reasoning, tool calls merged by
index, logprob entries, finish and stop reasons, and the running usage on its role and finish
chunks; the final usage chunk; and the set of chunk shapes (which keys each kind of chunk
carries, and which are null). Where one delta ends and the
next begins is not compared: vLLM sends one engine step per chunk, llmfleet may merge steps
that arrive together, and clients join deltas either way.

An error is compared by status, `type` and `param`; its message is reported, not required.

A stream's bytes are compared too (`frame_differences`), as far as they do not depend on where
deltas split: each event is a frame of the same lines (`data:` alone on the OpenAI routes: an
`id:` line is a difference), and each kind of frame is written alike, compact or not and with
its keys in the same order. With the JSON compared field by field, that leaves only the ids,
`created` and the chunk boundaries free.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx

ID = "<id>"


@dataclass
class Answer:
    status: int
    body: Any  # parsed JSON, or the list of SSE data payloads of a stream
    stream: bool
    raw: str = ""  # a stream's bytes as sent
    response: httpx.Response | None = None  # as received, for the SDKs to read again (tests/parity/replay.py)


def frames(raw: str) -> list[list[str]]:
    """The frames of an SSE body, each the list of its lines."""
    return [frame.split("\n") for frame in raw.split("\n\n") if frame]


# What a Response echoes of its request (`tools`, `text`, `tool_choice`): vllm serve passes them
# through the OpenAI SDK's types, which add the optional fields it has as nulls and order them;
# llmfleet echoes them as the client sent them (docs/compatibility.md). Their own keys are not compared.
ECHOED = ("tools", "text", "tool_choice")


def _keys(value: Any) -> Any:
    """The keys of a JSON value in the order written, nested (a list by its first element).

    A completion's `top_logprobs` are objects keyed by token: their keys are data, not how the
    frame is written, and which token's come first depends on where the stream's deltas split."""
    if isinstance(value, dict):
        if value.get("object") == "response":
            return [(key, None if key in ECHOED else _keys(item)) for key, item in value.items()]
        if "text_offset" in value:  # a completion's logprobs
            return [(key, None if key == "top_logprobs" else _keys(item)) for key, item in value.items()]
        return [(key, _keys(item)) for key, item in value.items()]
    if isinstance(value, list) and value:
        return [_keys(value[0])]
    return None


def _writing(frame: list[str]) -> tuple[str, tuple[str, ...], Any, bool] | None:
    """(kind, line fields, key order, compact) of one frame; None for the end marker."""
    fields = tuple(line.split(":", 1)[0] for line in frame)
    data = next((line[6:] for line in frame if line.startswith("data: ")), None)
    if data is None or data == "[DONE]":
        return None
    payload = json.loads(data)
    compact = data == json.dumps(payload, separators=(",", ":"), ensure_ascii=False)
    kind = payload.get("type") if isinstance(payload, dict) and "type" in payload else _shape(payload) \
        if isinstance(payload, dict) and "choices" in payload else "error" if "error" in payload else "other"
    return kind, fields, _keys(payload), compact


def frame_differences(expected: str, actual: str, ending: bool = True) -> list[str]:
    """Where two streams' frames are written differently, whatever their values and splits; with
    `ending`, also where they end differently (the Responses battery judges its last event itself)."""
    def by_kind(raw: str) -> dict[str, set]:
        written: dict[str, set] = {}
        for frame in frames(raw):
            writing = _writing(frame)
            if writing is not None:
                written.setdefault(writing[0], set()).add(json.dumps(writing[1:]))
        return written

    vllm, fleet = by_kind(expected), by_kind(actual)
    out = []
    for kind in sorted(set(vllm) & set(fleet)):
        if vllm[kind] != fleet[kind]:
            out.append(f"frames of {kind!r} written differently: vllm {sorted(vllm[kind])} != llmfleet "
                       f"{sorted(fleet[kind])}")
    endings = [_writing(last) or last for raw in (expected, actual) for last in (frames(raw) or [[]])[-1:]]
    if ending and endings[0] != endings[1]:
        out.append(f"last frame: vllm {endings[0]} != llmfleet {endings[1]}")
    return out


def parse_sse(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final `[DONE]`."""
    events = []
    for line in text.splitlines():
        if line.startswith("data: "):
            payload = line[6:]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def _scrub(obj: Any, top: bool = True) -> Any:
    """A copy without ids and timestamps."""
    if isinstance(obj, dict):
        out = {}
        for key, value in obj.items():
            if top and key in ("id", "created"):
                continue
            if key == "tool_calls" and isinstance(value, list):
                value = [{**call, "id": ID if call.get("id") else call.get("id")} if isinstance(call, dict)
                         else call for call in value]
            out[key] = _scrub(value, top=False)
        return out
    if isinstance(obj, list):
        return [_scrub(v, top=False) for v in obj]
    return obj


def _shapes(chunk: dict[str, Any]) -> list[str]:
    """The shapes of a chunk in a stream's set of shapes: a chat chunk that ends a choice with a
    delta, and a completion chunk that both starts and ends its choice, counted as two.

    vLLM's output collector merges engine steps that its reader has not taken yet, so whether the
    last delta rides on the finish chunk (`delta: {content: null, tool_calls}` beside
    `finish_reason`) or comes one chunk before it (then `delta: {}`) depends on timing, on either
    server. It is seen here as it is in the unmerged case: the delta chunk, then the finish chunk.
    A short completion stream may likewise come as one chunk, or two, or one per token: so its
    `prompt_token_ids`, set on the first chunk only, count here as a key whether null or not (the
    first chunk's own shape is compared apart, `first_chunk`), and a chunk carrying them beside its
    `finish_reason` is its first step and its finish at once.
    """
    choices = chunk.get("choices") or ()
    if len(choices) == 1 and "text" in choices[0] and "prompt_token_ids" in choices[0]:
        choice = {**choices[0], "prompt_token_ids": []}  # present, whether null or not
        if choice.get("finish_reason") is None:
            return [_shape({**chunk, "choices": [choice]})]
        step = {k: v for k, v in chunk.items() if k != "system_fingerprint"}
        step["choices"] = [choice | {"finish_reason": None}]
        return [_shape(step), _shape({**chunk, "choices": [choice]})]
    if len(choices) != 1 or choices[0].get("finish_reason") is None or not choices[0].get("delta"):
        return [_shape(chunk)]
    choice = choices[0]
    step = {k: v for k, v in chunk.items() if k != "system_fingerprint"}
    step["choices"] = [{k: v for k, v in choice.items() if k != "stop_reason"} | {"finish_reason": None}]
    finish = {**chunk, "choices": [{**choice, "delta": {}, "logprobs": None}]}
    return [_shape(step), _shape(finish)]


def _shape(chunk: dict[str, Any]) -> str:
    """Which keys a chunk carries, and which of them are null."""
    def keys(d: dict) -> str:
        return ",".join(f"{k}{'=null' if v is None else ''}" for k, v in sorted(d.items()))
    parts = [keys({k: v for k, v in chunk.items() if k not in ("choices",)})]
    for choice in chunk.get("choices") or ():
        parts.append("choice:" + keys({k: v for k, v in choice.items() if k not in ("delta", "index")}))
        if "delta" in choice:
            parts.append("delta:" + keys(choice["delta"]))
    if not chunk.get("choices"):
        parts.append("no choices")
    return " | ".join(parts)


def stream_view(events: list[Any]) -> dict[str, Any]:
    """What a client makes of a stream, and the shapes of its chunks."""
    chunks = [e for e in events if isinstance(e, dict)]
    errors = [c["error"] for c in chunks if "error" in c]
    choices: dict[int, dict[str, Any]] = {}
    usage = None
    for chunk in chunks:
        if "error" in chunk:
            continue
        if not chunk.get("choices") and "usage" in chunk:
            usage = chunk["usage"]
        for choice in chunk.get("choices") or ():
            view = choices.setdefault(choice["index"], {"text": "", "content": None, "reasoning": None,
                                                        "role": None, "tool_calls": {}, "logprobs": None,
                                                        "finish_reason": None, "stop_reason": None,
                                                        "usage_at_role": None, "usage_at_finish": None})
            _merge_choice(view, choice, chunk.get("usage"))
    for view in choices.values():
        view["tool_calls"] = [view["tool_calls"][i] for i in sorted(view["tool_calls"])]
    return {
        "ends_with_done": bool(events) and events[-1] == "[DONE]",
        "errors": [_error_view(e, 200) for e in errors],
        "choices": [choices[i] for i in sorted(choices)],
        "usage": usage,
        "first_chunk": _shape(_first_step(chunks[0])) if chunks else None,
        "shapes": sorted({shape for c in chunks for shape in _shapes(c)}),
    }


def _first_step(chunk: dict[str, Any]) -> dict[str, Any]:
    """A completion stream's first chunk as it is when it does not also end the stream (`_shapes`)."""
    choices = chunk.get("choices") or ()
    if len(choices) != 1 or "text" not in choices[0] or choices[0].get("finish_reason") is None:
        return chunk
    step = {k: v for k, v in chunk.items() if k != "system_fingerprint"}
    return step | {"choices": [choices[0] | {"finish_reason": None}]}


def _merge_choice(view: dict[str, Any], choice: dict[str, Any], usage: dict | None) -> None:
    if "text" in choice:
        view["text"] += choice["text"] or ""
    delta = choice.get("delta") or {}
    if "role" in delta:
        view["role"], view["usage_at_role"] = delta["role"], usage
    for key in ("content", "reasoning"):
        if delta.get(key) is not None:
            view[key] = (view[key] or "") + delta[key]
    for call in delta.get("tool_calls") or ():
        merged = view["tool_calls"].setdefault(call["index"], {"has_id": False, "type": None, "name": None,
                                                               "arguments": ""})
        merged["has_id"] = merged["has_id"] or bool(call.get("id"))
        merged["type"] = call.get("type") or merged["type"]
        function = call.get("function") or {}
        merged["name"] = function.get("name") or merged["name"]
        merged["arguments"] += function.get("arguments") or ""
    logprobs = choice.get("logprobs")
    if logprobs is not None:
        if "content" in logprobs:  # chat
            view["logprobs"] = (view["logprobs"] or []) + (logprobs["content"] or [])
        else:  # completions: parallel lists
            merged = view["logprobs"] or {}
            for key, values in logprobs.items():
                merged[key] = merged.get(key, []) + (values or [])
            view["logprobs"] = merged
    if choice.get("finish_reason") is not None:
        view["finish_reason"] = choice["finish_reason"]
        view["stop_reason"] = choice.get("stop_reason")
        view["usage_at_finish"] = usage


def _error_view(error: Any, status: int) -> dict[str, Any]:
    error = error.get("error", error) if isinstance(error, dict) else {"message": str(error)}
    return {"status": status, "type": error.get("type"), "param": error.get("param"),
            "code": error.get("code")}


def view(answer: Answer) -> Any:
    """The comparable form of an answer."""
    if answer.status != 200:
        return _error_view(answer.body, answer.status)
    if answer.stream:
        return stream_view(answer.body)
    return _scrub(answer.body)


def differences(expected: Any, actual: Any, path: str = "") -> list[str]:
    """Paths where `actual` differs from `expected`, with both values."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        out = []
        for key in sorted(set(expected) | set(actual), key=str):
            if key not in actual:
                out.append(f"{path}.{key}: missing (vllm: {_short(expected[key])})")
            elif key not in expected:
                out.append(f"{path}.{key}: extra ({_short(actual[key])})")
            else:
                out += differences(expected[key], actual[key], f"{path}.{key}")
        return out
    if isinstance(expected, list) and isinstance(actual, list) and len(expected) == len(actual):
        return [d for i, (e, a) in enumerate(zip(expected, actual, strict=True))
                for d in differences(e, a, f"{path}[{i}]")]
    if expected != actual or type(expected) is not type(actual):
        return [f"{path or '.'}: vllm {_short(expected)} != llmfleet {_short(actual)}"]
    return []


def error_message(answer: Answer) -> str | None:
    body = answer.body
    if answer.status != 200 and isinstance(body, dict):
        return (body.get("error") or {}).get("message")
    if answer.stream:
        for event in body:
            if isinstance(event, dict) and "error" in event:
                return event["error"].get("message")
    return None


def _short(value: Any, limit: int = 160) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "…"
