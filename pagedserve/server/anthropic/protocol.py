"""Request bodies of Anthropic's Messages API (pydantic v2). Unknown fields are refused, as
Anthropic does; the fields its SDK and Claude Code send that mean nothing here (metadata,
cache_control, thinking, service_tier, output_config, context_management, a tool's strict and
eager_input_streaming, a tool_use block's caller) are accepted and ignored. temperature, top_p
and top_k come in the body (the SDK passes them as extra fields), in Anthropic's ranges.
Image blocks become chat image parts; document blocks parse, so that the translation can refuse
them by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StrictInt, field_validator

from pagedserve.server.protocol import OpenAIModel as StrictModel

Ignored = dict[str, Any] | None  # accepted, no meaning here


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Ignored = None
    citations: list[Any] | None = None


class ImageSource(StrictModel):
    type: Literal["base64", "url", "file"]  # file (the Files API) is refused
    media_type: str | None = None  # base64: image/jpeg, image/png, image/gif, image/webp
    data: str | None = None  # base64
    url: str | None = None  # refused unless a file under --allowed-local-media-path
    file_id: str | None = None


class ImageBlock(StrictModel):
    type: Literal["image"]
    source: ImageSource
    cache_control: Ignored = None


class MediaBlock(StrictModel):
    """A document: refused by the translation with a message that names it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["document", "search_result"]


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Ignored = None
    # The SDK's model_dump() of a reply's block has these (None here): accepted, ignored.
    caller: Ignored = None
    toolset_name: str | None = None


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock | MediaBlock,
                                  Field(discriminator="type")]] = ""
    is_error: bool | None = None
    cache_control: Ignored = None
    toolset_name: str | None = None


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None
    cache_control: Ignored = None


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = Annotated[TextBlock | ImageBlock | MediaBlock | ToolUseBlock | ToolResultBlock
                         | ThinkingBlock | RedactedThinkingBlock, Field(discriminator="type")]


class Message(StrictModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(StrictModel):
    type: Literal["custom"] | None = None  # server tools (web search, bash...) are refused
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: Ignored = None
    # Accepted: a forced call's input always follows input_schema (a grammar makes it), and
    # every call's input streams as it is generated.
    strict: bool | None = None
    eager_input_streaming: bool | None = None


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool": the tool to call
    disable_parallel_tool_use: bool | None = None


class CountTokensRequest(StrictModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Ignored = None
    output_config: Ignored = None
    context_management: Ignored = None
    cache_control: Ignored = None  # the request's automatic cache breakpoint


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: StrictInt | None = None
    metadata: Ignored = None
    service_tier: str | None = None

    # Anthropic's documented ranges, narrower than the engine's (temperature up to 2, top_k
    # -1): refused here, at the door, as Anthropic refuses them.
    @field_validator("temperature", "top_p")
    @classmethod
    def _unit_interval(cls, value: float | None) -> float | None:
        if value is not None and not 0 <= value <= 1:  # written so that NaN fails too
            raise ValueError(f"must be in [0, 1], got {value!r}")
        return value

    @field_validator("top_k")
    @classmethod
    def _not_negative(cls, value: int | None) -> int | None:
        if value is not None and value < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
        return value
