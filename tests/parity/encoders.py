"""`vllm serve --runner pooling` beside llmfleet's vLLM encoder worker, on the tiny model, and the cases sent to both.

Both run the tiny model as a pooling model with the same options (the parity battery's engine
options): as an embedding model (`--convert embed`: embeddings, score, rerank, pooling and
tokenize) and as a classifier (`--convert classify`: classify, pooling and tokenize), compared
answer by answer; every bad input must get the same status. `differences` reads two answers as
equal when their vectors and scores are within 1e-5 (base64 vectors decoded first), their ranks,
indexes, usage and every other value are the same; the ids and `created` differ.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import numpy as np

from tests.parity.battery import MAX_MODEL_LEN
from tests.parity.harness import ENGINE_ENV, ENGINE_OPTIONS, ENGINE_START_S, _start_vllm_serve
from tests.procs import (
    Proc,
    start_gateway,
    start_worker,
    stop_all,
    wait_registered,
    wait_until_answers,
    wait_until_served,
)

MODEL = "tiny-embed"
OPTIONS = ["--runner", "pooling", "--convert", "embed"]
CLASSIFIER = "tiny-classify"
CLASSIFIER_OPTIONS = ["--runner", "pooling", "--convert", "classify"]
TOLERANCE = 1e-5
TOO_LONG = "word " * (MAX_MODEL_LEN + 200)


class EncoderPair:
    """The encoder worker (behind a gateway of its own) and `vllm serve`, started side by side;
    `urls()` once both serve."""

    def __init__(self, redis_url: str, model_dir: str, model: str = MODEL, options: list[str] = OPTIONS,
                 worker_options: tuple[str, ...] = ()):
        self.redis_url, self.model = redis_url, model
        self.worker = start_worker(redis_url, model_dir, *ENGINE_OPTIONS, *options, *worker_options, engine="vllm",
                                   served_name=model, env=ENGINE_ENV, wait=False)
        self.serve = _start_vllm_serve(model_dir, model, options)
        self.gateway: Proc | None = None

    def urls(self) -> tuple[str, str]:
        """(vllm serve's, the gateway's) base URLs, once both serve the model."""
        if self.gateway is None:
            self.gateway = start_gateway(self.redis_url)
            wait_registered(self.worker, ENGINE_START_S)
            wait_until_served(self.gateway, self.model, timeout=60)
        wait_until_answers(self.serve, "/health", ENGINE_START_S)
        return self.serve.url, self.gateway.url

    def stop(self) -> None:
        gateways = [self.gateway] if self.gateway is not None else []
        *_, worker = stop_all([*gateways, self.serve, self.worker], timeout=60)
        assert worker == 0, self.worker.log()[-3000:]


@dataclass(frozen=True)
class Case:
    name: str
    path: str
    body: dict[str, Any]


def cases() -> list[Case]:
    texts = ["The sea is calm tonight.", "A tide of words", "hello"]
    query, documents = "calm sea", ["The sea is calm tonight.", "Mountains and rivers", "a calm sea at night", "x"]
    valid = [
        Case("embed one string", "/v1/embeddings", {"input": texts[0]}),
        Case("embed strings", "/v1/embeddings", {"input": texts}),
        Case("embed token ids", "/v1/embeddings", {"input": [11, 42, 300, 7]}),
        Case("embed token id lists", "/v1/embeddings", {"input": [[11, 42], [300, 7, 8, 9]]}),
        Case("embed base64", "/v1/embeddings", {"input": texts, "encoding_format": "base64"}),
        Case("embed float explicit, user", "/v1/embeddings", {"input": texts[1], "encoding_format": "float",
                                                              "user": "someone"}),
        Case("embed truncated", "/v1/embeddings", {"input": TOO_LONG, "truncate_prompt_tokens": 5}),
        Case("embed truncated to the context", "/v1/embeddings", {"input": TOO_LONG, "truncate_prompt_tokens": -1}),
        Case("embed a conversation", "/v1/embeddings", {"messages": [{"role": "user", "content": texts[0]}]}),
        Case("embed float16 base64", "/v1/embeddings", {"input": texts[2], "encoding_format": "base64",
                                                        "embed_dtype": "float16"}),
        Case("score 1:1", "/score", {"text_1": query, "text_2": documents[0]}),
        Case("score 1:N", "/score", {"text_1": query, "text_2": documents}),
        Case("score N:N", "/v1/score", {"text_1": documents[:2], "text_2": documents[2:]}),
        Case("score queries/documents", "/score", {"queries": query, "documents": documents}),
        Case("rerank top_n", "/rerank", {"query": query, "documents": documents, "top_n": 2}),
        Case("rerank v1", "/v1/rerank", {"query": query, "documents": documents}),
        Case("rerank v2", "/v2/rerank", {"query": query, "documents": documents, "top_n": 10}),
        Case("pooling", "/pooling", {"input": texts}),
        Case("pooling base64", "/pooling", {"input": texts[0], "encoding_format": "base64"}),
        Case("tokenize", "/tokenize", {"prompt": texts[0]}),
        Case("cohere embed texts", "/v2/embed", {"texts": texts}),
        Case("cohere embed every type", "/v2/embed", {"texts": texts, "embedding_types": ["float", "binary", "ubinary",
                                                                                          "base64"]}),
        Case("cohere embed truncated at the start", "/v2/embed", {"texts": [TOO_LONG], "truncate": "START",
                                                                  "max_tokens": 5}),
        Case("cohere embed truncated to the context", "/v2/embed", {"texts": [TOO_LONG]}),
        Case("cohere embed inputs", "/v2/embed", {"inputs": [{"content": [{"type": "text", "text": texts[0]}]}]}),
        Case("invocations embed", "/invocations", {"input": texts}),
        Case("invocations embed a conversation", "/invocations", {"messages": [{"role": "user", "content": texts[0]}]}),
        Case("invocations rerank", "/invocations", {"query": query, "documents": documents}),
        Case("invocations score", "/invocations", {"text_1": query, "text_2": documents}),
    ]
    invalid = [
        Case("embed nothing", "/v1/embeddings", {"input": []}),
        Case("embed too long", "/v1/embeddings", {"input": TOO_LONG}),
        # Past the context in fewer characters than a worker renders on its loop (a token a character).
        Case("embed too long, a short text", "/v1/embeddings", {"input": "!" * (MAX_MODEL_LEN + 50)}),
        Case("embed a number", "/v1/embeddings", {"input": 42}),
        Case("embed mixed types", "/v1/embeddings", {"input": ["a", 1]}),
        Case("embed no input", "/v1/embeddings", {}),
        Case("embed an empty string", "/v1/embeddings", {"input": ""}),
        Case("embed empty strings", "/v1/embeddings", {"input": ["", "a"]}),
        Case("embed an empty conversation", "/v1/embeddings", {"messages": []}),
        Case("embed a negative token id", "/v1/embeddings", {"input": [-1, 5]}),
        Case("embed an empty token id list", "/v1/embeddings", {"input": [[], [5]]}),
        Case("score an empty text", "/score", {"text_1": "", "text_2": "a"}),
        Case("embed token id out of vocabulary", "/v1/embeddings", {"input": [5, 10_000_000]}),
        Case("embed dimensions", "/v1/embeddings", {"input": "a", "dimensions": 8}),
        Case("embed truncation past the context", "/v1/embeddings",
             {"input": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}),
        Case("embed encoding_format unknown", "/v1/embeddings", {"input": "a", "encoding_format": "hex"}),
        Case("score unpaired", "/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}),
        Case("score one side", "/score", {"text_1": "a"}),
        Case("rerank no documents", "/rerank", {"query": "a", "documents": []}),
        Case("rerank no query", "/rerank", {"documents": ["a"]}),
        Case("rerank negative top_n", "/rerank", {"query": "a", "documents": ["a"], "top_n": -1}),
        Case("pooling dimensions", "/pooling", {"input": "a", "dimensions": 8}),
        Case("cohere embed nothing", "/v2/embed", {}),
        Case("cohere embed texts and images", "/v2/embed", {"texts": ["a"], "images": ["data:image/png;base64,AA=="]}),
        Case("cohere embed input_type", "/v2/embed", {"texts": ["a"], "input_type": "search_query"}),
        Case("cohere embed untruncated past max_tokens", "/v2/embed", {"texts": ["a b c d"], "truncate": "NONE",
                                                                       "max_tokens": 2}),
        Case("cohere embed output_dimension", "/v2/embed", {"texts": ["a"], "output_dimension": 8}),
        Case("cohere embed an unknown type", "/v2/embed", {"texts": ["a"], "embedding_types": ["int8"]}),
        Case("invocations a completion body", "/invocations", {"prompt": "a"}),
    ]
    return [Case(c.name, c.path, {"model": MODEL, **c.body}) for c in valid + invalid]


def classifier_cases() -> list[Case]:
    """The classifier's cases: its endpoints' answers, and the same status for each bad input."""
    texts = ["The sea is calm tonight.", "A tide of words", "hello"]
    valid = [
        Case("classify one string", "/classify", {"input": texts[0]}),
        Case("classify strings", "/classify", {"input": texts}),
        Case("classify token ids", "/classify", {"input": [11, 42, 300, 7]}),
        Case("classify token id lists", "/classify", {"input": [[11, 42], [300, 7, 8, 9]]}),
        Case("classify truncated", "/classify", {"input": TOO_LONG, "truncate_prompt_tokens": 5}),
        Case("classify without activation", "/classify", {"input": texts, "use_activation": False}),
        Case("classify a conversation", "/classify", {"messages": [{"role": "user", "content": texts[0]}]}),
        Case("classify pooling", "/pooling", {"input": texts}),
        Case("classify pooling base64", "/pooling", {"input": texts[1], "encoding_format": "base64"}),
        Case("classify tokenize", "/tokenize", {"prompt": texts[0]}),
        Case("classify invocations", "/invocations", {"input": texts}),
    ]
    invalid = [
        Case("classify nothing", "/classify", {"input": []}),
        Case("classify no input", "/classify", {}),
        Case("classify too long", "/classify", {"input": TOO_LONG}),
        Case("classify an empty string", "/classify", {"input": ""}),
        Case("classify a number", "/classify", {"input": 42}),
        Case("classify token id out of vocabulary", "/classify", {"input": [5, 10_000_000]}),
        Case("classify an empty conversation", "/classify", {"messages": []}),
        Case("classify truncation past the context", "/classify",
             {"input": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}),
    ]
    return [Case(c.name, c.path, {"model": CLASSIFIER, **c.body}) for c in valid + invalid]


def differences(expected: Any, actual: Any, where: str = "$", dtype: str = "<f4") -> list[str]:
    """What differs between vllm serve's answer and llmfleet's, beyond ids, times and float noise
    (`dtype`: what a base64 vector holds)."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        if set(expected) != set(actual):
            return [f"{where}: keys {sorted(expected)} != {sorted(actual)}"]
        return [d for key in expected if key not in ("id", "created")
                for d in differences(expected[key], actual[key], f"{where}.{key}", dtype)]
    if isinstance(expected, list) and isinstance(actual, list):
        if len(expected) != len(actual):
            return [f"{where}: {len(expected)} items != {len(actual)}"]
        return [d for i, (e, a) in enumerate(zip(expected, actual)) for d in differences(e, a, f"{where}[{i}]", dtype)]
    if isinstance(expected, float) or isinstance(actual, float):
        close = isinstance(actual, (int, float)) and abs(expected - actual) <= TOLERANCE
        return [] if close else [f"{where}: {expected!r} != {actual!r}"]
    if isinstance(expected, str) and isinstance(actual, str) and expected != actual \
            and (where.endswith(("embedding", ".data")) or ".base64[" in where):
        return _vector_differences(expected, actual, where, dtype)
    return [] if expected == actual else [f"{where}: {expected!r} != {actual!r}"]


def _vector_differences(expected: str, actual: str, where: str, dtype: str) -> list[str]:
    """Two base64 vectors: the same length, each value within the tolerance (of its dtype's precision)."""
    one, other = base64.b64decode(expected), base64.b64decode(actual)
    if len(one) != len(other):
        return [f"{where}: {len(one)} bytes != {len(other)}"]
    gap = float(np.max(np.abs(np.frombuffer(one, dtype).astype(np.float32) - np.frombuffer(other, dtype)),
                       initial=0.0))
    tolerance = TOLERANCE if dtype == "<f4" else float(np.finfo(np.float16).eps)  # one float16 step near 1
    return [] if gap <= tolerance else [f"{where}: base64 vectors differ by up to {gap}"]
