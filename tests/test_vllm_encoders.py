"""The tiny model as an embedding model and as a classifier, on llmfleet's vLLM encoder worker and on `vllm serve`, answer by answer.

Every case of tests/parity/encoders.py goes to both (one request at a time on each, both at
once): the same status, and for an answer the same values (vectors and scores within 1e-5, ranks,
indexes and usage equal). The official OpenAI SDK's embeddings (base64 by default) and a
generation request to the embedding model are checked beside them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.parity.encoders import CLASSIFIER, MODEL, TOO_LONG, cases, classifier_cases, differences
from tests.procs import LOG_DIR, metric_value
from worker.consumer import CLAIM_BLOCK_MS

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def servers(encoder_pair) -> tuple[str, str]:
    """(vllm serve's, llmfleet's gateway's) base URLs."""
    return encoder_pair.urls()


def _answer(client: httpx.Client, url: str, path: str, body: dict) -> tuple[int, object]:
    response = client.post(url + path, json=body)
    try:
        return response.status_code, response.json()
    except ValueError:
        return response.status_code, response.text


def _compare(vllm_url: str, fleet_url: str, sent: list, log_name: str) -> list[str]:
    """Each case to both servers (one request at a time on each, both at once); what differs.
    Both answers of each case are kept in the test logs (`log_name`), for a look."""
    found = []
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    with httpx.Client(timeout=120) as to_vllm, httpx.Client(timeout=120) as to_fleet, ThreadPoolExecutor(1) as beside, \
            open(LOG_DIR / log_name, "w") as log:
        for case in sent:
            from_vllm = beside.submit(_answer, to_vllm, vllm_url, case.path, case.body)
            status, answer = _answer(to_fleet, fleet_url, case.path, case.body)
            expected_status, expected = from_vllm.result()
            log.write(json.dumps({"case": case.name, "vllm": [expected_status, expected],
                                  "llmfleet": [status, answer]}) + "\n")
            if status != expected_status:
                found.append(f"{case.name}: status {status}, vllm serve {expected_status}: {answer}")
            elif status == 200:
                dtype = "<f2" if case.body.get("embed_dtype") == "float16" else "<f4"
                found += [f"{case.name}: {d}" for d in differences(expected, answer, dtype=dtype)[:5]]
    return found


def test_every_pooling_endpoint_answers_as_vllm_serve(servers):
    assert not (found := _compare(*servers, cases(), "encoder-parity-answers.jsonl")), "\n".join(found)


def test_every_classifier_endpoint_answers_as_vllm_serve(classifier_pair):
    """The tiny model as a classifier (`--convert classify`) on both: classify's probabilities and
    labels, pooling, and the same status for each bad input."""
    vllm_url, fleet_url = classifier_pair.urls()
    sent = classifier_cases()
    assert not (found := _compare(vllm_url, fleet_url, sent, "classifier-parity-answers.jsonl")), "\n".join(found)
    # ... and what it compared were answers, not two refusals alike:
    probabilities = httpx.post(f"{fleet_url}/classify", json={"model": CLASSIFIER, "input": "hello"},
                               timeout=60).json()["data"][0]["probs"]
    assert len(probabilities) >= 2 and abs(sum(probabilities) - 1) < 1e-5
    cards = {m["id"]: m for m in httpx.get(f"{fleet_url}/v1/models", timeout=10).json()["data"]}
    assert cards[CLASSIFIER]["kinds"] == ["tokenize", "detokenize", "classify", "pooling"]
    # What it does not serve: vllm serve has no such routes for it (404); the fleet, whose other
    # models may serve them, refuses with a 400 that says what this one serves.
    for path, body in [("/v1/embeddings", {"input": "a"}), ("/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})]:
        assert httpx.post(f"{vllm_url}{path}", json={"model": CLASSIFIER, **body}, timeout=30).status_code == 404
        refused = httpx.post(f"{fleet_url}{path}", json={"model": CLASSIFIER, **body}, timeout=30)
        assert refused.status_code == 400 and "it serves classify" in refused.json()["error"]["message"], path


def test_the_sdk_embeds_as_vllm_serve_does(servers):
    vllm_url, fleet_url = servers
    texts = ["The sea is calm tonight.", "hello"]
    ours = openai.OpenAI(base_url=f"{fleet_url}/v1", api_key="x", max_retries=0).embeddings.create(
        model=MODEL, input=texts)  # base64, decoded by the SDK
    theirs = openai.OpenAI(base_url=f"{vllm_url}/v1", api_key="x", max_retries=0).embeddings.create(
        model=MODEL, input=texts, encoding_format="float")
    assert np.allclose([d.embedding for d in ours.data], [d.embedding for d in theirs.data], atol=1e-5)
    assert ours.usage.prompt_tokens == theirs.usage.prompt_tokens > 0


def test_generation_on_the_embedding_model_is_refused(servers):
    """vllm serve has no generation routes for a pooling model (404); the fleet, whose other
    models may generate, refuses the request for this one with a 400 that says what it serves."""
    vllm_url, fleet_url = servers
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{vllm_url}/v1/chat/completions", json=body, timeout=30).status_code == 404
    refused = httpx.post(f"{fleet_url}/v1/chat/completions", json=body, timeout=30)
    assert refused.status_code == 400
    assert "does not support the Chat Completions API" in refused.json()["error"]["message"]
    cards = {m["id"]: m for m in httpx.get(f"{fleet_url}/v1/models", timeout=10).json()["data"]}
    assert cards[MODEL]["kinds"] == ["tokenize", "detokenize", "embed", "score", "rerank", "pooling"]


def test_requests_that_reach_the_worker_together_are_encoded_together_each_with_its_own_answer(servers,
                                                                                              encoder_pair):
    """Many clients' requests waiting together: the worker claims them in one read and, with
    `--encode-together` (the fixture's worker has it), encodes those of the same options with one
    call of vLLM's handler (worker/adapters/vllm_pooling.py). Each still gets its own answer, as
    `vllm serve` gives it: its vectors, its prompt tokens; one with a token outside the vocabulary
    gets its own 400 (its call refused, the requests it was to share it with are encoded alone),
    and the rest their answers all the same."""
    vllm_url, fleet_url = servers
    bodies = [{"model": MODEL, "input": f"The sea number {i} is calm tonight."} for i in range(40)]
    bodies += [{"model": MODEL, "input": ["a tide of words", "hello there"]},
               {"model": MODEL, "input": "in base64", "encoding_format": "base64"},
               {"model": MODEL, "input": [11, 42, 300]}, {"model": MODEL, "input": [[11, 42], [7, 8, 9]]},
               {"model": MODEL, "input": [5, 10_000_000]}]  # out of the vocabulary: refused, and the others not
    url = encoder_pair.worker.url

    def calls_of(le: str = "+Inf") -> float:  # calls of the handler for at most `le` requests, so far
        return metric_value(url, "llmfleet_worker_encode_call_requests_bucket", kind="embed", le=le)

    calls_before, small_before = calls_of(), calls_of("8.0")
    with httpx.Client(timeout=120) as client, ThreadPoolExecutor(len(bodies)) as pool:
        expected = [_answer(client, vllm_url, "/v1/embeddings", body) for body in bodies]
        # The worker sits out while they queue (less than its heartbeat's 3 s), then claims them in one
        # read: its last blocking read has ended in Redis before they are sent.
        os.kill(encoder_pair.worker.pid, signal.SIGSTOP)
        try:
            time.sleep(1.05 * CLAIM_BLOCK_MS / 1000)
            sent = [pool.submit(_answer, client, fleet_url, "/v1/embeddings", body) for body in bodies]
            time.sleep(0.6)
        finally:
            os.kill(encoder_pair.worker.pid, signal.SIGCONT)
        answers = [future.result() for future in sent]
    assert [status for status, _ in answers] == [status for status, _ in expected] == [200] * (len(bodies) - 1) + [400]
    for body, (_, answer), (_, theirs) in zip(bodies[:-1], answers, expected, strict=False):
        assert not (found := differences(theirs, answer)), (body["input"], found[:3])
    calls, small = calls_of() - calls_before, calls_of("8.0") - small_before
    print(f"{len(bodies)} requests in {calls:.0f} calls of the handler, {calls - small:.0f} of more than 8")
    # Together: the texts in a call or a few (as the worker's claims reach the encoder), the three
    # requests of token ids alone (their call refused for the bad one).
    assert calls <= len(bodies) / 4 and calls - small >= 1, (calls, small)
