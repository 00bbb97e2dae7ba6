"""A stream continued from the engine's tokens (worker/adapters/vllm.py).

The engine as vLLM's handlers see it (`_ClockedEngine`): what it notes of each output, and what it
asks of the engine, over a stand-in engine that answers scripted outputs (a multimodal prompt, one
of the cases, needs a model this machine cannot run). Then a tool call half streamed, continued
on real vLLM through its hermes parser (tests/tool_call_continuation.py). The whole path, worker
deaths and drains on real vLLM, is in tests/faults/test_vllm_worker_deaths.py."""

from __future__ import annotations

import asyncio
import json

import pytest

pytestmark = pytest.mark.vllm


class _Engine:
    """Answers each request with two outputs of a token each (" x", then " y"); keeps what it was
    asked, and whether its request was closed before its end."""

    def __init__(self):
        self.asked = []
        self.tokenizer = self
        self.closed = False  # its request's generator closed before its end: the request aborted

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        from vllm.outputs import CompletionOutput, RequestOutput

        self.asked.append((prompt, sampling_params))
        ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
        try:
            for text, token_ids in ((" x", [41]), (" y", [42])):
                yield RequestOutput(request_id, None, ids, None, [CompletionOutput(
                    index=0, text=text, token_ids=token_ids, cumulative_logprob=None, logprobs=None)], finished=False)
        except GeneratorExit:
            self.closed = True
            raise


def _run(prompt, prefix=None, **params):
    from vllm import SamplingParams

    from worker.adapters.vllm import _TOKENS, _ClockedEngine, _Tokens

    engine, tokens = _Engine(), _Tokens(prefix)

    async def outputs():
        _TOKENS.set(tokens)
        return [output async for output in _ClockedEngine(engine).generate(
            prompt, SamplingParams(max_tokens=10, min_tokens=4, **params), "r")]

    return engine, tokens, asyncio.run(outputs())


def test_a_stream_notes_the_engines_tokens_for_its_deltas():
    _engine, tokens, _outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3]})
    assert tokens.take(0) == [41, 42] and tokens.take(0) == []  # both outputs' tokens


def test_a_prompt_that_is_not_tokens_alone_notes_none():
    _engine, tokens, _outputs = _run({"type": "multimodal", "prompt_token_ids": [1, 2, 3]})
    assert tokens.take(0) is None  # its deltas carry no tokens: it is continued from its text, if at all


def test_a_continuation_hands_the_handler_the_answer_so_far_then_the_engines_rest():
    engine, tokens, outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": "abc"}, prefix=[7, 8])
    (prompt, params), = engine.asked
    assert prompt == {"type": "token", "prompt_token_ids": [1, 2, 3, 7, 8]}  # the prompt's text no longer holds
    assert (params.max_tokens, params.min_tokens) == (8, 2)  # what the request had left
    so_far, *rest = outputs
    assert (so_far.prompt_token_ids, list(so_far.outputs[0].token_ids), so_far.outputs[0].text) == (
        [1, 2, 3], [7, 8], "<7><8>")
    assert [output.prompt_token_ids for output in rest] == [[1, 2, 3]] * 2  # as the client sent it, for its usage
    assert tokens.passed and tokens.take(0) == [41, 42]  # only the engine's new tokens


@pytest.mark.parametrize(("include", "text"), [(False, ""), (True, " x")])
def test_a_stop_string_begun_before_the_break_ends_the_continuation_in_any_text(include, text):
    """The engine reads the answer so far ("<7><8>") as prompt: a stop string begun there and ended
    by the continuation (" x y") is looked for in the engine's own text, before any parser splits it
    into content, reasoning or a tool call; found, the stream ends there and its request with it."""
    engine, _tokens, outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3]}, prefix=[7, 8],
                                    stop=["zz", "8> x"], include_stop_str_in_output=include)
    _so_far, ended = outputs
    choice = ended.outputs[0]
    assert (choice.text, choice.finish_reason, choice.stop_reason, ended.finished) == (text, "stop", "8> x", True)
    assert list(choice.token_ids) == [41] and engine.closed  # what the engine made up to there; then aborted
    # No stop across the break: the engine's outputs pass as they came (held only while too short to tell).
    engine, _tokens, outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3]}, prefix=[7, 8],
                                    stop=["8> y", "zz"])
    assert [o.outputs[0].text for o in outputs[1:]] == [" x", " y"] and not engine.closed


def test_a_tool_call_half_streamed_is_continued_from_its_tokens_by_vllms_parser(tool_call_continuation_run):
    """On real vLLM with the hermes tool parser (tests/tool_call_continuation.py): a call's stream
    cut in the middle of its arguments and continued from the engine's tokens sent up to there goes
    on where the client stood: the rest of the arguments, no second call header (its parser's
    state was rebuilt from the tokens), the whole run's finish, tokens and usage."""
    ran = tool_call_continuation_run.result(timeout=480)
    assert ran.returncode == 0, ran.stderr[-3000:]
    result = json.loads(ran.stdout.strip().splitlines()[-1])
    whole, sent, continued = result["whole"], result["whole"][:result["sent"]], result["continued"]
    assert not [row for row in whole + continued if row[9]], (whole[-1], continued[-1])

    def calls(rows):  # each call's header deltas and its arguments, as a client joins them
        joined = {}
        for row in rows:
            for index, call_id, name, arguments in row[2]:
                call = joined.setdefault(index, {"headers": [], "arguments": ""})
                if call_id or name:
                    call["headers"].append((call_id, name))
                call["arguments"] += arguments
        return joined

    (whole_call,) = calls(whole).values()
    assert [name for _id, name in whole_call["headers"]] == ["get_weather"]
    assert json.loads(whole_call["arguments"]) == {"city": "Saint-Malo", "note": "lighthouses"}
    assert calls(sent)[0]["arguments"] and calls(sent)[0]["arguments"] != whole_call["arguments"]  # cut midway
    assert calls(continued).get(0, {}).get("headers", []) == []  # no second header: the call goes on
    assert calls(sent)[0]["arguments"] + calls(continued)[0]["arguments"] == whole_call["arguments"]
    assert [row[3] for row in continued if row[3]][-1] == [row[3] for row in whole if row[3]][-1] == "tool_calls"
    deltas = [row for row in continued if not row[8]]
    assert [row[6] for row in deltas if row[4]][:1] == [True]  # the continuation's first token, marked
    # The engine's tokens of the continuation are the whole run's from the cut on, counted once.
    def tokens(rows):
        return [token for row in rows if not row[8] for token in row[5] or ()]

    assert tokens(sent) + tokens(continued) == tokens(whole)
    assert continued[-1][7][1] == whole[-1][7][1] - len(tokens(sent))
