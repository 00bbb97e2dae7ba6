"""The wire contract: round trips, schema evolution and bounded, typed decoding."""

from __future__ import annotations

import asyncio

import msgpack
import pytest

from shared.codec import MAX_ENVELOPE_BYTES, decode, decode_batch, encode, encode_batch
from shared.envelopes import (
    Candidate,
    ChunkEnvelope,
    GenerationChunk,
    RequestEnvelope,
    SamplingOptions,
    ToolCallDelta,
    Usage,
)
from shared.errors import EnvelopeError, ErrorInfo, InvalidRequest, error_from_info
from worker.adapters.aggregate import collect_candidates


def _request(**overrides) -> RequestEnvelope:
    fields = dict(request_id="r1", model="m", kind="chat", reply_to="llmfleet:replies:g", arrival=1.5,
                  body={"messages": [{"role": "user", "content": "hi"}]}, params=SamplingOptions(max_tokens=7, n=2))
    return RequestEnvelope(**{**fields, **overrides})


def test_request_round_trip():
    request = _request(body={"messages": [], "tools": [{"type": "function", "function": {"name": "f"}}]},
                       cancel_id="c")
    assert decode(RequestEnvelope, encode(request)) == request


def test_null_content_survives_the_wire():
    """A delta with no content (a tool call) is told apart from an empty text delta."""
    for text in (None, ""):
        chunk = GenerationChunk(text=text, tool_calls=[ToolCallDelta(0, "id", "fn")])
        assert decode(ChunkEnvelope, encode(ChunkEnvelope("r", 0, [chunk]))).chunks[0].text == text


def test_only_deltas_of_one_kind_merge():
    text, reasoning = GenerationChunk(text="a", token_count=1), GenerationChunk(text=None, reasoning="r")
    assert text.can_absorb(GenerationChunk(text="b", token_count=1))
    assert not text.can_absorb(reasoning) and not reasoning.can_absorb(text)
    lists = GenerationChunk(logprobs={"tokens": ["a"], "text_offset": [0]})
    lists.absorb(GenerationChunk(logprobs={"tokens": ["b"], "text_offset": [1]}))
    assert lists.logprobs == {"tokens": ["a", "b"], "text_offset": [0, 1]}


@pytest.mark.parametrize("deltas, whole", [
    ([[{"token": "a", "logprob": -0.5}], [{"token": "b", "logprob": -1.0}]],
     [{"token": "a", "logprob": -0.5}, {"token": "b", "logprob": -1.0}]),
    ([{"tokens": ["a"], "token_logprobs": [-0.5]}, {"tokens": ["b"], "token_logprobs": [-1.0]}],
     {"tokens": ["a", "b"], "token_logprobs": [-0.5, -1.0]}),
], ids=["chat entries", "completion lists"])
def test_a_whole_answer_holds_every_deltas_logprobs_in_either_shape(deltas, whole):
    """A non-streaming answer is the fold of its deltas (worker/adapters/aggregate.py); completion
    logprobs, parallel lists, failed it with a TypeError."""
    chunks = [GenerationChunk(text=t, token_count=1, logprobs=lp) for t, lp in zip("ab", deltas, strict=True)]

    async def stream():
        for chunk in [*chunks, GenerationChunk(done=True, finish_reason="stop")]:
            yield chunk

    answer = asyncio.run(collect_candidates(stream(), 1))
    assert answer.candidates[0].text == "ab" and answer.candidates[0].logprobs == whole
    assert chunks[0].logprobs == deltas[0]  # the deltas themselves are left as they were


def test_chunk_round_trip_with_every_field():
    chunk = GenerationChunk(
        choice_index=1, text="a", reasoning="r", tool_calls=[ToolCallDelta(0, "id", "fn", "{}")],
        logprobs=[{"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": []}], finish_reason="stop",
        stop_reason="x", done=True, usage=Usage(3, 4), error=ErrorInfo("c", "m", 400, "p"), first_token=True,
        candidates=[Candidate(0, "t", tool_calls=[ToolCallDelta(0, "i", "n", "a")])], token_count=2,
        system_fingerprint="fp", result={"tokens": [1]},
    )
    envelope = ChunkEnvelope("r1", 3, [chunk], "w1")
    assert decode(ChunkEnvelope, encode(envelope)) == envelope


def test_defaults_stay_off_the_wire():
    wire = msgpack.unpackb(encode(ChunkEnvelope("r", 0, [GenerationChunk(text="x", token_count=1)])))
    assert wire["chunks"] == [{"text": "x", "token_count": 1}]


def test_unknown_fields_from_a_newer_writer_are_ignored():
    wire = _request().to_wire()
    wire["added_later"] = {"x": 1}
    wire["params"]["new_sampling_knob"] = 0.3
    assert decode(RequestEnvelope, msgpack.packb(wire)) == _request()


@pytest.mark.parametrize("data, reason", [
    (b"\xc1\xc1", "not a msgpack envelope"),
    (msgpack.packb([1, 2]), "must be a map"),
    (msgpack.packb({"v": 2, "request_id": "r", "seq": 0, "chunks": []}), "unsupported wire version"),
    (msgpack.packb({"v": 1, "request_id": "r", "seq": 0, "chunks": "nope"}), r"Expected `array`.*\$\.chunks"),
    (msgpack.packb({"request_id": "r", "seq": -2, "chunks": []}), r"Expected `int` >= -1 - at `\$\.seq`"),
    (msgpack.packb({"request_id": "r", "seq": 0, "chunks": [{"text": 3}]}), r"\$\.chunks\[0\]\.text"),
    (msgpack.packb({"request_id": "r", "seq": 0, "chunks": [{"done": True, "usage": {"prompt_tokens": "9"}}]}),
     r"\$\.chunks\[0\]\.usage\.prompt_tokens"),
    (msgpack.packb({"v": 1, "seq": 0, "chunks": []}), "malformed ChunkEnvelope"),
    (b"\x00" * (MAX_ENVELOPE_BYTES + 1), "exceeds"),
])
def test_bad_chunk_envelopes_are_refused(data, reason):
    with pytest.raises(EnvelopeError, match=reason):
        decode(ChunkEnvelope, data)


def test_batch_round_trip():
    envelopes = [encode(ChunkEnvelope(f"r{i}", i, [GenerationChunk(text=str(i), token_count=1)])) for i in range(3)]
    assert decode_batch(encode_batch(envelopes)) == envelopes


@pytest.mark.parametrize("data, reason", [
    (b"\xc1", "not a msgpack batch"),
    (msgpack.packb({"a": b"x"}), "list of encoded envelopes"),
    (msgpack.packb([b"x", 3]), "list of encoded envelopes"),
    (b"\x00" * (MAX_ENVELOPE_BYTES + 1), "exceeds"),
])
def test_bad_batches_are_refused(data, reason):
    with pytest.raises(EnvelopeError, match=reason):
        decode_batch(data)


def test_batch_replies_is_off_unless_asked_for():
    assert _request().batch_replies is False  # what a gateway from before batches means
    assert "batch_replies" not in _request().to_wire()
    assert decode(RequestEnvelope, encode(_request(batch_replies=True))).batch_replies is True


@pytest.mark.parametrize("field, value, where", [
    ("arrival", "soon", "$.arrival"), ("deadline", -1.0, "$.deadline"), ("request_id", "", "$.request_id"),
    ("priority", "urgent", "$.priority"), ("body", [1], "$.body"), ("params", {"n": 0}, "$.params.n"),
    ("params", {"max_tokens": "many"}, "$.params.max_tokens"), ("stream", "yes", "$.stream"),
])
def test_every_request_field_is_checked_when_decoded(field, value, where):
    """What decoded used to fail later, outside the code that dead-letters it (a string arrival)."""
    wire = _request().to_wire()
    wire[field] = value
    with pytest.raises(EnvelopeError, match=f"malformed RequestEnvelope: .* - at `{where.replace('$', '[$]')}`"):
        decode(RequestEnvelope, msgpack.packb(wire))


def test_bad_request_kind_is_refused():
    wire = _request().to_wire()
    wire["kind"] = "embedding"
    with pytest.raises(EnvelopeError, match="unknown request kind"):
        decode(RequestEnvelope, msgpack.packb(wire))


def test_errors_survive_the_wire():
    error = error_from_info(InvalidRequest("too long", param="input_tokens", err_type="Bad Request",
                                           in_stream=True).to_info())
    assert isinstance(error, InvalidRequest)
    assert (error.status, error.param, error.message) == (400, "input_tokens", "too long")
    assert (error.err_type, error.in_stream) == ("Bad Request", True)
