"""POST /v1/completions: OpenAI legacy completions, streaming and not, in vLLM's shapes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from gateway.api.openai.protocol import DEFAULT_MAX_TOKENS, CompletionRequest, cap_output, check_sampling
from gateway.fleet.registry import ModelView
from gateway.http.json_body import JSONRoute
from gateway.serve.formatter import Formatter, usage_body
from gateway.serve.generation import generation_route, new_envelope, output_ceiling, request_json
from gateway.settings import GatewaySettings
from shared.envelopes import GenerationChunk, RequestEnvelope

router = APIRouter(route_class=JSONRoute)


class CompletionFormatter(Formatter):
    endpoint = "completions"
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def _choice(self, index: int, chunk: GenerationChunk | None, finish: str | None) -> dict[str, Any]:
        return {"index": index, "text": chunk.text or "" if chunk is not None else "",
                "logprobs": chunk.logprobs if chunk is not None else None, "finish_reason": finish,
                "stop_reason": chunk.stop_reason if chunk is not None else None,
                "prompt_token_ids": chunk.prompt_token_ids if chunk is not None else None,
                "token_ids": chunk.token_ids if chunk is not None else None}

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        choices = [
            {"index": c.index, "text": c.text or "", "logprobs": c.logprobs, "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason, "token_ids": c.token_ids, "prompt_logprobs": c.prompt_logprobs,
             "prompt_token_ids": c.prompt_token_ids,
             "routed_experts": None}
            for c in terminal.candidates or ()
        ]
        return {"id": self.response_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "service_tier": None,
                "system_fingerprint": terminal.system_fingerprint, "usage": usage_body(terminal.usage, details=True),
                "kv_transfer_params": None, "ec_transfer_params": None, "metrics": None}


def completion_envelope(body: CompletionRequest, raw: dict[str, Any], model: str, max_model_len: int,
                        settings: GatewaySettings) -> RequestEnvelope:
    params = body.sampling_options(body.max_tokens, body.logprobs, echo=body.echo)
    check_sampling(params, max_model_len, beam_search=body.use_beam_search)
    if (capped := cap_output(params, output_ceiling(settings), "max_tokens", max_model_len,
                             given=raw.get("max_tokens") is not None, default=DEFAULT_MAX_TOKENS)) is not None:
        raw = {**raw, "max_tokens": capped}
    return new_envelope(raw, "completion", model, settings, body=body, params=params)


async def prepare(body: CompletionRequest, request: Request, view: ModelView,
                  settings: GatewaySettings) -> tuple[RequestEnvelope, CompletionFormatter]:
    envelope = completion_envelope(body, await request_json(request), view.name, view.max_model_len, settings)
    return envelope, CompletionFormatter(body, envelope)


create_completion = generation_route(router, "/v1/completions", CompletionRequest, prepare)
