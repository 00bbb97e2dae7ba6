"""Which requests a vLLM encoder answers with `_PlainEmbedding` (worker/adapters/vllm_pooling.py):
one text and no option that changes the vectors, else vLLM's whole embedding handler.

That both paths answer alike is tests/test_vllm_encoders.py's: its cases of one text (valid, and
past the context in a short text) go to the worker one at a time, as the bodies here say are plain,
and are compared with `vllm serve`'s answers."""

from __future__ import annotations

import time

import pytest

from shared.envelopes import RequestEnvelope
from tests.parity.battery import MAX_MODEL_LEN
from worker.adapters.vllm_pooling import _PLAIN_TEXT_CHARS, _PlainEmbedding


def _envelope(body: dict, kind: str = "embed", api: str = "") -> RequestEnvelope:
    return RequestEnvelope(request_id="r", model="m", kind=kind, reply_to="g", arrival=time.time(),
                           body={"model": "m", **body}, api=api)


@pytest.mark.parametrize(("body", "text"), [
    ({"input": "The sea is calm tonight."}, "The sea is calm tonight."),
    ({"input": ["hello"]}, "hello"),
    # How the gateway writes the vectors, and the client's tag, do not change them.
    ({"input": "a", "encoding_format": "base64", "embed_dtype": "float16", "endianness": "little",
      "user": "someone"}, "a"),
    ({"input": "!" * (MAX_MODEL_LEN + 50)}, "!" * (MAX_MODEL_LEN + 50)),  # refused by vLLM's render, as by the handler
    ({"input": "x" * _PLAIN_TEXT_CHARS}, "x" * _PLAIN_TEXT_CHARS),
])
def test_one_text_without_options_is_plain(body, text):
    assert _PlainEmbedding.text(_envelope(body)) == text


@pytest.mark.parametrize("body", [
    {"input": ["a", "b"]},  # several inputs: the handler renders them on its thread, together
    {"input": [11, 42, 300]},  # token ids
    {"input": [[11, 42]]},
    {"input": ""},
    {"input": [""]},
    {"input": 42},
    {},
    {"messages": [{"role": "user", "content": "a"}]},
    {"input": "x" * (_PLAIN_TEXT_CHARS + 1)},  # rendered on vLLM's thread, not the worker's loop
    {"input": "a", "dimensions": 8},
    {"input": "a", "truncate_prompt_tokens": 5},
    {"input": "a", "use_activation": False},
    {"input": "a", "add_special_tokens": False},
    {"input": "a", "priority": 1},
    {"input": "a", "request_id": "mine"},
])
def test_anything_else_goes_to_the_handler(body):
    assert _PlainEmbedding.text(_envelope(body)) is None


def test_only_the_openai_embedding_api_is_plain():
    assert _PlainEmbedding.text(_envelope({"input": "a"}, kind="pooling")) is None
    assert _PlainEmbedding.text(_envelope({"input": "a"}, kind="classify")) is None
    assert _PlainEmbedding.text(_envelope({"texts": ["a"]}, api="cohere")) is None
    assert _PlainEmbedding.text(_envelope({"input": "a"}, api="cohere")) is None
