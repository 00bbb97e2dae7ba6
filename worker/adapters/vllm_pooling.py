"""`VLLMPoolingAdapter`: an encoder on vLLM's `AsyncLLM` run as a pooling model (`--runner pooling`).

The second kind of work beside `VLLMAdapter` (vllm.py), built the same way: the worker runs
`vllm serve`'s own pooling handlers in-process over its engine (`ServingEmbedding`,
`ServingScores`, `ServingClassification`, `ServingPooling`, and `ServingTokenization`), built
as vLLM's API server builds them for the model's tasks (`init_pooling_state`). The client's body
is validated by vLLM's request models, rendered, truncated, batched, pooled and post-processed
(normalisation, matryoshka dimensions, cosine scores, chunked long inputs) by vLLM's own code.

Only the last step differs: where vLLM's handler would build its JSON response, the worker takes
the handler's outputs (`_InContext`) and sends them as typed `Pooled` outputs, packed float32,
with the inputs' token count; the gateway writes the same JSON from them (gateway/api/pooling.py).
So vectors cross Redis as bytes, and the gateway can write them as base64 or float JSON without
a Python float per element.

The kinds a worker announces are what its model serves, as `vllm serve` registers routes for it:
embed for an embedding model; classify for a classifier; score and rerank for an embedding model
or a classifier with one label; pooling for every pooling model; tokenize and detokenize always.

Requests encoded together (`--encode-together`, off by default): many clients' small requests reach
a worker at once (it claims every waiting entry it has room for in one read), and vLLM's handler
costs about as much per request as per input. So the embed, classify and pooling requests that
reach `encode` in the same turn of the event loop, each a list of inputs with the same options
otherwise, go through one call of the handler (`_Merged`), and each request gets its own inputs'
outputs and prompt tokens back. If that call is refused (one request's input is bad), each request
is encoded alone, for its own answer. Each request of a call waits for the whole call, though:
measured here, that cost more inputs/s than the CPU it saves (docs/benchmarks.md, "Ninth pass").
Without it, the requests of one read still reach the engine in the same moment, and its steps
batch them; their renders still go to vLLM's renderer threads in one job (`_RenderTogether`).

Cancellation: the runner cancels the task awaiting `encode`; the handler's engine generators
are closed with it, which aborts their engine requests (`AsyncLLM.encode`). A request encoded with
others stops waiting; their call is cancelled when every one of them has.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

import numpy as np
import orjson
import pydantic
import torch
from vllm import AsyncEngineArgs
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.pooling.classify.protocol import ClassificationRequest
from vllm.entrypoints.pooling.classify.serving import ServingClassification
from vllm.entrypoints.pooling.embed.protocol import CohereEmbedRequest, EmbeddingRequest
from vllm.entrypoints.pooling.embed.serving import ServingEmbedding
from vllm.entrypoints.pooling.pooling.protocol import PoolingRequest
from vllm.entrypoints.pooling.pooling.serving import ServingPooling
from vllm.entrypoints.pooling.scoring.protocol import RerankRequest, ScoreRequest
from vllm.entrypoints.pooling.scoring.serving import ServingScores
from vllm.entrypoints.pooling.typing import EncodeCMPLRenderParams, PoolingServeContext
from vllm.entrypoints.pooling.utils import enable_scoring_api, get_pooling_usage
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
from vllm.exceptions import GenerationError, RetryableRequestError
from vllm.renderers.chat_utils import ChatTemplateConfig
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.tasks import POOLING_TASKS
from vllm.v1.engine.async_llm import AsyncLLM

from shared.envelopes import API_NAMES, GenerationChunk, Pooled, RequestEnvelope, Usage
from shared.errors import InvalidRequest
from worker import metrics
from worker.adapters.base import ENCODER_KINDS, TOKENIZER_KINDS, EncoderAdapter, TokenizerAdapter
from worker.adapters.vllm import AsyncLLMLifetime, _error_chunk, _refusal, answer_tokenizer

# vLLM's request model of each kind, as its routes validate the body.
_REQUESTS: dict[str, pydantic.TypeAdapter] = {
    "embed": pydantic.TypeAdapter(EmbeddingRequest), "score": pydantic.TypeAdapter(ScoreRequest),
    "rerank": pydantic.TypeAdapter(RerankRequest), "classify": pydantic.TypeAdapter(ClassificationRequest),
    "pooling": pydantic.TypeAdapter(PoolingRequest),
}
# Where a kind's body may be another API's (`RequestEnvelope.api`): an embed from Cohere's /v2/embed,
# which vLLM's embedding handler reads as Cohere's (its prompts, truncation and input types).
_OTHER_APIS: dict[tuple[str, str], pydantic.TypeAdapter] = {
    ("embed", "cohere"): pydantic.TypeAdapter(CohereEmbedRequest)}


# Body fields the engine's outputs do not depend on: how the gateway writes the vectors, the client's tag.
_NOT_ENCODED = frozenset({"encoding_format", "embed_dtype", "endianness", "user"})

# Kinds whose requests are encoded together (`_Merged`), and the body fields that may differ between them.
_MERGED_KINDS = ("embed", "classify", "pooling")
_PER_REQUEST = _NOT_ENCODED | {"input", "request_id"}

# A request of at most this many outputs is post-processed on the loop, not on vLLM's thread (`_InContext`).
_HERE_UP_TO_OUTPUTS = 16

# A plain embedding (`_PlainEmbedding`): its body's other fields are the model and one text, of at most this
# many characters (rendered on the loop).
_PLAIN_FIELDS = _NOT_ENCODED | {"model", "input"}
_PLAIN_TEXT_CHARS = 4096


def _merge_key(request: RequestEnvelope) -> tuple[str, bytes] | None:
    """What requests encoded together must share: their kind, their inputs' type (texts, or token
    ids) and every other field of their bodies; None for a request that is encoded alone."""
    body = request.body
    if request.kind not in _MERGED_KINDS or request.api or (prompts := _prompts(body.get("input"))) is None:
        return None
    try:
        options = orjson.dumps({name: value for name, value in body.items() if name not in _PER_REQUEST},
                               option=orjson.OPT_SORT_KEYS)
    except TypeError:
        return None
    return request.kind, prompts[0].encode() + b"\x00" + options


def _prompts(value: Any) -> tuple[str, list] | None:
    """A body's `input` as a list of prompts, as vLLM reads it (a string or a list of token ids is
    one prompt), with their type; None for anything else (left to vLLM's own refusal)."""
    if isinstance(value, str):
        return "text", [value]
    if isinstance(value, list) and value:
        if all(isinstance(item, str) for item in value):
            return "text", value
        if all(isinstance(item, int) and not isinstance(item, bool) for item in value):
            return "tokens", [value]
        if all(isinstance(item, list) and item and all(isinstance(t, int) and not isinstance(t, bool) for t in item)
               for item in value):
            return "tokens", value
    return None


class _Merged:
    """Requests of one kind and options, encoded by one call of vLLM's handler."""

    __slots__ = ("requests", "futures", "task", "waiting")

    def __init__(self) -> None:
        self.requests: list[RequestEnvelope] = []
        self.futures: list[asyncio.Future[GenerationChunk]] = []
        self.task: asyncio.Task | None = None
        self.waiting = 0  # requests still waiting for their answer


class _Part:
    """Some of a merged call's outputs, as the output functions read a handler's context."""

    __slots__ = ("final_res_batch",)

    def __init__(self, outputs: list) -> None:
        self.final_res_batch = outputs


class _RenderTogether:
    """An io processor's `render_async` that hands the prompts asked for in one loop turn to vLLM's
    renderer threads in one job per thread, where vLLM hands each prompt over alone.

    A handler renders each of its prompts on the renderer's executor (`--renderer-num-workers`
    threads, 1 by default), and asks for them all at once. One job per prompt costs a thread's wake
    and the GIL's hand-over per prompt. Here the prompts run in the order asked, each rendered by
    vLLM's own `render`, and each answer (or error) goes to its own future, as vLLM's would."""

    __slots__ = ("render", "executor", "threads", "waiting")

    def __init__(self, render: Callable[[Any], Any], executor: Executor, threads: int):
        self.render = render
        self.executor = executor
        self.threads = max(1, threads)
        self.waiting: list[tuple[Any, asyncio.Future]] = []

    def __call__(self, render_params: Any) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        if not self.waiting:
            loop.call_soon(self._submit, loop)
        future = loop.create_future()
        self.waiting.append((render_params, future))
        return future

    def _submit(self, loop: asyncio.AbstractEventLoop) -> None:
        waiting, self.waiting = self.waiting, []
        size = -(-len(waiting) // self.threads)
        for start in range(0, len(waiting), size):
            part = waiting[start:start + size]
            try:
                job = loop.run_in_executor(self.executor, self._render_all, [params for params, _ in part])
            except RuntimeError as exc:  # the executor has shut down: each prompt fails, as vLLM's would
                job = loop.create_future()
                job.set_exception(exc)
            job.add_done_callback(functools.partial(_answer_renders, part))

    def _render_all(self, batch: list[Any]) -> list[tuple[bool, Any]]:
        answers = []
        for render_params in batch:
            try:
                answers.append((True, self.render(render_params)))
            except Exception as exc:  # noqa: BLE001 - the prompt's own error, for its future
                answers.append((False, exc))
        return answers


def _answer_renders(waiting: list[tuple[Any, asyncio.Future]], job: asyncio.Future) -> None:
    """Each prompt's render, or its error, to its future (those still awaited)."""
    if job.cancelled():  # the executor shut down
        answers = [(False, None)] * len(waiting)
    elif job.exception() is not None:
        answers = [(False, job.exception())] * len(waiting)
    else:
        answers = job.result()
    for (_, future), (ok, value) in zip(waiting, answers, strict=True):
        if future.done():  # its handler stopped waiting
            continue
        if ok:
            future.set_result(value)
        elif value is None:
            future.cancel()
        else:
            future.set_exception(value)
            future.exception()  # retrieved: the handler's gather stops at its first error


class _InContext:
    """A vLLM pooling handler that ends with its outputs (the request's context) instead of its
    JSON response: everything before the response is vLLM's own. Its io processors render a
    request's prompts together (`_RenderTogether`).

    vLLM post-processes every request's outputs on its renderer's thread. For a request of a few
    outputs that is a thread's wake and the GIL's hand-over each way for next to no work (for an
    embedding, a check of Cohere's token bound); those are post-processed here, on the loop."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._postprocessing_on_thread = self._postprocessing_async
        self._postprocessing_async = self._postprocess

    async def _postprocess(self, io_processor: Any, ctx: PoolingServeContext) -> Any:
        if len(ctx.final_res_batch or ()) <= _HERE_UP_TO_OUTPUTS:
            return self._postprocessing(io_processor, ctx)
        return await self._postprocessing_on_thread(io_processor, ctx)

    def get_io_processor(self, request: Any) -> Any:
        io_processor = super().get_io_processor(request)
        if not isinstance(io_processor.render_async, _RenderTogether):
            io_processor.render_async = _RenderTogether(io_processor.render, io_processor._executor,
                                                        self.model_config.renderer_num_workers)
        return io_processor

    def _build_response(self, ctx: PoolingServeContext) -> PoolingServeContext:
        return ctx


class _Embedding(_InContext, ServingEmbedding):
    pass


class _PlainEmbedding:
    """vLLM's embedding handler's own steps for the commonest request: one text, no options.

    For one input the handler costs about as much of the worker's CPU as the engine's client does:
    it validates the body with vLLM's request model, builds its context, renders on its renderer's
    thread and reads its engine's outputs through a merging iterator (docs/benchmarks.md,
    "Fourteenth pass"). For a body of one text and no options, every step's outcome but the text's
    is fixed: the tokenizer's and the pooling parameters are the handler's own, built once from a
    body of vLLM's request model. The text is rendered by the handler's io processor (vLLM's
    renderer), encoded by the engine under the handler's request id and counted by vLLM's usage.
    Its errors are the handler's (an input past the context is refused by the same render) and are
    answered alike."""

    __slots__ = ("handler", "tok_params", "params")

    def __init__(self, handler: _Embedding, served_model_name: str):
        template = _REQUESTS["embed"].validate_python({"model": served_model_name, "input": "-"})
        self.handler = handler
        self.tok_params = template.build_tok_params(handler.model_config)
        # The engine's input processor clones its request's params: one verified set serves every request.
        self.params = handler.io_processor.create_pooling_params(template)
        self.params.verify(handler.model_config)

    @staticmethod
    def text(request: RequestEnvelope) -> str | None:
        """The one text of a plain embedding's body; None for any other request."""
        body = request.body
        if request.kind != "embed" or request.api or not body.keys() <= _PLAIN_FIELDS:
            return None
        text = body.get("input")
        if isinstance(text, list) and len(text) == 1:
            text = text[0]
        return text if isinstance(text, str) and 0 < len(text) <= _PLAIN_TEXT_CHARS else None

    async def __call__(self, request_id: str, text: str) -> tuple[list[Pooled], int]:
        handler = self.handler
        engine_input = handler.io_processor.render(EncodeCMPLRenderParams(
            prompts=parse_model_prompt(handler.model_config, text), tok_params=self.tok_params, prompt_extras={},
            skip_mm_cache=False, params=self.params, lora_requests=None, priorities=0))
        output = None
        outputs = handler.engine_client.encode(request_id=f"{handler.request_id_prefix}-{request_id}-0",
                                               prompt=engine_input["prompts"], pooling_params=self.params)
        async with contextlib.aclosing(outputs):
            async for output in outputs:
                pass
        if output is None:
            raise ValueError("Failed to generate results for all prompts")
        if output.error is not None:  # as the handler reads an engine's error
            raise (RetryableRequestError if output.error.retryable else GenerationError)(output.error.message)
        return [_pooled(output.outputs.data)], get_pooling_usage([output]).prompt_tokens


class _Scores(_InContext, ServingScores):
    pass


class _Classification(_InContext, ServingClassification):
    pass


class _Pooling(_InContext, ServingPooling):
    pass


class VLLMPoolingAdapter(AsyncLLMLifetime, EncoderAdapter, TokenizerAdapter):
    """A pooling model with its tokenizer: the encoder kinds it serves, tokenize, detokenize."""

    engine_name = "vllm"
    kinds = (*ENCODER_KINDS, *TOKENIZER_KINDS)  # until `start` knows the model's

    def __init__(self, engine_args: AsyncEngineArgs, served_model_name: str | None = None, *,
                 chat_template: str | None = None, encode_together: bool = False):
        super().__init__(served_model_name or engine_args.model, engine_args.max_model_len or 0)
        self.engine_args = engine_args
        self.chat_template = chat_template
        self.encode_together = encode_together
        self.engine: AsyncLLM | None = None
        self._handlers: dict[str, Any] = {}
        self._outputs: dict[str, Callable[[PoolingServeContext], tuple[list[Pooled], int]]] = {}
        self._gathering: dict[tuple[str, bytes], _Merged] = {}  # requests to encode together, this loop turn
        self._plain: _PlainEmbedding | None = None

    async def start(self) -> None:
        """Build the engine, then `vllm serve`'s pooling handlers over it (as `init_pooling_state` does)."""
        self.engine = engine = self._build_engine(self.engine_args)
        config = engine.model_config
        self.max_model_len = config.max_model_len
        tasks = await engine.get_supported_tasks()
        models = OpenAIServingModels(engine, [BaseModelPath(self.served_model_name, self.engine_args.model)])
        template = ChatTemplateConfig(chat_template=self.chat_template)
        options = {"request_logger": None, "chat_template_config": template}
        task = config.get_pooling_task(tasks)
        if task == "embed":
            embedding = _Embedding(engine, models, **options)
            self._serve("embed", embedding, _vectors)
            if not embedding.io_processor.enable_chunked_processing:  # a long input is split, by the handler
                self._plain = _PlainEmbedding(embedding, self.served_model_name)
        if task == "classify":
            labels = getattr(config.hf_config, "id2label", {}) or {}
            self._serve("classify", _Classification(engine, models, **options), lambda ctx: _classes(ctx, labels))
        if enable_scoring_api(tasks, config):
            scores = _Scores(engine, models, supported_tasks=tasks, **options)
            self._serve("score", scores, lambda ctx: _scores(ctx, scores))
            self._serve("rerank", scores, lambda ctx: _scores(ctx, scores))
        if any(t in POOLING_TASKS for t in tasks):
            self._serve("pooling", _Pooling(engine, models, supported_tasks=tasks, **options), _vectors)
        self.kinds = (*(kind for kind in ENCODER_KINDS if kind in self._handlers), *TOKENIZER_KINDS)
        renderer = OnlineRenderer(config, engine.renderer, request_logger=None, chat_template=self.chat_template,
                                  chat_template_content_format="auto")
        self.tokenization = ServingTokenization(models, renderer, request_logger=None,
                                                chat_template=self.chat_template, chat_template_content_format="auto")

    def _serve(self, kind: str, handler, outputs: Callable[[PoolingServeContext], tuple[list[Pooled], int]]) -> None:
        self._handlers[kind] = handler
        self._outputs[kind] = outputs

    async def encode(self, request: RequestEnvelope) -> GenerationChunk:
        """`vllm serve`'s handler of the request's kind, its outputs packed for the wire; with
        `encode_together`, with the requests of the same kind and options that came in the same
        loop turn, where it can be."""
        if request.kind not in self._handlers:  # a kind `--kinds` named that this model cannot serve
            return GenerationChunk(done=True, finish_reason="error", error=InvalidRequest(
                f"The model does not support the {API_NAMES[request.kind]} API.").to_info())
        key = _merge_key(request) if self.encode_together else None
        if key is None:
            return await self._encode(request)
        merged = self._gathering.get(key)
        if merged is None:  # the requests claimed with this one come to `encode` in this loop turn
            merged = self._gathering[key] = _Merged()
            asyncio.get_running_loop().call_soon(self._start_merged, key)
        answer = asyncio.get_running_loop().create_future()
        merged.requests.append(request)
        merged.futures.append(answer)
        merged.waiting += 1
        try:
            return await asyncio.shield(answer)
        except asyncio.CancelledError:
            merged.waiting -= 1
            if not merged.waiting and merged.task is not None:  # nobody waits for the call: stop it
                merged.task.cancel()
            raise

    def _start_merged(self, key: tuple[str, bytes]) -> None:
        merged = self._gathering.pop(key)
        if not merged.waiting:  # all cancelled before their call began
            return
        merged.task = asyncio.get_running_loop().create_task(self._encode_merged(merged))

    async def _encode_merged(self, merged: _Merged) -> None:
        """Encode the requests in one call of vLLM's handler and give each its answer; each alone
        if there is only one, or the call is refused."""
        try:
            if len(merged.requests) == 1:
                answers = [await self._encode(merged.requests[0])]
            else:
                answers = await self._encode_together(merged.requests)
            if answers is None:
                answers = await asyncio.gather(*(self._encode(request) for request in merged.requests),
                                               return_exceptions=True)
        except asyncio.CancelledError:  # nobody waits for them any more
            for future in merged.futures:
                future.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - each request's runner fails it, as if it had run alone
            answers = [exc] * len(merged.requests)
        for future, answer in zip(merged.futures, answers, strict=True):
            if isinstance(answer, BaseException):
                future.set_exception(answer)
                future.exception()  # retrieved here: its request may have stopped waiting for it
            else:
                future.set_result(answer)

    async def _encode_together(self, requests: list[RequestEnvelope]) -> list[GenerationChunk] | None:
        """One call of the handler for every request's inputs; each request's outputs and prompt
        tokens, in order; None if the handler refuses the whole (a bad input: each alone then)."""
        first = requests[0]
        counts, prompts = [], []
        for request in requests:
            _kind, inputs = _prompts(request.body["input"])
            counts.append(len(inputs))
            prompts.extend(inputs)
        body = {**first.body, "input": prompts, "request_id": f"{first.request_id}+{len(requests) - 1}"}
        try:
            ctx = await self._handlers[first.kind](_REQUESTS[first.kind].validate_python(body))
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - each request alone gets its own answer or refusal
            return None
        if isinstance(ctx, ErrorResponse) or len(ctx.final_res_batch) != len(prompts):
            return None
        metrics.ENCODE_CALL_REQUESTS.labels(self.served_model_name, first.kind).observe(len(requests))
        answers, at = [], 0
        for count in counts:
            answers.append(_encoded(*self._outputs[first.kind](_Part(ctx.final_res_batch[at:at + count]))))
            at += count
        return answers

    async def _encode(self, request: RequestEnvelope) -> GenerationChunk:
        """`vllm serve`'s handler of the request's kind on this request alone (its own steps for a
        plain embedding, `_PlainEmbedding`, whose errors are the handler's own and answered alike)."""
        metrics.ENCODE_CALL_REQUESTS.labels(self.served_model_name, request.kind).observe(1)
        try:
            if self._plain is not None and (text := self._plain.text(request)) is not None:
                return _encoded(*await self._plain(request.request_id, text))
            model = _OTHER_APIS[request.kind, request.api] if request.api else _REQUESTS[request.kind]
            body = model.validate_python({**request.body, "request_id": request.request_id})
            ctx = await self._handlers[request.kind](body)
        except Exception as exc:  # noqa: BLE001 - `_refusal` answers what vLLM's server answers, re-raises the rest
            return _refusal(exc)
        if isinstance(ctx, ErrorResponse):
            return _error_chunk(ctx)
        return _encoded(*self._outputs[request.kind](ctx))

    async def tokenize(self, request: RequestEnvelope) -> GenerationChunk:
        """`vllm serve`'s /tokenize or /detokenize, on this engine's tokenizer."""
        return await answer_tokenizer(self.tokenization, request)


def _encoded(pooled: list[Pooled], prompt_tokens: int) -> GenerationChunk:
    """An encoding's answer: its outputs and its inputs' tokens."""
    return GenerationChunk(done=True, finish_reason="stop", pooled=pooled, usage=Usage(prompt_tokens=prompt_tokens))


def _pooled(tensor: torch.Tensor, label: str | None = None) -> Pooled:
    """A tensor as the wire carries it: float32, little-endian (exact for float32, float16 and bfloat16)."""
    values = tensor.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy()
    return Pooled(data=values.astype("<f4", copy=False).tobytes(), shape=list(values.shape), label=label)


def _vectors(ctx: PoolingServeContext) -> tuple[list[Pooled], int]:
    """Embeddings or pooled data, one per input, with their prompt tokens (vLLM's usage)."""
    return ([_pooled(output.outputs.data) for output in ctx.final_res_batch],
            get_pooling_usage(ctx.final_res_batch).prompt_tokens)


def _classes(ctx: PoolingServeContext, labels: dict[int, str]) -> tuple[list[Pooled], int]:
    """Class probabilities, with the label of the most probable class, as ServingClassification reads them."""
    pooled = []
    for output in ctx.final_res_batch:
        probs = output.outputs.data
        pooled.append(_pooled(probs, labels.get(int(np.argmax(probs.tolist())))))
    return pooled, sum(len(output.prompt_token_ids) for output in ctx.final_res_batch)


def _scores(ctx: PoolingServeContext, handler: ServingScores) -> tuple[list[Pooled], int]:
    """A score per pair; the prompt tokens of every input the engine read, as ServingScores counts them."""
    tokens = sum(handler._extract_prompt_len(engine_input["prompts"]) for engine_input in ctx.engine_inputs)
    return [_pooled(output.outputs.data.reshape(1)) for output in ctx.final_res_batch], tokens
