"""A gateway's relay coalesces under backlog only (`Run.chunks`): the deltas of a request already
waiting when its relay comes for the next one are merged into one event; a delta that nothing
follows yet goes out at once, alone.
"""

from __future__ import annotations

import asyncio

from gateway.fleet.runs import Run
from shared.envelopes import ChunkEnvelope, GenerationChunk, ToolCallDelta
from tests.procs import in_process_fleet
from tests.test_lease_fencing import _request, _stop, _text


async def test_deltas_already_waiting_merge_and_none_is_held_back(redis_url: str) -> None:
    async with in_process_fleet(redis_url) as fleet:
        request = _request(fleet)
        replies = fleet.router.open(request.request_id)
        run = Run(request, replies, fleet.registry)
        chunks = run.chunks()
        seq = iter(range(100))

        def arrive(*parts: GenerationChunk) -> None:
            replies.put_nowait(ChunkEnvelope(request.request_id, next(seq), list(parts), worker_id="w"))

        arrive(_text("a"))
        first = await asyncio.wait_for(anext(chunks), 5)  # nothing behind it: out at once, alone
        assert (first.text, first.token_count) == ("a", 1)
        # The relay fell behind: four envelopes wait, a tool call among them.
        tool = GenerationChunk(text=None, tool_calls=[ToolCallDelta(index=0, name="f", arguments="{")], token_count=1)
        arrive(_text("b"), _text("c"))
        arrive(_text("d"))
        arrive(tool, _text("e"))
        arrive(_text("f"), _stop())
        rest = [chunk async for chunk in chunks]
    assert [(c.text, c.token_count) for c in rest[:2]] == [("bcd", 3), (None, 1)] and rest[1].tool_calls
    assert [(c.text, c.token_count) for c in rest[2:3]] == [("ef", 2)]
    assert rest[-1].done and rest[-1].finish_reason == "stop" and len(rest) == 4
