"""Request and response bodies of the OpenAI-compatible API (pydantic v2).

Request models forbid unknown fields, as OpenAI does; the engine's sampling fields that OpenAI
lacks (top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
skip_special_tokens, include_stop_str_in_output, cache_salt) are accepted as vLLM accepts them,
and so are vLLM's guided-decoding fields (guided_json, guided_regex, guided_choice,
guided_grammar) beside OpenAI's response_format.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from pagedserve.sampling_params import SamplingParams
from pagedserve.server.unicode_check import unpaired_surrogate


class OpenAIModel(BaseModel):
    """A request body: unknown fields are refused, as OpenAI does, and so is text that is not
    valid Unicode."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        where = unpaired_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds an unpaired UTF-16 surrogate (U+D800..U+DFFF); "
                             "send valid Unicode text")
        return data


# ---- errors -------------------------------------------------------------------------------


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared pieces ------------------------------------------------------------------------


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted: no padding is added to chunks here


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


# Engine sampling fields a request may set; None (or absent) keeps the engine default.
SAMPLING_FIELDS = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "min_tokens", "stop",
                   "stop_token_ids", "ignore_eos", "skip_special_tokens",
                   "include_stop_str_in_output", "logit_bias")


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str = "response"
    description: str | None = None
    # "schema" would shadow pydantic's BaseModel.schema.
    json_schema: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced: strict or not


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(OpenAIModel):
    model: str | None = None
    n: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    min_p: float | None = None
    seed: StrictInt | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    response_format: ResponseFormat | None = None
    # vLLM's guided decoding fields: at most one, and not with response_format.
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # refused: xgrammar has no such setting

    def base_sampling_fields(self, defaults: dict[str, Any] | None = None) -> dict[str, Any]:
        """The sampling fields the request set, over `defaults` (the model's)."""
        return {**(defaults or {}), **{name: getattr(self, name) for name in SAMPLING_FIELDS
                                       if getattr(self, name) is not None}}


# ---- /v1/completions ----------------------------------------------------------------------

# Token ids are strict ints: true or 100.0 in a prompt is a client's bug, not token 1 or 100.
PromptInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class CompletionRequest(SamplingRequest):
    prompt: PromptInput
    max_tokens: StrictInt | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None  # rejected when given: no fill-in-the-middle
    # vLLM's extension: each choice (and each streamed chunk) carries its new token ids; always
    # on for a model without a tokenizer, whose text is empty.
    return_token_ids: bool = False

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        fields = self.base_sampling_fields(defaults)
        fields["max_tokens"] = self.max_tokens
        if self.logprobs is not None:
            fields["logprobs"] = self.logprobs
            if self.echo:
                fields["prompt_logprobs"] = self.logprobs
        return SamplingParams(**fields)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # with return_token_ids, or without a tokenizer


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """A streamed chunk has the same shape as the full response (object text_completion)."""


# ---- /v1/chat/completions -----------------------------------------------------------------


class ImageURL(OpenAIModel):
    url: str  # a data: URL (base64), or a file under --allowed-local-media-path
    detail: Literal["auto", "low", "high"] | None = None  # accepted: the processor decides


class ContentPart(OpenAIModel):
    """A part of a message's content: text, image_url, or (vLLM's) image_embeds. Other types
    (input_audio, video_url, file) parse with their fields, to be refused by name."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None
    image_url: ImageURL | str | None = None
    # Base64 of `torch.save(tensor [tokens, hidden])`, or {"image_embeds": that} with, for the
    # Qwen-VL family, "image_grid_thw": base64 of the saved (t, h, w) patch grid.
    image_embeds: str | dict[str, str] | None = None
    uuid: str | None = None  # vLLM's: accepted; an image is known by its content's hash


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class RequestToolCall(OpenAIModel):
    """A tool call in an assistant message of the conversation sent back."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(OpenAIModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


ASSISTANT_ONLY = ("reasoning_content", "reasoning", "refusal", "annotations", "audio")


class ChatMessage(OpenAIModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message answers this call
    tool_calls: list[RequestToolCall] | None = None  # an assistant message's calls
    # What a reply carries when an agent sends it back (the SDK's message object, or its
    # model_dump() with every field): accepted; the reasoning goes to the chat template as
    # reasoning_content (as vLLM passes it: a template that does not read it drops it), the
    # rest is left out of the prompt.
    reasoning_content: str | None = None
    reasoning: str | None = None  # vLLM's newer name for reasoning_content
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: FunctionCall | None = None  # refused when set: OpenAI's deprecated form

    @model_validator(mode="after")
    def _as_openai_requires(self) -> ChatMessage:
        # OpenAI: every message but the assistant's has content; a tool message names its call.
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if self.role != "assistant":
            for name in ASSISTANT_ONLY:
                if getattr(self, name) is not None:
                    raise ValueError(f"only an assistant message has {name}")
        if self.function_call is not None:
            raise ValueError("function_call is deprecated: send the call in tool_calls")
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs tool_call_id")
        return self


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_tokens: StrictInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: StrictInt | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: bool = True
    # vLLM's prefill: the last (assistant) message is left open and the reply goes on from it.
    continue_final_message: bool = False
    # vLLM's: the chat template's own variables (Qwen3's enable_thinking, say).
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Sent by OpenAI's SDKs (the Agents SDK among them) and accepted, as vLLM accepts them,
    # with no effect here: nothing is stored, there are no tiers, the prefix cache needs no
    # key. reasoning_effort is passed to the chat template as a variable of that name
    # (gpt-oss's reads it; others ignore it).
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    modalities: list[Literal["text"]] | None = None  # audio output is refused

    def sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        fields = self.base_sampling_fields(defaults)
        # Absent: generate up to the context length (the engine fills it in per prompt).
        fields["max_tokens"] = (self.max_completion_tokens if self.max_completion_tokens
                                is not None else self.max_tokens)
        if self.logprobs:
            fields["logprobs"] = self.top_logprobs or 0
        return SamplingParams(**fields)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of a streamed tool call: the first carries id, type and name; the rest append
    to the arguments of the call at `index`."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


# ---- models, tokenizer, version -----------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(OpenAIModel):
    """vLLM's /tokenize: {"model", "prompt"} or {"model", "messages"} (chat template)."""

    model: str | None = None
    prompt: str | None = None
    # Default: what the model is fed for the same string: /v1/completions' text as it is, a
    # pooling model's input with the tokenizer's special tokens (/v1/embeddings' usage).
    add_special_tokens: bool | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[StrictInt]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
