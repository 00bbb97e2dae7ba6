"""The scripted engine's stream interval (as vLLM's `--stream-interval`): the first token alone,
then that many tokens a delta, the same text and usage as one token a delta."""

from __future__ import annotations

import itertools
import time

import pytest

from shared.envelopes import RequestEnvelope, SamplingOptions
from worker.adapters.scripted import ScriptedAdapter


def _request(max_tokens: int, stop: list[str] | None = None) -> RequestEnvelope:
    body = {"messages": [{"role": "user", "content": "one two three four five six seven"}]}
    return RequestEnvelope("r", "m", "chat", "", 0.0, stream=True, body=body,
                           params=SamplingOptions(max_tokens=max_tokens, stop=stop))


async def _run(adapter: ScriptedAdapter, request: RequestEnvelope) -> tuple[list, list[float]]:
    chunks, arrivals = [], []
    async for chunk in adapter.generate(request):
        chunks.append(chunk)
        arrivals.append(time.monotonic())
    return chunks, arrivals


@pytest.mark.parametrize("max_tokens, counts", [(25, [1, 10, 10, 4]), (21, [1, 10, 10]), (1, [1])])
async def test_deltas_hold_the_stream_interval_of_tokens_and_the_same_text(max_tokens, counts):
    every, _ = await _run(ScriptedAdapter("m"), _request(max_tokens))
    grouped, _ = await _run(ScriptedAdapter("m", stream_interval=10), _request(max_tokens))
    deltas = grouped[:-1]
    assert [c.token_count for c in deltas] == counts
    assert "".join(c.text for c in deltas) == "".join(c.text for c in every[:-1])
    assert deltas[-1].finish_reason == "length" and all(c.finish_reason is None for c in deltas[:-1])
    assert deltas[0].first_token and deltas[0].usage.prompt_tokens == 7
    assert grouped[-1].done and grouped[-1].usage.completion_tokens == max_tokens


async def test_a_stop_string_inside_a_held_group_ends_the_delta_there():
    grouped, _ = await _run(ScriptedAdapter("m", stream_interval=10), _request(30, stop=["five"]))
    deltas = grouped[:-1]
    assert "".join(c.text for c in deltas) == "one two three four "
    assert deltas[-1].finish_reason == "stop" and deltas[-1].stop_reason == "five"


@pytest.mark.parametrize("max_tokens, counts, gaps", [(11, [1, 5, 5], [0.05, 0.05]), (8, [1, 5, 2], [0.05, 0.02])])
async def test_each_group_is_sent_when_its_last_token_is_due(max_tokens, counts, gaps):
    adapter = ScriptedAdapter("m", tokens_per_second=100, stream_interval=5)  # a token every 10 ms
    chunks, arrivals = await _run(adapter, _request(max_tokens))
    assert [c.token_count for c in chunks[:-1]] == counts
    # Never sent before its last token is due: 10 ms a token after the one before.
    for (earlier, later), gap in zip(itertools.pairwise(arrivals[:3]), gaps, strict=True):
        assert later - earlier >= gap * 0.9
