"""The parity comparator itself: what it forgives (where vLLM's chunk boundaries fall) and what it
still catches (a delta of another shape)."""

from __future__ import annotations

from tests.parity.compare import stream_view

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
