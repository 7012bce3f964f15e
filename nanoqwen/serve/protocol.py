"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Field names and shapes follow the OpenAI API reference; `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `min_tokens`, `stop_token_ids` and `return_token_ids` are
vLLM's extensions. Types are checked strictly (a string is not a number, 1.5 is not an
integer); value ranges are checked by SamplingParams, so the API and the library give the
same message."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Request(BaseModel):
    # Unknown fields are ignored, as OpenAI's API and vLLM do. Python's JSON parser takes
    # NaN and Infinity, which no sampling field allows.
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """What completions and chat completions share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    return_token_ids: bool = False  # each choice also carries its token ids
    logit_bias: dict[str, float] | None = None  # token id (as text) -> bias in [-100, 100]
    user: str | None = None  # accepted, unused
    # vLLM's extension: the text constrained to a JSON schema ("json"), any JSON object
    # ("json_object": true), a regex, an EBNF grammar or an xgrammar structural tag.
    structured_outputs: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # One prompt (text or token ids) or a batch of them.
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    # Accepted only at their defaults: the engine has no such feature.
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # the call a tool message answers


class FunctionDefinition(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    echo: bool = False  # refused: only /v1/completions echoes
    tools: list[ToolParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {...}}
    response_format: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """vLLM's /tokenize: a prompt, or messages through the chat template (exactly one)."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = True  # with prompt
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True  # with messages
    tools: list[ToolParam] | None = None  # with messages: the template's tools section
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# ---- responses ------------------------------------------------------------------------------
class _OmitsNone(BaseModel):
    """Leaves out the fields named in _omit_if_none while they are None (other None fields,
    such as finish_reason, stay as null, as OpenAI sends them)."""

    _omit_if_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _omit(self, handler):
        data = handler(self)
        for name in self._omit_if_none:
            if data.get(name, 0) is None:
                del data[name]
        return data


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose K/V the prefix cache held


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    # The first of an echoed prompt's tokens has null for both, as OpenAI sends it.
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_OmitsNone):
    _omit_if_none = ("token_ids",)
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(_OmitsNone):
    _omit_if_none = ("tool_calls",)
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_OmitsNone):
    _omit_if_none = ("token_ids",)
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class FunctionDelta(_OmitsNone):
    _omit_if_none = ("name", "arguments")
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(_OmitsNone):
    """A streamed call: its first chunk has the id, type and name (arguments ""), the next
    ones pieces of its arguments, as OpenAI streams them."""

    _omit_if_none = ("id", "type")
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(_OmitsNone):
    # Only what the chunk carries, as OpenAI sends it: {"role": ...} first, then {"content": ...}
    # or {"tool_calls": [...]}; the last chunk's delta may be empty.
    _omit_if_none = ("role", "content", "tool_calls")
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatStreamChoice(_OmitsNone):
    _omit_if_none = ("token_ids",)
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """A streamed piece: the same object as a whole completion, as in OpenAI's API."""


class TokenizeResponse(_OmitsNone):
    _omit_if_none = ("token_strs",)
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "nanoqwen"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
