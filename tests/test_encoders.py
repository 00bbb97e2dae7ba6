"""The second kind of work: embeddings, score, rerank, classify and pooling on scripted encoder workers.

A gateway, scripted encoders (an embedding model on two workers, a classifier, a slow embedding
model for cancels and deadlines) and a scripted generation model beside them, all real processes
on the session's Redis. The scripted encoder's vectors are deterministic (worker/adapters/
scripted_encoder.py), so an answer can be checked against vectors computed here.
"""

from __future__ import annotations

import asyncio
import base64
import time

import httpx
import numpy as np
import openai
import pytest

from tests.procs import metric_value, start_gateway, start_worker, wait_for, wait_until_served
from tests.test_keys import create_key, llmfleet_keys
from worker.adapters.scripted_encoder import ScriptedEncoder

pytestmark = pytest.mark.integration

EMBED, CLASSIFY, SLOW, GENERATE = "scripted-embed", "scripted-classify", "scripted-slow-embed", "scripted-chat"
MAX_MODEL_LEN = 16
MAX_INPUTS = 8


@pytest.fixture(scope="module")
def encoders(redis_url: str):
    """(gateway, the embedding model's workers, the slow model's worker)."""
    started = []
    try:
        embed = [start_worker(redis_url, EMBED, "--runner", "pooling", "--max-model-len", str(MAX_MODEL_LEN))
                 for _ in range(2)]
        started += embed
        started.append(start_worker(redis_url, CLASSIFY, "--convert", "classify"))
        slow = start_worker(redis_url, SLOW, "--runner", "pooling", "--scripted-seconds-per-input", "60")
        started.append(slow)
        started.append(start_worker(redis_url, GENERATE))
        gateway = start_gateway(redis_url, "--max-encoder-inputs", str(MAX_INPUTS))
        started.append(gateway)
        for model in (EMBED, CLASSIFY, SLOW, GENERATE):
            wait_until_served(gateway, model)
        yield gateway, embed, slow
    finally:
        for proc in started:
            proc.stop()


@pytest.fixture(scope="module")
def keyed_gateway(redis_url: str, encoders):
    """A gateway that requires managed keys, in front of the same encoders."""
    gateway = start_gateway(redis_url, "--require-keys")
    try:
        wait_for(lambda: httpx.post(f"{gateway.url}/v1/embeddings", json={"model": EMBED, "input": "a"}, timeout=5)
                 .status_code == 401, 10, "the gateway to answer")
        yield gateway
    finally:
        gateway.stop()


def expected(texts: list[str], dimensions: int = 64) -> np.ndarray:
    """The scripted encoder's vectors of `texts` (its own code, run here)."""
    encoder = ScriptedEncoder("here")
    return np.stack([_normalised(encoder._vector(text.split())[:dimensions]) for text in texts])


def _normalised(vector: np.ndarray) -> np.ndarray:
    return vector / np.linalg.norm(vector)


def post(gateway, path: str, body: dict, **kwargs) -> httpx.Response:
    return httpx.post(f"{gateway.url}{path}", json=body, timeout=30, **kwargs)


def test_the_openai_sdk_embeds_with_base64_by_default(encoders):
    gateway = encoders[0]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    texts = ["the quick brown fox", "jumps over", "the lazy dog"]
    result = client.embeddings.create(model=EMBED, input=texts)  # the SDK asks for base64 and decodes it
    assert [item.index for item in result.data] == [0, 1, 2]
    assert np.allclose(np.array([item.embedding for item in result.data]), expected(texts), atol=1e-6)
    assert result.usage.prompt_tokens == result.usage.total_tokens == 9
    assert result.model == EMBED and result.object == "list"
    as_floats = client.embeddings.create(model=EMBED, input=texts, encoding_format="float")
    # The same float32s: JSON writes each as its shortest float32 text, base64 as its bytes.
    assert np.array_equal(np.array([item.embedding for item in as_floats.data], dtype=np.float32),
                          np.array([item.embedding for item in result.data], dtype=np.float32))


def test_float_and_base64_carry_the_same_float32s(encoders):
    gateway = encoders[0]
    floats = post(gateway, "/v1/embeddings", {"model": EMBED, "input": "hello there"}).json()
    encoded = post(gateway, "/v1/embeddings", {"model": EMBED, "input": "hello there", "encoding_format": "base64"})
    vector = np.frombuffer(base64.b64decode(encoded.json()["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(np.array(floats["data"][0]["embedding"], dtype=np.float32), vector)
    assert floats["id"].startswith("embd-") and floats["data"][0]["object"] == "embedding"
    assert floats["usage"] == {"prompt_tokens": 2, "total_tokens": 2, "completion_tokens": 0,
                               "prompt_tokens_details": None, "completion_tokens_details": None}
    half = post(gateway, "/v1/embeddings", {"model": EMBED, "input": "hello there", "encoding_format": "base64",
                                             "embed_dtype": "float16", "endianness": "big"}).json()
    assert np.allclose(np.frombuffer(base64.b64decode(half["data"][0]["embedding"]), dtype=">f2"), vector, atol=1e-3)
    raw = post(gateway, "/v1/embeddings", {"model": EMBED, "input": ["hello there", "hi"],
                                            "encoding_format": "bytes_only"})
    assert raw.headers["content-type"] == "application/octet-stream"
    assert np.array_equal(np.frombuffer(raw.content, dtype="<f4")[:64], vector)


def test_token_ids_dimensions_and_truncation(encoders):
    gateway = encoders[0]
    ids = post(gateway, "/v1/embeddings", {"model": EMBED, "input": [[5, 6, 7], [8]]}).json()
    assert np.allclose([d["embedding"] for d in ids["data"]], expected(["5 6 7", "8"]), atol=1e-6)
    assert ids["usage"]["prompt_tokens"] == 4
    short = post(gateway, "/v1/embeddings", {"model": EMBED, "input": "a b c", "dimensions": 8}).json()
    assert np.allclose(short["data"][0]["embedding"], expected(["a b c"], 8)[0], atol=1e-6)
    long_text = " ".join(f"w{i}" for i in range(MAX_MODEL_LEN + 4))
    refused = post(gateway, "/v1/embeddings", {"model": EMBED, "input": long_text})
    assert refused.status_code == 400
    assert "maximum context length is 16 tokens" in refused.json()["error"]["message"]
    cut = post(gateway, "/v1/embeddings", {"model": EMBED, "input": long_text, "truncate_prompt_tokens": 5}).json()
    assert cut["usage"]["prompt_tokens"] == 5
    assert np.allclose(cut["data"][0]["embedding"], expected(["w0 w1 w2 w3 w4"])[0], atol=1e-6)


def test_cohere_embed_gives_each_type_asked_for_from_the_same_vectors(encoders):
    gateway = encoders[0]
    texts = ["hello there", "a calm sea"]
    answer = post(gateway, "/v2/embed", {"model": EMBED, "texts": texts,
                                          "embedding_types": ["base64", "ubinary", "float", "binary"]}).json()
    assert list(answer) == ["id", "embeddings", "texts", "meta", "response_type"]
    assert answer["id"].startswith("embd-") and answer["response_type"] == "embeddings_by_type"
    assert answer["texts"] == texts
    assert answer["meta"] == {"api_version": {"version": "2"}, "billed_units": {"input_tokens": 5, "image_tokens": 0}}
    embeddings = answer["embeddings"]
    assert list(embeddings) == ["float", "binary", "ubinary", "base64"]
    vectors = expected(texts)
    assert np.allclose(embeddings["float"], vectors, atol=1e-6)
    assert np.array_equal(np.array(embeddings["float"], dtype=np.float32),
                          np.stack([np.frombuffer(base64.b64decode(b), dtype="<f4") for b in embeddings["base64"]]))
    bits = np.packbits(np.array(embeddings["float"]) >= 0, axis=-1)  # eight dimensions a byte
    assert embeddings["ubinary"] == bits.tolist()
    assert embeddings["binary"] == (bits.astype(int) - 128).tolist()
    only_float = post(gateway, "/v2/embed", {"model": EMBED, "texts": ["hi"]}).json()["embeddings"]
    assert list(only_float) == ["float"]


def test_cohere_embed_truncates_as_asked_and_sizes_to_the_output_dimension(encoders):
    gateway = encoders[0]
    words = [f"w{i}" for i in range(MAX_MODEL_LEN + 4)]
    cases = {"END": words[:5], "START": words[-5:]}
    for truncate, kept in cases.items():
        answer = post(gateway, "/v2/embed", {"model": EMBED, "texts": [" ".join(words)], "truncate": truncate,
                                              "max_tokens": 5}).json()
        assert answer["meta"]["billed_units"]["input_tokens"] == 5, truncate
        assert np.allclose(answer["embeddings"]["float"][0], expected([" ".join(kept)])[0], atol=1e-6), truncate
    whole = post(gateway, "/v2/embed", {"model": EMBED, "texts": [" ".join(words)]}).json()  # END, to the context
    assert whole["meta"]["billed_units"]["input_tokens"] == MAX_MODEL_LEN
    too_many = post(gateway, "/v2/embed", {"model": EMBED, "texts": ["a b c"], "truncate": "NONE", "max_tokens": 2})
    assert too_many.status_code == 400 and "exceeds max_tokens=2" in too_many.json()["error"]["message"]
    short = post(gateway, "/v2/embed", {"model": EMBED, "texts": ["a b c"], "output_dimension": 8}).json()
    assert np.allclose(short["embeddings"]["float"][0], expected(["a b c"], 8)[0], atol=1e-6)
    mixed = post(gateway, "/v2/embed", {"model": EMBED, "inputs": [{"content": [{"type": "text", "text": "a b c"}]}]})
    assert np.allclose(mixed.json()["embeddings"]["float"][0], expected(["a b c"])[0], atol=1e-6)


def test_invocations_dispatch_pooling_bodies_by_what_the_model_serves(encoders):
    gateway = encoders[0]

    def both(path: str, body: dict) -> tuple[dict, dict]:
        direct, dispatched = post(gateway, path, body), post(gateway, "/invocations", body)
        assert direct.status_code == dispatched.status_code == 200, (path, dispatched.text)
        return direct.json(), dispatched.json()

    def same(direct: dict, dispatched: dict) -> bool:
        return {k: v for k, v in direct.items() if k not in ("id", "created")} == \
            {k: v for k, v in dispatched.items() if k not in ("id", "created")}

    for path, body in [("/v1/embeddings", {"model": EMBED, "input": ["hello there", "hi"]}),
                       ("/rerank", {"model": EMBED, "query": "calm sea", "documents": ["a calm sea", "mountains"]}),
                       ("/score", {"model": EMBED, "text_1": "calm sea", "text_2": ["a calm sea", "mountains"]}),
                       ("/classify", {"model": CLASSIFY, "input": "hello there"}),
                       # A conversation to an embedding model: embedded, as vLLM's dispatch does (no chat route).
                       ("/v1/embeddings", {"model": EMBED, "messages": [{"role": "user", "content": "hi there"}]})]:
        assert same(*both(path, body)), path
    chat = post(gateway, "/invocations", {"model": GENERATE, "messages": [{"role": "user", "content": "hi"}],
                                           "max_tokens": 2})
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    nothing = post(gateway, "/invocations", {"model": EMBED, "prompt": "hi"})
    assert nothing.status_code == 400
    assert "Expected one of: ['EmbeddingRequest', 'RerankRequest', 'ScoreRequest', 'PoolingRequest']" in \
        nothing.json()["error"]["message"]


def test_score_pairs_one_to_many_and_many_to_many(encoders):
    gateway = encoders[0]
    one_to_many = post(gateway, "/score", {"model": EMBED, "text_1": "red apple", "text_2": ["red apple", "blue sky"]})
    scores = [d["score"] for d in one_to_many.json()["data"]]
    vectors = expected(["red apple", "blue sky"])
    assert scores == pytest.approx([1.0, float(vectors[0] @ vectors[1])], abs=1e-6)
    assert one_to_many.json()["usage"]["prompt_tokens"] == 6
    many = post(gateway, "/v1/score", {"model": EMBED, "queries": ["red apple", "blue sky"],
                                        "documents": ["blue sky", "blue sky"]}).json()
    assert [d["score"] for d in many["data"]] == pytest.approx([scores[1], 1.0], abs=1e-6)
    mismatched = post(gateway, "/score", {"model": EMBED, "text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
    assert mismatched.status_code == 400
    assert mismatched.json()["error"]["message"] == "Input lengths must be either 1:1, 1:N or N:N"


def test_rerank_orders_documents_and_keeps_top_n(encoders):
    gateway = encoders[0]
    documents = ["blue sky", "red apple pie", "red apple"]
    answers = [post(gateway, path, {"model": EMBED, "query": "red apple", "documents": documents, "top_n": 2}).json()
               for path in ("/rerank", "/v1/rerank", "/v2/rerank")]
    results = answers[0]["results"]
    assert [r["index"] for r in results] == [2, 1]
    assert [r["document"]["text"] for r in results] == ["red apple", "red apple pie"]
    assert results[0]["relevance_score"] == pytest.approx(1.0, abs=1e-6)
    assert all(answer["results"] == results for answer in answers[1:])
    assert answers[0]["usage"] == {"prompt_tokens": 9, "total_tokens": 9}
    everything = post(gateway, "/rerank", {"model": EMBED, "query": "red apple", "documents": documents}).json()
    assert len(everything["results"]) == 3


def test_classify_and_pooling(encoders):
    gateway = encoders[0]
    classes = post(gateway, "/classify", {"model": CLASSIFY, "input": ["good day", "bad day"]}).json()
    for item in classes["data"]:
        assert item["num_classes"] == 2 and sum(item["probs"]) == pytest.approx(1.0, abs=1e-6)
        assert item["label"] == ("LABEL_0" if item["probs"][0] > item["probs"][1] else "LABEL_1")
    assert classes["id"].startswith("classify-")
    pooled = post(gateway, "/pooling", {"model": EMBED, "input": "good day"}).json()
    assert pooled["data"][0]["object"] == "pooling"
    assert np.allclose(pooled["data"][0]["data"], expected(["good day"])[0], atol=1e-6)


def test_models_say_what_each_serves_and_the_other_work_is_a_400(encoders):
    gateway = encoders[0]
    cards = {m["id"]: m for m in httpx.get(f"{gateway.url}/v1/models").json()["data"]}
    assert cards[EMBED]["kinds"] == ["embed", "score", "rerank", "pooling"]
    assert cards[CLASSIFY]["kinds"] == ["classify", "pooling"]
    assert cards[GENERATE]["kinds"] == ["chat", "completion"]
    chat = post(gateway, "/v1/chat/completions", {"model": EMBED, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "Chat Completions" in chat.json()["error"]["message"]
    embed = post(gateway, "/v1/embeddings", {"model": GENERATE, "input": "hi"})
    assert embed.status_code == 400 and "Embeddings" in embed.json()["error"]["message"]
    assert post(gateway, "/classify", {"model": EMBED, "input": "hi"}).status_code == 400


@pytest.mark.parametrize("path, body, words", [
    ("/v1/embeddings", {"input": []}, "at least one prompt"),
    ("/v1/embeddings", {"input": ["a", ""]}, "The decoder prompt cannot be empty"),
    ("/v1/embeddings", {"messages": []}, "empty conversation"),
    ("/v1/embeddings", {"input": 42}, "validation error"),
    ("/v1/embeddings", {"input": ["a", 1]}, "validation error"),
    ("/v1/embeddings", {}, "input"),
    ("/v1/embeddings", {"input": ["a"] * (MAX_INPUTS + 1)}, "at most 8"),
    ("/v1/embeddings", {"input": "a", "encoding_format": "hex"}, "encoding_format"),
    ("/v1/embeddings", {"input": "a", "truncate_prompt_tokens": MAX_MODEL_LEN + 1}, "truncate_prompt_tokens"),
    ("/v1/embeddings", {"input": "a", "dimensions": 1000}, "imensions"),
    ("/rerank", {"query": "a", "documents": []}, "text_pair"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "a", "documents": ["a"] * MAX_INPUTS}, "at most 8"),
    ("/score", {"text_1": "a"}, "text_1"),
    ("/classify", {"input": []}, "at least one prompt"),
    ("/pooling", {"input": "a", "dimensions": 4}, "dimensions"),
    ("/v2/embed", {}, "Exactly one of texts, images, or inputs"),
    ("/v2/embed", {"texts": []}, "Exactly one of texts, images, or inputs"),
    ("/v2/embed", {"texts": ["a"], "images": ["data:image/png;base64,AAAA"]}, "Exactly one of texts"),
    ("/v2/embed", {"texts": ["a"], "embedding_types": ["int8"]}, "embedding_types"),
    ("/v2/embed", {"texts": ["a"], "truncate": "MIDDLE"}, "truncate"),
    ("/v2/embed", {"texts": ["a"], "input_type": "search_query"}, "Unsupported input_type"),
    ("/v2/embed", {"images": ["data:image/png;base64,AAAA"]}, "image"),
    ("/v2/embed", {"texts": ["a"] * (MAX_INPUTS + 1)}, "at most 8"),
])
def test_bad_input_is_a_clear_400(encoders, path, body, words):
    response = post(encoders[0], path, {"model": EMBED if path != "/classify" else CLASSIFY, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"] or words == error["param"], error


def test_a_client_gone_cancels_the_encoding_on_its_worker(encoders):
    gateway, _embed, slow = encoders
    cancelled = metric_value(slow.url, "llmfleet_worker_cancels_total", model=SLOW, cause="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{gateway.url}/v1/embeddings", json={"model": SLOW, "input": "never answered"}, timeout=1)
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_cancels_total", model=SLOW, cause="disconnect")
             == cancelled + 1, 10, "the worker to cancel the encoding")
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == 0, 10, "its slot to free")


def test_a_deadline_ends_the_encoding_with_a_timeout(encoders):
    gateway, _embed, slow = encoders
    started = time.monotonic()
    response = post(gateway, "/v1/embeddings", {"model": SLOW, "input": "too slow", "timeout": 1})
    assert response.status_code == 408 and "timeout (1 s) ran out" in response.json()["error"]["message"]
    assert time.monotonic() - started < 10
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == 0, 10, "its slot to free")


async def test_many_clients_share_the_embedding_workers(encoders):
    gateway, embed, _slow = encoders
    before = [metric_value(w.url, "llmfleet_worker_encoded_inputs_total", model=EMBED, kind="embed") for w in embed]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answers = await asyncio.gather(*(client.post("/v1/embeddings", json={"model": EMBED, "input": f"text {i}"})
                                         for i in range(64)))
    for i, answer in enumerate(answers):
        assert np.allclose(answer.json()["data"][0]["embedding"], expected([f"text {i}"])[0], atol=1e-6)
    after = [metric_value(w.url, "llmfleet_worker_encoded_inputs_total", model=EMBED, kind="embed") for w in embed]
    assert sum(after) - sum(before) == 64


def test_a_keys_token_limit_counts_the_inputs_tokens(keyed_gateway, redis_url):
    _name, secret = create_key(redis_url, "--tpm", "20")
    headers = {"Authorization": f"Bearer {secret}"}
    body = {"model": EMBED, "input": [f"w{i} x{i}" for i in range(8)]}  # 16 tokens, as the worker counts them
    first = httpx.post(f"{keyed_gateway.url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert first.status_code == 200, first.text
    assert first.json()["usage"]["prompt_tokens"] == 16
    second = httpx.post(f"{keyed_gateway.url}/v1/embeddings", json=body, headers=headers, timeout=30)
    assert second.status_code == 429 and second.headers["x-ratelimit-limit-tokens"] == "20"
    assert int(second.headers["x-ratelimit-remaining-tokens"]) == 4  # the worker's count replaced the estimate
    name, other = create_key(redis_url)
    for path, extra in (("/rerank", {"query": "a b", "documents": ["a", "b c"]}), ("/score", {"text_1": "a",
                                                                                              "text_2": "b"})):
        answer = httpx.post(f"{keyed_gateway.url}{path}", json={"model": EMBED, **extra},
                            headers={"Authorization": f"Bearer {other}"}, timeout=30)
        assert answer.status_code == 200, answer.text
    wait_for(lambda: f"{name}  {EMBED}  2         7              0" in llmfleet_keys(redis_url, "usage", name), 5,
             "the key's usage to count both requests' 7 input tokens")


async def test_a_cancel_by_cancel_id_stops_the_encoding_and_answers_499(encoders):
    gateway, _embed, slow = encoders
    in_flight = metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW)
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30) as client:
        answering = asyncio.ensure_future(client.post("/v1/embeddings", json={
            "model": SLOW, "input": "stop me", "cancel_id": "encoding-1"}))
        deadline = time.monotonic() + 10
        while metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == in_flight:  # the worker has it
            assert time.monotonic() < deadline and not answering.done(), "the worker never started the encoding"
            await asyncio.sleep(0.05)
        cancelled = await client.post("/v1/cancel", json={"cancel_id": "encoding-1"})
        answer = await answering
    assert cancelled.json() == {"cancelled": 1}
    assert answer.status_code == 499, answer.text
    assert answer.json()["error"]["type"] == "Cancelled"
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == in_flight, 10,
             "its slot to free")


PART_INPUTS = 10


@pytest.fixture(scope="module")
def parted_gateway(redis_url: str, encoders):
    """A gateway that serves a request of more than PART_INPUTS inputs in parts, and requires keys."""
    gateway = start_gateway(redis_url, "--require-keys", "--max-encoder-inputs", "200",
                            "--encoder-part-inputs", str(PART_INPUTS))
    try:
        wait_for(lambda: post(gateway, "/v1/embeddings", {"model": EMBED, "input": "a"}).status_code == 401, 10,
                 "the gateway to answer")
        yield gateway
    finally:
        gateway.stop()


def _key_usage(redis_url: str, name: str) -> list[str]:
    """The key's usage line of EMBED: its name, the model, requests, prompt and completion tokens."""
    return next(line.split() for line in llmfleet_keys(redis_url, "usage", name).splitlines()
                if line.startswith(name) and EMBED in line)


def test_a_request_of_many_inputs_is_encoded_in_parts_by_every_worker_and_answered_in_order(
        encoders, parted_gateway, redis_url):
    _gateway, embed, _slow = encoders
    name, secret = create_key(redis_url)
    texts = [f"w{i} x{i % 7} y" for i in range(95)]  # 10 parts, the last of 5
    before = [metric_value(w.url, "llmfleet_worker_encoded_inputs_total", model=EMBED, kind="embed") for w in embed]
    parts = metric_value(parted_gateway.url, "llmfleet_gateway_request_parts_total", model=EMBED)
    answer = post(parted_gateway, "/v1/embeddings", {"model": EMBED, "input": texts, "encoding_format": "float"},
                  headers={"Authorization": f"Bearer {secret}"})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert [item["index"] for item in body["data"]] == list(range(95))
    assert np.allclose([item["embedding"] for item in body["data"]], expected(texts), atol=1e-6)
    assert body["usage"]["prompt_tokens"] == 3 * 95
    assert metric_value(parted_gateway.url, "llmfleet_gateway_request_parts_total", model=EMBED) == parts + 10
    encoded = [metric_value(w.url, "llmfleet_worker_encoded_inputs_total", model=EMBED, kind="embed") - b
               for w, b in zip(embed, before)]
    assert sum(encoded) == 95 and all(encoded), f"inputs encoded by each worker: {encoded}"
    # One request against the key's limits and usage, its tokens all counted.
    wait_for(lambda: _key_usage(redis_url, name)[2:] == ["1", str(3 * 95), "0"], 5,
             "the key's usage to count one request of 285 tokens")
    # A part's error is the request's, as the worker gave it; the other parts stop.
    texts[57] = "long " * (MAX_MODEL_LEN + 4)
    refused = post(parted_gateway, "/v1/embeddings", {"model": EMBED, "input": texts},
                   headers={"Authorization": f"Bearer {secret}"})
    whole = post(encoders[0], "/v1/embeddings", {"model": EMBED, "input": texts[50:58]})
    assert refused.status_code == whole.status_code == 400, refused.text[:300]
    assert refused.json()["error"] == whole.json()["error"]


async def test_a_cancel_or_a_client_gone_stops_every_part(encoders, parted_gateway, redis_url):
    _gateway, _embed, slow = encoders
    _name, secret = create_key(redis_url)
    headers = {"Authorization": f"Bearer {secret}"}
    in_flight = metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW)
    submitted = metric_value(parted_gateway.url, "llmfleet_gateway_submitted_total", model=SLOW)
    body = {"model": SLOW, "input": [f"part {i}" for i in range(40)], "cancel_id": "parts-1"}  # 4 parts of 60 s each
    async with httpx.AsyncClient(base_url=parted_gateway.url, timeout=30, headers=headers) as client:
        answering = asyncio.ensure_future(client.post("/v1/embeddings", json=body))
        deadline = time.monotonic() + 10
        while metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) < in_flight + 2:  # both in its window
            assert time.monotonic() < deadline and not answering.done(), "the worker never took the first parts"
            await asyncio.sleep(0.05)
        cancelled = await client.post("/v1/cancel", json={"cancel_id": "parts-1"})
        answer = await answering
    assert cancelled.json() == {"cancelled": 2}
    assert answer.status_code == 499 and answer.json()["error"]["type"] == "Cancelled", answer.text
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == in_flight, 10,
             "the parts' slots to free")
    # The parts not queued yet never were: one worker of the model, so two parts at a time.
    assert metric_value(parted_gateway.url, "llmfleet_gateway_submitted_total", model=SLOW) == submitted + 2

    cancels = metric_value(slow.url, "llmfleet_worker_cancels_total", model=SLOW, cause="disconnect")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{parted_gateway.url}/v1/embeddings", json={**body, "cancel_id": None}, headers=headers,
                   timeout=1.5)
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_cancels_total", model=SLOW, cause="disconnect")
             == cancels + 2, 10, "the worker to cancel both parts it had")
    wait_for(lambda: metric_value(slow.url, "llmfleet_worker_in_flight", model=SLOW) == in_flight, 10,
             "the parts' slots to free")
