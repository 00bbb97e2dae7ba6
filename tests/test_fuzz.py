"""Hostile input, fuzzed (issue #14): schemathesis against a real gateway's own OpenAPI schema.

One gateway process (`--api-key`) and a scripted worker on real Redis; schemathesis reads
`/openapi.json` and sends every operation bodies that fit its schema and bodies that do not
(positive and negative modes), with the valid key, and (fitting bodies only) with none and with a
wrong one, which must get a 401 on every path but the open ones. Whatever it sends:
- no answer is a 5xx, and none takes longer than REQUEST_TIMEOUT_S (a hang fails the test);
- every 4xx is in its family's error shape: Anthropic's `{"type": "error", "error": {type,
  message}}` on /v1/messages*, OpenAI's `{"error": {message, type, param, code}}` elsewhere.

Most generated bodies name the worker's model (the rest a random one), so they reach the
request checks, the queue and the worker rather than stopping at "model not found".
The run is bounded by MAX_EXAMPLES per operation and mode with the key, a quarter of it without
(LLMFLEET_FUZZ_EXAMPLES, default 40: about 1.5 minutes on two cores).
"""

from __future__ import annotations

import os
import random
import re
import zlib

import httpx
import orjson
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from tests.procs import start_gateway, start_worker, wait_for

pytestmark = pytest.mark.integration

MODEL = "fuzz-model"
API_KEY = "fuzz-key-0123456789"
OPEN_PATHS = ("/health", "/ready", "/metrics", "/fleet/load")  # answered without a key (the gateway's default)
MAX_EXAMPLES = int(os.environ.get("LLMFLEET_FUZZ_EXAMPLES", "40"))
REQUEST_TIMEOUT_S = 20.0

# Every API route and the request model its body is validated with: the published schema must
# carry each, or schemathesis would fuzz a body-less operation.
BODY_MODELS = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/messages": "MessagesRequest",
    "/v1/messages/count_tokens": "CountTokensRequest",
    "/v1/cancel": "CancelRequest",
    "/tokenize": "TokenizerRequest",
    "/detokenize": "TokenizerRequest",
    "/v1/embeddings": "EmbeddingRequest",
    "/v2/embed": "CohereEmbedRequest",
    "/score": "ScoreRequest",
    "/v1/score": "ScoreRequest",
    "/rerank": "RerankRequest",
    "/v1/rerank": "RerankRequest",
    "/v2/rerank": "RerankRequest",
    "/classify": "ClassifyRequest",
    "/pooling": "PoolingRequest",
}
# The pooling endpoints' bodies name a scripted encoder (an embedding model), the rest the generation model.
ENCODER_MODEL = "fuzz-encoder"
ENCODER_PATHS = ("/v1/embeddings", "/v2/embed", "/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify",
                 "/pooling")


@pytest.fixture(scope="module")
def fuzzed_gateway(redis_url):
    worker = start_worker(redis_url, MODEL, "--max-concurrency", "64")
    gateway = encoder = None
    try:
        encoder = start_worker(redis_url, ENCODER_MODEL, "--runner", "pooling", "--max-model-len", "512")
        gateway = start_gateway(redis_url, "--request-timeout", "15", "--api-key", API_KEY)

        def served() -> bool:
            models = httpx.get(f"{gateway.url}/v1/models", headers=_key_headers("/", "valid"), timeout=2).json()
            return {MODEL, ENCODER_MODEL} <= {m["id"] for m in models["data"]}

        wait_for(served, 30, f"{MODEL} to be listed by the gateway", interval=0.1)
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()
        if encoder is not None:
            encoder.stop()


# Every operation the gateway publishes; the schema test checks that this list is the whole of it.
OPERATIONS = [
    *(("POST", path) for path in BODY_MODELS),
    ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/ready"),
    ("GET", "/metrics"), ("GET", "/version"),
    ("GET", "/fleet/load"), ("GET", "/load"), ("POST", "/invocations"),
    ("GET", "/v1/responses/{response_id}/input_items"),
    ("GET", "/v1/streams/{response_id}"), ("GET", "/v1/responses/{response_id}"),
    ("DELETE", "/v1/responses/{response_id}"), ("POST", "/v1/responses/{response_id}/cancel"),
    ("POST", "/v1/sessions"), ("GET", "/v1/sessions"), ("GET", "/v1/sessions/{session_id}"),
    ("DELETE", "/v1/sessions/{session_id}"), ("GET", "/v1/sessions/{session_id}/history"),
    ("POST", "/v1/sessions/{session_id}/rollback"), ("POST", "/v1/sessions/{session_id}/save"),
    ("GET", "/v1/snapshots"), ("GET", "/v1/snapshots/{snapshot_id}"), ("PATCH", "/v1/snapshots/{snapshot_id}"),
    ("DELETE", "/v1/snapshots/{snapshot_id}"), ("POST", "/v1/snapshots/{snapshot_id}/load"),
]


@pytest.fixture(scope="module")
def gateway_schema(fuzzed_gateway):
    published = httpx.get(f"{fuzzed_gateway.url}/openapi.json", headers=_key_headers("/openapi.json", "valid"))
    assert published.status_code == 200, published.text
    return schemathesis.openapi.from_dict(published.json())


def _key_headers(path: str, key: str) -> dict[str, str]:
    """A valid key, a wrong one or none; as Anthropic's clients send it on /v1/messages*."""
    secret = {"valid": API_KEY, "wrong": "not-" + API_KEY, "none": None}[key]
    if secret is None:
        return {}
    return {"x-api-key": secret} if path.startswith("/v1/messages") else {"Authorization": f"Bearer {secret}"}


def test_the_published_schema_has_every_request_model(fuzzed_gateway):
    published = httpx.get(f"{fuzzed_gateway.url}/openapi.json", headers=_key_headers("/", "valid")).json()
    for path, model in BODY_MODELS.items():
        body = published["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{model}"}, (path, body)
        assert model in published["components"]["schemas"]
    invocations = published["paths"]["/invocations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert invocations == {"anyOf": [{"$ref": f"#/components/schemas/{model}"} for model in (
        "ChatCompletionRequest", "CompletionRequest", "EmbeddingRequest", "ClassifyRequest", "RerankRequest",
        "ScoreRequest", "PoolingRequest")]}
    operations = {(method.upper(), path) for path, methods in published["paths"].items() for method in methods}
    assert operations - {("GET", "/openapi.json")} == set(OPERATIONS)


def _aim_at_the_served_model(case) -> None:
    """Three bodies in four name the served model of their kind (chosen by the body's hash: reproducible)."""
    body = case.body
    if isinstance(body, dict) and "model" in body and zlib.crc32(repr(body).encode()) % 4:
        body["model"] = ENCODER_MODEL if case.path in ENCODER_PATHS else MODEL


def assert_family_error_shape(path: str, status: int, body) -> None:
    if path.startswith("/v1/messages"):
        assert isinstance(body, dict) and body.get("type") == "error", (status, body)
        error = body["error"]
        assert isinstance(error.get("type"), str) and isinstance(error.get("message"), str), (status, body)
        return
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), (status, body)
    error = body["error"]
    assert {"message", "type", "param", "code"} <= error.keys(), (status, body)
    assert isinstance(error["message"], str) and isinstance(error["type"], str), (status, body)


# Operations with something to get wrong (a body, a query) are also sent what does not fit.
NEGATIVE = [*(("POST", path) for path in BODY_MODELS), ("GET", "/v1/responses/{response_id}"),
            ("POST", "/v1/sessions"), ("POST", "/v1/sessions/{session_id}/rollback"),
            ("PATCH", "/v1/snapshots/{snapshot_id}"), ("POST", "/v1/snapshots/{snapshot_id}/load"),
            ("GET", "/fleet/load")]
# With a valid key everything, both modes; without one (or with a wrong one) fewer, fitting cases:
# every answer off the open paths is then a 401.
RUNS = [(*operation, GenerationMode.POSITIVE, "valid") for operation in OPERATIONS] + \
    [(*operation, GenerationMode.NEGATIVE, "valid") for operation in NEGATIVE] + \
    [(*operation, GenerationMode.POSITIVE, key) for key in ("none", "wrong") for operation in OPERATIONS]
# The scripted worker has no tokenizer: a tokenizer request finds no worker of its kind, which is
# the fleet's documented answer (503; Anthropic's 529), not a failure.
TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/v1/messages/count_tokens")


def _no_tokenizer_in_the_fleet(path: str, response) -> bool:
    return (path in TOKENIZER_PATHS and response.status_code in (503, 529)
            and re.search(r"accepts (de)?tokenize requests", response.text) is not None)


@pytest.mark.parametrize(("method", "path", "mode", "key"), RUNS,
                         ids=[f"{m} {p} {mode.value} {key} key" for m, p, mode, key in RUNS])
def test_no_input_gets_a_5xx_a_hang_or_a_shapeless_4xx(gateway_schema, fuzzed_gateway, method, path, mode, key):
    operation = gateway_schema[path][method]
    keyless = key != "valid" and path not in OPEN_PATHS

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES if key == "valid" else max(1, MAX_EXAMPLES // 4), deadline=None,
              suppress_health_check=list(HealthCheck), database=None, print_blob=True)
    def one_case(case):
        _aim_at_the_served_model(case)
        response = case.call(base_url=fuzzed_gateway.url, timeout=REQUEST_TIMEOUT_S,
                             headers=_key_headers(path, key))
        status = response.status_code
        if keyless:
            assert status == 401, (status, response.text[:2000], case.as_curl_command())
        if _no_tokenizer_in_the_fleet(path, response):
            return
        assert status < 500, (status, response.text[:2000], case.as_curl_command())
        if 400 <= status < 500:
            try:
                body = response.json()
            except ValueError:
                body = response.text
            assert_family_error_shape(path, status, body)

    one_case()


# --- what the fuzzing found, each kept as a test of its own -------------------------------------

@pytest.mark.parametrize("path", ["/v1/responses", "/v1/messages"])
def test_an_integer_beyond_64_bits_is_a_400_not_a_500(fuzzed_gateway, path):
    """Found by schemathesis: `{"input": "", "tool_choice": {"": -9223372036854775809}}` on
    /v1/responses was a 500 (the Response echoes tool_choice, and no 64-bit JSON encoder writes
    it); so was such an integer in a field that crosses Redis (msgpack cannot carry it)."""
    huge = -9223372036854775809
    tool = {"name": "f", "input_schema": {"type": "object", "maxProperties": huge}}
    # Chat and completions carry the body as the client sent it, read by orjson, which reads such an
    # integer as a float: they answer it.
    body = {"/v1/responses": {"input": "", "tool_choice": {"": huge}},
            "/v1/messages": {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}}[path]
    answer = httpx.post(f"{fuzzed_gateway.url}{path}", json={"model": MODEL, **body},
                        headers=_key_headers(path, "valid"), timeout=REQUEST_TIMEOUT_S)
    assert answer.status_code == 400, answer.text
    assert_family_error_shape(path, 400, answer.json())
    assert "64-bit" in answer.text or "64 bit" in answer.text, answer.text


# --- hostile values schemathesis does not write ------------------------------------------------------
# Schemathesis writes valid JSON whose values fit or miss the schema's types. These are what clients
# get wrong in other ways: JSON that Python's json module writes but is not JSON (NaN, Infinity, a lone
# surrogate), values of the right type in the wrong shape one level down, integers past 64 bits, deep
# nesting. Each route's body is a valid one with one to three of its schema's fields set from this pool.
# It found: NaN in any route's body was a 500; a non-streaming completion with logprobs, a 500; a
# Responses `tool_choice` naming a function beside `tools` that is no list, and a message item whose
# content is a number, each a 500.
HOSTILE = [b"NaN", b"-Infinity", b'"\\ud800"', b"[" * 3000 + b"]" * 3000, b"18446744073709551616", b"-1", b"0",
           b"1", b"2", b"3.5", b"true", b"null", b'""', b'"x"', b"[]", b"{}", b"[1, 2]", b'["a", 1]', b"[[]]",
           b'{"a": 1}', b'{"type": "function"}', b'{"type": "function", "name": "g", "function": {"name": "g"}}',
           b'[{"role": "user", "content": 5}]', b'[{"role": "user"}]', b'[{"type": "function", "function": 1}]',
           b'{"type": "json_schema", "json_schema": 1}', b'{"include_usage": "x"}', b'{"5": "x"}',
           b'"' + b"x" * 5000 + b'"']
VALID_BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/completions": {"prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"input": "hi", "max_output_tokens": 4},
    "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"input": "hi"}, "/v2/embed": {"texts": ["hi"], "input_type": "search_document"},
    "/score": {"text_1": "a", "text_2": "b"}, "/v1/score": {"text_1": "a", "text_2": "b"},
    "/rerank": {"query": "a", "documents": ["b"]}, "/v1/rerank": {"query": "a", "documents": ["b"]},
    "/v2/rerank": {"query": "a", "documents": ["b"]}, "/classify": {"input": "hi"},
    "/pooling": {"input": "hi"}, "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}, "/v1/cancel": {},
}
HOSTILE_BODIES_PER_ROUTE = 40


def _fields(published: dict, path: str) -> list[str]:
    name = BODY_MODELS[path]
    return sorted(published["components"]["schemas"][name].get("properties", {}))


def test_hostile_values_in_every_route_get_a_4xx_and_leave_the_connection_open(fuzzed_gateway):
    rng = random.Random(20261128)
    published = httpx.get(f"{fuzzed_gateway.url}/openapi.json", headers=_key_headers("/", "valid")).json()
    with httpx.Client(base_url=fuzzed_gateway.url, timeout=REQUEST_TIMEOUT_S) as client:
        for path in BODY_MODELS:
            model = ENCODER_MODEL if path in ENCODER_PATHS else MODEL
            base = {"model": model, **VALID_BODIES[path]}
            fields = [name for name in _fields(published, path) if name != "model"]
            for _ in range(HOSTILE_BODIES_PER_ROUTE):
                changed = dict.fromkeys(rng.sample(fields, min(len(fields), rng.randint(1, 3))))
                parts = [orjson.dumps(name) + b": " + (rng.choice(HOSTILE) if name in changed else orjson.dumps(value))
                         for name, value in {**base, **changed}.items()]
                body = b"{" + b", ".join(parts) + b"}"
                response = client.post(path, content=body, headers={"content-type": "application/json",
                                                                    **_key_headers(path, "valid")})
                if _no_tokenizer_in_the_fleet(path, response):
                    continue
                assert response.status_code < 500, (path, body[:500], response.text[:1000])
                if response.status_code >= 400:
                    assert_family_error_shape(path, response.status_code, response.json())
