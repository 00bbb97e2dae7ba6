"""The `GenerationAdapter` contract every engine implements.

`generate(request)` is an async iterator of `GenerationChunk`: zero or more delta chunks, then
exactly one terminal chunk (`done=True`) with the finish reason and token counts. Two ways to
stop a generation early, and both must stop the engine:

- `abort(request_id)`: the adapter stops the engine and still yields its terminal chunk, with
  finish_reason "cancelled" and the usage generated so far.
- closing the iterator (`aclose()`, or cancelling the task that iterates it): no terminal chunk
  is owed, but the engine request must be aborted before `aclose()` returns.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from shared.envelopes import GenerationChunk, RequestEnvelope


class GenerationAdapter(ABC):
    """An engine that turns a request envelope into a stream of generation chunks."""

    engine_name: str = "unknown"
    kinds: tuple[str, ...] = ("chat", "completion")  # the request kinds the engine can answer

    def __init__(self, served_model_name: str, max_model_len: int):
        self.served_model_name = served_model_name
        self.max_model_len = max_model_len

    async def start(self) -> None:
        """Load the model; called once before the first request."""

    async def shutdown(self) -> None:
        """Release the engine; called once when the worker exits."""

    async def check_health(self) -> None:
        """Raise if the engine can no longer serve requests."""

    @property
    def failure(self) -> BaseException | None:
        """Why the engine can serve no more requests, or None while it can."""
        return None

    @abstractmethod
    def generate(self, request: RequestEnvelope) -> AsyncIterator[GenerationChunk]:
        """Stream the chunks of one request (see the module docstring for the contract)."""

    @abstractmethod
    async def abort(self, request_id: str) -> None:
        """Stop a running generation; its iterator then ends with a "cancelled" terminal chunk."""
