"""The first hour with a gateway, over HTTP: a newcomer's usual mistakes get answers that say what
to do (paths vllm serve has and llmfleet does not, /v1 twice or missing, a wrong method, a body
that is not JSON), the OpenAI SDK's `models.retrieve` works, and a refusal before routing is
counted under its route. Real gateways, scripted workers and Redis; the official SDKs as clients."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest

from tests.conftest import SCRIPTED_MODEL
from tests.procs import metric_value, start_gateway, start_worker, wait_for
from tests.test_keys import create_key

pytestmark = pytest.mark.integration

STATIC_KEY = "first-hour-static-key"
SLASHED_MODEL = "first-hour/slashed-model"  # as Hugging Face ids are: org/name
USER = [{"role": "user", "content": "hi"}]
SERVED_NAMED = "It serves POST /v1/chat/completions, POST /v1/completions, POST /v1/responses, POST /v1/messages"
NOT_FOUND = {"type": "NotFoundError", "param": None, "code": 404}


@pytest.fixture(scope="module")
def keyed_gateway(redis_url, scripted_fleet):
    """A gateway that requires keys (the static one too), beside the scripted fleet's workers, and a
    worker whose model id holds a slash."""
    worker = start_worker(redis_url, "first-hour-model", served_name=SLASHED_MODEL)
    gateway = None
    try:
        gateway = start_gateway(redis_url, "--require-keys", "--api-key", STATIC_KEY)
        headers = {"Authorization": f"Bearer {STATIC_KEY}"}

        def both_listed() -> bool:
            listed = httpx.get(f"{gateway.url}/v1/models", headers=headers, timeout=5).json()["data"]
            return {SCRIPTED_MODEL, SLASHED_MODEL} <= {m["id"] for m in listed}

        wait_for(both_listed, 15, "both models to be listed")
        yield gateway
    finally:
        if gateway is not None:
            gateway.stop()
        worker.stop()


def _gateway(scripted_fleet):
    return scripted_fleet[0][0]


@pytest.mark.parametrize("method, path, advice", [
    ("POST", "/v1/audio/transcriptions", " (yet): its workers serve text generation, not speech models"),
    ("GET", "/ping", "; for health checks use GET /health (the process is alive) or GET /ready"),
])
def test_a_path_vllm_serve_has_says_llmfleet_does_not_serve_it_and_what_it_serves(scripted_fleet, method, path,
                                                                                   advice):
    answer = httpx.request(method, f"{_gateway(scripted_fleet).url}{path}", json={"model": SCRIPTED_MODEL})
    assert answer.status_code == 404, answer.text
    error = answer.json()["error"]
    assert {k: v for k, v in error.items() if k != "message"} == NOT_FOUND
    assert error["message"].startswith(f"llmfleet does not serve {method} {path}{advice}"), error["message"]
    assert SERVED_NAMED in error["message"] and "README's Endpoints section" in error["message"]


def test_v1_twice_from_the_openai_sdk_says_the_base_url_already_ends_in_v1(scripted_fleet):
    gateway = _gateway(scripted_fleet)
    client = openai.OpenAI(base_url=f"{gateway.url}/v1/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as raised:
        client.chat.completions.create(model=SCRIPTED_MODEL, messages=USER, max_tokens=2)
    error = raised.value.body
    assert {k: v for k, v in error.items() if k != "message"} == NOT_FOUND
    assert error["message"] == (
        "POST /v1/v1/chat/completions has /v1 twice: the client's base_url already ends in /v1, and the path adds "
        f'it again. With base_url="{gateway.url}/v1", request paths go without /v1 (/chat/completions, /models: '
        "the OpenAI SDK's way). The full path is POST /v1/chat/completions.")


def test_v1_twice_from_the_anthropic_sdk_answers_in_anthropic_shape(scripted_fleet):
    gateway = _gateway(scripted_fleet)
    client = anthropic.Anthropic(base_url=f"{gateway.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as raised:
        client.messages.create(model=SCRIPTED_MODEL, max_tokens=2, messages=USER)
    body = raised.value.response.json()
    assert body == {"type": "error", "error": {"type": "not_found_error", "message": (
        "POST /v1/v1/messages has /v1 twice: the Anthropic SDK adds /v1/messages itself, so its base_url is the "
        f'server\'s address without /v1 (base_url="{gateway.url}"). The full path is POST /v1/messages.')}}


def test_unknown_paths_under_v1_messages_keep_anthropic_shape(scripted_fleet):
    url = _gateway(scripted_fleet).url
    answer = httpx.post(f"{url}/v1/messages/render", json={"model": SCRIPTED_MODEL})
    assert answer.status_code == 404
    body = answer.json()
    assert set(body) == {"type", "error"} and body["type"] == "error" and body["error"]["type"] == "not_found_error"
    assert body["error"]["message"].startswith("llmfleet does not serve POST /v1/messages/render (yet)")
    answer = httpx.post(f"{url}/v1/messages/batches", json={})
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "not_found_error"
    assert answer.json()["error"]["message"].startswith("There is no POST /v1/messages/batches on llmfleet.")


def test_v1_missing_and_an_unknown_path_say_what_to_use(scripted_fleet):
    url = _gateway(scripted_fleet).url
    error = httpx.post(f"{url}/chat/completions", json={}).json()["error"]
    assert error["message"] == ("There is no POST /chat/completions: the API's paths start with /v1 "
                                f'(POST /v1/chat/completions); with the OpenAI SDK, base_url="{url}/v1".')
    answer = httpx.get(f"{url}/v1/no-such-thing")
    assert answer.status_code == 404
    error = answer.json()["error"]
    assert {k: v for k, v in error.items() if k != "message"} == NOT_FOUND
    assert error["message"].startswith(f"There is no GET /v1/no-such-thing on llmfleet. {SERVED_NAMED}")


def test_a_wrong_method_is_a_405_that_names_the_right_one(scripted_fleet):
    url = _gateway(scripted_fleet).url
    answer = httpx.get(f"{url}/v1/chat/completions")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json() == {"error": {"message": "GET is not allowed on /v1/chat/completions; it takes POST.",
                                       "type": "MethodNotAllowedError", "param": None, "code": 405}}
    answer = httpx.get(f"{url}/v1/messages")
    assert answer.status_code == 405 and answer.headers["allow"] == "POST"
    assert answer.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "GET is not allowed on /v1/messages; it takes POST."}}


def test_models_retrieve_gives_the_listed_model_and_an_unknown_one_the_chat_404(scripted_fleet):
    url = _gateway(scripted_fleet).url
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve(SCRIPTED_MODEL)
    assert (model.id, model.object, model.owned_by) == (SCRIPTED_MODEL, "model", "llmfleet")
    listed = next(m for m in httpx.get(f"{url}/v1/models").json()["data"] if m["id"] == SCRIPTED_MODEL)
    assert httpx.get(f"{url}/v1/models/{SCRIPTED_MODEL}").json() == listed
    with pytest.raises(openai.NotFoundError) as raised:
        client.models.retrieve("no-such-model")
    chat = httpx.post(f"{url}/v1/chat/completions", json={"model": "no-such-model", "messages": USER})
    assert raised.value.body == chat.json()["error"] == {
        "message": "The model `no-such-model` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}


def test_models_retrieve_takes_an_id_with_a_slash_and_a_key_sees_only_its_models(keyed_gateway, redis_url):
    url = keyed_gateway.url
    static = openai.OpenAI(base_url=f"{url}/v1", api_key=STATIC_KEY, max_retries=0)
    assert static.models.retrieve(SLASHED_MODEL).id == SLASHED_MODEL  # the SDK sends it as first-hour%2Fslashed-model
    assert static.models.retrieve(SCRIPTED_MODEL).id == SCRIPTED_MODEL
    _name, secret = create_key(redis_url, "--models", SLASHED_MODEL)
    limited = openai.OpenAI(base_url=f"{url}/v1", api_key=secret, max_retries=0)
    assert limited.models.retrieve(SLASHED_MODEL).id == SLASHED_MODEL
    with pytest.raises(openai.NotFoundError) as raised:
        limited.models.retrieve(SCRIPTED_MODEL)  # it exists, but not for this key
    chat = httpx.post(f"{url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"}, timeout=30,
                      json={"model": SCRIPTED_MODEL, "messages": USER, "max_tokens": 2})
    assert raised.value.body == chat.json()["error"] == {
        "message": f"The model `{SCRIPTED_MODEL}` does not exist or you do not have access to it.",
        "type": "NotFoundError", "param": "model", "code": 404}


def test_malformed_json_says_where_in_words(scripted_fleet):
    url = _gateway(scripted_fleet).url
    body = b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}] "max_tokens": 3}'
    column = body.index(b'"max_tokens"') + 1  # where a ',' was due
    answer = httpx.post(f"{url}/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json() == {"error": {
        "message": f"The request body is not valid JSON: Expecting ',' delimiter at line 1 column {column} "
                   f"(char {column - 1}).", "type": "BadRequestError", "param": None, "code": 400}}
    lines = b'{\n  "model": "scripted-model"\n  "prompt": "hi"\n}'
    answer = httpx.post(f"{url}/v1/completions", content=lines, headers={"content-type": "application/json"})
    assert answer.json()["error"]["message"] == ("The request body is not valid JSON: Expecting ',' delimiter at "
                                                 "line 3 column 3 (char 32).")
    answer = httpx.post(f"{url}/v1/messages", content=b'{"model": ', headers={"content-type": "application/json"})
    assert answer.status_code == 400
    assert answer.json() == {"type": "error", "error": {"type": "invalid_request_error", "message": (
        "The request body is not valid JSON: Expecting value at line 1 column 11 (char 10).")}}


# What Python's json.dumps writes for a float nan or inf, or a str with a lone surrogate, and json.loads takes
# back, though it is not JSON; and a body nested deeper than any request is.
NOT_JSON = {
    "nan": (b'"temperature": NaN', "NaN is not a JSON number"),
    "infinity": (b'"top_p": -Infinity', "-Infinity is not a JSON number"),
    "surrogate": (b'"user": "\\ud800"', "no low surrogate in string"),
    "deep": (b'"stop": ' + b"[" * 5000 + b"]" * 5000, "depth limit exceeded"),
}
BODIES = {  # each route's body, before the field that makes it not JSON
    "/v1/chat/completions": b'{"model": "scripted-model", "messages": [{"role": "user", "content": "hi"}], ',
    "/v1/completions": b'{"model": "scripted-model", "prompt": "hi", ',
    "/v1/responses": b'{"model": "scripted-model", "input": "hi", ',
    "/v1/messages": b'{"model": "scripted-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}], ',
    "/tokenize": b'{"model": "scripted-model", "prompt": "hi", ',
    "/v1/embeddings": b'{"model": "scripted-model", "input": "hi", ',
    "/invocations": b'{"model": "scripted-model", "prompt": "hi", ',
}


@pytest.mark.parametrize("path", BODIES)
@pytest.mark.parametrize("case", NOT_JSON)
def test_what_json_loads_takes_but_is_not_json_is_a_400_that_says_so(scripted_fleet, path, case):
    """Each was a 500 (a bare "Internal Server Error", the connection dropped): FastAPI took the body and
    the gateway's own parse, orjson's, refused it."""
    field, words = NOT_JSON[case]
    with httpx.Client(base_url=_gateway(scripted_fleet).url, timeout=30) as client:
        answer = client.post(path, content=BODIES[path] + field + b"}", headers={"content-type": "application/json"})
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert error["message"].startswith(f"The request body is not valid JSON: {words} at line 1 column ")
        assert error["type"] == ("invalid_request_error" if path == "/v1/messages" else "BadRequestError")
        # the same connection serves the next request
        valid = client.post("/v1/completions", json={"model": SCRIPTED_MODEL, "prompt": "hi", "max_tokens": 2})
        assert valid.status_code == 200, valid.text


def test_every_route_reads_its_body_strictly():
    from fastapi.routing import APIRoute

    from gateway.app import ROUTERS
    from gateway.http.json_body import JSONRoute
    routes = [route for router in ROUTERS for route in router.routes if isinstance(route, APIRoute)]
    assert len(routes) > 20 and all(isinstance(route, JSONRoute) for route in routes)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/invocations"])
def test_a_body_without_the_json_content_type_says_to_send_it(scripted_fleet, path):
    url = _gateway(scripted_fleet).url
    chat = {"model": SCRIPTED_MODEL, "messages": '[{"role": "user", "content": "hi"}]'}
    as_curl_d = httpx.post(f"{url}{path}", data=chat)  # application/x-www-form-urlencoded, as curl -d sends
    assert as_curl_d.status_code == 400
    assert as_curl_d.json() == {"error": {"message": (
        "The request body must be JSON, sent with `Content-Type: application/json` (this one says "
        "`application/x-www-form-urlencoded`; curl -d sends application/x-www-form-urlencoded unless given "
        "-H 'Content-Type: application/json')."), "type": "BadRequestError", "param": None, "code": 400}}
    untyped = httpx.post(f"{url}{path}", content=b'{"model": "scripted-model", "prompt": "hi"}')
    assert "content-type" not in untyped.request.headers
    assert untyped.status_code == 400
    assert "(this one has none;" in untyped.json()["error"]["message"]


def test_a_keyless_request_is_counted_under_its_route_and_an_unknown_path_under_one_label(keyed_gateway):
    url = keyed_gateway.url

    def counts() -> tuple[float, ...]:
        return tuple(metric_value(url, "llmfleet_gateway_requests_total", family="llmfleet", endpoint=endpoint,
                                  status="401") for endpoint in ("/v1/models", "/v1/models/{model:path}", "unmatched"))

    before = counts()
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/models/{SCRIPTED_MODEL}").status_code == 401
    for path in ("/v1/no-such-thing", "/v1/audio/transcriptions"):
        assert httpx.post(f"{url}{path}", json={}).status_code == 401
    assert [after - then for after, then in zip(counts(), before)] == [1, 1, 2]
