"""The answers of the pooling endpoints, written from an encoder's pooled outputs as `vllm serve` writes them.

A worker sends each input's output as packed float32 (`shared.envelopes.Pooled`). The shapes here
are vLLM's response models', key for key (`EmbeddingResponse`, `ScoreResponse`, `RerankResponse`,
`ClassificationResponse`, `PoolingResponse`), and the vectors are written as vLLM writes them:

- `float` embeddings as numpy arrays that orjson writes itself (`OPT_SERIALIZE_NUMPY`, as vLLM's
  ORJSONResponse does), so no Python float is made per element; `float` pooled data as vLLM's
  `tolist()` of it;
- `base64` as the bytes themselves, encoded (float32 in the machine's byte order is what came
  over the wire: no conversion), or converted to the `embed_dtype` and `endianness` asked for;
- `bytes` and `bytes_only` as one binary body, with the metadata header vLLM gives it.
"""

from __future__ import annotations

import base64
import json
import sys
from typing import Any

import numpy as np
import orjson
from starlette.responses import Response

from gateway.api.pooling.protocol import CohereEmbedRequest, EncodingOptions, RerankRequest, side
from shared.envelopes import GenerationChunk, Pooled
from shared.errors import InvalidRequest

_NUMPY = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS  # vLLM's ORJSONResponse's options
_LITTLE = sys.byteorder == "little"


def usage_body(tokens: int) -> dict[str, Any]:
    """vLLM's `UsageInfo` of a pooling answer: the inputs' tokens, nothing generated."""
    return {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
            "prompt_tokens_details": None, "completion_tokens_details": None}


def values(pooled: Pooled) -> np.ndarray:
    """An output's values, read in place from its bytes (float32, little-endian)."""
    array = np.frombuffer(pooled.data, dtype="<f4")
    return array.reshape(pooled.shape) if len(pooled.shape) > 1 else array


def json_response(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body, option=_NUMPY), media_type="application/json")


def _tokens(terminal: GenerationChunk) -> int:
    return terminal.usage.prompt_tokens if terminal.usage is not None else 0


def _list_body(response_id: str, created: int, model: str, data: list, terminal: GenerationChunk) -> dict[str, Any]:
    return {"id": response_id, "object": "list", "created": created, "model": model, "data": data,
            "usage": usage_body(_tokens(terminal))}


def embeddings(terminal: GenerationChunk, request_id: str, created: int, model: str,
               options: EncodingOptions) -> Response:
    """POST /v1/embeddings's answer."""
    return _vectors(terminal, f"embd-{request_id}", created, model, options, "embedding", float_array=True)


def pooling(terminal: GenerationChunk, request_id: str, created: int, model: str, options: EncodingOptions) -> Response:
    """POST /pooling's answer."""
    return _vectors(terminal, f"pooling-{request_id}", created, model, options, "pooling", float_array=False)


def _vectors(terminal: GenerationChunk, response_id: str, created: int, model: str, options: EncodingOptions,
             item: str, *, float_array: bool) -> Response:
    outputs = terminal.pooled or []
    if options.encoding_format in ("bytes", "bytes_only"):
        return _bytes_response(outputs, response_id, created, model, options, _tokens(terminal))
    key = "embedding" if item == "embedding" else "data"
    data = [{"index": i, "object": item, key: _vector(pooled, options, float_array)}
            for i, pooled in enumerate(outputs)]
    return json_response(_list_body(response_id, created, model, data, terminal))


def _vector(pooled: Pooled, options: EncodingOptions, float_array: bool) -> Any:
    if options.encoding_format == "float":
        return values(pooled) if float_array else values(pooled).tolist()
    return base64.b64encode(_binary(pooled, options)).decode()


def _binary(pooled: Pooled, options: EncodingOptions) -> bytes:
    """The output's bytes in the dtype and byte order asked for, as vLLM's `tensor2binary` makes them."""
    big = options.endianness == "big" or (options.endianness == "native" and not _LITTLE)
    if options.embed_dtype == "float32" and not big:
        return pooled.data  # as it came over the wire
    array = np.frombuffer(pooled.data, dtype="<f4")
    if options.embed_dtype == "float16":
        with np.errstate(over="ignore"):  # past float16's range is inf, as torch's conversion makes it
            array = array.astype(np.float16)
    elif options.embed_dtype == "bfloat16":
        array = _bfloat16(array)
    return array.astype(array.dtype.newbyteorder(">" if big else "<")).tobytes()


def _bfloat16(array: np.ndarray) -> np.ndarray:
    """float32 to bfloat16 bits, rounded to nearest even (torch's conversion), NaN kept a NaN."""
    bits = array.astype("<f4").view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(array), np.uint16(0x7FC0), rounded).astype(np.uint16)


def _bytes_response(outputs: list[Pooled], response_id: str, created: int, model: str, options: EncodingOptions,
                    tokens: int) -> Response:
    """`bytes`: the vectors back to back, what each is in a `metadata` header; `bytes_only`: no header."""
    body, items, offset = [], [], 0
    for index, pooled in enumerate(outputs):
        binary = _binary(pooled, options)
        body.append(binary)
        items.append({"index": index, "embed_dtype": options.embed_dtype, "endianness": options.endianness,
                      "start": offset, "end": offset + len(binary), "shape": list(values(pooled).shape)})
        offset += len(binary)
    headers = None
    if options.encoding_format == "bytes":
        headers = {"metadata": json.dumps({"id": response_id, "created": created, "model": model, "data": items,
                                           "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})}
    return Response(b"".join(body), media_type="application/octet-stream", headers=headers)


def classify(terminal: GenerationChunk, request_id: str, created: int, model: str) -> Response:
    """POST /classify's answer: each input's class probabilities and its most probable label."""
    data = []
    for index, pooled in enumerate(terminal.pooled or []):
        probs = values(pooled).tolist()
        data.append({"index": index, "label": pooled.label, "probs": probs, "num_classes": len(probs)})
    return json_response(_list_body(f"classify-{request_id}", created, model, data, terminal))


def score(terminal: GenerationChunk, request_id: str, created: int, model: str) -> Response:
    """POST /score's answer: a score per pair, in the pairs' order."""
    data = [{"index": i, "object": "score", "score": float(values(pooled)[0])}
            for i, pooled in enumerate(terminal.pooled or [])]
    return json_response(_list_body(f"score-{request_id}", created, model, data, terminal))


def rerank(terminal: GenerationChunk, request_id: str, model: str, body: RerankRequest) -> Response:
    """POST /rerank's answer: the documents by relevance, the most relevant first, `top_n` of them
    (all for 0), each with its index in the request and the document itself."""
    documents = side(body.documents)
    results = []
    for index, pooled in enumerate(terminal.pooled or []):
        document = documents[index]
        shown = ({"text": document, "multi_modal": None} if isinstance(document, str)
                 else {"text": None, "multi_modal": document.get("content", [])})
        results.append({"index": index, "document": shown, "relevance_score": float(values(pooled)[0])})
    results.sort(key=lambda result: result["relevance_score"], reverse=True)  # stable: ties keep their order
    top_n = body.top_n if body.top_n > 0 else len(results)
    if top_n < len(documents):
        results = results[:top_n]
    tokens = _tokens(terminal)
    return json_response({"id": f"score-{request_id}", "model": model,
                          "usage": {"prompt_tokens": tokens, "total_tokens": tokens}, "results": results})


COHERE_TYPES = ("float", "binary", "ubinary", "base64")  # in the order vLLM's response model writes them


def cohere_embed(terminal: GenerationChunk, request_id: str, body: CohereEmbedRequest) -> Response:
    """POST /v2/embed's answer: the vectors in each of Cohere's types asked for, the texts echoed,
    the tokens billed, as vLLM writes them (`CohereEmbedResponse`, without its empty fields)."""
    outputs = terminal.pooled or []
    asked = set(body.embedding_types or ["float"])
    embeddings: dict[str, Any] = {}
    for kind in (kind for kind in COHERE_TYPES if kind in asked):
        if kind == "float":
            embeddings[kind] = [values(pooled).tolist() for pooled in outputs]
        elif kind == "base64":  # little-endian float32: the bytes as they came over the wire
            embeddings[kind] = [base64.b64encode(pooled.data).decode() for pooled in outputs]
        else:
            embeddings[kind] = _packed_bits(outputs, signed=kind == "binary")
    tokens = _tokens(terminal)
    images = body.images is not None or any(part.get("type") == "image_url" for item in body.inputs or ()
                                            for part in item.get("content") or ())
    image_tokens = tokens if images else 0
    answer: dict[str, Any] = {"id": f"embd-{request_id}", "embeddings": embeddings}
    if body.texts is not None:
        answer["texts"] = body.texts
    answer["meta"] = {"api_version": {"version": "2"},
                      "billed_units": {"input_tokens": tokens - image_tokens, "image_tokens": image_tokens}}
    answer["response_type"] = "embeddings_by_type"
    return json_response(answer)


def _packed_bits(outputs: list[Pooled], signed: bool) -> list[list[int]]:
    """Cohere's binary types: one bit per dimension (1 for >= 0), eight to a byte, the most
    significant first; `binary` as signed bytes, `ubinary` unsigned (vLLM's `_pack_binary_embeddings`)."""
    if not outputs:
        return []
    array = np.stack([values(pooled) for pooled in outputs])
    if array.shape[1] % 8:
        raise InvalidRequest("Embedding dimension must be a multiple of 8 for binary embedding types, but got "
                             f"{array.shape[1]}.")
    packed = np.packbits(array >= 0, axis=-1)
    return (packed.astype(np.int16) - 128 if signed else packed).tolist()
