"""Fold a stream of generation chunks into whole candidates, for non-streaming requests.

The worker runs every request through the same streaming path; a non-streaming request is
this fold over it, published as one terminal chunk. The gateway never aggregates. An adapter
whose engine builds whole responses itself (vLLM parses tool calls differently in whole
responses) sends a terminal chunk that already holds its candidates; it passes as it is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from shared.envelopes import Candidate, GenerationChunk, Logprobs, ToolCallDelta, extend_logprobs


class CandidateBuilder:
    """Accumulates the deltas of one choice."""

    def __init__(self, index: int):
        self.index = index
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.tool_calls: dict[int, ToolCallDelta] = {}
        self.logprobs: Logprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    def add(self, chunk: GenerationChunk) -> None:
        self.text.append(chunk.text or "")
        self.reasoning.append(chunk.reasoning)
        if chunk.logprobs is not None:
            self.logprobs = extend_logprobs(self.logprobs, chunk.logprobs)
        for delta in chunk.tool_calls or ():
            call = self.tool_calls.setdefault(delta.index, ToolCallDelta(index=delta.index))
            call.id = call.id or delta.id
            call.name = call.name or delta.name
            call.arguments += delta.arguments
        # A delta's finish carries its stop_reason; the terminal chunk's (stop_reason None) is
        # only the default for choices without one (`build`).
        if chunk.finish_reason is not None and not chunk.done:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason

    def build(self, default_finish: str | None) -> Candidate:
        reasoning = "".join(self.reasoning)
        return Candidate(
            index=self.index,
            text="".join(self.text),
            reasoning=reasoning or None,
            tool_calls=[self.tool_calls[i] for i in sorted(self.tool_calls)] or None,
            logprobs=self.logprobs,
            finish_reason=self.finish_reason or default_finish,
            stop_reason=self.stop_reason,
        )


async def collect_candidates(chunks: AsyncIterator[GenerationChunk], n: int) -> GenerationChunk:
    """Drain `chunks` and return one terminal chunk holding all `n` candidates."""
    builders = [CandidateBuilder(i) for i in range(n)]
    first_token = False
    async for chunk in chunks:
        first_token = first_token or chunk.first_token
        if chunk.choice_index < n:
            builders[chunk.choice_index].add(chunk)
        if chunk.done and (chunk.candidates is not None or chunk.result is not None):
            return chunk
        if chunk.done:
            return GenerationChunk(
                done=True,
                first_token=first_token,
                usage=chunk.usage,
                timings=chunk.timings,
                error=chunk.error,
                finish_reason=chunk.finish_reason,
                candidates=[b.build(chunk.finish_reason) for b in builders],
            )
    raise RuntimeError("generation ended without a terminal chunk")
