"""POST /v1/chat/completions: OpenAI chat, streaming and not, in vLLM's response shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.fleet import GatewaySettings
from gateway.protocol import ChatCompletionRequest, check_sampling
from gateway.serving import Formatter, new_envelope, serve_generation
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, ToolCallDelta, Usage

router = APIRouter()


def usage_body(usage: Usage | None) -> dict[str, Any]:
    usage = usage or Usage()
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "completion_tokens": usage.completion_tokens,
    }
    if usage.reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": usage.reasoning_tokens}
    return body


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is not None or delta.name is not None:
        function = {"name": delta.name}
        if delta.arguments:
            function["arguments"] = delta.arguments
        return {"id": delta.id, "type": "function", "index": delta.index, "function": function}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


class ChatFormatter(Formatter):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, request: ChatCompletionRequest, envelope: RequestEnvelope):
        super().__init__(request, envelope)
        self._started = [False] * request.n
        self._finished = [False] * request.n
        self._tokens = [0] * request.n

    def _usage_so_far(self) -> dict[str, Any] | None:
        if not self.continuous_usage:
            return None
        return usage_body(Usage(self._prompt_tokens, sum(self._tokens)))

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        events = []
        if chunk.usage is not None:
            self._prompt_tokens = chunk.usage.prompt_tokens
        self._tokens[chunk.choice_index] += chunk.token_count
        if not chunk.done or chunk.text or chunk.reasoning or chunk.tool_calls or chunk.logprobs:
            events += self._role_events([chunk.choice_index])
            events.append(self._chunk([self._choice(chunk)], self._usage_so_far()))
        if chunk.done:
            events += self._role_events(range(self.n))  # choices that produced nothing at all
            events += self._final_events(chunk)
        return events

    def _role_events(self, indexes) -> list[dict[str, Any]]:
        events = []
        for i in indexes:
            if not self._started[i]:
                self._started[i] = True
                choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                events.append(self._chunk([choice], self._usage_so_far()))
        return events

    def _choice(self, chunk: GenerationChunk) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if chunk.reasoning:
            delta["reasoning"] = chunk.reasoning
        if chunk.text or not (chunk.reasoning or chunk.tool_calls):
            delta["content"] = chunk.text
        if chunk.tool_calls:
            delta["tool_calls"] = [_tool_call_delta(t) for t in chunk.tool_calls]
        logprobs = {"content": chunk.logprobs} if chunk.logprobs is not None else None
        finish = None
        if chunk.finish_reason and not chunk.done:
            finish = chunk.finish_reason
            self._finished[chunk.choice_index] = True
        return {"index": chunk.choice_index, "delta": delta, "logprobs": logprobs, "finish_reason": finish,
                **({"stop_reason": chunk.stop_reason} if finish else {})}

    def _final_events(self, terminal: GenerationChunk) -> list[dict[str, Any]]:
        events = []
        for i in range(self.n):
            if not self._finished[i]:
                self._finished[i] = True
                choice = {"index": i, "delta": {}, "logprobs": None,
                          "finish_reason": terminal.finish_reason or "stop", "stop_reason": terminal.stop_reason}
                events.append(self._chunk([choice], self._usage_so_far()))
        if self.include_usage:
            events.append(self._chunk([], usage_body(terminal.usage)))
        return events

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._candidate(c) for c in terminal.candidates or ()],
            "usage": usage_body(terminal.usage),
        }

    @staticmethod
    def _candidate(candidate: Candidate) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": candidate.text, "reasoning": candidate.reasoning}
        if candidate.tool_calls:
            message["tool_calls"] = [
                {"id": t.id, "type": "function", "function": {"name": t.name, "arguments": t.arguments}}
                for t in candidate.tool_calls
            ]
            message["content"] = candidate.text or None
        logprobs = {"content": candidate.logprobs} if candidate.logprobs is not None else None
        return {"index": candidate.index, "message": message, "logprobs": logprobs,
                "finish_reason": candidate.finish_reason, "stop_reason": candidate.stop_reason}


def chat_envelope(body: ChatCompletionRequest, model: str, max_model_len: int,
                  settings: GatewaySettings) -> RequestEnvelope:
    params = body.sampling_options(body.requested_max_tokens, body.logprobs_count, echo=False)
    check_sampling(params, max_model_len)
    return new_envelope(
        body, "chat", params, model, settings,
        messages=[m.model_dump(exclude_none=True) for m in body.messages],
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None,
        tool_choice=body.tool_choice, parallel_tool_calls=body.parallel_tool_calls,
        chat_template_kwargs=body.chat_template_kwargs,
    )


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    fleet = request.app.state.fleet
    view = await fleet.registry.resolve(body.model)
    envelope = chat_envelope(body, view.name, view.max_model_len, fleet.settings)
    return await serve_generation(request, fleet, envelope, ChatFormatter(body, envelope))
