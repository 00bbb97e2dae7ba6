"""The parity comparator itself: what it forgives (where vLLM's chunk boundaries fall) and what it
still catches (a delta of another shape)."""

from __future__ import annotations

import json

from tests.parity.compare import frame_differences, stream_view

TOP = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "tiny"}


def _chunk(delta, finish=None, **extra):
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, "token_ids": None}
    if finish is not None:
        choice["stop_reason"] = None
        extra["system_fingerprint"] = "fp"
    return {**TOP, "choices": [choice], **extra}


def _call(arguments):
    return {"content": None, "tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}


def test_the_last_delta_on_the_finish_chunk_or_before_it_is_the_same_stream():
    merged = [_chunk(_call("{")), _chunk(_call("}"), finish="tool_calls"), "[DONE]"]
    apart = [_chunk(_call("{")), _chunk(_call("}")), _chunk({}, finish="tool_calls"), "[DONE]"]
    assert stream_view(merged) == stream_view(apart)


def test_a_finish_delta_of_another_shape_still_differs():
    expected = [_chunk(_call("{")), _chunk(_call("}"), finish="tool_calls"), "[DONE]"]
    no_null_content = {"tool_calls": _call("}")["tool_calls"]}
    actual = [_chunk(_call("{")), _chunk(no_null_content, finish="tool_calls"), "[DONE]"]
    assert stream_view(expected)["shapes"] != stream_view(actual)["shapes"]


def _text(text, first=False, finish=None):
    """A completion stream's chunk (echo on: the first carries the prompt's token ids), as vLLM writes it."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
              "prompt_token_ids": [55, 86] if first else None, "token_ids": None}
    extra = {"system_fingerprint": "fp"} if finish is not None else {}
    return {**TOP, "object": "text_completion", "choices": [choice], **extra}


def test_a_short_completion_stream_in_one_chunk_or_one_per_token_is_the_same_stream():
    # Recorded in a CI run: vllm serve sent the four tokens of an echo stream as one chunk.
    whole = [_text("Once upon a time more' H", first=True, finish="length"), "[DONE]"]
    apart = [_text("Once upon a time", first=True), _text(" more"), _text("'"), _text(" H", finish="length"),
             "[DONE]"]
    two = [_text("Once upon a time more'", first=True), _text(" H", finish="length"), "[DONE]"]
    assert stream_view(whole) == stream_view(apart) == stream_view(two)


def test_a_completion_chunk_of_another_shape_still_differs():
    apart = [_text("Once", first=True), _text(" upon"), _text(" a", finish="length"), "[DONE]"]
    no_fingerprint = [*apart[:2], {k: v for k, v in apart[2].items() if k != "system_fingerprint"}, "[DONE]"]
    no_prompt_ids = [{**apart[0], "choices": [apart[0]["choices"][0] | {"prompt_token_ids": None}]}, *apart[1:]]
    extra_key = [apart[0], {**apart[1], "choices": [apart[1]["choices"][0] | {"extra": 1}]}, *apart[2:]]
    assert stream_view(no_fingerprint)["shapes"] != stream_view(apart)["shapes"]
    assert stream_view(no_prompt_ids)["first_chunk"] != stream_view(apart)["first_chunk"]
    assert stream_view(extra_key)["shapes"] != stream_view(apart)["shapes"]


def _sse(*chunks) -> str:
    return "".join(f"data: {json.dumps(c, separators=(',', ':'))}\n\n" for c in chunks) + "data: [DONE]\n\n"


def _with_logprobs(text, tokens):
    chunk = _text(text)
    chunk["choices"][0]["logprobs"] = {"text_offset": [0] * len(tokens), "token_logprobs": [-1.0] * len(tokens),
                                       "tokens": tokens, "top_logprobs": [{t: -1.0, "x": -2.0} for t in tokens]}
    return chunk


def test_completion_frames_with_top_logprobs_split_elsewhere_are_written_alike():
    # Recorded in a CI run: the first token of each frame, the key of its first top_logprobs
    # entry, depends on where the deltas split.
    per_token = _sse(_with_logprobs(" H", [" H"]), _with_logprobs(" more", [" more"]))
    merged = _sse(_with_logprobs(" H more", [" H", " more"]))
    assert frame_differences(per_token, merged) == []
    reordered = _with_logprobs(" H", [" H"])
    reordered["choices"][0]["logprobs"] = dict(reversed(reordered["choices"][0]["logprobs"].items()))
    assert frame_differences(per_token, _sse(reordered, _with_logprobs(" more", [" more"]))) != []
