"""What an engine is to a worker: one base per kind of work, dispatched on by type.

`Adapter` is an engine's lifetime (start, health, shutdown) and the request kinds it answers.
A kind of work is an abstract class below it, and the worker's runner picks the path of a
request by `isinstance(adapter, ...)` (worker/runner.py): a second kind of work is one new class,
never a flag threaded through the first kind's code.

- `GenerationAdapter` (chat, completion): `generate(request)` is an async iterator of
  `GenerationChunk`: zero or more delta chunks, then exactly one terminal chunk (`done=True`)
  with the finish reason and token counts. Two ways to stop a generation early, and both must
  stop the engine:
  - `abort(request_id)`: the adapter stops the engine and still yields its terminal chunk, with
    finish_reason "cancelled" and the usage generated so far;
  - closing the iterator (`aclose()`, or cancelling the task that iterates it): no terminal
    chunk is owed, but the engine request must be aborted before `aclose()` returns.
- `TokenizerAdapter` (tokenize, detokenize): the model's tokenizer, answering `vllm serve`'s
  /tokenize and /detokenize with one terminal chunk holding the whole answer (`result`).
- `EncoderAdapter` (embed, score, rerank, classify, pooling: the second kind of work, a pooling
  model's): `encode(request)` answers with one terminal chunk holding a pooled output per input
  or per pair (`pooled`, packed float32) and the inputs' tokens (`usage`). Stopping it early is
  cancelling the task that awaits it, which must stop the engine's work for it.

An engine may be several kinds (vLLM's generation engine is a generation and a tokenizer; its
pooling engine an encoder and a tokenizer); a request of a kind the worker's engine is not is
answered with a clear error, never dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from shared.envelopes import ENCODER_KINDS, GENERATION_KINDS, TOKENIZER_KINDS, GenerationChunk, RequestEnvelope

__all__ = ["ENCODER_KINDS", "GENERATION_KINDS", "TOKENIZER_KINDS", "Adapter", "EncoderAdapter", "GenerationAdapter",
           "TokenizerAdapter"]


class Adapter(ABC):  # noqa: B024 - its kinds are the abstract part; the lifetime has defaults
    """An engine's lifetime and the request kinds it answers."""

    engine_name: str = "unknown"
    kinds: tuple[str, ...] = ()

    def __init__(self, served_model_name: str, max_model_len: int):
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len

    async def start(self) -> None:  # noqa: B027 - an engine with nothing to load keeps it
        """Load the model; called once before the first request."""

    async def shutdown(self) -> None:  # noqa: B027
        """Release the engine; called once when the worker exits."""

    async def check_health(self) -> None:  # noqa: B027
        """Raise if the engine can no longer serve requests."""

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can serve no more requests, or None while it can."""
        return None


class GenerationAdapter(Adapter):
    """An engine that turns a request envelope into a stream of generation chunks."""

    kinds = GENERATION_KINDS

    @abstractmethod
    def generate(self, request: RequestEnvelope, prefix_ids: list[int] | None = None) -> AsyncIterator[GenerationChunk]:
        """Stream the chunks of one request (see the module docstring for the contract). With
        `prefix_ids`, continue its one choice after those tokens of its answer, which its client
        was already sent: stream only what comes after them, with the usage of the rest alone.
        An engine that can be continued so sends with each delta the tokens it stands for
        (`GenerationChunk.output_ids`) when the request is one a takeover continues
        (`RequestEnvelope.continues`), or `prefix_ids` is given (an empty list: from the start)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running generation; its iterator then ends with a "cancelled" terminal chunk."""


class TokenizerAdapter(ABC):
    """The model's tokenizer, for /tokenize and /detokenize (a mixin of an `Adapter`)."""

    @abstractmethod
    async def tokenize(self, request: RequestEnvelope) -> GenerationChunk:
        """The terminal chunk answering a tokenize or detokenize request: its `result`, or its error."""


class EncoderAdapter(Adapter):
    """An engine that pools its inputs (a pooling model): embeddings, scores, rankings, classes.

    `kinds` are the encoder kinds this engine's model serves (an embedding model: embed, score,
    rerank, pooling; a classifier: classify, pooling, and score and rerank with one label)."""

    kinds = ENCODER_KINDS

    @abstractmethod
    async def encode(self, request: RequestEnvelope) -> GenerationChunk:
        """The terminal chunk answering an encoder request: its `pooled` outputs in the request's
        order and its `usage`, or its error. Cancelling the awaiting task stops the engine's work."""
