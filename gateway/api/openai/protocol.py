"""Request models of the OpenAI chat and completions APIs, validated at the HTTP edge.

Unknown fields are tolerated, as vLLM does. Two kinds of rules, with vLLM's statuses and types:
- schema rules (types, required fields, "stream_options needs stream") fail pydantic
  validation: 400 with type "Bad Request" and a dotted `param`;
- sampling ranges (temperature, top_p, penalties, n with greedy sampling...) are checked by
  `check_sampling` with vLLM's messages: 400 "BadRequestError".
Rules that need the tokenizer (prompt length, token ids in the vocabulary) run on the worker.
"""

from __future__ import annotations

import math
import os
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from gateway.http.errors import FieldRuleError, openai_rule
from shared.envelopes import SamplingOptions
from shared.errors import InvalidRequest

# vLLM's default limit of stop strings (VLLM_MAX_STOP_STRINGS). The gateway leaves that limit on
# chat and completions to the worker's vLLM, which words its refusal as `vllm serve` does and
# follows the same variable; the other families' modules still import this.
MAX_STOP_STRINGS = 4
MAX_N = 128
# Prompts of one completion request, as `vllm serve` bounds them: the gateway holds state for each
# of the prompts' n choices.
MAX_PROMPTS = int(os.environ.get("VLLM_MAX_COMPLETION_PROMPTS", "1024"))
MAX_LOGIT_BIAS_ENTRIES = 1024
DEFAULT_MAX_TOKENS = 16  # of a completion that sets none, as vLLM has it


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="allow")


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class MediaPart(OpenAIModel):
    """A content part that is not text (`image_url`, `input_audio`...): passed to the worker's
    engine as it was sent, as `vllm serve` passes it to the model; the engine checks it (a
    text-only model refuses it) and fetches its URLs only from where its operator allows."""

    type: Literal["image_url", "input_audio", "audio_url", "video_url", "file", "refusal", "thinking",
                  "image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "tool_reference"]


class ToolCallFunction(OpenAIModel):
    name: str
    arguments: str | dict[str, Any] = ""


class MessageToolCall(OpenAIModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(OpenAIModel):
    role: str  # any role the chat template knows; vLLM renders custom roles too
    content: str | list[TextPart | MediaPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise FieldRuleError(f"a {self.role} message needs `content`", param="content")
        return self


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_timings: bool = False  # an extension: see GenerationRequest.include_timings


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: dict[str, Any] | None = None


class GenerationRequest(OpenAIModel):
    """Fields common to chat and completions."""

    model: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    logit_bias: dict[str, float] | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False  # vLLM's: n beams, greedy or not (its sampling checks do not apply)
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    user: str | None = None
    cancel_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    timeout: Annotated[float, Field(gt=0)] | None = None  # seconds; capped by the gateway's limit
    resumable: bool = False  # an extension: the stream survives its client (gateway/serve/resumable.py)
    # An extension: the request's stage times ("timings": queue, prefill, decode, relay, total,
    # tokens per second) on the response, or on a stream's last chunk (serving.request_timings).
    include_timings: bool = False

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> list[str] | None:
        return [value] if isinstance(value, str) else value

    @field_validator("logit_bias")
    @classmethod
    def _bounded_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise FieldRuleError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries",
                                 param="logit_bias")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise FieldRuleError("Stream options can only be defined when `stream=True`.", param="stream_options")
        if self.resumable and not self.stream:
            raise FieldRuleError("`resumable` needs `stream=True`: only a stream can be resumed.", param="resumable")
        if self.response_format is not None and self.response_format.type == "json_schema" \
                and self.response_format.json_schema is None:
            raise FieldRuleError("When response_format type is 'json_schema', the 'json_schema' field "
                                 "must be provided.", param="response_format")
        return self

    @property
    def choice_count(self) -> int:
        """The choices of the answer."""
        return self.n

    def sampling_options(self, max_tokens: int | None, logprobs: int | None, echo: bool) -> SamplingOptions:
        return SamplingOptions(
            max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            min_p=self.min_p, seed=self.seed, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty,
            logit_bias=self.logit_bias, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, min_tokens=self.min_tokens, n=self.n, logprobs=logprobs,
            echo=echo, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )


MAX_MESSAGES = 4096


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    logprobs: bool = False
    top_logprobs: int | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # Extensions (gateway/api/sessions.py), never forwarded to the engine: the turn continues this
    # stored session; `discard_thinking` keeps the turn's reasoning out of what is stored.
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    discard_thinking: bool = True

    @model_validator(mode="after")
    def _roles(self) -> ChatCompletionRequest:
        """The OpenAI API's rules of each role, which `vllm serve` leaves to the chat template."""
        for i, message in enumerate(self.messages):
            if message.role == "tool" and not message.tool_call_id:
                raise openai_rule("Missing parameter 'tool_call_id': messages with role 'tool' must have a "
                                  "'tool_call_id'.", f"messages[{i}].tool_call_id")
            if message.tool_calls is not None and message.role != "assistant":
                raise openai_rule(f"Invalid parameter: 'tool_calls' is only allowed on messages with role "
                                  f"'assistant', not '{message.role}'.", f"messages[{i}].tool_calls")
            if message.role == "assistant" and message.content is None and not message.tool_calls \
                    and getattr(message, "function_call", None) is None:
                raise openai_rule("Invalid parameter: messages with role 'assistant' must have either 'content' or "
                                  "'tool_calls'.", f"messages[{i}].content")
        return self

    @model_validator(mode="after")
    def _chat_rules(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and (self.top_logprobs < -1):
            raise FieldRuleError("`top_logprobs` must be a positive value or -1.", param="top_logprobs")
        if self.top_logprobs and not self.logprobs:
            raise FieldRuleError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        if self.tools is not None and not self.tools:
            raise FieldRuleError("`tools` must not be an empty array. Either provide at least one tool or "
                                 "omit the field entirely.", param="tools")
        if self.tool_choice not in (None, "none") and not self.tools:
            raise FieldRuleError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if isinstance(self.tool_choice, dict):
            name = (self.tool_choice.get("function") or {}).get("name")
            if name not in {t.function.name for t in self.tools or ()}:
                raise FieldRuleError("The tool specified in `tool_choice` does not match any of the specified "
                                     "`tools`", param="tool_choice")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]] | None = None
    echo: bool = False
    logprobs: int | None = None
    max_tokens: int | None = DEFAULT_MAX_TOKENS
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value):
        if not value:
            raise FieldRuleError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if (count := len(prompts_of(value))) > MAX_PROMPTS:
            raise FieldRuleError(f"prompt list length {count} exceeds the maximum allowed count of {MAX_PROMPTS}. "
                                 "To increase this limit, set the VLLM_MAX_COMPLETION_PROMPTS environment variable.",
                                 param="prompt")
        return value

    @property
    def choice_count(self) -> int:
        """The choices of the answer: n per prompt, choice `c` of prompt `p` at index p * n + c (vLLM's)."""
        return self.n * len(prompts_of(self.prompt))

    @model_validator(mode="after")
    def _completion_rules(self) -> CompletionRequest:
        if self.prompt is None:
            raise FieldRuleError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")
        if self.suffix is not None:
            raise FieldRuleError("suffix is only supported for models with FIM completion rendering",
                                 param="suffix")
        if self.max_tokens is None:
            self.max_tokens = DEFAULT_MAX_TOKENS
        return self


def prompts_of(prompt: str | list) -> list:
    """The prompts of a completion's `prompt`: a string or a list of token ids is one prompt; a list
    of strings or of token id lists is one prompt each."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        return prompt
    return [prompt]


def cap_output(params: SamplingOptions, ceiling: int, field: str, max_model_len: int, *, given: bool,
               default: int | None = None) -> int | None:
    """Hold a request to the operator's ceiling on output tokens (`ceiling`, 0 for none): above
    it, a 400 naming the ceiling; when the client gave no limit (`given` False), the ceiling, or
    the engine's `default` (completions: 16), or the context, whichever is smallest (vLLM then
    takes the room left in the context if that is less). Returns the max_tokens the engine must
    be sent when the client gave none, else None."""
    if not ceiling:
        return None
    if given:
        if params.max_tokens is not None and params.max_tokens > ceiling:
            raise InvalidRequest(f"{field}={params.max_tokens} is more than this deployment allows: at most {ceiling} "
                                 "output tokens per request. Please request fewer output tokens.", param=field,
                                 code="max_tokens_above_limit")
        return None
    params.max_tokens = min(ceiling, default or max_model_len, max_model_len)
    return params.max_tokens


def check_sampling(options: SamplingOptions, max_model_len: int, max_tokens_field: str = "max_tokens", *,
                   beam_search: bool = False) -> None:
    """vLLM's sampling-parameter checks, with its messages and params (SamplingParams._verify_args).

    `max_tokens_field` names the field the client used for the output limit. A beam search
    (`use_beam_search`) is held to the checks vLLM runs on it: the beam count and the output limit.
    """
    o = options
    if beam_search:
        _check(_beam_rules(o, max_model_len, max_tokens_field))
        return
    rules: list[tuple[bool, str, str | None]] = [
        (o.n < 1, f"n must be at least 1, got {o.n}.", None),
        (o.n > MAX_N, f"n must be at most {MAX_N}, got {o.n}.", "n"),
        (o.presence_penalty is not None and not -2 <= o.presence_penalty <= 2,
         f"presence_penalty must be in [-2, 2], got {o.presence_penalty}.", None),
        (o.frequency_penalty is not None and not -2 <= o.frequency_penalty <= 2,
         f"frequency_penalty must be in [-2, 2], got {o.frequency_penalty}.", None),
        (o.repetition_penalty is not None and not 0 < o.repetition_penalty <= 2,
         f"repetition_penalty must be in (0, 2], got {o.repetition_penalty}.", None),
        (o.temperature is not None and not math.isfinite(o.temperature),
         f"temperature must be a finite number, got {o.temperature}.", "temperature"),
        (o.temperature is not None and o.temperature < 0,
         f"temperature must be non-negative, got {o.temperature}.", "temperature"),
        (o.temperature is not None and o.temperature > 2,
         f"temperature must be in [0, 2], got {o.temperature}.", "temperature"),
        (o.top_p is not None and not 0 < o.top_p <= 1, f"top_p must be in (0, 1], got {o.top_p}.", "top_p"),
        (o.top_k is not None and o.top_k < -1,
         f"top_k must be 0 (disable), or at least 1, got {o.top_k}.", None),
        (o.min_p is not None and not 0 <= o.min_p <= 1, f"min_p must be in [0, 1], got {o.min_p}.", None),
        (o.max_tokens is not None and o.max_tokens < 1,
         f"max_tokens must be at least 1, got {o.max_tokens}.", "max_tokens"),
        (o.max_tokens is not None and o.max_tokens > max_model_len,
         (f"{max_tokens_field}={o.max_tokens} cannot be greater than max_model_len={max_model_len}. "
          "Please request fewer output tokens."), max_tokens_field),
        (o.min_tokens < 0, f"min_tokens must be greater than or equal to 0, got {o.min_tokens}.", None),
        (o.max_tokens is not None and o.min_tokens > o.max_tokens,
         f"min_tokens must be less than or equal to max_tokens={o.max_tokens}, got {o.min_tokens}.", None),
        (o.logprobs is not None and o.logprobs < -1,
         f"logprobs must be non-negative or -1, got {o.logprobs}.", "logprobs"),
        (bool(o.stop) and "" in (o.stop or ()), "stop cannot contain an empty string.", None),
        (o.n > 1 and o.temperature is not None and o.temperature < 1e-5,
         f"n must be 1 when using greedy sampling, got {o.n}.", None),
    ]
    _check(rules)
    for key in o.logit_bias or ():
        try:
            int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                 f"[{key!r}]", param="logit_bias") from None


def _beam_rules(o: SamplingOptions, max_model_len: int, max_tokens_field: str) -> list[tuple[bool, str, str | None]]:
    return [
        (o.n < 1, f"beam_width must be at least 1, got {o.n}.", None),
        (o.n > MAX_N, f"beam_width must be at most {MAX_N}, got {o.n}.", "n"),
        (o.max_tokens is not None and o.max_tokens > max_model_len,
         (f"{max_tokens_field}={o.max_tokens} cannot be greater than max_model_len={max_model_len}. "
          "Please request fewer output tokens."), max_tokens_field),
    ]


def _check(rules: list[tuple[bool, str, str | None]]) -> None:
    for broken, message, param in rules:
        if broken:
            raise InvalidRequest(message, param=param)


class TokenizerRequest(OpenAIModel):
    """POST /tokenize, /detokenize: the worker's tokenizer checks the rest, as vLLM does."""

    model: str | None = None


class CancelRequest(OpenAIModel):
    """POST /v1/cancel: by the runs' `cancel_id`, by a session's `session_id` (whatever it runs or
    has queued), or by the response `id` a client saw, of any family; one of the three. Each names
    the caller's own runs only."""

    cancel_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    session_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    id: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @model_validator(mode="after")
    def _one_target(self) -> CancelRequest:
        given = [name for name in ("cancel_id", "session_id", "id") if getattr(self, name) is not None]
        if not given:
            raise FieldRuleError("give `cancel_id`, `session_id` or `id`: an empty cancel never cancels everything",
                                 param="cancel_id")
        if len(given) > 1:
            raise FieldRuleError(f"give one of `cancel_id`, `session_id` and `id`, not {' and '.join(given)}",
                                 param=given[1])
        return self

    @property
    def request_id(self) -> str | None:
        if self.id is None:
            return None
        prefix = next((p for p in RESPONSE_ID_PREFIXES if self.id.startswith(p)), "")
        return self.id.removeprefix(prefix)


# The ids each family shows a client, `<prefix><request_id>`: chat, completions, Anthropic
# messages, Responses (gateway/api/openai/, gateway/api/anthropic/).
RESPONSE_ID_PREFIXES = ("chatcmpl-", "cmpl-", "msg_", "resp_")
