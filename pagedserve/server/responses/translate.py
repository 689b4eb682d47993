"""A Responses request -> a chat completion request (input items -> chat messages), and the chat
path's output blocks -> output items, the conversation to store, and the response object."""

from __future__ import annotations

import re
import time
from typing import Any

from pydantic import ValidationError

from pagedserve.server import protocol as p
from pagedserve.server.common import ApiError
from pagedserve.server.output_blocks import Block, BlockStream
from pagedserve.server.responses import protocol as r
from pagedserve.server.streaming import Tally

# Chat request fields -> the Responses fields they came from (for errors' `param`).
PARAMS = {"messages": "input", "max_completion_tokens": "max_output_tokens",
          "max_tokens": "max_output_tokens", "response_format": "text.format",
          "response_format.json_schema": "text.format.schema"}


def renamed(exc: ApiError, origins: list[str] | None = None) -> ApiError:
    """A chat path's error with its param named as the Responses API names it. `origins`:
    where each chat message came from (input.3, instructions, previous_response_id), so that
    messages.K.content.J names the input item's part."""
    error = exc.body.error
    if error.param in PARAMS:
        chat_name, error.param = error.param, PARAMS[error.param]
        if re.match(rf"{re.escape(chat_name)}\b", error.message):  # "max_tokens must be..."
            error.message = error.param + error.message[len(chat_name):]
    elif origins and error.param and error.param.startswith("messages."):
        index, _, rest = error.param.removeprefix("messages.").partition(".")
        if index.isdigit() and int(index) < len(origins):
            origin = origins[int(index)]
            error.param = f"{origin}.{rest}" if rest and origin.startswith("input") else origin
            error.message = error.message.replace(f"messages.{index}", origin, 1)
    return exc


def chat_request(body: r.ResponsesRequest, history: list[dict[str, Any]]
                 ) -> p.ChatCompletionRequest:
    """The chat request for `history` (the conversation so far, as chat messages: a stored
    one and this request's input) under this request's instructions."""
    messages = list(history)
    if body.instructions:
        messages.insert(0, {"role": "system", "content": body.instructions})
    chat: dict[str, Any] = {
        "model": body.model, "messages": messages, "stream": body.stream,
        "max_completion_tokens": body.max_output_tokens, "temperature": body.temperature,
        "top_p": body.top_p, "parallel_tool_calls": body.parallel_tool_calls}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"})}
                         for t in body.tools]
    choice = body.tool_choice
    if isinstance(choice, r.NamedToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    elif choice is not None:
        chat["tool_choice"] = choice
    fmt = body.text.format if body.text else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise ApiError(400, "text.format json_schema needs schema", param="text.format")
        chat["response_format"] = {"type": "json_schema", "json_schema": {
            "name": fmt.name or "response", "description": fmt.description,
            "schema": fmt.json_schema, "strict": fmt.strict}}
    try:
        return p.ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # checked at the door already: a gap in those checks
        raise ApiError(400, f"cannot translate the request: {exc.errors()[0]['msg']}") from None


def input_messages(items: str | list[Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """Input items as chat messages, and the input item each came from: function calls join
    the assistant message before them, their outputs become tool messages, earlier reasoning
    is left out."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], ["input"]
    out: list[dict[str, Any]] = []
    origins: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not (isinstance(item, r.FunctionCallItem) and out and out[-1]["role"] == "assistant"):
            origins.append(where)
        if isinstance(item, r.MessageItem):  # developer: as the chat path renders it
            out.append({"role": item.role,
                        "content": _content(item.content, f"{where}.content")})
        elif isinstance(item, r.FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, r.FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id,
                        "content": _content(item.output, f"{where}.output", images=False)})
        else:  # reasoning: no message
            origins.pop()
    return out, origins


def _content(content: str | list[Any], where: str, images: bool = True
             ) -> str | list[dict[str, Any]]:
    """The text; with input_image parts, chat content parts in order."""
    if isinstance(content, str):
        return content
    texts, parts = [], []
    for j, part in enumerate(content):
        if isinstance(part, r.ImagePart) and images:
            parts.append(_image_part(part, f"{where}.{j}"))
            continue
        if not isinstance(part, r.TextPart):
            raise ApiError(400, f"{where}.{j}: {part.type} is not supported here",
                           param=f"{where}.{j}")
        texts.append(part.text)
        parts.append({"type": "text", "text": part.text})
    return parts if len(parts) > len(texts) else "\n".join(texts)  # as chat joins its parts


def _image_part(part: r.ImagePart, where: str) -> dict[str, Any]:
    if not part.image_url:
        raise ApiError(400, f"{where}: input_image needs image_url (file_id is not supported)",
                       param=where)
    return {"type": "image_url", "image_url": {"url": part.image_url}}


# ---- the reply ----------------------------------------------------------------------------

ITEM_PREFIX = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def item_id(response_id: str, block: Block) -> str:
    return f"{ITEM_PREFIX[block.kind]}_{response_id.removeprefix('resp_')}_{block.index}"


def output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def reasoning_text(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def output_item(response_id: str, block: Block, done: bool) -> dict[str, Any]:
    """The block's output item: as output_item.added opens it (empty), or done."""
    status = "completed" if done else "in_progress"
    text = block.text if done else ""
    iid = item_id(response_id, block)
    if block.kind == "reasoning":
        return {"type": "reasoning", "id": iid, "summary": [],
                "content": [reasoning_text(text)] if done else [], "status": status}
    if block.kind == "text":
        return {"type": "message", "id": iid, "status": status, "role": "assistant",
                "content": [output_text(text)] if done else []}
    return {"type": "function_call", "id": iid, "call_id": block.call_id, "name": block.name,
            "arguments": text, "status": status}


def assistant_message(blocks: BlockStream) -> dict[str, Any]:
    """The output as the chat message a later turn's prompt shows."""
    text = "".join(b.text for b in blocks.blocks if b.kind == "text")
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    calls = [{"id": b.call_id, "type": "function",
              "function": {"name": b.name, "arguments": b.text}}
             for b in blocks.blocks if b.kind == "tool_call"]
    if calls:
        message["tool_calls"] = calls
    return message


def usage(tally: Tally, reasoning_tokens: int) -> dict[str, Any]:
    u = tally.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": u.total_tokens}


def response_object(response_id: str, model: str, body: r.ResponsesRequest, created: float,
                    blocks: BlockStream | None = None, usage_: dict[str, Any] | None = None
                    ) -> dict[str, Any]:
    """The response: in progress (no blocks yet), or done with its output and usage."""
    status, incomplete = "in_progress", None
    if blocks is not None:
        status = "completed"
        if blocks.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
    fmt = body.text.format if body.text and body.text.format else None
    choice = body.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": int(created), "status": status,
        "error": None, "incomplete_details": incomplete, "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens, "model": model,
        "output": [output_item(response_id, b, True) for b in blocks.blocks] if blocks else [],
        "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id,
        "reasoning": (body.reasoning.model_dump() if body.reasoning
                      else {"effort": None, "summary": None}),
        "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
        "text": {"format": (fmt.model_dump(by_alias=True, exclude_none=True) if fmt
                            else {"type": "text"})},
        "tool_choice": (choice.model_dump() if isinstance(choice, r.NamedToolChoice)
                        else choice or "auto"),
        "tools": [t.model_dump() for t in body.tools or []], "truncation": "disabled",
        "usage": usage_, "metadata": body.metadata or {}, "user": body.user,
        "completed_at": int(time.time()) if blocks is not None else None}
