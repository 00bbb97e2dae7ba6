"""The formatter contract: how an API family turns a run's typed chunks into its JSON.

A `Formatter` gives a family's SSE events for each chunk (`stream_events`), the whole response
from a terminal chunk (`response`), and its error shapes. The shapes are `vllm serve`'s, key for
key, for the OpenAI families; the Anthropic and Responses families name their events. Everything
a family differs in is here; serving a run (gateway/serve/generation.py) is the same for all.
"""

from __future__ import annotations

import json
import time
from typing import Any, ClassVar

import orjson
from starlette.responses import Response

from gateway.http.errors import fleet_error_body, fleet_error_response
from shared.envelopes import GenerationChunk, RequestEnvelope, Usage
from shared.errors import FleetError

SSE_DONE = b"data: [DONE]\n\n"


def sse(event: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(event) + b"\n\n"


def usage_body(usage: Usage | None, details: bool = False) -> dict[str, Any]:
    """OpenAI usage; `details` adds vLLM's null detail fields (whole responses). The prompt's
    details are there where the engine reports them (`--enable-prompt-tokens-details`)."""
    usage = usage or Usage()
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens,
                                         "created_cache_tokens": usage.created_cache_tokens or 0}
        if details:
            body["prompt_tokens_details"]["multimodal_tokens"] = None
    elif details:
        body["prompt_tokens_details"] = None
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    elif details:
        body["completion_tokens_details"] = None
    return body


class Formatter:
    """Turns one request's chunks into an API family's JSON: SSE events, or the whole response.

    The shapes are `vllm serve`'s, key for key: a client switching from it sees no difference.
    Subclasses give the choice objects (`_choice`) and the whole response (`response`).
    """

    endpoint: str
    id_prefix: str
    chunk_object: str
    # SSE framing: OpenAI's unnamed `data:` events closed by `data: [DONE]`; the Anthropic and
    # Responses families name each event after its "type" (`event: message_start`) and close
    # with their own last event instead of a marker.
    named_events = False
    done_marker: bytes | None = SSE_DONE
    include_timings = False
    n = 1  # choices; a family whose formatter has its own __init__ (Anthropic, Responses) has one
    # Each family's formatter by its `endpoint`: a follower on another gateway ends a stream whose
    # relay died in the stream's own family (`lost_events`), with none of the formatter that began it.
    families: ClassVar[dict[str, type[Formatter]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "endpoint" in vars(cls):
            Formatter.families.setdefault(cls.endpoint, cls)

    def __init__(self, request: Any, envelope: RequestEnvelope):
        """`request`: the family's parsed request, whose `stream_options` and `include_timings` it reads."""
        self.response_id = f"{self.id_prefix}-{envelope.request_id}"
        self.created = int(envelope.arrival)
        self.model = envelope.model
        self.n = envelope.choice_count  # n, or n per prompt of a completion with several
        options = request.stream_options
        self.include_usage = bool(options and options.include_usage)
        self.continuous_usage = self.include_usage and bool(options.continuous_usage_stats)
        self.include_timings = request.include_timings or bool(options and options.include_timings)
        self.arrival = envelope.arrival
        self._prompt_tokens = 0
        self._tokens = [0] * self.n  # completion tokens per choice so far
        self._finished = [False] * self.n
        self._fingerprint: str | None = None

    def _chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        body = {"id": self.response_id, "object": self.chunk_object, "created": self.created,
                "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return body

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """The SSE events for one delta or terminal chunk."""
        if chunk.usage is not None:
            self._prompt_tokens = chunk.usage.prompt_tokens
        if chunk.system_fingerprint is not None:
            self._fingerprint = chunk.system_fingerprint
        events = self._opening_events(chunk)
        if chunk.done:
            return events + self._closing_events(chunk)
        self._tokens[chunk.choice_index] += chunk.token_count
        events.append(self._delta_event(chunk))
        return events

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        """The whole non-streaming response, from the terminal chunk's candidates."""
        raise NotImplementedError

    @classmethod
    def encode(cls, event: dict[str, Any]) -> bytes:
        """One SSE event on the wire, as `vllm serve` writes it: compact JSON, but for an error in
        an OpenAI stream, which vLLM writes with `json.dumps` (spaces after separators)."""
        if cls.named_events:
            return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"
        if "error" in event:
            return b"data: " + json.dumps(event).encode() + b"\n\n"
        return sse(event)

    def error_response(self, error: FleetError) -> Response:
        """A refusal before the stream starts, in the family's error shape."""
        return fleet_error_response(error)

    def error_events(self, error: FleetError) -> list[dict[str, Any]]:
        """The events that end a stream on an error after its first byte."""
        return [fleet_error_body(error)]

    @classmethod
    def lost_events(cls, error: FleetError, first_id: int) -> list[dict[str, Any]]:
        """The events that end a stream on an error, for a reader with none of the stream's state
        (a follower whose relaying gateway died): the family's error, which in the OpenAI families
        needs none. `first_id`: the first event's id (a Responses event's sequence number)."""
        return [fleet_error_body(error)]

    def _choice(self, index: int, chunk: GenerationChunk | None, finish: str | None) -> dict[str, Any]:
        """One choice of a stream chunk; `chunk` None for the empty finish of a silent choice."""
        raise NotImplementedError

    def _opening_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        """Events owed before this chunk's own (chat's role chunks); counted before its tokens."""
        return []

    def _running_usage(self, index: int) -> dict[str, Any] | None:
        """`continuous_usage_stats`: the usage of choice `index` so far, on every chunk."""
        if not self.continuous_usage:
            return None
        done = self._tokens[index]
        usage = {"prompt_tokens": self._prompt_tokens, "total_tokens": self._prompt_tokens + done,
                 "completion_tokens": done}
        if self.endpoint == "chat":
            usage["completion_tokens_details"] = None
        return usage

    def _delta_event(self, chunk: GenerationChunk) -> dict[str, Any]:
        index = chunk.choice_index
        finish = chunk.finish_reason
        self._finished[index] = self._finished[index] or finish is not None
        return self._finishing(self._chunk([self._choice(index, chunk, finish)], self._running_usage(index)), finish)

    def _finishing(self, event: dict[str, Any], finish: str | None) -> dict[str, Any]:
        # Without a usage chunk to close the stream, each choice's finish carries the fingerprint.
        if finish is not None and not self.include_usage and self._fingerprint is not None:
            event["system_fingerprint"] = self._fingerprint
        return event

    def _closing_events(self, terminal: GenerationChunk) -> list[dict[str, Any]]:
        """A finish for every choice that has none yet, then the usage chunk if asked for."""
        events = []
        for i in range(self.n):
            if not self._finished[i]:
                self._finished[i] = True
                finish = terminal.finish_reason or "stop"
                event = self._chunk([self._choice(i, None, finish)], self._running_usage(i))
                events.append(self._finishing(event, finish))
        if self.include_usage:
            event = self._chunk([], usage_body(terminal.usage))
            if self._fingerprint is not None:
                event["system_fingerprint"] = self._fingerprint
            events.append(event)
        if self.include_timings:  # on the usage chunk, or on a chunk of its own
            if not self.include_usage:
                events.append(self._chunk([]))
            events[-1]["timings"] = request_timings(terminal, self.arrival)
        return events


def request_timings(terminal: GenerationChunk, arrival: float) -> dict[str, float | None]:
    """One request's stage times, seconds: queue (arrival to a worker's claim), prefill (to the
    first token), decode (first token to last), migration (what takeovers of the stream by other
    workers added: the pauses its client saw; 0 without one), relay (the worker's end to this
    gateway), total (arrival to now), time to first token (arrival to the engine's first token),
    and completion tokens per second of decode. Worker and gateway clocks meet in `relay` and
    `ttft`, which are only as right as they agree."""
    now = time.time()
    worker = terminal.timings or {}
    decode = worker.get("decode_s")
    tokens = terminal.usage.completion_tokens if terminal.usage is not None else 0
    finished_at, first_token_at = worker.get("finished_at"), worker.get("first_token_at")
    return {"queue_s": worker.get("queue_s"), "prefill_s": worker.get("prefill_s"), "decode_s": decode,
            "migration_s": worker.get("migration_s", 0.0),
            "relay_s": max(0.0, now - finished_at) if finished_at else None, "total_s": now - arrival,
            "ttft_s": max(0.0, first_token_at - arrival) if first_token_at else None,
            "completion_tokens_per_s": tokens / decode if decode else None}


