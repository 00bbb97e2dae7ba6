"""The pooling answers' vectors, in process: the bytes the gateway writes are those vLLM's `tensor2binary` makes."""

from __future__ import annotations

import base64
import json

import numpy as np
import orjson
import pytest
import torch
from vllm.utils.serial_utils import tensor2binary

from gateway.api.pooling import answers
from gateway.api.pooling.protocol import EmbeddingRequest
from shared.codec import decode, encode
from shared.envelopes import ChunkEnvelope, GenerationChunk, Pooled, Usage

VALUES = np.array([0.0, -0.0, 1.0, -1.5, 3.14159265, 1e-8, -2.5e-5, 65504.0, 1e30, 0.1, 0.2, 0.30000001],
                  dtype=np.float32)


def _terminal(*vectors: np.ndarray) -> GenerationChunk:
    return GenerationChunk(done=True, finish_reason="stop", usage=Usage(prompt_tokens=7),
                           pooled=[Pooled(data=v.astype("<f4").tobytes(), shape=list(v.shape)) for v in vectors])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("endianness", ["native", "little", "big"])
def test_base64_is_vllms_bytes_in_every_dtype_and_byte_order(dtype, endianness):
    options = EmbeddingRequest(input="x", encoding_format="base64", embed_dtype=dtype, endianness=endianness)
    body = json.loads(answers.embeddings(_terminal(VALUES), "r", 0, "m", options).body)
    ours = base64.b64decode(body["data"][0]["embedding"])
    assert ours == tensor2binary(torch.from_numpy(VALUES.copy()), dtype, endianness)


def test_float_json_is_vllms_orjson_of_the_float32_array():
    options = EmbeddingRequest(input="x")
    body = answers.embeddings(_terminal(VALUES, VALUES[:3]), "r", 12, "m", options).body
    vllms = orjson.dumps({"embedding": VALUES}, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)
    assert vllms[len(b'{"embedding":'):-1] in body
    parsed = json.loads(body)
    assert parsed["usage"] == {"prompt_tokens": 7, "total_tokens": 7, "completion_tokens": 0,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    assert [item["index"] for item in parsed["data"]] == [0, 1] and parsed["id"] == "embd-r"


def test_bytes_only_is_the_vectors_back_to_back_and_bytes_carries_their_metadata():
    terminal = _terminal(VALUES, VALUES[:4])
    only = answers.embeddings(terminal, "r", 0, "m", EmbeddingRequest(input="x", encoding_format="bytes_only"))
    assert only.body == VALUES.tobytes() + VALUES[:4].tobytes() and "metadata" not in only.headers
    described = answers.embeddings(terminal, "r", 0, "m", EmbeddingRequest(input="x", encoding_format="bytes"))
    items = json.loads(described.headers["metadata"])["data"]
    assert [(i["start"], i["end"], i["shape"]) for i in items] == [(0, 48, [12]), (48, 64, [4])]


def test_a_pooled_answer_crosses_the_wire_as_bytes_not_floats():
    vector = np.random.default_rng(0).standard_normal(1024).astype(np.float32)
    wire = encode(ChunkEnvelope("r", 0, [_terminal(vector)]))
    assert len(wire) < 4 * 1024 + 200  # msgpack bin: 4 bytes a value (a list of floats would take 9)
    back = decode(ChunkEnvelope, wire).chunks[0].pooled[0]
    assert np.array_equal(answers.values(back), vector)
