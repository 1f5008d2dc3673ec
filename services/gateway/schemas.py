"""Request and response bodies of the OpenAI-compatible API.

Requests are strict (no type coercion) and reject unknown fields, so a typo such as
`max_token` is a 400 naming the field instead of being silently ignored. The bounds here
mirror `SamplingParams.validate()`, so the OpenAPI schema tells clients (and fuzzers) the
real limits.
"""

from __future__ import annotations

from typing import Annotated, Literal

from kvrelay.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_N
from kvrelay.gateway.chat_render import ChatTemplateFields
from kvrelay.gateway.structured.fields import StructuredFields
from kvrelay.gateway.structured.tools import ToolCall, ToolFields
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

MAX_STOP = 16
MAX_REQUEST_PRIORITY = 1000  # |priority| of a request; the engine sees tenant band * 10^4 + it
MAX_BATCH_PROMPTS = 16
MAX_STOP_TOKEN_IDS = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


def _integral(value):
    """OpenAI accepts integral floats (`4.0`) where it documents integers: take them as ints."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# An integer field (strict: no strings, no booleans) that also takes an integral float.
Int = Annotated[int, BeforeValidator(_integral)]

StopField = Annotated[str | Annotated[list[str], Field(max_length=MAX_STOP)] | None, Field(default=None)]
TokenIds = Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1)]


class _SamplingFields(StructuredFields):  # structured-output fields: gateway/structured/fields.py
    model: str
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[Int, Field(ge=1, le=MAX_N)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StopField = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    seed: Annotated[Int, Field(ge=-(2**63), le=2**64 - 1)] | None = None
    user: Annotated[str, Field(max_length=256)] | None = None
    # Token id (as a string, as OpenAI sends it) -> bias in [-100, 100] added to its logit.
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    # Extensions beyond OpenAI's set (vLLM clients send them through `extra_body`).
    top_k: Annotated[Int, Field(ge=-1)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[Int, Field(ge=0)] = 0
    ignore_eos: bool = False
    # Plugin logits processors: ["name", ...] or {"name": {...arguments}} (docs/plugins.md).
    logits_processors: list[str] | dict[str, dict] | None = None
    # Requests share cached prompt prefixes only with requests of the same salt (vLLM's field).
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # Higher first among the tenant's own requests, up to its max_request_priority (vLLM's field).
    priority: Annotated[Int, Field(ge=-MAX_REQUEST_PRIORITY, le=MAX_REQUEST_PRIORITY)] = 0
    # vLLM's: each prompt token's logprob plus its top-k alternatives, per choice.
    prompt_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # vLLM's: end at these token ids too; keep special tokens' text; end the text with the stop string
    # (or the stop token's text); keep only the prompt's last k tokens (-1: as many as the context holds).
    stop_token_ids: Annotated[list[Annotated[Int, Field(ge=0)]], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    allowed_token_ids: Annotated[list[Annotated[Int, Field(ge=0)]], Field(min_length=1, max_length=2**17)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=100)]], Field(max_length=100)] | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | TokenIds | Annotated[list[str], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)] | Annotated[
        list[TokenIds], Field(min_length=1, max_length=MAX_BATCH_PROMPTS)]
    max_tokens: Annotated[Int, Field(ge=0)] | None = 16  # 0: with echo, only score the prompt
    logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False  # put the prompt before the completion (with logprobs: the prompt's logprobs too)


MAX_EMBEDDING_INPUTS = 2048  # inputs in one embeddings request: OpenAI's limit
EmbeddingText = Annotated[str, Field(min_length=1)]


PoolingInput = EmbeddingText | TokenIds | Annotated[list[EmbeddingText], Field(
    min_length=1, max_length=MAX_EMBEDDING_INPUTS)] | Annotated[list[TokenIds], Field(
        min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, with vLLM's extensions (clients send them through `extra_body`)."""

    model: str
    input: PoolingInput
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: Annotated[Int, Field(ge=1)] | None = None  # Matryoshka models only
    user: Annotated[str, Field(max_length=256)] | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    normalize: bool | None = None  # None: the model's pooler decides
    priority: Annotated[Int, Field(ge=-MAX_REQUEST_PRIORITY, le=MAX_REQUEST_PRIORITY)] = 0


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


ScoreTexts = EmbeddingText | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class _PoolingFields(_Strict):
    model: str
    user: Annotated[str, Field(max_length=256)] | None = None
    truncate_prompt_tokens: Annotated[Int, Field(ge=-1)] | None = None
    priority: Annotated[Int, Field(ge=-MAX_REQUEST_PRIORITY, le=MAX_REQUEST_PRIORITY)] = 0


class ScoreRequest(_PoolingFields):
    """vLLM's score API: text_1 against each of text_2 (one text_1), or pairwise (equal lists)."""

    text_1: ScoreTexts
    text_2: ScoreTexts


class ClassifyRequest(_PoolingFields):
    """vLLM's classification request: label probabilities of each input."""

    input: PoolingInput


class RerankDocument(_Strict):
    text: EmbeddingText


class RerankRequest(_PoolingFields):
    """The Jina / Cohere rerank API as vLLM serves it."""

    query: EmbeddingText
    documents: Annotated[list[EmbeddingText | RerankDocument], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    top_n: Annotated[Int, Field(ge=0)] | None = None  # None or 0: every document
    return_documents: bool = True


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ImageURL(_Strict):
    url: Annotated[str, Field(min_length=1)]  # a data: URL (base64) or http(s); gateway/media.py
    detail: Literal["auto", "low", "high"] | None = None  # OpenAI's; the model's processor decides the size


class ImageURLPart(_Strict):
    """An image (vision-language models; gateway/images.py); a text-only model answers 400."""

    type: Literal["image_url"]
    image_url: ImageURL


def _known_parts(content):
    """Name an audio, video or file part plainly, instead of the union's "Input should be a valid
    string" for the whole content."""
    if isinstance(content, list):
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in ("text", "image_url"):
                raise ValueError(f"part {i} has type {kind!r}, but this server takes parts of type 'text' and "
                                 "'image_url' only")
    return content


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | list[Annotated[TextPart | ImageURLPart, Field(discriminator="type")]] | None,
                       BeforeValidator(_known_parts)] = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None  # assistant turns that called tools (gateway/structured/tools.py)
    tool_call_id: Annotated[str, Field(max_length=256)] | None = None  # tool turns: the call answered
    # Fields of the assistant messages OpenAI and vLLM return, so that a reply appended to the history as
    # the client got it is accepted: the thinking reaches the template (Qwen3's reads it); refusal and
    # annotations are dropped; audio and the deprecated function_call only as null.
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: list | None = None
    audio: dict | None = None
    function_call: dict | None = None


class ChatCompletionRequest(_SamplingFields, ToolFields, ChatTemplateFields):  # chat_render.py
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[Int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[Int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[Int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    # OpenAI's, for clients that send them: accepted and ignored (nothing is stored, there are no tiers).
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    service_tier: Annotated[str, Field(max_length=32)] | None = None


# ---- responses (documented in the OpenAPI schema; handlers build the same shapes as dicts) ----


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens served by the prefix cache (of this tenant's cache group)


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None  # vLLM's: the stop token id or stop string that ended it


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None  # None when the answer is only tool calls
    reasoning_content: str | None = None  # with --reasoning-parser: the model's thinking
    tool_calls: list[dict] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int
    root: str | None = None  # vLLM's: a LoRA adapter's folder
    parent: str | None = None  # vLLM's: the model a LoRA adapter runs on


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    error: ErrorDetail


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorBody, "description": text}
    for status, text in {
        400: "Invalid request: `param` names the field",
        401: "Missing or unknown API key",
        403: "The tenant may not use this model",
        404: "Unknown model",
        413: "Request body too large",
        429: "Quota exceeded; see Retry-After and x-ratelimit-* headers",
        503: "Queue full, quota store unavailable or no healthy workers",
    }.items()
}

GENERATION_RESPONSES: dict[int | str, dict] = {
    200: {"description": "A completion; `text/event-stream` of chunks when `stream` is true",
          "content": {"text/event-stream": {}}}} | ERROR_RESPONSES
