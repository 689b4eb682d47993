"""Request bodies of the Responses API (pydantic v2). Unknown fields are refused, as OpenAI
does; fields Codex and the SDK send that mean nothing here (reasoning, include,
prompt_cache_key, metadata, service_tier, ...) are accepted and ignored. Images become chat
image parts; file and audio inputs parse, so that the translation can refuse them by name."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, StrictInt, Tag

from pagedserve.server.protocol import OpenAIModel as StrictModel


class TextPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class ImagePart(StrictModel):
    type: Literal["input_image"]
    image_url: str | None = None  # a data: URL, or a file under --allowed-local-media-path
    file_id: str | None = None  # refused: no Files API here
    detail: Literal["auto", "low", "high"] | None = None  # accepted: the processor decides


class MediaPart(StrictModel):
    """Refused by the translation with a message that names it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["input_file", "input_audio", "refusal"]


ContentPart = Annotated[TextPart | ImagePart | MediaPart, Field(discriminator="type")]


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(StrictModel):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: str | None = None


class ReasoningItem(StrictModel):
    """An earlier turn's reasoning: accepted, and left out of the prompt (as reasoning models'
    templates leave it out)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: str | None = None


def _item_type(value: Any) -> str | None:
    # A message may leave out its type ({"role": "user", "content": "hi"}).
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(StrictModel):
    type: Literal["function"]  # built-in tools (web search, files, shell...) are refused
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(StrictModel):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, ignored


class ReasoningConfig(StrictModel):
    """Accepted and ignored: how much a model reasons is its template's business."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(StrictModel):
    include_obfuscation: bool | None = None  # accepted: no padding is added to events here


class ResponsesRequest(StrictModel):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (dropping turns) is not implemented
    background: Literal[False] | None = None  # background runs are not implemented
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
