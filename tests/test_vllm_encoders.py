"""The tiny model as an embedding model and as a classifier, on llmfleet's vLLM encoder worker and on `vllm serve`, answer by answer.

Every case of tests/parity/encoders.py goes to both (one request at a time on each, both at
once): the same status, and for an answer the same values (vectors and scores within 1e-5, ranks,
indexes and usage equal). The official OpenAI SDK's embeddings (base64 by default) and a
generation request to the embedding model are checked beside them.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest

from tests.parity.encoders import CLASSIFIER, MODEL, cases, classifier_cases, differences
from tests.procs import LOG_DIR

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
