"""The engine as vLLM's handlers see it for a stream continued from the engine's tokens
(`_ClockedEngine`, worker/adapters/vllm.py): what it notes of each output, and what it asks of the
engine. The engine under it is a stand-in that answers scripted outputs: a multimodal prompt, one
of the cases, needs a model this machine cannot run. The whole path on real vLLM is in
tests/faults/test_vllm_worker_deaths.py."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.vllm


class _Engine:
    """Answers each request with one output of two tokens; keeps what it was asked."""

    def __init__(self):
        self.asked = []
        self.tokenizer = self

    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)

    async def generate(self, prompt, sampling_params, request_id, **kwargs):
        from vllm.outputs import CompletionOutput, RequestOutput

        self.asked.append((prompt, sampling_params))
        ids = list(prompt.get("prompt_token_ids", [])) if isinstance(prompt, dict) else []
        yield RequestOutput(request_id, None, ids, None, [CompletionOutput(
            index=0, text=" x y", token_ids=[41, 42], cumulative_logprob=None, logprobs=None)], finished=False)


def _run(prompt, prefix=None):
    from vllm import SamplingParams

    from worker.adapters.vllm import _TOKENS, _ClockedEngine, _Tokens

    engine, tokens = _Engine(), _Tokens(prefix)

    async def outputs():
        _TOKENS.set(tokens)
        return [output async for output in _ClockedEngine(engine).generate(
            prompt, SamplingParams(max_tokens=10, min_tokens=4), "r")]

    return engine, tokens, asyncio.run(outputs())


def test_a_stream_notes_the_engines_tokens_for_its_deltas():
    _engine, tokens, _outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3]})
    assert tokens.take(0) == [41, 42] and tokens.take(0) == []


def test_a_prompt_that_is_not_tokens_alone_notes_none():
    _engine, tokens, _outputs = _run({"type": "multimodal", "prompt_token_ids": [1, 2, 3]})
    assert tokens.take(0) is None  # its deltas carry no tokens: it is continued from its text, if at all


def test_a_continuation_hands_the_handler_the_answer_so_far_then_the_engines_rest():
    engine, tokens, outputs = _run({"type": "token", "prompt_token_ids": [1, 2, 3], "prompt": "abc"}, prefix=[7, 8])
    (prompt, params), = engine.asked
    assert prompt == {"type": "token", "prompt_token_ids": [1, 2, 3, 7, 8]}  # the prompt's text no longer holds
    assert (params.max_tokens, params.min_tokens) == (8, 2)  # what the request had left
    so_far, rest = outputs
    assert (so_far.prompt_token_ids, list(so_far.outputs[0].token_ids), so_far.outputs[0].text) == (
        [1, 2, 3], [7, 8], "<7><8>")
    assert rest.prompt_token_ids == [1, 2, 3]  # the prompt as the client sent it, for its usage and parsers
    assert tokens.passed and tokens.take(0) == [41, 42]  # only the engine's new tokens
