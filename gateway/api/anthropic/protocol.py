"""Anthropic Messages requests, validated at the HTTP edge, and the chat request each becomes.

The fleet's workers serve OpenAI chat; a Messages request is converted here into the chat
body `vllm serve` itself builds from it (vllm/entrypoints/anthropic/serving.py,
`to_chat_completion_request`), so a worker renders, samples and parses it exactly as
`vllm serve`'s /v1/messages would:
- `system` (a string, or text blocks) becomes a leading system message; system messages
  inside `messages` (a vLLM extension) stay where they are;
- text blocks are text parts, one text part alone is plain content; images are `image_url`
  parts (base64 sources as data URLs); thinking blocks are the assistant's `reasoning`;
- `tool_use` blocks are the assistant's `tool_calls` (input as JSON text); a user's
  `tool_result` is a `tool` message (its images follow in a user message);
- `tools` are functions (`input_schema` their parameters); `tool_choice` any/tool/none/auto
  is required/named/none/auto, and `auto` when tools come without a choice;
- `max_tokens` sets max_tokens and max_completion_tokens, `stop_sequences` the stop strings;
- `thinking` disabled asks the template for no reasoning (`reasoning_effort` "none"), enabled
  sets vLLM's `thinking_token_budget`; `output_config` gives an effort and a JSON schema.
Rules vLLM checks in its request model are checked here with its words; the rest (prompt
length, the tools a worker's parser accepts) on the worker, as on `vllm serve`.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.api.openai.protocol import MAX_MESSAGES, MAX_STOP_STRINGS
from gateway.http.errors import FieldRuleError
from shared.envelopes import SamplingOptions

BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request hash: dropped, as vLLM does


class AnthropicModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(AnthropicModel):
    """One block of a message; which fields matter depends on `type`."""

    type: Literal["text", "image", "tool_use", "tool_result", "tool_reference", "thinking", "redacted_thinking"]
    text: str | None = None
    source: dict[str, Any] | None = None  # image: {"type": "base64", "media_type", "data"} or {"type": "url", "url"}
    id: str | None = None
    name: str | None = None
    input: Any = None  # a tool_use's: an object (checked by `PromptFields._blocks`, in Anthropic's words)
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None  # tool_result
    is_error: bool | None = None
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None  # redacted_thinking


class Message(AnthropicModel):
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(AnthropicModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any]
    strict: bool | None = None

    @field_validator("input_schema")
    @classmethod
    def _object_by_default(cls, schema: dict[str, Any]) -> dict[str, Any]:
        return schema if "type" in schema else {**schema, "type": "object"}


class ToolChoice(AnthropicModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise FieldRuleError("tool_choice.name is required when type is 'tool'", param="tool_choice")
        return self


class ThinkingConfig(AnthropicModel):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(ge=1024)] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingConfig:
        if self.type == "enabled" and self.budget_tokens is None:
            raise FieldRuleError("thinking.budget_tokens is required when thinking is enabled", param="thinking")
        return self


class JsonOutputFormat(AnthropicModel):
    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")


class OutputConfig(AnthropicModel):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: JsonOutputFormat | None = None


class PromptFields(AnthropicModel):
    """What a Messages request and a count_tokens request share: the prompt and its tools."""

    model: str = Field(min_length=1)
    messages: list[Message] = Field(max_length=MAX_MESSAGES)
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM extension

    @model_validator(mode="after")
    def _blocks(self) -> PromptFields:
        """Anthropic's rules of the blocks that carry tool calls and results, in its API's words."""
        for i, message in enumerate(self.messages):
            for j, block in enumerate(message.content if isinstance(message.content, list) else ()):
                where = f"messages.{i}.content.{j}.{block.type}"
                if block.type == "tool_result" and not block.tool_use_id:
                    raise FieldRuleError(f"{where}.tool_use_id: Field required", param=f"{where}.tool_use_id")
                if block.type == "tool_use" and not isinstance(block.input, dict):
                    problem = "Field required" if block.input is None else "Input should be a valid dictionary"
                    raise FieldRuleError(f"{where}.input: {problem}", param=f"{where}.input")
                if block.type == "tool_use" and not (block.id and block.name):
                    missing = "id" if not block.id else "name"
                    raise FieldRuleError(f"{where}.{missing}: Field required", param=f"{where}.{missing}")
        return self

    @property
    def reasoning_effort(self) -> str | None:
        if self.thinking is not None and self.thinking.type == "disabled":
            return "none"
        return self.output_config.effort if self.output_config is not None else None

    def chat_messages(self) -> list[dict[str, Any]]:
        messages = []
        system = _system_text(self.system)
        if system:
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _chat_messages(message)
        return messages

    def chat_tools(self) -> dict[str, Any]:
        """The tools and tool choice of the chat request."""
        fields: dict[str, Any] = {"tool_choice": None}  # as vLLM sets it, over the chat default "none"
        choice = self.tool_choice
        if choice is not None:
            fields["parallel_tool_calls"] = not choice.disable_parallel_tool_use
            fields["tool_choice"] = _CHAT_TOOL_CHOICE.get(choice.type) or {
                "type": "function", "function": {"name": choice.name}}
        if self.tools is not None:
            fields["tools"] = [{"type": "function", "function": _without_none({
                "name": t.name, "description": t.description, "parameters": t.input_schema, "strict": t.strict})}
                for t in self.tools]
            fields["tool_choice"] = fields["tool_choice"] or "auto"
        return fields


_CHAT_TOOL_CHOICE = {"auto": "auto", "any": "required", "none": "none"}


class MessagesRequest(PromptFields):
    max_tokens: int
    metadata: dict[str, Any] | None = None
    stop_sequences: list[str] | None = Field(default=None, max_length=MAX_STOP_STRINGS)
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    # llmfleet extensions, as on chat: a key for POST /v1/cancel, and a deadline of the client's own.
    cancel_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None
    resumable: bool = False  # an extension: the stream survives its client (gateway/serve/resumable.py)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value <= 0:
            raise FieldRuleError("max_tokens must be positive", param="max_tokens")
        return value

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if thinking is not None and thinking.type == "enabled" and thinking.budget_tokens >= self.max_tokens:
            raise FieldRuleError("thinking.budget_tokens must be less than max_tokens", param="thinking")
        if self.resumable and not self.stream:
            raise FieldRuleError("`resumable` needs `stream: true`: only a stream can be resumed.", param="resumable")
        return self

    def sampling_options(self) -> SamplingOptions:
        return SamplingOptions(max_tokens=self.max_tokens, temperature=self.temperature, top_p=self.top_p,
                               top_k=self.top_k, stop=self.stop_sequences)

    def chat_body(self, model: str) -> dict[str, Any]:
        """The chat request `vllm serve` builds from this one."""
        body = _without_none({
            "model": model, "messages": self.chat_messages(), "max_tokens": self.max_tokens,
            "max_completion_tokens": self.max_tokens, "stop": self.stop_sequences,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "chat_template_kwargs": self.chat_template_kwargs, "reasoning_effort": self.reasoning_effort,
            "cache_salt": getattr(self, "cache_salt", None), "vllm_xargs": getattr(self, "vllm_xargs", None),
        })
        if self.stream:
            body["stream"] = True
        if self.thinking is not None and self.thinking.type == "enabled":
            body["thinking_token_budget"] = self.thinking.budget_tokens
        output_format = self.output_config.format if self.output_config is not None else None
        if output_format is not None and output_format.json_schema:
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": output_format.type, "schema": output_format.json_schema}}
        return {**body, **self.chat_tools()}


class CountTokensRequest(PromptFields):
    def tokenize_body(self, model: str) -> dict[str, Any]:
        """The tokenize request that counts the prompt `vllm serve`'s count_tokens renders."""
        kwargs = dict(self.chat_template_kwargs or {})
        effort = self.reasoning_effort
        if effort is not None:  # what vLLM's chat request gives the template for an effort
            kwargs.setdefault("enable_thinking", effort != "none")
            kwargs["reasoning_effort"] = effort
        tools = self.chat_tools().get("tools")  # the tool choice does not change the prompt
        return _without_none({"model": model, "messages": self.chat_messages(), "tools": tools,
                              "chat_template_kwargs": kwargs or None})


def _without_none(fields: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in fields.items() if v is not None}


def _system_text(system: str | list[ContentBlock] | None) -> str:
    if isinstance(system, str):
        return system
    return "".join(b.text for b in system or () if b.type == "text" and b.text and not b.text.startswith(BILLING_HEADER))


def _chat_messages(message: Message) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: tool results become `tool` messages before it."""
    if message.role == "system":
        text = message.content if isinstance(message.content, str) else _system_text(message.content)
        return [{"role": "system", "content": text}] if text and not text.startswith(BILLING_HEADER) else []
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    before: list[dict[str, Any]] = []  # tool messages, in block order, ahead of the message itself
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    reasoning: list[str] = []
    for block in message.content:
        if block.type == "text" and block.text:
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and block.source:
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block.source)}})
        elif block.type == "thinking" and block.thinking is not None:
            reasoning.append(block.thinking)
        elif block.type == "tool_use":
            calls.append({"id": block.id or f"call_{int(time.time())}", "type": "function",
                          "function": {"name": block.name or "", "arguments": json.dumps(block.input or {})}})
        elif block.type == "tool_result" and message.role == "user":
            before += _tool_result_messages(block)
        elif block.type == "tool_result":
            parts.append({"type": "text", "text": f"Tool result: {block.content or ''}"})
    chat: dict[str, Any] = {"role": message.role}
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        chat["content"] = parts[0]["text"]
    elif parts:
        chat["content"] = parts
    if message.role == "user" and "content" not in chat:
        return before  # a user turn of only tool results
    return [*before, chat]


def _tool_result_messages(block: ContentBlock) -> list[dict[str, Any]]:
    texts: list[str] = []
    images: list[str] = []
    references: list[dict[str, Any]] = []
    for item in block.content if isinstance(block.content, list) else ():
        kind = item.get("type") if isinstance(item, dict) else None
        if kind == "text":
            texts.append(item.get("text", ""))
        elif kind == "image" and _image_url(item.get("source") or {}):
            images.append(_image_url(item.get("source") or {}))
        elif kind == "tool_reference" and (item.get("tool_name") or item.get("name")):
            references.append({"type": "tool_reference", "name": item.get("tool_name") or item.get("name")})
    text = block.content if isinstance(block.content, str) else "\n".join(texts)
    messages: list[dict[str, Any]] = [{"role": "tool", "tool_call_id": block.tool_use_id or "", "content": text}]
    if images:
        messages.append({"role": "user", "content": [{"type": "image_url", "image_url": {"url": u}} for u in images]})
    if references:
        messages.append({"role": "tool", "tool_call_id": block.tool_use_id or "", "content": references})
    return messages


def _image_url(source: dict[str, Any]) -> str:
    if source.get("type") == "url":
        return source.get("url", "")
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"
