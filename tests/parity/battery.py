"""The requests both servers get: every feature of the OpenAI surface, valid and invalid.

A `Case` is one HTTP request. Greedy decoding or a fixed seed makes the engine deterministic,
so the two answers must be identical but for ids and timestamps. Profiles name the server
pair a case needs: "tools" (`--enable-auto-tool-choice --tool-call-parser hermes`) and
"think" (`--reasoning-parser deepseek_r1`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

TOOLS_MODEL = "tiny-tools"
THINK_MODEL = "tiny-think"
MAX_MODEL_LEN = 2048
TOO_LONG = "word " * (MAX_MODEL_LEN + 200)  # a prompt longer than the context


@dataclass(frozen=True)
class Case:
    feature: str
    name: str
    path: str
    body: Any  # a JSON body, or raw bytes sent as they are
    profile: str = "tools"
    invalid: bool = False
    # (status, type, param) the API itself (OpenAI's, Anthropic's) answers where `vllm serve` accepts
    # the request: llmfleet is held to it instead (docs/compatibility.md).
    api: tuple[int, str, str] | None = None
    # (status, type, param, code) llmfleet answers where `vllm serve`'s answer is its framework's,
    # which says nothing to a newcomer (a body that is not JSON: a repr of pydantic's error, its
    # param "body.<char>"): llmfleet is held to its own, in words (gateway/http/errors.py).
    ours: tuple[int, str, str | None, int | None] | None = None

    @property
    def stream(self) -> bool:
        return isinstance(self.body, dict) and bool(self.body.get("stream"))


@dataclass
class Battery:
    cases: list[Case] = field(default_factory=list)

    def add(self, feature: str, name: str, path: str, body: Any, *, both: bool = False, **kwargs) -> None:
        """Add a case; `both` adds it once streaming and once not."""
        if both:
            self.cases.append(Case(feature, f"{name} (non-stream)", path, {**body, "stream": False}, **kwargs))
            self.cases.append(Case(feature, f"{name} (stream)", path, {**body, "stream": True}, **kwargs))
        else:
            self.cases.append(Case(feature, name, path, body, **kwargs))


HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]
NOT_JSON = (400, "BadRequestError", None, 400)  # llmfleet's answer to a body that is not JSON (`Case.ours`)
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo"]}},
                   "required": ["city"], "additionalProperties": False},
    "strict": True}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {"tz": {"type": "string", "enum": ["UTC", "CET"]}},
                   "required": ["tz"], "additionalProperties": False},
    "strict": True}}
PERSON_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                 "required": ["name", "age"], "additionalProperties": False}


# Inline media (no fetch): a 1x1 PNG and a silent 1-sample WAV.
TINY_PNG = ("data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQ"
            "AAAABJRU5ErkJggg==")
TINY_WAV = "UklGRiYAAABXQVZFZm10IBAAAAABAAEAQB8AAIA+AAACABAAZGF0YQIAAAAAAA=="


# Where the tiny model's first required tool call ends (see "tool_choice required" below).
CALL_ENDS = 46


def chat(**extra) -> dict[str, Any]:
    return {"model": TOOLS_MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 8, **extra}


def completion(**extra) -> dict[str, Any]:
    return {"model": TOOLS_MODEL, "prompt": "Once upon a time", "temperature": 0, "max_tokens": 8, **extra}


def think(**extra) -> dict[str, Any]:
    return {"model": THINK_MODEL, "messages": HELLO, "temperature": 0, "max_tokens": 24, **extra}


def build() -> list[Case]:
    b = Battery()
    C, P = "/v1/chat/completions", "/v1/completions"

    # Sampling
    b.add("sampling", "greedy", C, chat(), both=True)
    b.add("sampling", "seeded top_p/top_k/min_p", C,
          chat(temperature=0.9, top_p=0.9, top_k=40, min_p=0.05, seed=1234, max_tokens=12), both=True)
    b.add("sampling", "penalties", C,
          chat(presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3, max_tokens=16), both=True)
    b.add("sampling", "logit_bias forces a token", C, chat(logit_bias={"300": 100}, max_tokens=5), both=True)
    b.add("sampling", "stop strings trimmed", C, chat(stop=["e", "t"], max_tokens=30), both=True)
    b.add("sampling", "stop string kept", C, chat(stop="e", include_stop_str_in_output=True, max_tokens=30))
    b.add("sampling", "max_completion_tokens", C, chat(max_tokens=None, max_completion_tokens=5))
    b.add("sampling", "default max_tokens: the room left", C,
          {"model": TOOLS_MODEL, "messages": [{"role": "user", "content": "word " * 240}], "temperature": 0})
    b.add("sampling", "ignore_eos + min_tokens", C, chat(ignore_eos=True, min_tokens=6, max_tokens=6))
    b.add("sampling", "completion greedy", P, completion(), both=True)
    b.add("sampling", "completion seeded", P, completion(temperature=1.0, seed=7, max_tokens=10), both=True)
    b.add("sampling", "completion token-id prompt", P, completion(prompt=[200, 201, 202, 203]))
    b.add("sampling", "several prompts", P, completion(prompt=["Once upon a time", "The harbour at dawn"]),
          both=True)
    b.add("sampling", "several token-id prompts", P, completion(prompt=[[200, 201], [202, 203, 204]]))
    b.add("n>1", "several prompts, n=2 seeded", P,
          completion(prompt=["Once upon a time", "The harbour"], n=2, temperature=1.0, seed=7), both=True)

    # n > 1
    b.add("n>1", "chat n=3", C, chat(n=3, temperature=0.8, seed=11, max_tokens=6), both=True)
    b.add("n>1", "completion n=2", P, completion(n=2, temperature=0.8, seed=5, max_tokens=6), both=True)

    # Logprobs
    b.add("logprobs", "chat top_logprobs=3", C, chat(logprobs=True, top_logprobs=3, max_tokens=5), both=True)
    b.add("logprobs", "chat logprobs only", C, chat(logprobs=True, max_tokens=4))
    b.add("logprobs", "chat sampled top_logprobs=2", C,
          chat(logprobs=True, top_logprobs=2, temperature=1.0, seed=3, max_tokens=6), both=True)
    b.add("logprobs", "completion logprobs=2", P, completion(logprobs=2, max_tokens=5), both=True)
    b.add("logprobs", "completion echo", P, completion(echo=True, max_tokens=4), both=True)
    b.add("logprobs", "completion echo + logprobs", P, completion(echo=True, logprobs=1, max_tokens=3))

    # Stream options
    b.add("stream_options", "include_usage", C, chat(stream=True, stream_options={"include_usage": True}))
    b.add("stream_options", "continuous_usage_stats", C,
          chat(stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    b.add("stream_options", "continuous usage, n=2", C,
          chat(stream=True, n=2, temperature=0.7, seed=9, max_tokens=4,
               stream_options={"include_usage": True, "continuous_usage_stats": True}))
    b.add("stream_options", "completion include_usage", P,
          completion(stream=True, stream_options={"include_usage": True}))

    # Structured outputs
    b.add("structured", "json_object", C, chat(response_format={"type": "json_object"}, max_tokens=24), both=True)
    b.add("structured", "json_schema strict", C, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True}},
        max_tokens=40), both=True)
    b.add("structured", "response_format text", C, chat(response_format={"type": "text"}))
    b.add("structured", "structured_outputs choice", C, chat(structured_outputs={"choice": ["alpha", "beta"]}))
    b.add("structured", "structured_outputs regex", P,
          completion(structured_outputs={"regex": "[a-c]{3}-[0-9]{2}"}, max_tokens=10))

    # Tools
    tools = [WEATHER_TOOL, TIME_TOOL]
    # 46 tokens end the first call at its </tool_call>. Cut inside a second call (60 tokens), vllm
    # serve's stream is not one answer: where the engine's last output carries 9 tokens or more (a
    # loaded machine merges them), vLLM's parser ends the first call's arguments with a spurious
    # "{}" (Parser.finalize_generation, the unstreamed arguments of the call it has begun), and a
    # CI run found `{\t"tz": "CET"}{}` from vllm serve beside llmfleet's `{\t"tz": "CET"}`. Whole,
    # the answer cut there is one answer (the raw text), so that case is sent whole only.
    b.add("tools", "tool_choice required", C, chat(tools=tools, tool_choice="required", max_tokens=CALL_ENDS),
          both=True)
    b.add("tools", "tool_choice required, cut inside a second call", C,
          chat(tools=tools, tool_choice="required", max_tokens=60, stream=False))
    b.add("tools", "tool_choice named", C,
          chat(tools=tools, tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=40),
          both=True)
    b.add("tools", "tool_choice auto", C, chat(tools=tools, tool_choice="auto", max_tokens=12), both=True)
    b.add("tools", "tool_choice none", C, chat(tools=tools, tool_choice="none", max_tokens=8))
    b.add("tools", "required, parallel_tool_calls false", C,
          chat(tools=tools, tool_choice="required", parallel_tool_calls=False, max_tokens=60), both=True)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    b.add("tools", "tool results in history", C, chat(messages=history, tools=tools, max_tokens=8), both=True)

    # Reasoning
    b.add("reasoning", "reasoning split", C, think(), both=True, profile="think")
    b.add("reasoning", "enable_thinking false", C,
          think(chat_template_kwargs={"enable_thinking": False}), both=True, profile="think")
    b.add("reasoning", "include_reasoning false", C, think(include_reasoning=False), profile="think")
    b.add("reasoning", "usage with reasoning tokens", C,
          think(stream=True, stream_options={"include_usage": True}), profile="think")

    # Messages and tolerated fields
    b.add("messages", "content parts", C, chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": "Hello there,"}, {"type": "text", "text": " how are you?"}]}]))
    b.add("messages", "developer + system roles", C, chat(messages=[
        {"role": "developer", "content": "Be brief."}, {"role": "system", "content": "You are tiny."}, *HELLO]))
    b.add("messages", "user, metadata, unknown fields", C,
          chat(user="u-1", metadata={"team": "a"}, some_future_field={"x": 1}))
    b.add("messages", "assistant prefill, continue_final_message", C,
          chat(messages=[*HELLO, {"role": "assistant", "content": "I am"}], add_generation_prompt=False,
               continue_final_message=True))

    # vLLM's extensions: token ids, prompt logprobs, beam search
    b.add("token ids", "chat return_token_ids", C, chat(return_token_ids=True, max_tokens=5), both=True)
    b.add("token ids", "completion return_token_ids", P, completion(return_token_ids=True, max_tokens=5), both=True)
    b.add("token ids", "chat prompt_logprobs", C, chat(prompt_logprobs=2, max_tokens=3))
    b.add("beam search", "chat n=2 beams", C, chat(n=2, use_beam_search=True, max_tokens=5), both=True)
    b.add("beam search", "completion n=3 beams", P, completion(n=3, use_beam_search=True, max_tokens=5))

    # SageMaker's entry point: one route, dispatched on the body
    b.add("invocations", "chat body", "/invocations", chat(), both=True)
    b.add("invocations", "completion body", "/invocations", completion())

    # Tokenizer endpoints
    b.add("tokenize", "tokenize prompt", "/tokenize", {"model": TOOLS_MODEL, "prompt": "Hello there"})
    b.add("tokenize", "tokenize chat", "/tokenize", {"model": TOOLS_MODEL, "messages": HELLO})
    b.add("tokenize", "tokenize with token strings", "/tokenize",
          {"model": TOOLS_MODEL, "prompt": "Once upon", "return_token_strs": True})
    b.add("tokenize", "detokenize", "/detokenize", {"model": TOOLS_MODEL, "tokens": [200, 201, 202]})

    # Invalid requests: same status and error type as vLLM
    bad = {"invalid": True}
    b.add("errors", "temperature -1", C, chat(temperature=-1), **bad)
    b.add("errors", "temperature 3", C, chat(temperature=3), **bad)
    b.add("errors", "missing messages", C, {"model": TOOLS_MODEL}, **bad)
    b.add("errors", "messages as a string", C, chat(messages="hello"), **bad)
    b.add("errors", "unknown role", C, chat(messages=[{"role": "wizard", "content": "hi"}]), **bad)
    b.add("errors", "max_tokens beyond the context", C, chat(max_tokens=MAX_MODEL_LEN + 3000), **bad)
    b.add("errors", "max_completion_tokens beyond the context", C,
          chat(max_tokens=None, max_completion_tokens=MAX_MODEL_LEN + 1), **bad)
    b.add("errors", "max_tokens 0", C, chat(max_tokens=0), **bad)
    b.add("errors", "top_logprobs without logprobs", C, chat(top_logprobs=2), **bad)
    b.add("errors", "top_logprobs 50", C, chat(logprobs=True, top_logprobs=50), **bad)
    b.add("errors", "stream_options without stream", C, chat(stream_options={"include_usage": True}), **bad)
    b.add("errors", "n=2 with greedy sampling", C, chat(n=2), **bad)
    b.add("errors", "n=0", C, chat(n=0), **bad)
    b.add("errors", "top_p 0", C, chat(top_p=0), **bad)
    b.add("errors", "presence_penalty 3", C, chat(presence_penalty=3), **bad)
    b.add("errors", "unknown model", C, chat(model="no-such-model"), **bad)
    b.add("errors", "tool_choice without tools", C, chat(tool_choice="required"), **bad)
    b.add("errors", "empty tools", C, chat(tools=[]), **bad)
    b.add("errors", "broken JSON", C, b'{"model": "tiny-tools", "messages": [', **bad, ours=NOT_JSON)
    b.add("errors", "continue_final_message with add_generation_prompt", C,
          chat(continue_final_message=True, add_generation_prompt=True), **bad)
    b.add("errors", "two structured constraints", C,
          chat(structured_outputs={"choice": ["a"], "regex": "a+"}), **bad)
    b.add("errors", "prompt longer than the context", C,
          chat(messages=[{"role": "user", "content": TOO_LONG}]), **bad)
    b.add("errors", "prompt longer than the context (stream)", C,
          chat(messages=[{"role": "user", "content": TOO_LONG}], stream=True), **bad)
    b.add("errors", "logit_bias token outside the vocabulary", C, chat(logit_bias={"99999": 5}), **bad)
    b.add("errors", "logit_bias token outside the vocabulary (stream)", C,
          chat(logit_bias={"99999": 5}, stream=True), **bad)
    b.add("errors", "completion logprobs 30", P, completion(logprobs=30), **bad)
    b.add("errors", "completion missing prompt", P, {"model": TOOLS_MODEL}, **bad)
    b.add("errors", "completion token id outside the vocabulary", P, completion(prompt=[5, 99999]), **bad)
    b.add("errors", "min_tokens above max_tokens", C, chat(min_tokens=9, max_tokens=4), **bad)
    b.add("errors", "five stop strings", C, chat(stop=["#1", "#2", "#3", "#4", "#5"]), **bad)
    b.add("errors", "five stop strings (completion)", P, completion(stop=["#1", "#2", "#3", "#4", "#5"]), **bad)
    for part in ({"type": "image_url", "image_url": {"url": TINY_PNG}},
                 {"type": "input_audio", "input_audio": {"data": TINY_WAV, "format": "wav"}}):
        b.add("errors", f"{part['type']} part, text-only model", C,
              chat(messages=[{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]), **bad)
    b.add("errors", "json_schema without a schema", C, chat(response_format={"type": "json_schema"}), **bad)
    b.add("errors", "named tool that does not exist", C,
          chat(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), **bad)
    b.add("errors", "invocations body of no known shape", "/invocations", {"model": TOOLS_MODEL, "prompt": 5}, **bad)

    # Rules of the OpenAI API that vllm serve leaves to the chat template: held to the API's answer.
    def openai_rule(param: str) -> dict[str, Any]:
        return {"invalid": True, "api": (400, "invalid_request_error", param)}

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    b.add("errors", "tool message without tool_call_id", C, chat(messages=[
        *HELLO, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "content": "sunny"}]),
        **openai_rule("messages[2].tool_call_id"))
    b.add("errors", "assistant message with neither content nor tool_calls", C, chat(messages=[
        *HELLO, {"role": "assistant"}, *HELLO]), **openai_rule("messages[1].content"))
    b.add("errors", "tool_calls on a user message", C, chat(messages=[{**HELLO[0], "tool_calls": [call]}]),
          **openai_rule("messages[0].tool_calls"))
    return b.cases
