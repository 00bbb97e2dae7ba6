"""POST /v1/completions: OpenAI legacy completions, streaming and not, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.fleet import GatewaySettings
from gateway.openai_chat import usage_body
from gateway.protocol import CompletionRequest, check_sampling
from gateway.serving import Formatter, new_envelope, serve_generation
from shared.envelopes import GenerationChunk, RequestEnvelope, TokenLogprob, Usage

router = APIRouter()


class CompletionLogprobs:
    """Turns chat-shaped logprob entries into the completions shape, tracking text offsets."""

    def __init__(self):
        self.offset = 0

    def convert(self, entries: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if entries is None:
            return None
        body: dict[str, list] = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        for entry in entries:
            body["text_offset"].append(self.offset)
            body["token_logprobs"].append(entry["logprob"])
            body["tokens"].append(entry["token"])
            body["top_logprobs"].append({t["token"]: t["logprob"] for t in entry.get("top_logprobs") or ()})
            self.offset += len(entry["token"])
        return body


class CompletionFormatter(Formatter):
    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, request: CompletionRequest, envelope: RequestEnvelope):
        super().__init__(request, envelope)
        self._finished = [False] * request.n
        self._logprobs = [CompletionLogprobs() for _ in range(request.n)]
        self._tokens = 0

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        events = []
        self._tokens += chunk.token_count
        if chunk.usage is not None:
            self._prompt_tokens = chunk.usage.prompt_tokens
        usage = usage_body(Usage(self._prompt_tokens, self._tokens)) if self.continuous_usage else None
        if not chunk.done or chunk.text or chunk.logprobs:
            finish = chunk.finish_reason if not chunk.done else None
            if finish:
                self._finished[chunk.choice_index] = True
            choice = {"index": chunk.choice_index, "text": chunk.text,
                      "logprobs": self._logprobs[chunk.choice_index].convert(chunk.logprobs),
                      "finish_reason": finish, "stop_reason": chunk.stop_reason if finish else None}
            events.append(self._chunk([choice], usage))
        if chunk.done:
            for i in range(self.n):
                if not self._finished[i]:
                    choice = {"index": i, "text": "", "logprobs": None,
                              "finish_reason": chunk.finish_reason or "stop", "stop_reason": chunk.stop_reason}
                    events.append(self._chunk([choice], usage))
            if self.include_usage:
                events.append(self._chunk([], usage_body(chunk.usage)))
        return events

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        choices = [
            {"index": c.index, "text": c.text, "logprobs": CompletionLogprobs().convert(c.logprobs),
             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            for c in terminal.candidates or ()
        ]
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": usage_body(terminal.usage)}


def completion_envelope(body: CompletionRequest, model: str, max_model_len: int,
                        settings: GatewaySettings) -> RequestEnvelope:
    params = body.sampling_options(body.max_tokens, body.logprobs, echo=body.echo)
    check_sampling(params, max_model_len)
    return new_envelope(body, "completion", params, model, settings, prompt=body.prompt)


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    fleet = request.app.state.fleet
    view = await fleet.registry.resolve(body.model)
    envelope = completion_envelope(body, view.name, view.max_model_len, fleet.settings)
    return await serve_generation(request, fleet, envelope, CompletionFormatter(body, envelope))
