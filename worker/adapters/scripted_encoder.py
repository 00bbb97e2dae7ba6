"""A model-free encoder: deterministic vectors from the input's words, for tests and benchmarks.

The encoder beside `ScriptedAdapter` (scripted.py), as a pooling model is beside a generation
model. A token is a word of the text (or a token id, of a token-id input); an input's vector is
the normalised sum of its words' vectors, each a fixed pseudo-random vector drawn from the
word's digest, so the same text always pools to the same vector and texts sharing words are
close. What it answers follows `vllm serve` on an embedding model (`convert` "embed": embed,
score, rerank, pooling; score is the cosine similarity of the two vectors) or on a classifier
(`convert` "classify": classify, pooling; two classes, LABEL_0 and LABEL_1): the same pairing of
score inputs, the same refusals with vLLM's words (an input longer than the context,
`truncate_prompt_tokens` past it, `dimensions` a model cannot give).

`seconds_per_input` gives each input a fixed cost, paid one request at a time (an engine's
compute is shared by its requests), so a worker encodes at most 1 / seconds_per_input inputs a
second whatever its concurrency: benchmarks of spreading one large request over workers measure
the fleet, not this machine's cores.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from typing import Any

import numpy as np

from shared.envelopes import GenerationChunk, Pooled, RequestEnvelope, Usage
from shared.errors import InvalidRequest
from worker import metrics
from worker.adapters.base import EncoderAdapter
from worker.adapters.scripted import message_text

DIMENSIONS = 64
CONVERTS = {"embed": ("embed", "score", "rerank", "pooling"), "classify": ("classify", "pooling")}
LABELS = ("LABEL_0", "LABEL_1")


def words_of(value: Any) -> list[str]:
    """An input's tokens: the words of a text (of each message's text, for a conversation), or token ids."""
    if isinstance(value, str):
        return value.split()
    if isinstance(value, list) and value and isinstance(value[0], dict):  # chat messages
        return [word for message in value for word in message_text(message).split()]
    if isinstance(value, dict):  # a multimodal score input: its text parts, as a message's
        return message_text(value).split()
    return [str(token) for token in value or ()]


def inputs_of(body: dict[str, Any]) -> list[Any]:
    """The inputs of an embed, classify or pooling body, one per output (vLLM's reading: a string
    or a list of token ids is one input; a list of strings or of token id lists, one each)."""
    if body.get("messages") is not None:
        return [body["messages"]]
    value = body.get("input")
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return value
    return [value]


def _cohere_as_vllm_reads_it(body: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """A /v2/embed body as the embed body vLLM makes of it for a text model without task
    instructions: its texts (or the text of its inputs), truncated per `truncate` and `max_tokens`,
    at `output_dimension`; and with `truncate` NONE, the tokens an input may hold at most (None:
    no bound but the context). An `input_type` or an image is refused in vLLM's words."""
    if body.get("input_type") is not None:
        raise InvalidRequest(f"Unsupported input_type {body['input_type']!r}. This model does not define any "
                             "input_type task instructions.")
    parts = [part for item in body.get("inputs") or () for part in item.get("content") or ()]
    if body.get("images") is not None or any(part.get("type") == "image_url" for part in parts):
        raise InvalidRequest("This model does not support image inputs.")
    texts = body.get("texts")
    if texts is None:
        texts = [" ".join(part.get("text") or "" for part in item.get("content") or ()) for item in body["inputs"]]
    vllm_body: dict[str, Any] = {"input": texts, "dimensions": body.get("output_dimension")}
    most, truncate = body.get("max_tokens"), body.get("truncate", "END")
    if truncate == "NONE":
        return vllm_body, most
    vllm_body["truncate_prompt_tokens"] = most if most is not None else -1
    vllm_body["truncation_side"] = "left" if truncate == "START" else None
    return vllm_body, None


def score_sides(body: dict[str, Any], kind: str) -> tuple[list[Any], list[Any]]:
    """The two sides of a score or rerank body, each a list, checked as vLLM pairs them."""
    if kind == "rerank":
        first, second = body.get("query"), body.get("documents")
    else:
        pair = next(p for p in (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"),
                                ("text_1", "text_2")) if p[0] in body and p[1] in body)
        first, second = body[pair[0]], body[pair[1]]
    first = first if isinstance(first, list) else [first]
    second = second if isinstance(second, list) else [second]
    if len(first) > 1 and len(first) != len(second):
        raise InvalidRequest("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise InvalidRequest("At least one text element must be given")
    if not second:
        raise InvalidRequest("At least one text_pair element must be given")
    return first, second


class ScriptedEncoder(EncoderAdapter):
    """Embeddings, scores, rankings, classes and pooled vectors, without a model."""

    engine_name = "scripted"

    def __init__(self, served_model_name: str, max_model_len: int = 4096, convert: str = "embed",
                 seconds_per_input: float = 0.0, dimensions: int = DIMENSIONS, loop_stall: float = 0.0):
        super().__init__(served_model_name, max_model_len)
        self.kinds = CONVERTS["classify" if convert == "classify" else "embed"]
        self.seconds_per_input = seconds_per_input
        self.loop_stall = loop_stall  # seconds each encoding blocks the loop as it begins (a long render)
        self.dimensions = dimensions
        self._engine = asyncio.Lock()  # the compute its requests share

    async def encode(self, request: RequestEnvelope) -> GenerationChunk:
        if self.loop_stall:
            time.sleep(self.loop_stall)  # blocking on purpose: nothing else on the loop runs meanwhile
        metrics.ENCODE_CALL_REQUESTS.labels(self.served_model_name, request.kind).observe(1)  # each alone
        body, untruncated_max = _cohere_as_vllm_reads_it(request.body) if request.api == "cohere" \
            else (request.body, None)
        if request.kind in ("score", "rerank"):
            first, second = score_sides(body, request.kind)
            texts = [self._tokens(words_of(item), body) for item in first + second]
            vectors = [self._vector(tokens) for tokens in texts]
            queries, documents = vectors[:len(first)], vectors[len(first):]
            pairs = [(queries[0] if len(queries) == 1 else queries[i], document)
                     for i, document in enumerate(documents)]
            pooled = [_pooled(np.array([float(np.dot(q, d))], dtype=np.float32)) for q, d in pairs]
        else:
            texts = [self._tokens(words_of(item), body) for item in inputs_of(body)]
            if untruncated_max is not None:
                for tokens in texts:
                    if len(tokens) > untruncated_max:
                        raise InvalidRequest(f"Input of {len(tokens)} tokens exceeds max_tokens={untruncated_max} with "
                                             "truncate=NONE. Set truncate to END or START to allow truncation.")
            vectors = [self._vector(tokens) for tokens in texts]
            if request.kind == "classify" or (request.kind == "pooling" and "classify" in self.kinds):
                pooled = [_classes(vector) for vector in vectors]
            else:
                size = self._dimensions(body, request.kind)
                pooled = [_pooled(_normalised(vector[:size])) for vector in vectors]
        await self._pay(len(texts))
        return GenerationChunk(done=True, finish_reason="stop", pooled=pooled,
                               usage=Usage(prompt_tokens=sum(len(tokens) for tokens in texts)))

    def _tokens(self, tokens: list[str], body: dict[str, Any]) -> list[str]:
        """The input's tokens, truncated as asked, or a refusal of one empty or too long (vLLM's words)."""
        if not tokens:
            raise InvalidRequest("The decoder prompt cannot be empty")
        limit = body.get("truncate_prompt_tokens")
        if limit is not None:
            limit = int(limit)  # the body as sent: 5.0 is the 5 the gateway validated
            if limit > self.max_model_len:
                raise InvalidRequest("truncate_prompt_tokens value is greater than max_model_len. Please request a "
                                     "smaller truncation size.")
            limit = self.max_model_len if limit == -1 else limit
            tokens = tokens[-limit:] if body.get("truncation_side") == "left" else tokens[:limit]
        if len(tokens) > self.max_model_len:
            raise InvalidRequest(f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                                 f"prompt contains {len(tokens)} input tokens, which exceeds this limit even without "
                                 "any output tokens. Please reduce the length of the input prompt.",
                                 param="input_tokens")
        return tokens

    def _dimensions(self, body: dict[str, Any], kind: str) -> int:
        """The size of the vectors asked for: a prefix of the model's, renormalised (matryoshka)."""
        size = body.get("dimensions")
        if size is None:
            return self.dimensions
        size = int(size)
        if kind == "pooling":
            raise InvalidRequest("dimensions is currently not supported", param="dimensions")
        if not 1 <= size <= self.dimensions:
            raise InvalidRequest(f"Dimensions must be between 1 and {self.dimensions}.", param="dimensions")
        return size

    def _vector(self, tokens: list[str]) -> np.ndarray:
        total = np.zeros(self.dimensions, dtype=np.float32)
        for token in tokens:
            total += _token_vector(token, self.dimensions)
        return _normalised(total)

    async def _pay(self, inputs: int) -> None:
        """The inputs' fixed cost, one request at a time; otherwise a turn of the loop."""
        if self.seconds_per_input <= 0:
            await asyncio.sleep(0)
            return
        async with self._engine:
            await asyncio.sleep(self.seconds_per_input * inputs)


@functools.lru_cache(maxsize=65536)
def _token_vector(token: str, dimensions: int) -> np.ndarray:
    """A token's fixed pseudo-random vector, drawn from its digest (kept: drawing costs more than adding)."""
    seed = int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal(dimensions, dtype=np.float32)


def _normalised(vector: np.ndarray) -> np.ndarray:
    norm = float(np.linalg.norm(vector))
    return vector / norm if norm > 0 else vector


def _pooled(values: np.ndarray) -> Pooled:
    return Pooled(data=values.astype("<f4").tobytes(), shape=list(values.shape))


def _classes(vector: np.ndarray) -> Pooled:
    logits = np.array([vector[0], -vector[0]], dtype=np.float32) * 4
    probs = np.exp(logits - logits.max())
    probs = (probs / probs.sum()).astype(np.float32)
    pooled = _pooled(probs)
    pooled.label = LABELS[int(np.argmax(probs))]
    return pooled
