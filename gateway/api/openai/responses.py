"""The OpenAI Responses API: POST /v1/responses (streaming, background), retrieve, delete, cancel.

A Responses request becomes the chat request `vllm serve` builds from it (its
`construct_input_messages`): `instructions` a system message, input items chat messages,
function tools chat tools, `text.format` a response_format, `max_output_tokens` max_tokens. The
worker serves it as kind "chat"; `ResponsesFormatter` renders the typed chunks into Responses
events (vLLM's `SimpleStreamingEventProcessor`: one output item per reasoning, text or tool call
run, opened and closed as the delta's kind changes), or into one Response object.

State lives in Redis (gateway/fleet/responses.py), so every replica answers for every response:
`previous_response_id` continues a conversation stored by another gateway, and retrieve, delete,
cancel and resuming a background stream work anywhere. Where `vllm serve` differs (its store is a
per-process dict, off by default), docs/parity.md says how.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import Field, model_validator
from starlette.responses import Response, StreamingResponse

from gateway import tenancy
from gateway.api.openai.protocol import OpenAIModel, cap_output, check_sampling
from gateway.fleet.responses import ResponseStore, StoredResponse
from gateway.fleet.runs import Fleet
from gateway.http.errors import FieldRuleError, error_body, json_response
from gateway.http.json_body import JSONRoute
from gateway.serve import resumable
from gateway.serve.formatter import Formatter
from gateway.serve.generation import life_of, new_envelope, output_ceiling, request_json, serve_generation
from gateway.serve.life import Hook, Outcome
from gateway.serve.sse import SSE_HEADERS
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, SamplingOptions, ToolCallDelta, Usage
from shared.errors import FleetError, ServiceUnavailable

router = APIRouter(route_class=JSONRoute)

ID_PREFIX = "resp_"
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses, with vLLM's defaults and its checks (unknown fields tolerated)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = Field(default=None, ge=-(2**63), lt=2**63)  # stored and echoed: a 64-bit int
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    include_reasoning: bool = True
    store: bool = True
    background: bool = False
    stream: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str = "auto"
    truncation: Literal["auto", "disabled"] | None = "disabled"
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = 0
    chat_template_kwargs: dict[str, Any] | None = None
    cancel_id: str | None = Field(default=None, min_length=1, max_length=256)
    timeout: float | None = Field(default=None, gt=0)  # seconds; capped by the gateway's limit
    resumable: bool = False  # an extension: the stream survives its client (gateway/serve/resumable.py)

    @model_validator(mode="before")
    @classmethod
    def _vllm_rules(cls, data: Any) -> Any:
        """vLLM's ResponsesRequest checks, with its messages (before the schema, as vLLM runs them)."""
        if not isinstance(data, dict):
            return data
        for name in ECHOED_FIELDS:
            if _has_wide_integer(data.get(name)):
                raise FieldRuleError(f"`{name}` holds an integer outside the 64-bit range", param=name)
        if data.get("background") and not data.get("store", True):
            raise FieldRuleError("background can only be used when `store` is true", param="background")
        if data.get("prompt") is not None:
            raise FieldRuleError("prompt template is not supported", param="prompt")
        tools, choice = data.get("tools"), data.get("tool_choice", "auto")
        named = isinstance(choice, dict) and choice.get("type") in ("function", "custom")
        if not tools:
            if choice in ("auto", "none"):
                data = {**data, "tool_choice": "none"}  # what vLLM echoes in the response
            elif choice == "required":
                raise FieldRuleError("Tool choice 'required' must be specified with 'tools' parameter.",
                                     param="tool_choice")
            elif named:
                raise FieldRuleError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
        elif named and isinstance(tools, list):  # tools that are no list: the schema refuses them
            if choice.get("name") not in {t.get("name") for t in tools if isinstance(t, dict)}:
                raise FieldRuleError("Tool choice 'function' not found in 'tools' parameter.", param="tool_choice")
        return data

    @model_validator(mode="after")
    def _shapes(self) -> ResponsesRequest:
        if isinstance(self.input, list):
            for item in self.input:
                _check_item(item)
        for tool in self.tools:
            if tool.get("type") == "function" and not tool.get("name"):
                raise FieldRuleError("a function tool needs a `name`", param="tools")
        fmt = (self.text or {}).get("format") or {}
        if fmt.get("type") == "json_schema" and not isinstance(fmt.get("schema"), dict):
            raise FieldRuleError("text.format of type 'json_schema' needs a `schema` object", param="text.format")
        if self.resumable and not self.stream:
            raise FieldRuleError("`resumable` needs `stream: true`: only a stream can be resumed.", param="resumable")
        return self


# Free-form fields the Response echoes back as they came: an integer JSON allows but no 64-bit
# encoder writes would fail the answer (a 500), so it is refused up front instead.
ECHOED_FIELDS = ("tools", "tool_choice", "text", "reasoning")


def _has_wide_integer(value: Any) -> bool:
    if isinstance(value, int) and not isinstance(value, bool):
        return not -(2**63) <= value < 2**64
    if isinstance(value, dict):
        return any(_has_wide_integer(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_wide_integer(v) for v in value)
    return False


def _check_item(item: dict[str, Any]) -> None:
    kind = item.get("type", "message" if "role" in item else None)
    if kind not in ITEM_TYPES:
        raise FieldRuleError(f"Unsupported input item type: {kind}", param="input")
    required = {"message": ("role",), "function_call": ("call_id", "name", "arguments"),
                "function_call_output": ("call_id", "output"), "reasoning": ()}[kind]
    missing = [name for name in required if name not in item]
    if missing:
        raise FieldRuleError(f"a {kind} input item needs `{'`, `'.join(missing)}`", param="input")
    if kind == "message" and not isinstance(item.get("content", ""), str | list):
        raise FieldRuleError("a message input item's `content` is a string or a list of content parts", param="input")
    if kind == "reasoning" and item.get("encrypted_content"):
        raise FieldRuleError("Encrypted content is not supported.", param="input")


# --- Responses input -> chat messages (vLLM's construct_input_messages) ---------------------------

def _part(part: Any) -> Any:
    """A content part as the chat API names it (vLLM's chat parser reads both names alike)."""
    if not isinstance(part, dict):
        return part
    if part.get("type") in ("input_text", "output_text"):
        return {"type": "text", "text": part.get("text", "")}
    if part.get("type") == "input_image" and part.get("image_url"):
        return {"type": "image_url", "image_url": {"url": part["image_url"]}}
    return part


def _text_of(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content and isinstance(content[0], dict):
        return content[0].get("text")
    return None


def _item_message(item: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The chat message of one item, or None when it joined `previous` (an assistant turn spans
    its reasoning, text and tool calls)."""
    assistant = previous if previous is not None and previous.get("role") == "assistant" else None
    kind = item.get("type", "message")
    if kind == "function_call":
        call = {"id": item["call_id"], "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]}}
        if assistant is not None:
            assistant.setdefault("tool_calls", []).append(call)
            return None
        return {"role": "assistant", "tool_calls": [call]}
    if kind == "function_call_output":
        return {"role": "tool", "content": item["output"], "tool_call_id": item["call_id"]}
    if kind == "reasoning":
        parts = item.get("content") or item.get("summary") or [{}]
        reasoning = parts[0].get("text", "")
        if assistant is not None and assistant.get("reasoning") is None:
            assistant["reasoning"] = reasoning
            return None
        return {"role": "assistant", "reasoning": reasoning}
    if item["role"] == "assistant":
        text = _text_of(item.get("content"))
        if assistant is not None and assistant.get("content") is None:
            assistant["content"] = text
            return None
        return {"role": "assistant", "content": text}
    message = {key: value for key, value in item.items() if key not in ("type", "id", "status")}
    if isinstance(message.get("content"), list):
        message["content"] = [_part(part) for part in message["content"]]
    return message


def items_to_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for item in items:
        message = _item_message(item, messages[-1] if messages else None)
        if message is not None:
            messages.append(message)
    return messages


def conversation(body: ResponsesRequest, previous: StoredResponse | None) -> list[dict[str, Any]]:
    """The chat messages before `instructions`: the stored history, the previous response's output
    (its reasoning, text and function calls), then this request's input."""
    history = list(previous.history) if previous is not None else []
    if previous is not None:
        history += items_to_messages([_as_input(item) for item in previous.response.get("output", ())])
    if isinstance(body.input, str):
        return history + [{"role": "user", "content": body.input}]
    return history + items_to_messages(body.input)


def _as_input(item: dict[str, Any]) -> dict[str, Any]:
    if item.get("type") == "message":
        return {"type": "message", "role": "assistant", "content": item.get("content") or [{"text": ""}]}
    return item


# --- the chat body -----------------------------------------------------------------------------

def _chat_tool_choice(choice: str | dict[str, Any]) -> str | dict[str, Any]:
    if isinstance(choice, dict):
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format") or {}
    if fmt.get("type") == "json_schema":
        schema = {key: fmt[key] for key in ("name", "schema", "strict", "description") if key in fmt}
        return {"type": "json_schema", "json_schema": {"name": "response", **schema}}
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    return None


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed", "stop", "logit_bias", "user", "chat_template_kwargs",
                   "include_reasoning", "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "include_stop_str_in_output")


def chat_body(body: ResponsesRequest, raw: dict[str, Any], model: str, messages: list[dict[str, Any]],
              max_tokens: int | None, stream: bool) -> dict[str, Any]:
    chat: dict[str, Any] = {"model": model, "messages": messages, "stream": stream}
    chat.update({name: raw[name] for name in SAMPLING_FIELDS if raw.get(name) is not None})
    if max_tokens is not None:
        chat["max_tokens"] = max_tokens
    functions = [t for t in body.tools if t.get("type", "function") == "function"]
    if functions:
        chat["tools"] = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}
                         for t in functions]
        chat["tool_choice"] = _chat_tool_choice(body.tool_choice)
        chat["parallel_tool_calls"] = body.parallel_tool_calls
    if (response_format := _response_format(body.text)) is not None:
        chat["response_format"] = response_format
    if body.reasoning and body.reasoning.get("effort"):
        chat["reasoning_effort"] = body.reasoning["effort"]
    return chat


def sampling_options(body: ResponsesRequest, max_tokens: int | None) -> SamplingOptions:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    return SamplingOptions(max_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                           min_p=body.min_p, seed=body.seed, presence_penalty=body.presence_penalty,
                           frequency_penalty=body.frequency_penalty, repetition_penalty=body.repetition_penalty,
                           logit_bias=body.logit_bias, stop=stop)


# --- rendering ---------------------------------------------------------------------------------

def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": None}


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "content": [_text_part(text)] if text else [], "role": "assistant", "status": status,
            "type": "message", "phase": None}


def _reasoning_item(item_id: str, text: str, status: str | None) -> dict[str, Any]:
    return {"id": item_id, "summary": [], "type": "reasoning",
            "content": [{"text": text, "type": "reasoning_text"}], "encrypted_content": None, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"arguments": arguments, "call_id": call_id, "name": name, "type": "function_call", "id": item_id,
            "async": None, "caller": None, "namespace": None, "status": status}


STATUS_BY_FINISH = {"length": "incomplete", "cancelled": "cancelled", "error": "failed"}
# The event that ends a stream, by the response's status. A cancelled response ends with
# response.incomplete: the API names no event of its own for it, and the SDK's stream ends on this one.
FINAL_EVENTS = {"completed": "response.completed", "incomplete": "response.incomplete",
                "cancelled": "response.incomplete", "failed": "response.failed"}


LATE_FIELDS = {"response.function_call_arguments.done": ("name",)}


def _shaped(kind: str, sequence: int, **fields: Any) -> dict[str, Any]:
    """Event `sequence` of kind `kind`, its fields in the order of the OpenAI SDK's event types, as
    vllm serve writes them: by name, but for a field the SDK added later (LATE_FIELDS), which comes last."""
    fields.update(sequence_number=sequence, type=kind)
    late = LATE_FIELDS.get(kind, ())
    return dict(sorted(fields.items(), key=lambda field: (field[0] in late, field[0])))


class ResponsesFormatter(Formatter):
    """Chunks -> Responses events, each with its `sequence_number`; or one Response object."""

    endpoint = "responses"
    named_events = True
    done_marker = None

    def __init__(self, body: ResponsesRequest, envelope: RequestEnvelope, max_model_len: int):
        # Not the chat base's state (choices, running usage): a Response has one output stream.
        self.body = body
        self.response_id = ID_PREFIX + envelope.request_id
        self.created = int(envelope.arrival)
        self.model = envelope.model
        self.max_model_len = max_model_len
        self.max_tokens = envelope.params.max_tokens
        self.prompt_tokens = 0
        self.sequence = 0
        self.started = False
        self.state: str | None = None  # "reasoning", "text", "call" or None: the open output item
        self.item: dict[str, Any] = {}
        self.call_index: int | None = None
        self.output: list[dict[str, Any]] = []
        self.final: dict[str, Any] | None = None  # the whole Response once it has ended

    # -- the Response object --
    def response_object(self, status: str, output: list[dict[str, Any]], usage: Usage | None = None,
                        error: FleetError | None = None) -> dict[str, Any]:
        body = self.body
        sampling = body.temperature, body.top_p
        room = self.max_model_len - self.prompt_tokens
        response = {
            "id": self.response_id, "created_at": self.created,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "metadata": body.metadata, "model": self.model,
            "object": "response", "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "temperature": 1.0 if sampling[0] is None else sampling[0], "tool_choice": body.tool_choice,
            "tools": body.tools, "top_p": 1.0 if sampling[1] is None else sampling[1], "background": body.background,
            "max_output_tokens": min(self.max_tokens, room) if self.max_tokens is not None else room,
            "max_tool_calls": body.max_tool_calls, "previous_response_id": body.previous_response_id,
            "prompt": None, "reasoning": body.reasoning, "service_tier": body.service_tier, "status": status,
            "text": body.text, "top_logprobs": None, "truncation": body.truncation,
            "usage": _usage(usage) if usage is not None else None, "user": body.user,
            "presence_penalty": body.presence_penalty or 0.0, "frequency_penalty": body.frequency_penalty or 0.0,
            "kv_transfer_params": None, "ec_transfer_params": None, "input_messages": None,
            "output_messages": None,
        }
        if error is not None:
            response["error"] = {"code": "server_error" if error.status >= 500 else "invalid_prompt",
                                 "message": error.message}
        return response

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        self._take_usage(terminal)
        candidate = (terminal.candidates or [Candidate(0, finish_reason=terminal.finish_reason)])[0]
        output = []
        if candidate.reasoning and self.body.include_reasoning:
            output.append(_reasoning_item(_item_id("rs"), candidate.reasoning, None))
        if candidate.text:
            output.append(_message_item(_item_id("msg"), candidate.text, "completed"))
        for call in candidate.tool_calls or ():
            output.append(_call_item(_item_id("fc"), call.id or _item_id("call"), call.name or "", call.arguments,
                                     "completed"))
        status = STATUS_BY_FINISH.get(candidate.finish_reason or terminal.finish_reason, "completed")
        self.final = self.response_object(status, output, terminal.usage)
        return self.final

    # -- events --
    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        """The next event (`_shaped`)."""
        event = _shaped(kind, self.sequence, **fields)
        self.sequence += 1
        return event

    def _take_usage(self, chunk: GenerationChunk) -> None:
        if chunk.usage is not None and chunk.usage.prompt_tokens:
            self.prompt_tokens = chunk.usage.prompt_tokens

    def _opening(self) -> list[dict[str, Any]]:
        if self.started:
            return []
        self.started = True
        created = self.response_object("in_progress", [])
        return [self._event("response.created", response=created),
                self._event("response.in_progress", response=created)]

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        self._take_usage(chunk)
        events = self._opening()
        if chunk.reasoning and self.body.include_reasoning:
            events += self._into("reasoning") + self._reasoning_delta(chunk.reasoning)
        if chunk.text:
            events += self._into("text") + self._text_delta(chunk.text)
        for call in chunk.tool_calls or ():
            events += self._into("call", call) + self._arguments_delta(call.arguments)
        if chunk.done:
            events += self._close()
            status = STATUS_BY_FINISH.get(chunk.finish_reason, "completed")
            self.final = self.response_object(status, self.output, chunk.usage)
            events.append(self._event(FINAL_EVENTS[status], response=self.final))
        return events

    def error_events(self, error: FleetError) -> list[dict[str, Any]]:
        events = self._opening() + self._close() + self.lost_events(error, self.sequence)
        self.sequence += 1
        self.final = self.response_object("failed", self.output, None, error)
        return events + [self._event("response.failed", response=self.final)]

    @classmethod
    def lost_events(cls, error: FleetError, first_id: int) -> list[dict[str, Any]]:
        """The `error` event alone: `response.failed` carries the output so far, which a follower
        on another gateway does not have (a retrieve of the response reads it as failed)."""
        return [_shaped("error", first_id, code=error.code, message=error.message, param=error.param)]

    def _into(self, state: str, call: ToolCallDelta | None = None) -> list[dict[str, Any]]:
        """Close the open item and open one of `state`, unless it is already the open one."""
        if self.state == state and (state != "call" or call.index == self.call_index):
            return []
        events = self._close()
        self.state = state
        index = len(self.output)
        if state == "call":
            self.call_index = call.index
            self.item = _call_item(_item_id("fc"), call.id or _item_id("call"), call.name or "", "", "in_progress")
            return events + [self._event("response.output_item.added", output_index=index, item=self.item)]
        if state == "text":
            self.item = _message_item(_item_id("msg"), "", "in_progress")
            part = {**_text_part(""), "logprobs": []}
        else:
            self.item = _reasoning_item(_item_id("rs"), "", "in_progress")
            self.item["content"] = None
            part = {"text": "", "type": "reasoning_text"}
        self.item["text"] = ""
        return events + [self._event("response.output_item.added", output_index=index,
                                     item={k: v for k, v in self.item.items() if k != "text"}),
                         self._event("response.content_part.added", output_index=index, item_id=self.item["id"],
                                     content_index=0, part=part)]

    def _where(self) -> dict[str, Any]:
        return {"output_index": len(self.output), "item_id": self.item["id"]}

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        self.item["text"] += text
        return [self._event("response.output_text.delta", content_index=0, delta=text, logprobs=[], **self._where())]

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        self.item["text"] += text
        return [self._event("response.reasoning_text.delta", content_index=0, delta=text, **self._where())]

    def _arguments_delta(self, arguments: str) -> list[dict[str, Any]]:
        if not arguments:
            return []
        self.item["arguments"] += arguments
        return [self._event("response.function_call_arguments.delta", delta=arguments, **self._where())]

    def _close(self) -> list[dict[str, Any]]:
        """The .done events of the open item, which joins the output."""
        if self.state is None:
            return []
        where, state = self._where(), self.state
        self.state = None
        if state == "call":
            item = {**self.item, "status": "completed"}
            events = [self._event("response.function_call_arguments.done", arguments=item["arguments"],
                                  name=item["name"], **where)]
        elif state == "text":
            text = self.item["text"]
            item = _message_item(self.item["id"], text, "completed")
            part = _text_part(text)
            events = [self._event("response.output_text.done", content_index=0, text=text, logprobs=[], **where),
                      self._event("response.content_part.done", content_index=0, part=part, **where)]
        else:
            text = self.item["text"]
            item = _reasoning_item(self.item["id"], text, "completed")
            events = [self._event("response.reasoning_text.done", content_index=0, text=text, **where),
                      self._event("response.content_part.done", content_index=0,
                                  part={"text": text, "type": "reasoning_text"}, **where)]
        self.output.append(item)
        return events + [self._event("response.output_item.done", output_index=where["output_index"], item=item)]


def _usage(usage: Usage) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0,
                                 "input_tokens_per_turn": [], "cached_tokens_per_turn": []},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0, "tool_output_tokens": 0,
                                  "output_tokens_per_turn": [], "tool_output_tokens_per_turn": []},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


# --- routes ------------------------------------------------------------------------------------

@dataclass(slots=True)
class Record:
    """Where one response is stored: its tenant's record, with the history it continued and its input."""

    store: ResponseStore
    tenant: str
    history: list[dict[str, Any]]
    input: list[dict[str, Any]]

    async def save(self, response: dict[str, Any]) -> None:
        await self.store.save(response, self.history, self.tenant, self.input)


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as `input_items` lists it: items with ids, a message's text as parts."""
    items = [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    listed = []
    for item in items:
        item = {"type": item.get("type", "message"), **item}
        if item["type"] == "message" and isinstance(item.get("content"), str):
            item["content"] = [{"type": "input_text", "text": item["content"]}]
        item.setdefault("id", _item_id({"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(
            item["type"], "item")))
        listed.append(item)
    return listed


def not_found(response_id: str) -> Response:
    return json_response(error_body(f"Response with id '{response_id}' not found.", 404, "response_id",
                                    "invalid_request_error"), 404)


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    fleet: Fleet = request.app.state.fleet
    tenant = tenancy.current().name
    raw = await request_json(request)
    view = await fleet.registry.resolve(body.model)
    previous = await fleet.responses.get(body.previous_response_id, tenant) if body.previous_response_id else None
    if body.previous_response_id and previous is None:  # unknown, expired, or another tenant's
        return not_found(body.previous_response_id)
    history = conversation(body, previous)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + history
    max_tokens = min(body.max_output_tokens, view.max_model_len) if body.max_output_tokens is not None else None
    params = sampling_options(body, max_tokens)
    check_sampling(params, view.max_model_len, "max_output_tokens")
    max_tokens = cap_output(params, output_ceiling(fleet.settings), "max_output_tokens", view.max_model_len,
                            given=max_tokens is not None) or max_tokens
    stream = body.stream or body.background  # a background run keeps its events for a later reader
    chat = chat_body(body, raw, view.name, messages, max_tokens, stream)
    envelope = new_envelope(chat, "chat", view.name, fleet.settings, body=None, params=params)
    envelope.stream, envelope.cancel_id = stream, body.cancel_id
    if body.timeout:
        envelope.deadline = min(envelope.deadline, envelope.arrival + body.timeout)
    formatter = ResponsesFormatter(body, envelope, view.max_model_len)
    record = Record(fleet.responses, tenant, history, input_items(body))
    detached = body.background or body.resumable  # runs on without its client: its own end stores it
    hooks = [_store_end(record, formatter, detached)] if body.store else []
    if body.background:
        return await _start_background(fleet, record, envelope, formatter, hooks)
    return await serve_generation(request, fleet, envelope, formatter, resumable=body.resumable, hooks=hooks)


async def _start_background(fleet: Fleet, record: Record, envelope: RequestEnvelope, formatter: ResponsesFormatter,
                            hooks: list[Hook]) -> Response:
    """Store the response as queued, run it detached from this request (gateway/serve/resumable.py:
    its events kept in Redis for any replica to follow), and answer at once: the queued Response,
    or for `stream` the events as they come. Its end is stored by the run, whoever listens."""
    queued = formatter.response_object("queued", [])
    await record.save(queued)
    try:
        await resumable.run_detached(fleet, life_of(fleet, envelope, formatter.endpoint, hooks), formatter)
    except FleetError as exc:  # not queued (429, 503): the response never existed
        await record.store.delete(queued["id"], record.tenant)
        return formatter.error_response(exc)
    if formatter.body.stream:
        return StreamingResponse(await resumable.follow(fleet, queued["id"], None, record.tenant),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    return json_response(queued)


def _store_end(record: Record, formatter: ResponsesFormatter, detached: bool) -> Hook:
    """The Response's end, stored: as its client read it; for a run detached from its client
    (background, resumable), whatever it was, a failure or a cancel too, once it was queued."""
    async def store_end(outcome: Outcome) -> None:
        final = formatter.final  # None when the run ended before its last event
        if final is None and detached and outcome.queued:
            error = outcome.error if isinstance(outcome.error, FleetError) else ServiceUnavailable(
                "The response was cancelled before it finished: no client read it within its grace, its gateway "
                "stopped, or the request queue became unreachable.")
            final = formatter.response_object("failed", formatter.output, None, error)
        if final is not None:
            await record.save(final)

    return store_end


@router.get("/v1/responses/{response_id}")
async def retrieve_response(response_id: str, request: Request, stream: bool = False,
                            starting_after: int | None = None) -> Response:
    fleet: Fleet = request.app.state.fleet
    tenant = tenancy.current().name
    stored = await fleet.responses.get(response_id, tenant)
    if stored is None:
        return not_found(response_id)
    if stream:  # replay the kept events after `starting_after`, then follow the live ones
        return StreamingResponse(await resumable.follow(fleet, response_id, starting_after, tenant),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    response = stored.response
    if response["status"] in ("queued", "in_progress") and await resumable.relay_gone(fleet, response_id):
        # Its gateway died with it (its workers stopped the run): it will never end on its own.
        failed = {**response, "status": "failed", "error": {
            "code": "server_error", "message": "The gateway running this response stopped before it finished; "
                                               "create it again."}}
        if await fleet.responses.fail(failed, tenant):
            response = failed
        elif (stored := await fleet.responses.get(response_id, tenant)) is not None:  # it ended meanwhile
            response = stored.response
    return json_response(response)


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=100),
                           order: Literal["asc", "desc"] = "desc", after: str | None = None) -> Response:
    """The input items of a stored response, as OpenAI's API lists them (newest first by default)."""
    stored = await request.app.state.fleet.responses.get(response_id, tenancy.current().name)
    if stored is None:
        return not_found(response_id)
    items = stored.input if order == "asc" else stored.input[::-1]
    if after is not None:
        position = next((i for i, item in enumerate(items) if item.get("id") == after), None)
        if position is None:
            return json_response(error_body(f"No input item with id '{after}' in response '{response_id}'.", 400,
                                            "after", "invalid_request_error"), 400)
        items = items[position + 1:]
    page = items[:limit]
    return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                          "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> Response:
    if not await request.app.state.fleet.responses.delete(response_id, tenancy.current().name):
        return not_found(response_id)
    return json_response({"id": response_id, "object": "response", "deleted": True})


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(response_id: str, request: Request) -> Response:
    fleet: Fleet = request.app.state.fleet
    store = fleet.responses
    tenant = tenancy.current().name
    before = await store.cancel(response_id, tenant)
    if before is None:
        return not_found(response_id)
    if before not in ("queued", "in_progress"):
        return json_response(error_body("Cannot cancel a synchronous response.", 400, "response_id",
                                        "invalid_request_error"), 400)
    if response_id.startswith(ID_PREFIX):
        await fleet.cancels.cancel_run(response_id.removeprefix(ID_PREFIX), tenant)
    stored = await store.get(response_id, tenant)
    return json_response(stored.response if stored is not None else {"id": response_id, "status": "cancelled"})
