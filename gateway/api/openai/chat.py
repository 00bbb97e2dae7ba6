"""POST /v1/chat/completions: OpenAI chat, streaming and not, in vLLM's response shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.api import sessions
from gateway.api.openai.protocol import ChatCompletionRequest, cap_output, check_sampling
from gateway.fleet.registry import ModelView
from gateway.http.json_body import JSONRoute
from gateway.serve.formatter import Formatter, usage_body
from gateway.serve.generation import generation_route, new_envelope, output_ceiling, request_json
from gateway.settings import GatewaySettings
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, ToolCallDelta
from shared.errors import FleetError

router = APIRouter(route_class=JSONRoute)


def _tool_call_delta(delta: ToolCallDelta) -> dict[str, Any]:
    if delta.id is not None or delta.name is not None:
        function = {"name": delta.name}
        if delta.arguments:
            function["arguments"] = delta.arguments
        return {"id": delta.id, "type": "function", "index": delta.index, "function": function}
    return {"index": delta.index, "function": {"arguments": delta.arguments}}


def _delta(chunk: GenerationChunk) -> dict[str, Any]:
    """A delta as vLLM writes it: only the keys that carry something (content null beside tool calls)."""
    delta: dict[str, Any] = {}
    if chunk.reasoning:
        delta["reasoning"] = chunk.reasoning
    if chunk.text is not None or chunk.tool_calls:
        delta["content"] = chunk.text
    if chunk.tool_calls:
        delta["tool_calls"] = [_tool_call_delta(t) for t in chunk.tool_calls]
    return delta


class ChatFormatter(Formatter):
    endpoint = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def __init__(self, request: ChatCompletionRequest, envelope: RequestEnvelope):
        super().__init__(request, envelope)
        self._started = [False] * request.n

    def _opening_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        # A role chunk opens each choice; at the end, also those of choices that produced nothing.
        # The choice's first delta brings the prompt's token ids, when the client asked for them.
        return self._role_events(range(self.n) if chunk.done else [chunk.choice_index], chunk.prompt_token_ids)

    def _role_events(self, indexes, prompt_token_ids: list[int] | None) -> list[dict[str, Any]]:
        events = []
        for i in indexes:
            if not self._started[i]:
                self._started[i] = True
                choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}
                event = self._chunk([choice], self._running_usage(i))
                event["prompt_token_ids"], event["prompt_text"] = prompt_token_ids, None
                events.append(event)
        return events

    def _choice(self, index: int, chunk: GenerationChunk | None, finish: str | None) -> dict[str, Any]:
        logprobs = chunk.logprobs if chunk is not None else None
        choice = {"index": index, "delta": _delta(chunk) if chunk is not None else {},
                  "logprobs": {"content": logprobs} if logprobs is not None else None, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = chunk.stop_reason if chunk is not None else None
        choice["token_ids"] = chunk.token_ids if chunk is not None else None
        return choice

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model,
            "choices": [self._candidate(c) for c in terminal.candidates or ()],
            "service_tier": None,
            "system_fingerprint": terminal.system_fingerprint,
            "usage": usage_body(terminal.usage, details=True),
            "prompt_logprobs": terminal.prompt_logprobs,
            "prompt_token_ids": terminal.prompt_token_ids,
            "prompt_text": None,
            "kv_transfer_params": None,
            "ec_transfer_params": None,
            "metrics": None,
        }

    @staticmethod
    def _candidate(candidate: Candidate) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": candidate.text, "refusal": None,
                                   "annotations": None, "audio": None, "function_call": None}
        if candidate.tool_calls:
            message["tool_calls"] = [{"id": t.id, "type": "function",
                                      "function": {"name": t.name, "arguments": t.arguments}}
                                     for t in candidate.tool_calls]
        message["reasoning"] = candidate.reasoning
        logprobs = {"content": candidate.logprobs} if candidate.logprobs is not None else None
        return {"index": candidate.index, "message": message, "logprobs": logprobs,
                "finish_reason": candidate.finish_reason, "stop_reason": candidate.stop_reason,
                "token_ids": candidate.token_ids, "routed_experts": None}


class SessionChatFormatter(ChatFormatter):
    """Chat's formatter for a turn of a session: it also keeps what choice 0 generated, streaming
    or whole, for the session to store (gateway/api/sessions.py)."""

    def __init__(self, request: ChatCompletionRequest, envelope: RequestEnvelope):
        super().__init__(request, envelope)
        self.turn = sessions.AssistantTurn()

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        self.turn.add(chunk)
        return super().stream_events(chunk)

    def error_events(self, error: FleetError) -> list[dict[str, Any]]:
        self.turn.fail()
        return super().error_events(error)

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        self.turn.take(terminal)
        return super().response(terminal)


def chat_envelope(body: ChatCompletionRequest, raw: dict[str, Any], model: str, max_model_len: int,
                  settings: GatewaySettings) -> RequestEnvelope:
    params = body.sampling_options(body.requested_max_tokens, body.logprobs_count, echo=False)
    field = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
    check_sampling(params, max_model_len, field, beam_search=body.use_beam_search)
    if (capped := cap_output(params, output_ceiling(settings), field, max_model_len,
                             given=body.requested_max_tokens is not None)) is not None:
        raw = {**raw, "max_tokens": capped}
    return new_envelope(raw, "chat", model, settings, body=body, params=params)


async def prepare(body: ChatCompletionRequest, request: Request, view: ModelView,
                  settings: GatewaySettings) -> tuple[RequestEnvelope, ChatFormatter]:
    envelope = chat_envelope(body, await request_json(request), view.name, view.max_model_len, settings)
    return envelope, (SessionChatFormatter if body.session_id else ChatFormatter)(body, envelope)


create_chat_completion = generation_route(router, "/v1/chat/completions", ChatCompletionRequest, prepare,
                                          serve=sessions.serve_chat)
