"""POST /v1/messages and /v1/messages/count_tokens: Anthropic Messages on the fleet.

A Messages request becomes the chat request `vllm serve` builds from it (see
gateway.anthropic.protocol) and travels as kind "chat"; workers never learn the family. The
typed chunks that come back are rendered here into Anthropic's message or its events, as
`vllm serve`'s own converter renders its chat chunks (vllm/entrypoints/anthropic/serving.py):

    message_start, ping,
    (content_block_start, content_block_delta..., content_block_stop) per block,
    message_delta (stop_reason, stop_sequence, usage), message_stop

Blocks follow the deltas: reasoning opens a thinking block (closed with its signature_delta),
text a text block, each tool call a tool_use block fed by input_json_delta. Text that arrives
while a tool_use block is open is held and sent as a text block after it, as vLLM does.
Where this differs from `vllm serve` it follows Anthropic's API (docs/parity.md): ids are
`msg_...`, `stop_sequence` is always present, a ping follows message_start, errors have
Anthropic's types and statuses.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.api.anthropic.protocol import CountTokensRequest, MessagesRequest
from gateway.api.openai.protocol import cap_output, check_sampling
from gateway.fleet.registry import ModelView
from gateway.http import anthropic_errors as errors
from gateway.http.errors import json_response
from gateway.http.json_body import JSONRoute
from gateway.serve.formatter import Formatter
from gateway.serve.generation import ask_worker, generation_route, new_envelope, output_ceiling
from gateway.settings import GatewaySettings
from shared.envelopes import Candidate, GenerationChunk, RequestEnvelope, ToolCallDelta, Usage
from shared.errors import FleetError

router = APIRouter(route_class=JSONRoute)


def stop_reason(finish_reason: str | None, stop: str | int | None, tool_used: bool,
                tool_complete: bool) -> tuple[str | None, str | None]:
    """The chat finish as Anthropic's (stop_reason, stop_sequence), by vLLM's rules: max_tokens
    wins; a matched stop string wins unless the tool calls are complete (a call it cut short
    must not run); a named tool call finishes "stop" in chat but is tool_use here."""
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason not in ("stop", "tool_calls"):
        return None, None
    if tool_complete:
        return "tool_use", None
    if isinstance(stop, str):  # the matched stop string; an int is a stop token, not a sequence
        return "stop_sequence", stop
    if finish_reason == "tool_calls" or tool_used:
        return "tool_use", None
    return "end_turn", None


def _usage(usage: Usage | None) -> dict[str, int]:
    """Anthropic's usage, as vLLM builds it: the prompt's tokens found in the engine's prefix cache
    (`cache_read_input_tokens`) and written to it (`cache_creation_input_tokens`) are apart from
    `input_tokens`, and present only where the engine reports them (`--enable-prompt-tokens-details`)."""
    usage = usage or Usage()
    body = {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens}
    for field, count in (("cache_creation_input_tokens", usage.created_cache_tokens),
                         ("cache_read_input_tokens", usage.cached_tokens)):
        if count is not None:
            body["input_tokens"] -= count
            body[field] = count
    body["input_tokens"] = max(0, body["input_tokens"])
    return body


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class _Blocks:
    """The content blocks of one streamed message: which is open, and the events that open,
    feed and close them. Indexes count from 0 in the order blocks open."""

    def __init__(self) -> None:
        self.index = 0  # the open block's index, or the next one's
        self.open: str | None = None  # type of the open block
        self.tool_id: str | None = None  # id of the open tool_use block
        self.held_text: list[str] = []  # text that came while a tool_use block was open
        self.tool_ids: dict[int, str] = {}  # chat tool-call index -> tool_use id
        self.tool_used = False
        self.last_arguments: list[str] = []  # of the latest tool_use block: only it can be cut short

    def start(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        self.open = block["type"]
        self.tool_id = block.get("id")
        return [{"type": "content_block_start", "content_block": block, "index": self.index}]

    def delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "delta": delta, "index": self.index}

    def stop(self) -> list[dict[str, Any]]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":  # vLLM has no signature to give; a random one, as `vllm serve`
            events.append(self.delta({"type": "signature_delta", "signature": uuid.uuid4().hex}))
        events.append({"type": "content_block_stop", "index": self.index})
        self.open = self.tool_id = None
        self.index += 1
        return events

    def stop_and_flush(self) -> list[dict[str, Any]]:
        """Close the open block, then send the text held back while it was a tool_use."""
        held, self.held_text = "".join(self.held_text), []
        events = self.stop()
        if held:
            events += [*self.start({"type": "text", "text": ""}),
                       self.delta({"type": "text_delta", "text": held}), *self.stop()]
        return events

    def switch_to(self, block: dict[str, Any]) -> list[dict[str, Any]]:
        if self.open == block["type"] and block["type"] != "tool_use":
            return []
        return self.stop_and_flush() + self.start(block)

    def reasoning(self, text: str) -> list[dict[str, Any]]:
        events = self.switch_to({"type": "thinking", "thinking": ""})  # its signature comes last, as a delta
        return [*events, self.delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[dict[str, Any]]:
        if self.open == "tool_use":
            self.held_text.append(text)
            return []
        return [*self.switch_to({"type": "text", "text": ""}), self.delta({"type": "text_delta", "text": text})]

    def tool_call(self, call: ToolCallDelta) -> list[dict[str, Any]]:
        events = []
        if call.id is not None:
            self.tool_ids[call.index] = call.id
            if self.tool_id != call.id and call.name is not None:
                self.tool_used = True
                self.last_arguments = []
                events += self.switch_to({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
        if call.arguments and self.tool_id is not None and self.tool_id == self.tool_ids.get(call.index):
            self.last_arguments.append(call.arguments)
            events.append(self.delta({"type": "input_json_delta", "partial_json": call.arguments}))
        return events


class MessagesFormatter(Formatter):
    """Chunks of a chat generation -> an Anthropic message, or its named SSE events.

    The OpenAI bookkeeping of the base (choices, stream_options) has no place here: a message
    is one choice, and its usage is always sent. So the base's __init__ is not used.
    """

    endpoint = "messages"
    id_prefix = "msg"
    named_events = True
    done_marker = None

    def __init__(self, envelope: RequestEnvelope):
        self.response_id = f"msg_{envelope.request_id}"
        self.created = int(envelope.arrival)
        self.model = envelope.model
        self._started = False
        self._input_tokens = 0
        self._finish: str | None = None
        self._stop: str | int | None = None
        self._blocks = _Blocks()

    def stream_events(self, chunk: GenerationChunk) -> list[dict[str, Any]]:
        if chunk.usage is not None:
            self._input_tokens = chunk.usage.prompt_tokens
        events = self._opening_events()
        if chunk.done:
            return events + self._closing_events(chunk)
        if chunk.finish_reason is not None:
            self._finish, self._stop = chunk.finish_reason, chunk.stop_reason
        if chunk.reasoning:
            events += self._blocks.reasoning(chunk.reasoning)
        if chunk.text:
            events += self._blocks.text(chunk.text)
        for call in chunk.tool_calls or ():
            events += self._blocks.tool_call(call)
        return events

    def _opening_events(self) -> list[dict[str, Any]]:
        if self._started:
            return []
        self._started = True
        message = self._message([], None, None, Usage(prompt_tokens=self._input_tokens))
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def _closing_events(self, terminal: GenerationChunk) -> list[dict[str, Any]]:
        blocks = self._blocks
        events = blocks.stop_and_flush()
        complete = blocks.tool_used and _is_json("".join(blocks.last_arguments))
        reason, sequence = stop_reason(self._finish or terminal.finish_reason or "stop", self._stop,
                                       blocks.tool_used, complete)
        usage = terminal.usage or Usage(prompt_tokens=self._input_tokens)
        return [*events, {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                          "usage": _usage(usage)},
                {"type": "message_stop"}]

    def response(self, terminal: GenerationChunk) -> dict[str, Any]:
        candidate = (terminal.candidates or [Candidate(index=0, finish_reason=terminal.finish_reason)])[0]
        calls = candidate.tool_calls or []
        reason, sequence = stop_reason(candidate.finish_reason, candidate.stop_reason, bool(calls), bool(calls))
        content: list[dict[str, Any]] = []
        if candidate.reasoning:
            content.append({"type": "thinking", "thinking": candidate.reasoning, "signature": uuid.uuid4().hex})
        if candidate.text:
            content.append({"type": "text", "text": candidate.text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": _tool_input(c.arguments)}
                    for c in calls]
        # Anthropic's empty answer is one empty text block (clients read content[0]), not [].
        return self._message(content or [{"type": "text", "text": ""}], reason, sequence, terminal.usage)

    def _message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None,
                 usage: Usage | None) -> dict[str, Any]:
        return {"id": self.response_id, "type": "message", "role": "assistant", "content": content,
                "model": self.model, "stop_reason": reason, "stop_sequence": sequence, "usage": _usage(usage)}

    def error_response(self, error: FleetError) -> Response:
        return errors.error_response(error)

    def error_events(self, error: FleetError) -> list[dict[str, Any]]:
        return self.lost_events(error, 0)

    @classmethod
    def lost_events(cls, error: FleetError, first_id: int) -> list[dict[str, Any]]:
        return [errors.fleet_error_body(error)[0]]


def _tool_input(arguments: str) -> dict[str, Any]:
    """A whole tool call's arguments as the tool_use input. A parser hands over only calls it
    parsed, whose arguments are a JSON object; anything else becomes an empty input rather than
    failing the whole answer (vLLM answers such a call with an error)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def messages_envelope(body: MessagesRequest, model: str, max_model_len: int,
                      settings: GatewaySettings) -> RequestEnvelope:
    params = body.sampling_options()
    check_sampling(params, max_model_len)
    cap_output(params, output_ceiling(settings), "max_tokens", max_model_len, given=True)
    return new_envelope(body.chat_body(model), "chat", model, settings, body=body, params=params)


async def prepare(body: MessagesRequest, _request: Request, view: ModelView,
                  settings: GatewaySettings) -> tuple[RequestEnvelope, MessagesFormatter]:
    envelope = messages_envelope(body, view.name, view.max_model_len, settings)
    return envelope, MessagesFormatter(envelope)


generation_route(router, "/v1/messages", MessagesRequest, prepare)


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    """The prompt's tokens, counted by a worker's tokenizer from the chat request it would render."""
    fleet = request.app.state.fleet
    view = await fleet.registry.resolve(body.model)
    answer = await ask_worker(fleet, new_envelope(body.tokenize_body(view.name), "tokenize", view.name, fleet.settings))
    count = answer.result["count"]
    return json_response({"input_tokens": count, "context_management": {"original_input_tokens": count}})
