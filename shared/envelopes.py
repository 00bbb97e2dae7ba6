"""Typed envelopes that cross Redis between gateways and workers.

Data flow::

    gateway --RequestEnvelope--> requests:{model} stream --> worker (consumer group)
    worker  --ChunkEnvelope----> replies:{gateway} stream --> gateway's ReplyRouter
    gateway --CancelNotice-----> cancel pub/sub channel   --> every worker
    worker  --WorkerInfo-------> heartbeat key (TTL)       --> every gateway's registry

Schema evolution (a rolling upgrade runs old and new processes side by side):
- `v` is the wire major version. Adding a field does not change it; only a change that old
  readers would misread does, and readers refuse majors they do not know.
- New fields get defaults and go at the end of their class.
- Decoders ignore unknown keys, so an old reader accepts a newer writer's envelopes.
- Fields equal to their default are left out on the wire, which keeps per-token chunks small.

Encoding to bytes happens only in `shared.codec`.
"""

from __future__ import annotations

import functools
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Literal

from shared.errors import EnvelopeError, ErrorInfo

WIRE_VERSION = 1

Kind = Literal["chat", "completion", "tokenize", "detokenize"]
KINDS: tuple[Kind, ...] = ("chat", "completion", "tokenize", "detokenize")
# "stop", "length", "tool_calls", "cancelled", "error", or another reason the engine gives
# (vLLM's "repetition"); the gateway shows it as the engine's server would.
FinishReason = str
# Logprobs in the shape of the request's API: for chat, a list of OpenAI entries
# {"token", "logprob", "bytes", "top_logprobs": [...]}; for completions, the parallel lists
# {"text_offset", "token_logprobs", "tokens", "top_logprobs"}.
Logprobs = list[dict[str, Any]] | dict[str, list]


def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in fields(cls))


@functools.cache
def _defaults(cls) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field of a dataclass, MISSING where it has none: read once per class."""
    return tuple((f.name, f.default) for f in fields(cls))


def _compact(obj) -> dict[str, Any]:
    """The fields of a dataclass that differ from their defaults, as plain values."""
    out = {}
    for name, default in _defaults(type(obj)):
        value = getattr(obj, name)
        if default is MISSING or value != default:
            out[name] = value
    return out


def _known(cls, data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise EnvelopeError(f"{cls.__name__} must be a map, got {type(data).__name__}")
    names = _FIELDS[cls]
    return {k: v for k, v in data.items() if k in names}


def _build(cls, data: Any):
    try:
        return cls(**_known(cls, data))
    except TypeError as exc:
        raise EnvelopeError(f"malformed {cls.__name__}: {exc}") from exc


@dataclass(slots=True)
class SamplingOptions:
    """Sampling and output options, with OpenAI/vLLM names. None means "engine default"."""

    max_tokens: int | None = None  # None: the room left in the context
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    logprobs: int | None = None  # number of top alternatives; None: no logprobs
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


@dataclass(slots=True)
class RequestEnvelope:
    """One generation request, as a worker receives it."""

    request_id: str
    model: str
    kind: Kind
    reply_to: str  # the gateway's reply stream
    arrival: float  # wall-clock seconds when the gateway accepted the request
    deadline: float = 0.0  # wall-clock seconds; 0 means none
    stream: bool = False  # False: the worker sends one terminal chunk with candidates
    # The client's request body as it was sent (validated by the gateway): an engine that speaks
    # the API itself, as vLLM does, reads every field from here.
    body: dict[str, Any] = field(default_factory=dict)
    params: SamplingOptions = field(default_factory=SamplingOptions)  # the gateway's reading of `body`
    cancel_id: str | None = None
    v: int = WIRE_VERSION
    queue_deadline: float = 0.0  # wall-clock seconds; a worker drops the request unstarted after it
    batch_replies: bool = False  # the gateway reads reply entries of several envelopes (keys.BATCH_FIELD)
    client_request_id: str = ""  # the HTTP request's X-Request-Id, on every log line about it (shared.logs)
    traceparent: str = ""  # W3C trace context of the gateway's span when tracing is on (shared.tracing)
    # Who the request is for (gateway.tenancy): the API key's name ("" when keys are off) and its
    # priority, "high", "normal" or "low"; a tenant's request waits in its queue (shared.fair_queue).
    tenant: str = ""
    priority: str = "normal"
    session_id: str = ""  # the session (gateway.sessions) whose turn this is; a cancel by it stops the turn

    @property
    def prompts(self) -> list:
        """The prompts of a completion: a string or a list of token ids is one prompt; a list of
        strings or of token id lists is one prompt each (vLLM's reading). Other kinds have one."""
        prompt = self.body.get("prompt") if self.kind == "completion" else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt
        return [prompt]

    @property
    def choice_count(self) -> int:
        """The choices of the answer: n for each prompt. Choice `c` of prompt `p` has index
        p * n + c, as on `vllm serve`."""
        return self.params.n * len(self.prompts)

    def to_wire(self) -> dict[str, Any]:
        out = _compact(self)
        out["params"] = _compact(self.params)
        out["v"] = self.v
        return out

    @classmethod
    def from_wire(cls, data: Any) -> RequestEnvelope:
        known = _known(cls, data)
        _check_version(known)
        known["params"] = _build(SamplingOptions, known.get("params", {}))
        try:
            envelope = cls(**known)
        except TypeError as exc:
            raise EnvelopeError(f"malformed RequestEnvelope: {exc}") from exc
        if not isinstance(envelope.request_id, str) or not isinstance(envelope.reply_to, str):
            raise EnvelopeError("request_id and reply_to must be strings")
        if envelope.kind not in KINDS:
            raise EnvelopeError(f"unknown request kind {envelope.kind!r}")
        return envelope


@dataclass(slots=True)
class ToolCallDelta:
    """Part of a tool call, OpenAI streaming shape: id and name first, then argument text.

    In a non-streaming candidate the same type holds a whole call.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens found in the engine's prefix cache, when it reports them
    created_cache_tokens: int | None = None  # prompt tokens written to the engine's cache, when it reports them


@dataclass(slots=True)
class Candidate:
    """One whole choice of a non-streaming request."""

    index: int
    text: str | None = ""  # None: no content (a tool call, or all reasoning)
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[Any] | None = None  # completions with echo and logprobs, as vLLM gives them
    token_ids: list[int] | None = None  # the choice's tokens, when the client asked (`return_token_ids`)
    prompt_token_ids: list[int] | None = None  # a completion choice's prompt, when the client asked


@dataclass(slots=True)
class GenerationChunk:
    """One step of a generation, for one choice.

    A generation is zero or more delta chunks, then exactly one terminal chunk (`done`), which
    carries the request's usage, and for a non-streaming request its candidates. With n > 1,
    each choice's last delta carries that choice's `finish_reason`; `done` marks the request's
    end. The terminal chunk is always the last one sent for a request.
    """

    choice_index: int = 0
    text: str | None = ""  # None: this delta carries no content (only reasoning, a tool call, or nothing)
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    done: bool = False
    usage: Usage | None = None
    error: ErrorInfo | None = None
    first_token: bool = False  # the first chunk carrying generated output (TTFT)
    candidates: list[Candidate] | None = None
    token_count: int = 0  # generated tokens this delta stands for
    system_fingerprint: str | None = None  # the engine's, on finishing chunks
    result: dict[str, Any] | None = None  # terminal only: a whole response that is not a generation (tokenize)
    # The prompt's token ids where the engine's server sends them (`return_token_ids`, echo): on a
    # choice's first delta; on the terminal chunk of a whole chat answer.
    prompt_token_ids: list[int] | None = None
    # Terminal only: the worker's stage times, seconds (queue_s, prefill_s, decode_s), when the
    # engine produced the first token and when it finished (first_token_at, finished_at: wall
    # clock), for the gateway's per-request timings and its time to first token.
    timings: dict[str, float] | None = None
    # Wall clock of the engine's first token, when it came before this chunk: set by an adapter
    # whose engine builds whole responses (one chunk for the whole answer). 0: when the chunk came.
    first_token_at: float = 0.0
    token_ids: list[int] | None = None  # this delta's tokens, when the client asked (`return_token_ids`)
    prompt_logprobs: list[Any] | None = None  # terminal of a whole chat answer: the prompt's logprobs, if asked

    @property
    def is_delta_only(self) -> bool:
        """True when the chunk is plain text/logprobs that may merge with its neighbour."""
        return not (self.tool_calls or self.finish_reason or self.done or self.error or self.candidates)

    def can_absorb(self, other: GenerationChunk) -> bool:
        """True when `other`, the next delta of the same choice, reads as part of this one."""
        return (self.is_delta_only and other.is_delta_only and self.choice_index == other.choice_index
                and (self.text is None) == (other.text is None) and bool(self.reasoning) == bool(other.reasoning)
                and type(self.logprobs) is type(other.logprobs) and type(self.token_ids) is type(other.token_ids)
                and other.prompt_token_ids is None)

    def absorb(self, other: GenerationChunk) -> None:
        """Append the next delta (see `can_absorb`) to this one."""
        if self.text is not None:
            self.text += other.text
        self.reasoning += other.reasoning
        self.token_count += other.token_count
        if self.token_ids is not None:
            self.token_ids.extend(other.token_ids)
        if isinstance(self.logprobs, list):
            self.logprobs.extend(other.logprobs)
        elif isinstance(self.logprobs, dict):
            for key, values in other.logprobs.items():
                self.logprobs.setdefault(key, []).extend(values)

    def to_wire(self) -> dict[str, Any]:
        out = _compact(self)
        if self.tool_calls:
            out["tool_calls"] = [_compact(t) for t in self.tool_calls]
        if self.usage is not None:
            out["usage"] = _compact(self.usage)
        if self.error is not None:
            out["error"] = _compact(self.error)
        if self.candidates:
            out["candidates"] = [_candidate_to_wire(c) for c in self.candidates]
        return out

    @classmethod
    def from_wire(cls, data: Any) -> GenerationChunk:
        known = _known(cls, data)
        if "tool_calls" in known:
            known["tool_calls"] = [_build(ToolCallDelta, t) for t in known["tool_calls"]]
        if "usage" in known:
            known["usage"] = _build(Usage, known["usage"])
        if "error" in known:
            known["error"] = _build(ErrorInfo, known["error"])
        if "candidates" in known:
            known["candidates"] = [_candidate_from_wire(c) for c in known["candidates"]]
        return _build(cls, known)


def _candidate_to_wire(candidate: Candidate) -> dict[str, Any]:
    out = _compact(candidate)
    if candidate.tool_calls:
        out["tool_calls"] = [_compact(t) for t in candidate.tool_calls]
    return out


def _candidate_from_wire(data: Any) -> Candidate:
    known = _known(Candidate, data)
    if "tool_calls" in known:
        known["tool_calls"] = [_build(ToolCallDelta, t) for t in known["tool_calls"]]
    return _build(Candidate, known)


@dataclass(slots=True)
class ChunkEnvelope:
    """The chunks a worker publishes for one request in one write, in order."""

    request_id: str
    seq: int  # per request, starting at 0; one envelope per sequence number
    chunks: list[GenerationChunk]
    worker_id: str = ""
    v: int = WIRE_VERSION
    # The fencing token of the worker's lease on the request (0: none, from an older worker). A
    # worker that takes a request over holds a later lease with a larger token, so a gateway can
    # drop what the worker that lost the request still had on the wire.
    lease: int = 0

    def to_wire(self) -> dict[str, Any]:
        wire = {
            "v": self.v,
            "request_id": self.request_id,
            "seq": self.seq,
            "worker_id": self.worker_id,
            "chunks": [c.to_wire() for c in self.chunks],
        }
        if self.lease:
            wire["lease"] = self.lease
        return wire

    @classmethod
    def from_wire(cls, data: Any) -> ChunkEnvelope:
        known = _known(cls, data)
        _check_version(known)
        raw_chunks = known.get("chunks")
        if not isinstance(raw_chunks, list):
            raise EnvelopeError("ChunkEnvelope.chunks must be a list")
        known["chunks"] = [GenerationChunk.from_wire(c) for c in raw_chunks]
        return _build(cls, known)


@dataclass(slots=True)
class CancelNotice:
    """Sent on the cancel channel: stop these requests wherever they run."""

    request_ids: list[str]
    reason: str = "disconnect"  # disconnect | explicit | deadline
    v: int = WIRE_VERSION
    sent_at: float = 0.0  # wall-clock seconds when the gateway decided to cancel

    def to_wire(self) -> dict[str, Any]:
        return {"v": self.v, "request_ids": self.request_ids, "reason": self.reason, "sent_at": self.sent_at}

    @classmethod
    def from_wire(cls, data: Any) -> CancelNotice:
        known = _known(cls, data)
        _check_version(known)
        return _build(cls, known)


@dataclass(slots=True)
class WorkerInfo:
    """A worker's heartbeat: what it serves and how busy it is."""

    worker_id: str
    model: str
    max_model_len: int
    capacity: int
    in_flight: int = 0
    engine: str = "vllm"
    started: float = 0.0
    draining: bool = False
    v: int = WIRE_VERSION
    completed: int = 0  # requests answered since the worker started (the fleet's drain rate)
    # The request kinds this worker accepts. A heartbeat without the field is from a worker older
    # than it, which accepted every kind of its time: these.
    kinds: list[str] = field(default_factory=lambda: list(KINDS))

    def to_wire(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in _FIELDS[WorkerInfo]}

    @classmethod
    def from_wire(cls, data: Any) -> WorkerInfo:
        known = _known(cls, data)
        _check_version(known)
        return _build(cls, known)


def _check_version(known: dict[str, Any]) -> None:
    version = known.get("v", WIRE_VERSION)
    if version != WIRE_VERSION:
        raise EnvelopeError(f"unsupported wire version {version!r} (this process speaks {WIRE_VERSION})")


_FIELDS = {
    cls: _field_names(cls)
    for cls in (
        SamplingOptions,
        RequestEnvelope,
        ToolCallDelta,
        Usage,
        Candidate,
        GenerationChunk,
        ChunkEnvelope,
        CancelNotice,
        WorkerInfo,
        ErrorInfo,
    )
}
