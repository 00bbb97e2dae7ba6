"""The OpenAI Responses API through the official SDK, across two gateways over one Redis.

A response stored through one gateway is continued, retrieved, deleted (and, in background mode,
cancelled and resumed) through the other: the state lives in Redis, not in a process. The
scripted engine repeats the last user message's words, one per token, and finishes with "length"
unless a stop string ends it; tool calls and reasoning need the tiny vLLM model (`vllm` tests).
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import SCRIPTED_MODEL
from tests.procs import start_gateway, start_redis, start_worker, wait_for, wait_until_served

pytestmark = pytest.mark.integration


def clients(scripted_fleet) -> tuple[openai.OpenAI, openai.OpenAI]:
    gateways, _ = scripted_fleet
    return tuple(openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=60) for g in gateways)


def words_of(*texts: str) -> int:
    return sum(len(t.split()) for t in texts)


@pytest.mark.cluster
def test_store_on_one_gateway_continue_retrieve_delete_on_the_other(scripted_fleet):
    one, other = clients(scripted_fleet)
    first = one.responses.create(model=SCRIPTED_MODEL, input="red green blue", instructions="be brief",
                                 max_output_tokens=4)
    assert first.id.startswith("resp_")
    assert first.status == "incomplete" and first.incomplete_details.reason == "max_output_tokens"
    assert first.output_text == "red green blue red"
    assert first.usage.input_tokens == words_of("be brief", "red green blue")
    assert first.usage.output_tokens == 4

    again = other.responses.retrieve(first.id)
    assert again.output_text == first.output_text and again.status == "incomplete"
    assert [item.id for item in again.output] == [item.id for item in first.output]

    # The other replica rebuilds the conversation: the stored input and output, then the new input;
    # the instructions do not carry over.
    follow = other.responses.create(model=SCRIPTED_MODEL, input=[{"role": "user", "content": "yellow"}],
                                    previous_response_id=first.id, max_output_tokens=2)
    assert follow.output_text == "yellow yellow"
    assert follow.previous_response_id == first.id
    assert follow.usage.input_tokens == words_of("red green blue", "red green blue red", "yellow")
    third = one.responses.create(model=SCRIPTED_MODEL, input="cyan", previous_response_id=follow.id,
                                 max_output_tokens=1)
    assert third.usage.input_tokens == words_of("red green blue", "red green blue red", "yellow", "yellow yellow",
                                                "cyan")

    other.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        one.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        one.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        one.responses.create(model=SCRIPTED_MODEL, input="x", previous_response_id=first.id)
    assert missing.value.body == {"message": f"Response with id '{first.id}' not found.",
                                  "type": "invalid_request_error", "param": "response_id", "code": 404}
    assert other.responses.retrieve(follow.id).output_text == "yellow yellow"  # the rest stays


def test_stream_events_and_their_ids_then_the_same_response_retrieved_elsewhere(scripted_fleet):
    one, other = clients(scripted_fleet)
    body = {"model": SCRIPTED_MODEL, "input": "alpha beta gamma stop", "extra_body": {"stop": ["stop"]}}
    whole = one.responses.create(**body)
    assert whole.status == "completed" and whole.output_text == "alpha beta gamma "

    with one.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert final.output_text == whole.output_text and final.status == "completed"
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    stored = other.responses.retrieve(final.id)
    assert stored.output_text == final.output_text
    assert stored.output[0].id == final.output[0].id  # the stored object is the one streamed

    # On the wire: each event named, as vllm serve frames it (no id line: the stream is not resumable).
    gateway = scripted_fleet[0][0]
    raw = httpx.post(f"{gateway.url}/v1/responses", timeout=60, json={
        "model": SCRIPTED_MODEL, "input": "alpha beta gamma stop", "stop": ["stop"], "stream": True})
    frames = [f for f in raw.text.split("\n\n") if f.strip()]
    for number, frame in enumerate(frames):
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        assert list(lines) == ["event", "data"], frame
        assert f'"sequence_number":{number}' in lines["data"]
        assert f'"type":"{lines["event"]}"' in lines["data"]
    assert "[DONE]" not in raw.text


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(scripted_fleet):
    one, _ = clients(scripted_fleet)
    events = list(one.responses.create(model=SCRIPTED_MODEL, input="one two", max_output_tokens=3, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output[0].content[0].text == "one two one"


def test_store_false_keeps_nothing(scripted_fleet):
    one, other = clients(scripted_fleet)
    response = one.responses.create(model=SCRIPTED_MODEL, input="quiet", store=False, max_output_tokens=1)
    assert response.output_text == "quiet"
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(response.id)


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"input": "x", "background": True, "store": False}, 400, "background"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     400, "tool_choice"),
    ({"input": "x", "tools": 1, "tool_choice": {"type": "function", "name": "g"}}, 400, "body.tools"),  # was a 500
    ({"input": [{"role": "user", "content": 5}]}, 400, "input"),  # was a 500 on the scripted engine
    ({"input": [{"type": "computer_call", "id": "c"}]}, 400, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input"),
    ({"input": "x", "max_output_tokens": 0}, 400, "max_tokens"),  # vLLM's sampling check names it so
    ({"input": "x", "temperature": 3}, 400, "temperature"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, 404, "response_id"),
    ({}, 400, "body.input"),
    ({"input": 42}, 400, "body.input"),  # not "body.input.str": pydantic's union branches left out, as vLLM
])
def test_bad_requests_get_openai_errors(scripted_fleet, body, status, param):
    gateway = scripted_fleet[0][0]
    answer = httpx.post(f"{gateway.url}/v1/responses", json={"model": SCRIPTED_MODEL, **body}, timeout=30)
    assert answer.status_code == status, answer.text
    error = answer.json()["error"]
    assert error["param"] == param and error["message"], error


def test_unknown_ids_are_404_and_a_finished_response_cannot_be_cancelled(scripted_fleet):
    one, other = clients(scripted_fleet)
    for call in (one.responses.retrieve, one.responses.delete, one.responses.cancel):
        with pytest.raises(openai.NotFoundError):
            call("resp_0123456789abcdef")
    done = one.responses.create(model=SCRIPTED_MODEL, input="done", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError) as refused:
        other.responses.cancel(done.id)
    assert refused.value.body["message"] == "Cannot cancel a synchronous response."


def test_function_call_items_become_the_chat_history(scripted_fleet):
    """A tool round trip as input: the scripted engine counts every message's words, so the
    function call's output and the assistant's text reach the prompt; the last user turn leads."""
    one, _ = clients(scripted_fleet)
    response = one.responses.create(model=SCRIPTED_MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "weather in paris"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "look it up"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny and warm"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "it is sunny"}]},
        {"role": "user", "content": "thanks"},
    ])
    assert response.output_text == "thanks thanks"
    assert response.usage.input_tokens == words_of("weather in paris", "sunny and warm", "it is sunny", "thanks")


@pytest.fixture(scope="module")
def bounded_store():
    """A fleet of its own (the store's index is Redis-wide): at most 20 stored responses, 120 s each."""
    redis = start_redis()
    worker = start_worker(redis.url, SCRIPTED_MODEL)
    gateway = start_gateway(redis.url, "--response-store-max-entries", "20", "--response-store-ttl", "120",
                            "--response-store-max-bytes", "4000")
    wait_until_served(gateway, SCRIPTED_MODEL)
    yield redis, gateway
    for proc in (gateway, worker, redis):
        proc.stop()


@pytest.mark.cluster
def test_a_flood_of_stored_responses_stays_bounded(bounded_store):
    from shared import redis_pool

    redis, gateway = bounded_store
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    ids = [client.responses.create(model=SCRIPTED_MODEL, input=f"flood {i}", max_output_tokens=2).id
           for i in range(60)]
    store = redis_pool.connect_sync(redis.url)
    stored = [k.decode() for k in store.scan_iter(match="llmfleet:response*")]
    hashes = [k for k in stored if k.startswith("llmfleet:response:")]
    assert len(hashes) == 20, len(hashes)
    assert store.zcard("llmfleet:responses:{stored}") == 20
    for key in stored:
        assert 0 < store.ttl(key) <= 120, key
    for old in ids[:40]:  # the oldest went first
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(old)
    assert client.responses.retrieve(ids[-1]).output_text == "flood 59"
    # A response larger than the byte bound is answered, not stored.
    big = client.responses.create(model=SCRIPTED_MODEL, input="word " * 1000, max_output_tokens=1)
    assert big.output_text == "word"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(big.id)
    wait_for(lambda: store.zcard("llmfleet:responses:{stored}") == 20, 5, "the index to stay at its bound")


# --- background mode: runs on without its client; cancel and resume from the other replica ------

def wait_for_status(client: openai.OpenAI, response_id: str, timeout: float = 60):
    return wait_for(lambda: (r := client.responses.retrieve(response_id)).status not in ("queued", "in_progress")
                    and r, timeout, f"{response_id} to end")


def test_background_answers_at_once_runs_on_and_is_read_from_the_other_replica(scripted_fleet):
    one, other = clients(scripted_fleet)
    queued = one.responses.create(model=SCRIPTED_MODEL, input="slow words then stop", background=True,
                                  extra_body={"stop": ["stop"]})
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = wait_for_status(other, queued.id)
    assert done.status == "completed" and done.output_text == "slow words then "
    # Its events are kept: the whole stream replays on either replica, ids and sequence numbers equal.
    events = list(other.responses.retrieve(queued.id, stream=True))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == done.output_text


@pytest.mark.cluster
def test_a_background_stream_resumed_on_the_other_replica_equals_the_whole_stream(scripted_fleet):
    gateways, _ = scripted_fleet
    body = {"model": SCRIPTED_MODEL, "input": "a resumable stream of words", "max_output_tokens": 400,
            "background": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{gateways[0].url}/v1/responses", json=body) as first:
            assert first.status_code == 200
            head = ""
            for text in first.iter_text():
                head += text
                if head.count("\n\n") >= 8:
                    break  # the client goes away mid-stream; the response runs on
        frames = [f for f in head.split("\n\n") if f.strip()][:8]
        last_id = int(dict(line.split(": ", 1) for line in frames[-1].splitlines())["id"])
        response_id = next(line for line in frames[0].splitlines() if line.startswith("data: "))
        response_id = response_id.split('"id":"', 1)[1].split('"', 1)[0]
        rest = http.get(f"{gateways[1].url}/v1/responses/{response_id}",
                        params={"stream": "true", "starting_after": last_id}).text
        whole = http.get(f"{gateways[1].url}/v1/responses/{response_id}", params={"stream": "true"}).text
    assert "\n\n".join(frames) + "\n\n" + rest == whole
    assert "event: response.incomplete" in whole.rsplit("\n\n", 2)[-2]  # max_output_tokens reached
    stored = openai.OpenAI(base_url=f"{gateways[0].url}/v1", api_key="x").responses.retrieve(response_id)
    assert stored.status == "incomplete" and stored.usage.output_tokens == 400


@pytest.mark.cluster
def test_cancel_a_background_response_from_the_other_replica(scripted_fleet):
    one, other = clients(scripted_fleet)
    # 400 tokens per second: 4000 tokens would take 10 s.
    queued = one.responses.create(model=SCRIPTED_MODEL, input="long long way", background=True,
                                  max_output_tokens=4000)
    stream = other.responses.retrieve(queued.id, stream=True)
    deltas = 0
    for event in stream:
        deltas += event.type == "response.output_text.delta"
        if deltas == 5:
            break
    cancelled = other.responses.cancel(queued.id)
    assert cancelled.status == "cancelled"
    final = wait_for(lambda: (r := one.responses.retrieve(queued.id)).usage is not None and r, 30,
                     "the cancelled run to store its end")
    assert final.status == "cancelled"
    assert 5 <= final.usage.output_tokens < 4000  # the worker stopped
    events = list(one.responses.retrieve(queued.id, stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        one.responses.cancel(queued.id)  # a cancelled response stays cancelled


# --- tool calls and reasoning on the tiny vLLM model ----------------------------------------------

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}


class TinyWorker:
    """The session's vLLM workers of the tiny model (tests/conftest.py), with a client of each gateway."""

    def __init__(self, workers):
        self.workers = workers

    def serve(self, profile: str) -> tuple[str, openai.OpenAI, openai.OpenAI]:
        name = self.workers.serve(profile)
        one, other = (openai.OpenAI(base_url=f"{g.url}/v1", api_key="x", max_retries=0, timeout=300)
                      for g in self.workers.gateways)
        return name, one, other


@pytest.fixture(scope="module")
def tiny_worker(parser_workers):
    return TinyWorker(parser_workers)


@pytest.mark.vllm
def test_a_function_call_round_trip_across_gateways(tiny_worker):
    model, one, other = tiny_worker.serve("tools")
    # One call (parallel_tool_calls false): the grammar lets the model end after it.
    ask = {"model": model, "input": "What is the weather in Paris?", "tools": [WEATHER], "tool_choice": "required",
           "parallel_tool_calls": False, "temperature": 0, "max_output_tokens": 100}
    first = one.responses.create(**ask)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id, first.output
    arguments = json.loads(calls[0].arguments)
    assert arguments["city"] in ("Paris", "Tokyo")

    with other.responses.stream(**ask) as stream:  # greedy: the same call, streamed
        events = list(stream)
        streamed = stream.get_final_response()
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert json.loads(deltas) == arguments and json.loads(done[0].arguments) == arguments
    assert done[0].name == "get_weather"
    assert [i.name for i in streamed.output if i.type == "function_call"] == ["get_weather"]

    # The tool's result goes back through the other replica, as the next turn of the stored response.
    answer = other.responses.create(model=model, previous_response_id=first.id, tools=[WEATHER], temperature=0,
                                    max_output_tokens=8, input=[{"type": "function_call_output",
                                                                 "call_id": calls[0].call_id, "output": "sunny"}])
    assert answer.status in ("completed", "incomplete")
    assert answer.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens - 1


@pytest.mark.vllm
def test_reasoning_items_streamed_and_whole_agree(tiny_worker):
    model, one, other = tiny_worker.serve("think")
    ask = {"model": model, "input": "Hello there, how are you today?", "temperature": 0, "max_output_tokens": 24}
    whole = one.responses.create(**ask)
    assert whole.output[0].type == "reasoning" and whole.output[0].content[0].text
    assert 0 < whole.usage.output_tokens <= 24
    events = list(other.responses.create(**ask, stream=True))
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == whole.output[0].content[0].text
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    assert events[-1].response.status == whole.status
    assert [e.sequence_number for e in events] == list(range(len(events)))
