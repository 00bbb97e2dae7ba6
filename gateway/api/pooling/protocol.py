"""Request models of `vllm serve`'s pooling endpoints, validated at the HTTP edge.

/v1/embeddings (OpenAI's), /score, /rerank (Jina's and Cohere's shape), /classify and /pooling
(vLLM's own). The gateway checks what it can without the model: types (a 400 "Bad Request" with
a dotted `param`, as vLLM's models answer), inputs that cannot be encoded (none at all), and the
operator's bound on inputs per request (`--max-encoder-inputs`). What needs the tokenizer or the
model (an input longer than the context, token ids outside the vocabulary, `dimensions` the
model cannot give) is the worker's: its engine refuses it with vLLM's own words. Unknown fields
are tolerated and passed on, as vLLM does.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from gateway.api.openai.protocol import OpenAIModel
from gateway.http.errors import FieldRuleError

# An input of an embeddings, classify or pooling request: a text, texts, token ids, lists of
# token ids (one input each), or a conversation (a list of messages, rendered by the chat template).
Input = str | list[str] | list[int] | list[list[int]] | list[dict[str, Any]]
# One side of a pair to score: a text, or (a multimodal model's) content parts.
ScoreInput = str | dict[str, Any]
EncodingFormat = Literal["float", "base64", "bytes", "bytes_only"]
EmbedDType = Literal["float32", "float16", "bfloat16", "fp8_e4m3", "fp8_e5m2"]
Endianness = Literal["native", "big", "little"]
SERVED_DTYPES = ("float32", "float16", "bfloat16")


def input_count(value: Input | None) -> int:
    """The inputs (outputs) of an `input`, as vLLM reads it: a text or token ids is one; a list of
    texts or of token id lists is one each; a conversation is one."""
    if isinstance(value, list) and value and isinstance(value[0], (str, list)):
        return len(value)
    return 0 if value is None or value == [] else 1


def side(value: ScoreInput | list[ScoreInput]) -> list[ScoreInput]:
    """One side of a score or rerank request, as a list (vLLM's reading)."""
    return value if isinstance(value, list) else [value]


class EncoderRequest(OpenAIModel):
    """What every pooling request shares (vLLM's `PoolingBasicRequestMixin`), and the gateway's extensions."""

    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=-1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    cancel_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # as a generation's
    timeout: Annotated[float, Field(gt=0)] | None = None  # seconds; capped by the gateway's limit

    @property
    def stream(self) -> bool:
        """An encoder's answer is one JSON body, never a stream (`stream` in a body is ignored, as by vLLM)."""
        return False

    @property
    def pooled_inputs(self) -> int:
        """The texts the engine pools for this request (the operator's bound counts them)."""
        raise NotImplementedError


class InputRequest(EncoderRequest):
    """A request of inputs, an output each: embeddings, classify, pooling."""

    input: Input | None = None
    messages: list[dict[str, Any]] | None = None  # a conversation to encode, instead of `input`

    @model_validator(mode="after")
    def _some_input(self):
        if self.messages is None and self.input is None:
            raise FieldRuleError("Field required: give `input` (or `messages`)", param="input",
                                 err_type="Bad Request")
        if self.messages == []:
            raise FieldRuleError("Cannot apply chat template to an empty conversation. Provide at least one message.",
                                 param="messages")
        if self.messages is None and input_count(self.input) == 0:
            raise FieldRuleError("You must pass at least one prompt", param="input")
        return self

    @property
    def pooled_inputs(self) -> int:
        return 1 if self.messages is not None else input_count(self.input)


class EncodingOptions(OpenAIModel):
    """How vectors are written: float JSON, base64 or raw bytes, in a dtype and byte order."""

    encoding_format: EncodingFormat = "float"
    embed_dtype: EmbedDType = "float32"
    endianness: Endianness = "native"

    @model_validator(mode="after")
    def _served_dtype(self):
        if self.embed_dtype not in SERVED_DTYPES:  # numpy has no fp8: the gateway cannot write it
            raise FieldRuleError(f"embed_dtype {self.embed_dtype} is not served by llmfleet; ask for "
                                 f"{', '.join(SERVED_DTYPES)}.", param="embed_dtype")
        return self


class EmbeddingRequest(InputRequest, EncodingOptions):
    """POST /v1/embeddings."""

    dimensions: int | None = None
    use_activation: bool | None = None


class PoolingRequest(InputRequest, EncodingOptions):
    """POST /pooling: the model's raw pooled output."""

    task: str | None = None
    dimensions: int | None = None
    use_activation: bool | None = None


class ClassifyRequest(InputRequest):
    """POST /classify."""

    use_activation: bool | None = None


class ScoringRequest(EncoderRequest):
    """What score and rerank share (vLLM's `ScoringRequestMixin`)."""

    use_activation: bool | None = None
    max_tokens_per_query: int = 0
    max_tokens_per_doc: int = 0
    instruction: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


# The pairs of fields a score request may name its two sides with, as vLLM's request models do.
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(ScoringRequest):
    """POST /score and /v1/score: `text_1`/`text_2` (or `queries`/`documents`, ...), 1:1, 1:N or N:N."""

    queries: ScoreInput | list[ScoreInput] | None = None
    documents: ScoreInput | list[ScoreInput] | None = None
    items: ScoreInput | list[ScoreInput] | None = None
    data_1: ScoreInput | list[ScoreInput] | None = None
    data_2: ScoreInput | list[ScoreInput] | None = None
    text_1: ScoreInput | list[ScoreInput] | None = None
    text_2: ScoreInput | list[ScoreInput] | None = None

    @model_validator(mode="after")
    def _two_sides(self):
        first, second = self.sides
        if first is None:
            raise FieldRuleError("Field required: give `text_1` and `text_2` (or `queries` and `documents`)",
                                 param="text_1", err_type="Bad Request")
        _check_pairing(side(first), side(second))
        return self

    @property
    def sides(self) -> tuple[Any, Any]:
        """The two sides, by the first pair of fields both given (vLLM's order of its request models)."""
        for one, other in SCORE_SIDES:
            if getattr(self, one) is not None and getattr(self, other) is not None:
                return getattr(self, one), getattr(self, other)
        return None, None

    @property
    def pooled_inputs(self) -> int:
        first, second = self.sides
        return len(side(first)) + len(side(second))


class RerankRequest(ScoringRequest):
    """POST /rerank, /v1/rerank, /v2/rerank: documents ranked by their relevance to the query."""

    query: ScoreInput
    documents: ScoreInput | list[ScoreInput]
    top_n: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _pairs(self):
        _check_pairing([self.query], side(self.documents))
        return self

    @property
    def pooled_inputs(self) -> int:
        return 1 + len(side(self.documents))


def _check_pairing(first: list, second: list) -> None:
    """vLLM's rule of the two sides' lengths, in its words."""
    if len(first) > 1 and len(first) != len(second):
        raise FieldRuleError("Input lengths must be either 1:1, 1:N or N:N")
    if not first:
        raise FieldRuleError("At least one text element must be given")
    if not second:
        raise FieldRuleError("At least one text_pair element must be given")


CohereEmbeddingType = Literal["float", "binary", "ubinary", "base64"]


class CohereEmbedRequest(OpenAIModel):
    """POST /v2/embed: Cohere's embed API, as `vllm serve` has it for an embedding model (texts,
    images or mixed inputs; the vectors in one or more of Cohere's types). The worker hands the
    body to vLLM's own handler, which reads it as Cohere's (`RequestEnvelope.api`)."""

    model: str | None = None
    input_type: str | None = None  # a task instruction the model defines, or refused by the worker
    texts: list[str] | None = None
    images: list[str] | None = None
    inputs: list[dict[str, Any]] | None = None
    output_dimension: int | None = None
    embedding_types: list[CohereEmbeddingType] | None = None
    truncate: Literal["NONE", "START", "END"] = "END"
    max_tokens: int | None = None
    priority: int = Field(default=0, ge=-(2**63), le=2**63 - 1)
    cancel_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None  # as a generation's
    timeout: Annotated[float, Field(gt=0)] | None = None  # seconds; capped by the gateway's limit

    @model_validator(mode="after")
    def _one_kind_of_input(self):
        given = [field for field in (self.texts, self.images, self.inputs) if field is not None]
        if len(given) != 1 or not given[0]:
            raise FieldRuleError("Exactly one of texts, images, or inputs must be provided, and it must be non-empty",
                                 param="texts", err_type="Bad Request")
        return self

    @property
    def stream(self) -> bool:
        return False

    @property
    def pooled_inputs(self) -> int:
        return len(self.texts or self.images or self.inputs or ())
