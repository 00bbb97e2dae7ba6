"""Continuing a stream where its client stood, on the worker that takes it over (docs/reliability.md).

Each unfinished choice of the stream runs as an engine request of its own, given the engine's
tokens or the text its client was sent (`RequestEnvelope.continued`); `continuing` merges their
chunks into the rest of the one stream the client reads: each choice's deltas under its own
index, usage counted once, a completion's logprob offsets counted on, and a stop string begun
before the break found after it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shared.envelopes import Continuation, GenerationChunk, SamplingOptions, Usage


async def continuing(parts: dict[int, AsyncIterator[GenerationChunk]],
                      state: Continuation) -> AsyncIterator[GenerationChunk]:
    """The continuations of a stream's choices (`parts`, by choice index) as the rest of the stream
    its client was reading: each choice's deltas under its own index, without the prompt's size, a
    completion's logprob offsets counted on from the last it was sent (wherever the engine counts
    from: 0 after the text sent; the answer so far, as it decodes it, after its tokens), and one
    first token (the worker times the continuation's prefill by it; the gateway counts only the
    stream's first); then one terminal chunk with the usage of the whole answer (the prompt as the
    client sent it, every completion token once)."""
    offsets = {choice.index: choice.text_offset for choice in state.choices}  # each choice's next token's
    shifts: dict[int, int] = {}  # what each choice's offsets are moved by: from where the engine counts to there
    completion_tokens = state.tokens
    terminals = []
    begun = False
    async with contextlib.aclosing(_merged(parts)) as chunks:
        async for index, chunk in chunks:
            if chunk.done:
                terminals.append(chunk)
                completion_tokens += chunk.usage.completion_tokens if chunk.usage is not None else 0
                continue
            chunk.choice_index = index
            if chunk.first_token:
                chunk.first_token, begun = not begun, True
            chunk.usage = None
            chunk.prompt_token_ids = None
            if isinstance(chunk.logprobs, dict) and (counted := chunk.logprobs.get("text_offset")):
                shift = shifts.setdefault(index, offsets[index] - counted[0])
                if shift:
                    chunk.logprobs["text_offset"] = [at + shift for at in counted]
            yield chunk
    if not terminals:
        return  # the runner fails it: no terminal chunk
    terminal = next((t for t in terminals if t.error is not None), None) \
        or next((t for t in terminals if t.finish_reason == "cancelled"), terminals[0])
    if terminal.usage is not None:
        terminal.usage = Usage(prompt_tokens=state.prompt_tokens, completion_tokens=completion_tokens)
    yield terminal


async def stopped_across_the_break(chunks: AsyncIterator[GenerationChunk], sent: str,
                                    params: SamplingOptions) -> AsyncIterator[GenerationChunk]:
    """A continued choice's chunks, ended at a stop string that straddles the break: begun in the
    text its client was sent, which the engine sees as prompt, not as output it checks. Its first
    text is held until it is as long as the longest stop string but one (vLLM holds that much back
    too); a stop found across the break then ends the choice there (the stop string's part in
    the text already sent cannot be taken back), and the engine request with it."""
    window = max(map(len, params.stop or ()), default=1) - 1
    tail = sent[-window:] if window > 0 else ""
    held: list[GenerationChunk] = []
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if not tail:
                yield chunk
                continue
            if not chunk.done:
                held.append(chunk)
            if not (chunk.done or chunk.finish_reason or sum(len(c.text or "") for c in held) >= window):
                continue
            first = tail + "".join(c.text or "" for c in held)
            if (hit := stop_begun_before(tail, first, params.stop)) is not None:
                at, stop = hit
                cut = held[0]
                for later in held[1:]:
                    cut.absorb(later)
                end = at + len(stop) if params.include_stop_str_in_output else at
                cut.text = first[len(tail):max(end, len(tail))]
                cut.finish_reason, cut.stop_reason = "stop", stop
                yield cut
                yield GenerationChunk(done=True, finish_reason="stop", usage=Usage(completion_tokens=cut.token_count))
                return
            for earlier in held:
                yield earlier
            if chunk.done:
                yield chunk
            tail, held = "", []


def stop_begun_before(tail: str, text: str, stops: list[str]) -> tuple[int, str] | None:
    """The first stop string in `text` (which starts with `tail`, the end of what was sent before
    a break) that begins within `tail` and ends after it: where it begins, and which; None if none."""
    return min(((at, stop) for stop in stops for at in range(max(0, len(tail) - len(stop) + 1), len(tail))
                if text.startswith(stop, at)), default=None)


async def _merged(parts: dict[int, AsyncIterator[GenerationChunk]]) -> AsyncIterator[tuple[int, GenerationChunk]]:
    """The chunks of several generations as they come, each with its key; all of them closed at the end."""
    waiting = {asyncio.ensure_future(anext(chunks)): (index, chunks) for index, chunks in parts.items()}
    try:
        while waiting:
            done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index, chunks = waiting.pop(future)
                try:
                    chunk = future.result()
                except StopAsyncIteration:
                    continue
                waiting[asyncio.ensure_future(anext(chunks))] = index, chunks
                yield index, chunk
    finally:
        for future in waiting:
            future.cancel()
        await asyncio.gather(*waiting, return_exceptions=True)
        for chunks in parts.values():
            await chunks.aclose()
