"""A stream that goes on when its worker dies: the takeover's replay, joined where the client stood.

When a worker dies mid-stream, or hands its runs over at its drain deadline, another worker of
the model takes the request over (the lease lapsed, or was given up; `worker/consumer.py`,
`reclaim_requests`). It continues the stream from the engine's tokens its client was sent, where
its worker sent them (below), or else runs it again from its start.
For a request whose output is fixed by the request itself — seeded, or greedy (`temperature: 0`)
without its tokens — the second run produces the same text, so the gateway does not end the stream with an error:
`Replay` drops what the takeover sends up to where the client's stream stood, checks that it
matches what was sent (text and reasoning, character by character; tool-call deltas whole), and
relays the rest. The client sees one stream, with no gap and no repeat, and the usage of the
whole run, counted once. If the takeover's output differs (a sampled request on an engine whose
numerics depend on the batch), the stream ends with the error it had before.

What is not joined, and ends with that error: a takeover delta that carries logprobs or a tool
call across the point where the client stood (only whole deltas of those are matched). The
worker bounds how often one request is taken over this way (`--migration-limit`).

Other streams (`RequestEnvelope.continues`) are continued instead: when its worker is seen dead,
its gateway saves what the client was sent (`Sent.continuation`, under keys.continuation_key),
and the worker that takes it over generates the rest after it (`RequestEnvelope.continued`); its
chunks follow the client's stream as they come. After the engine's tokens, where the worker sent
them with each delta (`GenerationChunk.output_ids`: vLLM's worker does; a tool or reasoning
parser's state is rebuilt from them, and a greedy stream goes on as it would have); else after
its text, where text is all the stream sent. A greedy stream without its tokens is saved as one
to replay (`Continuation.replay`).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from shared.envelopes import Continuation, ContinuedChoice, GenerationChunk, SamplingOptions


def replayable(params: SamplingOptions) -> bool:
    """Whether a request's output is fixed by the request: greedy, or seeded."""
    return params.temperature == 0 or params.seed is not None


def _calls(chunk: GenerationChunk) -> str:
    """A tool-call delta's content, without its call id (random on each run)."""
    return "".join(f"\x00{call.index}\x00{call.name or ''}\x00{call.arguments}" for call in chunk.tool_calls or ())


@dataclass(slots=True)
class _Choice:
    """One choice's output, as far as it was sent (then: as far as the takeover has matched it)."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    tokens: int = 0
    finished: bool = False
    text_offset: int = 0  # where a completion's next logprob offset counts from
    # The engine's tokens sent (4 bytes each, where a list of ints costs about 36); None: not all were.
    ids: array | None = field(default_factory=lambda: array("i"))


class Sent:
    """What a stream a takeover replays or continues has relayed so far, per choice."""

    def __init__(self, choice_count: int = 1) -> None:
        self.choice_count = choice_count
        self.choices: dict[int, _Choice] = {}
        self.prompt_tokens = 0  # the prompt's size, from the first delta's running usage

    def add(self, chunk: GenerationChunk) -> None:
        if chunk.usage is not None and not self.prompt_tokens:
            self.prompt_tokens = chunk.usage.prompt_tokens
        choice = self.choices.setdefault(chunk.choice_index, _Choice())
        if chunk.text:
            choice.text.append(chunk.text)
        if chunk.reasoning:
            choice.reasoning.append(chunk.reasoning)
        if chunk.tool_calls:
            choice.calls.append(_calls(chunk))
        choice.tokens += chunk.token_count
        if chunk.output_ids is not None and choice.ids is not None:
            choice.ids.extend(chunk.output_ids)
        elif chunk.token_count:
            choice.ids = None
        if isinstance(chunk.logprobs, dict) and chunk.logprobs.get("tokens"):
            choice.text_offset = chunk.logprobs["text_offset"][-1] + len(chunk.logprobs["tokens"][-1])
        choice.finished = choice.finished or chunk.finish_reason is not None

    def continuation(self) -> Continuation | None:
        """What a takeover continues from: each unfinished choice's text and tokens, with the
        engine's tokens where every one sent came with them; None where every choice has ended, or
        where the text alone must do but does not hold the answer's state (reasoning or a tool call
        was sent)."""
        sent = [(index, self.choices.get(index, _Choice())) for index in range(self.choice_count)]
        unfinished = [choice for _index, choice in sent if not choice.finished]
        by_ids = any(choice.ids for choice in unfinished) and all(
            choice.ids is not None and len(choice.ids) == choice.tokens for choice in unfinished)
        if not by_ids and any(choice.reasoning or choice.calls for choice in self.choices.values()):
            return None
        going = [ContinuedChoice(index=index, text="".join(choice.text), tokens=choice.tokens,
                                 text_offset=choice.text_offset, token_ids=choice.ids.tolist() if by_ids else None)
                 for index, choice in sent if not choice.finished]
        if not going:
            return None
        return Continuation(choices=going, tokens=sum(choice.tokens for _index, choice in sent),
                            prompt_tokens=self.prompt_tokens)


class Diverged(Exception):
    """The takeover's output is not what the client was sent."""


@dataclass(slots=True)
class _Position:
    """How far a takeover's output has matched one choice's sent output."""

    text: str
    reasoning: str
    calls: str
    tokens: int  # tokens sent
    finished: bool
    at_text: int = 0
    at_reasoning: int = 0
    at_calls: int = 0
    replayed_tokens: int = 0

    @property
    def caught_up(self) -> bool:
        return (self.at_text == len(self.text) and self.at_reasoning == len(self.reasoning)
                and self.at_calls == len(self.calls))


class Replay:
    """Joins a takeover's chunks onto the stream the client was sent (see the module's docstring)."""

    def __init__(self, sent: Sent):
        self._behind = {index: _Position("".join(c.text), "".join(c.reasoning), "".join(c.calls), c.tokens,
                                         c.finished)
                        for index, c in sent.choices.items()}
        self._ended: set[int] = set()  # caught up, and ended for the client: dropped up to their finish

    @property
    def done(self) -> bool:
        """Every choice has caught up: the takeover's chunks pass as they are from now on."""
        return not self._behind and not self._ended

    def take(self, chunk: GenerationChunk) -> GenerationChunk | None:
        """The part of the takeover's `chunk` the client has not seen (None: nothing), or raise
        `Diverged`."""
        if chunk.done:
            if chunk.error is None and any(not (p.finished or p.caught_up) for p in self._behind.values()):
                raise Diverged("the takeover ended before it reached what the client was sent")
            return chunk
        at = self._behind.get(chunk.choice_index)
        if at is None:
            if chunk.choice_index not in self._ended:
                return chunk
            if chunk.finish_reason is not None:
                self._ended.discard(chunk.choice_index)
            return None
        at.replayed_tokens += chunk.token_count
        text = self._match(chunk.text or "", at.text, at.at_text)
        reasoning = self._match(chunk.reasoning, at.reasoning, at.at_reasoning)
        at.at_text += len(chunk.text or "") - len(text)
        at.at_reasoning += len(chunk.reasoning) - len(reasoning)
        if chunk.tool_calls and at.at_calls < len(at.calls):
            calls = _calls(chunk)
            if at.calls[at.at_calls:at.at_calls + len(calls)] != calls:
                raise Diverged("the takeover's tool call is not the one the client was sent")
            at.at_calls += len(calls)
            if text or reasoning:
                raise Diverged("a takeover delta carries a tool call and text past what the client was sent")
            return None
        if not at.caught_up:
            if chunk.finish_reason is not None:
                raise Diverged("the takeover ended a choice before it reached what the client was sent")
            return None
        del self._behind[chunk.choice_index]
        if at.finished:  # the client had this choice's end already
            if chunk.finish_reason is None:
                self._ended.add(chunk.choice_index)
            return None
        if not (text or reasoning or chunk.tool_calls or chunk.finish_reason):
            return None
        if (text, reasoning) == (chunk.text or "", chunk.reasoning):
            return chunk  # the takeover's delta begins where the client stood
        if chunk.logprobs is not None:
            raise Diverged("a takeover delta carries logprobs across the point the client stood at")
        tokens = max(0, at.replayed_tokens - at.tokens)
        chunk.text = text if chunk.text is not None else None
        chunk.reasoning = reasoning
        chunk.token_count = tokens
        chunk.first_token = False
        chunk.usage = None
        chunk.prompt_token_ids = None
        if chunk.token_ids is not None:
            chunk.token_ids = chunk.token_ids[len(chunk.token_ids) - tokens:] if tokens else []
        return chunk

    @staticmethod
    def _match(delta: str, sent: str, at: int) -> str:
        """What of `delta` lies past the sent output, which it must match up to there."""
        overlap = min(len(delta), len(sent) - at)
        if delta[:overlap] != sent[at:at + overlap]:
            raise Diverged("the takeover's text is not what the client was sent")
        return delta[overlap:]
