"""Joining a takeover's replay onto what a stream already sent (gateway/fleet/replay.py): the
client's side of the join, whatever the two runs' chunk boundaries."""

from __future__ import annotations

import pytest

from gateway.fleet.replay import Diverged, Replay, Sent
from shared.envelopes import (
    Continuation,
    ContinuedChoice,
    GenerationChunk,
    RequestEnvelope,
    SamplingOptions,
    ToolCallDelta,
    Usage,
)


def _delta(text, tokens=1, index=0, **fields) -> GenerationChunk:
    return GenerationChunk(choice_index=index, text=text, token_count=tokens, **fields)


def _sent(*chunks: GenerationChunk) -> Sent:
    sent = Sent()
    for chunk in chunks:
        sent.add(chunk)
    return sent


def _joined(replay: Replay, chunks: list[GenerationChunk]) -> list[GenerationChunk]:
    return [out for chunk in chunks if (out := replay.take(chunk)) is not None]


def test_a_replay_split_elsewhere_goes_on_where_the_client_stood():
    replay = Replay(_sent(_delta("Once", first_token=True, usage=Usage(prompt_tokens=3)), _delta(" upon a", 2)))
    out = _joined(replay, [_delta("Once upon", 2, first_token=True, usage=Usage(prompt_tokens=3)),
                           _delta(" a time", 2, token_ids=[7, 8]), _delta(" there", 1)])
    assert [(c.text, c.token_count, c.first_token, c.usage, c.token_ids) for c in out] == [
        (" time", 1, False, None, [8]), (" there", 1, False, None, None)]
    assert replay.done


def test_a_replay_that_ends_where_the_client_stood_sends_only_the_finish():
    replay = Replay(_sent(_delta("a b"), _delta(" c")))
    out = _joined(replay, [_delta("a b c", 3), _delta("", 0, finish_reason="length"),
                           GenerationChunk(done=True, finish_reason="length", usage=Usage(2, 3))])
    assert [(c.text, c.finish_reason, c.done) for c in out] == [("", "length", False), ("", "length", True)]


def test_a_different_replay_is_refused():
    replay = Replay(_sent(_delta("Once upon")))
    with pytest.raises(Diverged):
        _joined(replay, [_delta("Once"), _delta(" more")])
    short = Replay(_sent(_delta("Once upon")))
    with pytest.raises(Diverged):
        _joined(short, [_delta("Once"), GenerationChunk(done=True, finish_reason="stop")])


def test_logprobs_across_the_join_are_refused_and_whole_ones_pass():
    entry = [{"token": "x", "logprob": -1.0, "bytes": [120], "top_logprobs": []}]
    with pytest.raises(Diverged):
        _joined(Replay(_sent(_delta("ab", logprobs=entry))), [_delta("abc", 2, logprobs=entry * 2)])
    replay = Replay(_sent(_delta("ab", logprobs=entry)))
    out = _joined(replay, [_delta("ab", logprobs=entry), _delta("c", logprobs=entry)])
    assert [(c.text, c.logprobs) for c in out] == [("c", entry)]


def test_whole_tool_call_deltas_are_matched_whatever_their_ids():
    def call(call_id, arguments):
        return _delta(None, tool_calls=[ToolCallDelta(0, call_id, "get" if call_id else None, arguments)])
    replay = Replay(_sent(call("call-1", ""), call(None, '{"a"')))
    out = _joined(replay, [call("call-2", ""), call(None, '{"a"'), call(None, ": 1}")])
    assert [c.tool_calls[0].arguments for c in out] == [": 1}"]
    with pytest.raises(Diverged):
        _joined(Replay(_sent(call("call-1", ""), call(None, '{"a"'))), [call("call-2", ""), call(None, '{"b"')])


def test_each_choice_is_joined_where_it_stood():
    replay = Replay(_sent(_delta("a", index=0), _delta("b", index=1), _delta("", 0, index=1, finish_reason="stop")))
    out = _joined(replay, [_delta("a", index=0), _delta("b", index=1), _delta("", 0, index=1, finish_reason="stop"),
                           _delta(" c", index=0)])
    assert [(c.choice_index, c.text, c.finish_reason) for c in out] == [(0, " c", None)]


def _stream(kind="chat", **body) -> RequestEnvelope:
    params = SamplingOptions(**{k: v for k, v in body.items() if k in ("temperature", "seed", "n", "logprobs",
                                                                          "max_tokens", "min_tokens", "echo")})
    body = {"messages": [{"role": "user", "content": "hi"}]} if kind == "chat" else {"prompt": "Once"}
    return RequestEnvelope(request_id="r", model="m", kind=kind, reply_to="g", arrival=1.0, stream=True, body=body,
                           params=params)


@pytest.mark.parametrize(("kind", "body", "continues"), [
    ("chat", {"temperature": 0.8}, True),
    ("chat", {}, True),
    ("completion", {"temperature": 0.8}, True),
    ("chat", {"temperature": 0}, True),  # from its tokens, as it would have gone on (else replayed)
    ("chat", {"temperature": 0, "seed": 7}, True),
    ("chat", {"seed": 7}, False),  # replayed, to give the same sample
    ("chat", {"n": 2}, True),  # each choice continued where it stood
    ("chat", {"logprobs": 2}, True),  # the new tokens' logprobs follow
    ("completion", {"n": 3, "logprobs": 1}, True),
    ("completion", {"echo": True}, False),
])
def test_which_streams_a_takeover_continues(kind, body, continues):
    assert _stream(kind, **body).continues is continues


TOOLS = [{"type": "function", "function": {"name": "f"}}]


@pytest.mark.parametrize("body", [{"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"},
                                  {"tools": TOOLS, "tool_choice": "none"}])
def test_a_chat_stream_with_tools_is_continued_from_its_tokens_or_text(body):
    request = _stream()
    request.body.update(body)
    assert request.continues


@pytest.mark.parametrize("body", [{"tools": TOOLS, "tool_choice": "required"},
                                  {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "f"}}},
                                  {"response_format": {"type": "json_object"}}, {"structured_outputs": {"regex": "a"}},
                                  {"continue_final_message": True}, {"prompt_logprobs": 1}, {"echo": True},
                                  {"guided_regex": "a+"}, {"use_beam_search": True}])
def test_a_chat_stream_under_a_grammar_is_not_continued(body):
    request = _stream()
    request.body.update(body)
    assert not request.continues


def test_a_greedy_stream_under_a_grammar_is_replayed_not_continued():
    request = _stream(temperature=0)
    request.body.update(structured_outputs={"regex": "a+"})
    assert not request.continues and request.replays_exactly


def test_a_continuation_is_from_tokens_only_where_every_choice_has_them():
    by_tokens = ContinuedChoice(index=0, text="", tokens=1, token_ids=[5])
    assert Continuation(choices=[by_tokens], tokens=1, prompt_tokens=2).from_tokens
    assert not Continuation(choices=[by_tokens, ContinuedChoice(index=1, text="a", tokens=1)], tokens=2,
                            prompt_tokens=2).from_tokens
    assert not Continuation(choices=[], tokens=0, prompt_tokens=0, replay=True).from_tokens


def test_a_continued_chat_request_goes_on_from_the_text_sent():
    request = _stream(max_tokens=60, min_tokens=10)
    request.body.update(max_tokens=60, min_tokens=10)
    continued = request.continued(ContinuedChoice(index=0, text="tick tock", tokens=12))
    assert continued.body["messages"][-1] == {"role": "assistant", "content": "tick tock"}
    assert (continued.body["continue_final_message"], continued.body["add_generation_prompt"]) == (True, False)
    assert (continued.body["max_tokens"], continued.params.max_tokens) == (48, 48)
    assert (continued.body["min_tokens"], continued.params.min_tokens) == (0, 0)
    assert request.body["messages"] == [{"role": "user", "content": "hi"}] and request.params.max_tokens == 60


def test_a_continued_completion_goes_on_from_the_text_sent():
    continued = _stream("completion", max_tokens=16).continued(ContinuedChoice(index=0, text=" upon", tokens=1))
    assert continued.body["prompt"] == "Once upon" and continued.params.max_tokens == 15


def test_each_choice_is_continued_as_a_request_of_one_choice_with_the_tokens_it_has_left():
    request = _stream(n=3, max_tokens=20)
    request.body.update(n=3, max_tokens=20)
    continued = request.continued(ContinuedChoice(index=2, text="2:tick", tokens=5))
    assert (continued.body["n"], continued.params.n) == (1, 1)
    assert (continued.body["max_tokens"], continued.params.max_tokens) == (15, 15)
    assert continued.body["messages"][-1] == {"role": "assistant", "content": "2:tick"}
    assert (request.body["n"], request.params.n) == (3, 3)


def test_what_a_takeover_continues_from_is_the_text_sent_with_its_tokens():
    sent = _sent(_delta("Once", 1, first_token=True, usage=Usage(prompt_tokens=3)), _delta(" upon a", 2))
    assert sent.continuation() == Continuation(choices=[ContinuedChoice(index=0, text="Once upon a", tokens=3)],
                                               tokens=3, prompt_tokens=3)
    assert _sent(_delta("", reasoning="hmm"), _delta("Once")).continuation() is None
    assert _sent(_delta("Once", finish_reason="length")).continuation() is None


def test_a_takeover_continues_each_unfinished_choice_and_counts_every_token_sent():
    sent = Sent(choice_count=3)
    for chunk in (_delta("a", 1, index=0, usage=Usage(prompt_tokens=2)), _delta("b", 2, index=1),
                  _delta("c", 1, index=0, finish_reason="stop")):
        sent.add(chunk)
    assert sent.continuation() == Continuation(
        choices=[ContinuedChoice(index=1, text="b", tokens=2), ContinuedChoice(index=2, text="", tokens=0)],
        tokens=4, prompt_tokens=2)
    sent.add(_delta("", 0, index=1, tool_calls=[ToolCallDelta(index=0, name="f")]))
    assert sent.continuation() is None  # a tool call's state is more than its text


def test_a_stream_that_sent_its_engine_tokens_is_continued_from_them_whatever_it_sent():
    sent = Sent(choice_count=2)
    for chunk in (_delta(None, 2, reasoning="Let me", output_ids=[7, 40], usage=Usage(prompt_tokens=5)),
                  _delta(None, 3, index=1, output_ids=[7, 41, 42]),
                  _delta(None, 1, tool_calls=[ToolCallDelta(index=0, name="f")], output_ids=[5]),
                  _delta(None, 0, index=1, output_ids=[])):  # held back by its parser: none yet
        sent.add(chunk)
    assert sent.continuation() == Continuation(choices=[
        ContinuedChoice(index=0, text="", tokens=3, token_ids=[7, 40, 5]),
        ContinuedChoice(index=1, text="", tokens=3, token_ids=[7, 41, 42])], tokens=6, prompt_tokens=5)


def test_a_stream_missing_some_engine_tokens_falls_back_to_its_text_where_that_holds_its_state():
    texts = _sent(_delta("Once", 1, output_ids=[11]), _delta(" upon", 1))
    assert texts.continuation().choices == [ContinuedChoice(index=0, text="Once upon", tokens=2)]
    assert _sent(_delta(None, 1, reasoning="hmm", output_ids=[11]), _delta(None, 1, reasoning="m")).continuation() \
        is None


def test_a_choice_continued_from_its_tokens_is_the_request_as_it_was_with_one_choice():
    request = _stream(n=2, max_tokens=20)
    request.body.update(n=2, max_tokens=20)
    continued = request.continued(ContinuedChoice(index=1, text="", tokens=3, token_ids=[7, 41, 42]))
    assert continued.body == {**request.body, "n": 1} and continued.params.n == 1
    assert continued.params.max_tokens == 20  # the engine's bound counts the tokens sent (worker/adapters/vllm.py)


def test_a_completions_logprob_offsets_go_on_from_the_last_token_sent_not_from_its_text():
    # Two tokens, each one byte of "é": each decodes to a replacement character, so vLLM's offsets
    # (0, then 1) count two characters where the text holds one.
    halves = {"text_offset": [0, 1], "token_logprobs": [-1.0, -1.0], "tokens": ["\ufffd", "\ufffd"],
              "top_logprobs": [None, None]}
    sent = _sent(_delta("é", 2, first_token=True, logprobs=halves, usage=Usage(prompt_tokens=3)))
    assert sent.continuation().choices == [ContinuedChoice(index=0, text="é", tokens=2, text_offset=2)]


async def _continued(sent: str, chunks: list[GenerationChunk], **params) -> list[GenerationChunk]:
    from worker.continuing import stopped_across_the_break

    async def engine():
        for chunk in chunks:
            yield chunk

    return [chunk async for chunk in stopped_across_the_break(engine(), sent, SamplingOptions(**params))]


def _ending(tokens: int) -> GenerationChunk:
    return GenerationChunk(done=True, finish_reason="length", usage=Usage(completion_tokens=tokens))


@pytest.mark.parametrize(("include", "text"), [(False, ""), (True, "ld")])
async def test_a_stop_string_begun_before_the_break_ends_the_continued_choice(include, text):
    """The engine sees the text sent before the break as prompt, so it cannot find a stop string
    begun there: the continuation's first text is held until it can tell, and ends the choice."""
    out = await _continued("Hello wor", [_delta("ld", 1, first_token=True), _delta(" and", 1), _delta(" more", 1),
                                         _ending(3)], stop=["world", "xyz"], include_stop_str_in_output=include)
    assert [(c.text, c.finish_reason, c.stop_reason, c.done) for c in out] == [
        (text, "stop", "world", False), ("", "stop", None, True)]
    assert (out[0].token_count, out[1].usage.completion_tokens) == (2, 2)


async def test_a_continuation_without_a_stop_across_the_break_passes_as_it_came():
    chunks = [_delta("ld", 1), _delta(" and", 1), _delta(" world", 1, finish_reason="stop"), _ending(3)]
    out = await _continued("Hello wor", chunks, stop=["worlds"])
    assert [(c.text, c.finish_reason) for c in out] == [("ld", None), (" and", None), (" world", "stop"),
                                                        ("", "length")]
    # a stop found whole in the text sent is not the continuation's (vLLM's min_tokens can let one through)
    out = await _continued("a world b", [_delta(" c", 1), _ending(1)], stop=["world"])
    assert [c.text for c in out] == [" c", ""]
    # a short continuation that ends before the window is full is checked as it is
    out = await _continued("Hello wor", [_delta("l", 1, finish_reason="length"), _ending(1)], stop=["world"])
    assert [(c.text, c.finish_reason) for c in out] == [("l", "length"), ("", "length")]


async def test_a_continued_completions_logprob_offsets_go_on_from_the_last_sent_wherever_the_engine_counts_from():
    """From its text the engine counts offsets from 0; from its tokens, from the answer so far as it
    decodes it (here one replacement character for the two halves of "é"): either way the client's
    next offset is the one after the last token it was sent."""
    from worker.continuing import continuing

    for token_ids, first in ((None, 0), ([195, 169], 1)):
        state = Continuation(choices=[ContinuedChoice(index=0, text="é", tokens=2, text_offset=2,
                                                      token_ids=token_ids)], tokens=2, prompt_tokens=3)

        async def engine(first=first):
            for at, text in ((first, " b"), (first + 2, " c")):
                yield _delta(text, 1, logprobs={"text_offset": [at], "tokens": [text], "token_logprobs": [-1.0],
                                                "top_logprobs": [None]})
            yield _ending(2)

        out = [chunk async for chunk in continuing({0: engine()}, state)]
        assert [chunk.logprobs["text_offset"] for chunk in out[:-1]] == [[2], [4]], token_ids
        assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (3, 4)
