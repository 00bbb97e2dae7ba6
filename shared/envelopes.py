"""Typed envelopes that cross Redis between gateways and workers.

Data flow::

    gateway --RequestEnvelope--> requests:{model} stream --> worker (consumer group)
    worker  --ChunkEnvelope----> replies:{gateway} stream --> gateway's ReplyRouter
    gateway --CancelNotice-----> cancel pub/sub channel   --> every worker
    worker  --WorkerInfo-------> heartbeat key (TTL)       --> every gateway's registry

Each envelope is a `msgspec.Struct`: `shared.codec` decodes msgpack straight into it and checks
every field's type and bounds on the way (a string where a number belongs, a negative sequence
number, an unknown request kind, a field of the wrong shape), so nothing past the codec meets a
malformed envelope. That is the only place envelopes are decoded. (Measured in
docs/benchmarks.md, "Envelope decode cost": a one-token chunk decodes with every check in 0.6 µs,
an eighth of the hand-written decoder it replaced and a seventh of pydantic over the same dict.)

Schema evolution (a rolling upgrade runs old and new processes side by side):
- `v` is the wire major version. Adding a field does not change it; only a change that old
  readers would misread does, and readers refuse majors they do not know.
- New fields get defaults and go at the end of their class.
- Decoders ignore unknown keys, so an old reader accepts a newer writer's envelopes.
- Fields equal to their default are left out on the wire (`omit_defaults`), which keeps
  per-token chunks small.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from shared.errors import ErrorInfo

WIRE_VERSION = 1

# The kinds of request a worker answers. A new kind is a new adapter class on the worker
# (worker/adapters/), dispatched by type; an envelope of a kind no worker of this version knows
# fails decoding, and is dead-lettered with that reason. Two kinds of work: generation (chat,
# completion) and encoding (embed, score, rerank, classify, pooling: vllm serve's pooling
# endpoints), each with the model's tokenizer beside it (tokenize, detokenize).
Kind = Literal["chat", "completion", "tokenize", "detokenize", "embed", "score", "rerank", "classify", "pooling"]
GENERATION_KINDS: tuple[str, ...] = ("chat", "completion")
TOKENIZER_KINDS: tuple[str, ...] = ("tokenize", "detokenize")
ENCODER_KINDS: tuple[str, ...] = ("embed", "score", "rerank", "classify", "pooling")
KINDS: tuple[str, ...] = (*GENERATION_KINDS, *TOKENIZER_KINDS, *ENCODER_KINDS)
# Each kind's API, as `vllm serve` names it when a model cannot serve it.
API_NAMES = {"chat": "Chat Completions", "completion": "Completions", "embed": "Embeddings", "score": "Score",
             "rerank": "Rerank (Score)", "classify": "Classification", "pooling": "Pooling"}


def work_of(kind: str) -> tuple[str, ...]:
    """The kinds of the same work as `kind`: generation's, or an encoder's (a tokenizer is either's)."""
    return GENERATION_KINDS if kind in GENERATION_KINDS else ENCODER_KINDS if kind in ENCODER_KINDS else KINDS
Priority = Literal["high", "normal", "low"]
# "stop", "length", "tool_calls", "cancelled", "error", or another reason the engine gives
# (vLLM's "repetition"); the gateway shows it as the engine's server would.
FinishReason = str
# Logprobs in the shape of the request's API: for chat, a list of OpenAI entries
# {"token", "logprob", "bytes", "top_logprobs": [...]}; for completions, the parallel lists
# {"text_offset", "token_logprobs", "tokens", "top_logprobs"}.
Logprobs = list[dict[str, Any]] | dict[str, list[Any]]

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Seconds = Annotated[float, msgspec.Meta(ge=0)]
Id = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Version = Annotated[int, msgspec.Meta(ge=WIRE_VERSION, le=WIRE_VERSION)]


def extend_logprobs(logprobs: Logprobs | None, more: Logprobs) -> Logprobs:
    """`logprobs` with `more`'s entries after its own, extended in place (either shape, the same in
    both); where `logprobs` is None, a copy of `more` to extend later."""
    if logprobs is None:
        return [*more] if isinstance(more, list) else {key: [*values] for key, values in more.items()}
    if isinstance(logprobs, list):
        logprobs.extend(more)
    else:
        for key, values in more.items():
            logprobs.setdefault(key, []).extend(values)
    return logprobs


class Envelope(msgspec.Struct, omit_defaults=True):
    """What every type that crosses the wire shares: defaults left off it."""

    def to_wire(self) -> dict[str, Any]:
        """The envelope as the plain values it travels as (defaults left out)."""
        return msgspec.to_builtins(self)


class SamplingOptions(Envelope):
    """Sampling and output options, with OpenAI/vLLM names. None means "engine default"."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None  # None: the room left in the context
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
    min_tokens: NonNegative = 0
    n: Annotated[int, msgspec.Meta(ge=1)] = 1
    logprobs: int | None = None  # number of top alternatives; None: no logprobs
    echo: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# Body fields whose state a continuation cannot rebuild (`RequestEnvelope.continues`): a grammar's, the prompt's
# own, a beam search's beams.
_NOT_CONTINUED = ("structured_outputs", "prompt_logprobs", "echo", "use_beam_search")


class RequestEnvelope(Envelope):
    """One request, as a worker receives it."""

    request_id: Id
    model: Id
    kind: Kind
    reply_to: Id  # the gateway's reply stream (where `reply_channel` is not given)
    arrival: Seconds  # wall-clock seconds when the gateway accepted the request
    deadline: Seconds = 0.0  # wall-clock seconds; 0 means none
    stream: bool = False  # False: the worker sends one terminal chunk with candidates
    # The client's request body as it was sent (validated by the gateway): an engine that speaks
    # the API itself, as vLLM does, reads every field from here.
    body: dict[str, Any] = msgspec.field(default_factory=dict)
    params: SamplingOptions = msgspec.field(default_factory=SamplingOptions)  # the gateway's reading of `body`
    cancel_id: str | None = None
    v: Version = WIRE_VERSION
    queue_deadline: Seconds = 0.0  # wall-clock seconds; a worker drops the request unstarted after it
    batch_replies: bool = False  # the gateway reads reply entries of several envelopes (keys.BATCH_FIELD)
    client_request_id: str = ""  # the HTTP request's X-Request-Id, on every log line about it (shared.logs)
    traceparent: str = ""  # W3C trace context of the gateway's span when tracing is on (shared.tracing)
    # Who the request is for (gateway.tenancy): the API key's name ("" when keys are off) and its
    # priority; a tenant's request waits in its queue (shared.fair_queue).
    tenant: str = ""
    priority: Priority = "normal"
    session_id: str = ""  # the session (gateway.sessions) whose turn this is; a cancel by it stops the turn
    # The API of the body where a kind has several ("cohere": an embed from /v2/embed); "": the kind's own.
    api: str = ""
    # The channel its gateway subscribes to while it lives (keys.gateway_presence_channel): a worker
    # stops a request whose gateway has gone (worker/cancels.py). "": none held (a cluster's nodes count
    # a channel's subscribers each for itself), or a gateway from before it.
    gateway_presence: str = ""
    # Where its worker publishes its replies (PUBLISH, batches of envelopes): its gateway's presence
    # channel, read as it comes in (gateway/fleet/relay.py); but an answer in one envelope too large
    # for a channel goes to `reply_to` (worker/publisher.py). "": every reply to `reply_to` (a
    # cluster, or a gateway from before it; a worker from before it writes there anyway, and the
    # gateway reads both).
    reply_channel: str = ""

    @property
    def prompts(self) -> list:
        """The prompts of a completion: a string or a list of token ids is one prompt; a list of
        strings or of token id lists is one prompt each (vLLM's reading). Other kinds have one."""
        prompt = self.body.get("prompt") if self.kind == "completion" else None
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return prompt
        return [prompt]

    @property
    def replays_exactly(self) -> bool:
        """A stream whose output the request fixes (greedy, or seeded): run again from its start by
        a worker that takes it over (unless it is continued from its tokens, `continues`), it gives
        the same text, which the gateway joins where its client stood (gateway/fleet/replay.py)."""
        return self.stream and (self.params.temperature == 0 or self.params.seed is not None)

    @property
    def continues(self) -> bool:
        """A stream that a worker taking it over continues where its client stood (`continued`): a
        chat answer, or a completion of one string prompt; its n choices each continued where it
        stood, its logprobs going on with the new tokens. From the engine's tokens its client was
        sent, where its worker sent them (`GenerationChunk.output_ids`); else from its text, where
        that holds the answer's state (no reasoning or tool call was sent). Not one with a
        structured output or a forced tool call, whose grammar's state a continuation cannot
        rebuild, nor a seeded sample (replayed, to give the same sample). A greedy stream continued
        from its tokens goes on as it would have; one that cannot be is replayed (`Continuation.replay`).
        A sampled stream's continuation is a valid sample, not the same one."""
        if not self.stream or (self.params.seed is not None and self.params.temperature != 0):
            return False
        body = self.body
        structured = (body.get("response_format") or {}).get("type", "text") != "text"
        if structured or any(body.get(name) for name in _NOT_CONTINUED) \
                or any(value for name, value in body.items() if name.startswith("guided_")):
            return False
        if self.kind == "chat":
            return not body.get("continue_final_message") and body.get("tool_choice") in (None, "auto", "none")
        return self.kind == "completion" and isinstance(body.get("prompt"), str) and not self.params.echo \
            and not body.get("suffix")

    def continued(self, choice: ContinuedChoice) -> RequestEnvelope:
        """This request, to continue one choice where its client's stream stood, as a request of one
        choice: from its tokens, the request as it was (the worker's engine reads the tokens after
        the prompt, `GenerationAdapter.generate`); from its text, that text as the start of the
        answer (chat: a final assistant message the model continues; completion: the prompt's end),
        with the tokens it had left."""
        body = dict(self.body)
        if choice.token_ids is not None:
            if "n" in body:
                body["n"] = 1
            return msgspec.structs.replace(self, body=body, params=msgspec.structs.replace(self.params, n=1))
        if self.kind == "chat":
            body["messages"] = [*body.get("messages", ()), {"role": "assistant", "content": choice.text}]
            body.update(continue_final_message=True, add_generation_prompt=False)
        else:
            body["prompt"] = body["prompt"] + choice.text
        params = msgspec.structs.replace(self.params, n=1, min_tokens=max(0, self.params.min_tokens - choice.tokens))
        if "n" in body:
            body["n"] = 1
        for name in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(name), int):
                body[name] = body[name] - choice.tokens
        if params.max_tokens is not None:
            params.max_tokens = params.max_tokens - choice.tokens
        if body.get("min_tokens"):
            body["min_tokens"] = params.min_tokens
        return msgspec.structs.replace(self, body=body, params=params)

    @property
    def choice_count(self) -> int:
        """The choices of the answer: n for each prompt. Choice `c` of prompt `p` has index
        p * n + c, as on `vllm serve`."""
        return self.params.n * len(self.prompts)


class ContinuedChoice(Envelope):
    """One choice of a stream as its client was sent it, to be continued from there."""

    index: NonNegative
    text: str
    tokens: NonNegative  # completion tokens sent
    # Where a completion's logprob offsets count on from: the sent tokens' last offset and its
    # token's length. vLLM counts offsets by each token's own text, which can outrun the text
    # (bytes of one character each decode to a replacement character).
    text_offset: NonNegative = 0
    # The engine's tokens of the choice so far, where its worker sent them (`GenerationChunk.output_ids`):
    # it is continued from them, not from its text.
    token_ids: list[int] | None = None


class Continuation(Envelope):
    """What the client of a stream was sent when its worker was lost, for the worker taking it over
    to continue from (`RequestEnvelope.continued`): written by its gateway (keys.continuation_key)."""

    choices: list[ContinuedChoice]  # the choices not finished yet, each continued from its text
    tokens: NonNegative  # completion tokens sent, of every choice (the finished ones too)
    prompt_tokens: NonNegative  # of the request as the client sent it (the usage it is answered with)
    # A greedy stream that cannot be continued from its tokens (not all were sent with its deltas): the
    # worker runs it again from its start instead, and its gateway joins that replay where the client stood.
    replay: bool = False

    @property
    def from_tokens(self) -> bool:
        """Every choice is continued from the engine's tokens."""
        return bool(self.choices) and all(choice.token_ids is not None for choice in self.choices)


class ToolCallDelta(Envelope):
    """Part of a tool call, OpenAI streaming shape: id and name first, then argument text.

    In a non-streaming candidate the same type holds a whole call.
    """

    index: NonNegative
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Usage(Envelope):
    prompt_tokens: NonNegative = 0
    completion_tokens: NonNegative = 0
    reasoning_tokens: NonNegative | None = None
    cached_tokens: NonNegative | None = None  # prompt tokens found in the engine's prefix cache, when it reports them
    created_cache_tokens: NonNegative | None = None  # prompt tokens written to the engine's cache, when it reports them


class Candidate(Envelope):
    """One whole choice of a non-streaming request."""

    index: NonNegative
    text: str | None = ""  # None: no content (a tool call, or all reasoning)
    reasoning: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    prompt_logprobs: list[Any] | None = None  # completions with echo and logprobs, as vLLM gives them
    token_ids: list[int] | None = None  # the choice's tokens, when the client asked (`return_token_ids`)
    prompt_token_ids: list[int] | None = None  # a completion choice's prompt, when the client asked


class Pooled(Envelope):
    """One pooled output of an encoder: an input's embedding, class probabilities or pooled data,
    or a pair's score. The values travel as packed float32 (little-endian, row-major), not as a
    list of floats: a 1024-dimension embedding is 4 KiB of msgpack bin, which the gateway writes
    as base64 as it is, or as float JSON through numpy, without a Python float per element."""

    data: bytes
    shape: list[NonNegative] = msgspec.field(default_factory=list)  # empty: one dimension, len(data) / 4
    label: str | None = None  # classify: the label of the most probable class, as the model names it


class GenerationChunk(Envelope):
    """One step of a generation, for one choice (or the one chunk of an answer that is no
    generation: a tokenizer's `result`, an encoder's `pooled` outputs).

    A generation is zero or more delta chunks, then exactly one terminal chunk (`done`), which
    carries the request's usage, and for a non-streaming request its candidates. With n > 1,
    each choice's last delta carries that choice's `finish_reason`; `done` marks the request's
    end. The terminal chunk is always the last one sent for a request.
    """

    choice_index: NonNegative = 0
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
    token_count: NonNegative = 0  # generated tokens this delta stands for
    system_fingerprint: str | None = None  # the engine's, on finishing chunks
    result: dict[str, Any] | None = None  # terminal only: a whole response that is not a generation (tokenize)
    # The prompt's token ids where the engine's server sends them (`return_token_ids`, echo): on a
    # choice's first delta; on the terminal chunk of a whole chat answer.
    prompt_token_ids: list[int] | None = None
    # The worker's stage times, seconds (queue_s, prefill_s, decode_s), when the engine produced the
    # first token and when it finished (first_token_at, finished_at: wall clock), for the gateway's
    # per-request timings and its time to first token: on the terminal chunk; and prefill_s and
    # first_token_at on a stream's first token, which its gateway keeps should the stream be taken over
    # (then the terminal's also say what the takeovers added: migration_s, migrations, migrated_at).
    timings: dict[str, float] | None = None
    # Wall clock of the engine's first token, when it came before this chunk: set by an adapter
    # whose engine builds whole responses (one chunk for the whole answer). 0: when the chunk came.
    first_token_at: Seconds = 0.0
    token_ids: list[int] | None = None  # this delta's tokens, when the client asked (`return_token_ids`)
    # The engine's tokens this delta stands for, held-back ones included, for a takeover to continue
    # the stream from (never shown to the client): sent with the deltas of a stream a takeover
    # continues (`RequestEnvelope.continues`), by a worker whose engine can go on after them.
    output_ids: list[int] | None = None
    prompt_logprobs: list[Any] | None = None  # terminal of a whole chat answer: the prompt's logprobs, if asked
    # Terminal only, of an encoder's answer (embed, score, rerank, classify, pooling): one pooled
    # output per input, or per pair scored, in the request's order; `usage` counts the inputs' tokens.
    pooled: list[Pooled] | None = None
    # A draining worker's last chunk of a stream it hands over (no output of its own): it sends
    # nothing more for the request, and another worker continues it from what its client was sent.
    handed_over: bool = False

    @property
    def is_delta_only(self) -> bool:
        """True when the chunk is plain text/logprobs that may merge with its neighbour."""
        return not (self.tool_calls or self.finish_reason or self.done or self.error or self.candidates
                    or self.handed_over)

    def can_absorb(self, other: GenerationChunk) -> bool:
        """True when `other`, the next delta of the same choice, reads as part of this one."""
        return (self.is_delta_only and other.is_delta_only and self.choice_index == other.choice_index
                and (self.text is None) == (other.text is None) and bool(self.reasoning) == bool(other.reasoning)
                and type(self.logprobs) is type(other.logprobs) and type(self.token_ids) is type(other.token_ids)
                and type(self.output_ids) is type(other.output_ids) and other.prompt_token_ids is None
                and other.timings is None)

    def absorb(self, other: GenerationChunk) -> None:
        """Append the next delta (see `can_absorb`) to this one."""
        if self.text is not None:
            self.text += other.text
        self.reasoning += other.reasoning
        self.token_count += other.token_count
        if self.token_ids is not None:
            self.token_ids.extend(other.token_ids)
        if self.output_ids is not None:
            self.output_ids.extend(other.output_ids)
        if self.logprobs is not None:
            extend_logprobs(self.logprobs, other.logprobs)


class ChunkEnvelope(Envelope):
    """The chunks a worker publishes for one request in one write, in order."""

    request_id: Id
    # Per request, from 0; -1: an ending the gateway made itself. An envelope of no chunks (a
    # worker's note that it has started the request, `ReplyPublisher.started`) takes none.
    seq: Annotated[int, msgspec.Meta(ge=-1)]
    chunks: list[GenerationChunk]
    worker_id: str = ""
    v: Version = WIRE_VERSION
    # The fencing token of the worker's lease on the request (0: none, from an older worker). A
    # worker that takes a request over holds a later lease with a larger token, so a gateway can
    # drop what the worker that lost the request still had on the wire.
    lease: NonNegative = 0
    # Where the request's entry is pending, on a worker's first write for it (seq 0): the stream and
    # entry id a takeover claims when its gateway sees the worker gone (keys.takeover_doorbell).
    stream: str = ""
    entry_id: str = ""
    # On the envelope that ends a request: its worker removed the request's registration at the
    # gateways (`keys.run_key`, which cancels by id read) before writing it, so its gateway need not.
    unregistered: bool = False
    # When (wall-clock seconds) its worker wrote it: the gateway times the reply path from it
    # (`llmfleet_gateway_relay_seconds`). 0: a worker from before it.
    sent_at: Seconds = 0.0


class CancelNotice(Envelope):
    """Sent on the cancel channel: stop these requests wherever they run."""

    request_ids: list[str]
    reason: str = "disconnect"  # disconnect | explicit | deadline
    v: Version = WIRE_VERSION
    sent_at: Seconds = 0.0  # wall-clock seconds when the gateway decided to cancel


class WorkerInfo(Envelope):
    """A worker's heartbeat: what it serves and how busy it is."""

    worker_id: Id
    model: Id
    max_model_len: NonNegative
    capacity: NonNegative
    in_flight: NonNegative = 0
    engine: str = "vllm"
    started: Seconds = 0.0
    draining: bool = False
    v: Version = WIRE_VERSION
    completed: NonNegative = 0  # requests answered since the worker started (the fleet's drain rate)
    # The request kinds this worker accepts. A heartbeat without the field is from a worker older
    # than it, which accepted every kind of its time: these.
    kinds: list[str] = msgspec.field(default_factory=lambda: ["chat", "completion", "tokenize", "detokenize"])
    # The worker keeps a subscription to its presence channel (keys.presence_channel) while its
    # process lives: a gateway that finds no subscriber there knows it died, without waiting for its
    # leases to lapse. False: it keeps none (an older worker, or a Redis Cluster, where a channel's
    # subscribers are counted per node).
    presence: bool = False
