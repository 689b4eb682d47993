"""Anthropic's request -> a chat completion request, and the chat path's output blocks ->
Anthropic's content blocks, stop reason and usage."""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from pagedserve.server import protocol as p
from pagedserve.server.anthropic import protocol as a
from pagedserve.server.common import ApiError
from pagedserve.server.output_blocks import Block, BlockStream
from pagedserve.server.streaming import Tally
from pagedserve.server.tool_parsers import NOT_JSON


def chat_request(body: a.CountTokensRequest) -> p.ChatCompletionRequest:
    """The chat request that asks the same of the model. A last assistant message is a
    prefill: the reply goes on from its text (and holds only what follows it)."""
    messages = chat_messages(body)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    last = messages[-1]
    if last["role"] == "assistant" and last["content"] and not last.get("tool_calls"):
        chat.update(continue_final_message=True, add_generation_prompt=False)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat.update(_tool_choice(choice, bool(body.tools)))
    if isinstance(body, a.MessagesRequest):
        chat.update(max_tokens=body.max_tokens, stream=body.stream, temperature=body.temperature,
                    top_p=body.top_p, top_k=body.top_k, stop=body.stop_sequences)
    try:
        return p.ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:  # checked at the door already: a gap in those checks
        raise ApiError(400, f"cannot translate the request: {exc.errors()[0]['msg']}") from None


def _tool_choice(choice: a.ToolChoice, has_tools: bool) -> dict[str, Any]:
    if choice.type == "none":
        return {"tool_choice": "none"}
    if not has_tools:
        raise ApiError(400, f"tool_choice {choice.type!r} needs tools", param="tool_choice")
    parallel = not choice.disable_parallel_tool_use
    if choice.type == "auto":
        return {"tool_choice": "auto", "parallel_tool_calls": parallel}
    if choice.type == "any":
        return {"tool_choice": "required", "parallel_tool_calls": parallel}
    if not choice.name:
        raise ApiError(400, 'tool_choice "tool" needs the tool\'s name',
                       param="tool_choice.name")
    return {"tool_choice": {"type": "function", "function": {"name": choice.name}},
            "parallel_tool_calls": parallel}


def chat_messages(body: a.CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.system
    if isinstance(system, list):
        system = "\n\n".join(b.text for b in system)
    if system:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        blocks = message.content
        if isinstance(blocks, str):
            blocks = [a.TextBlock(type="text", text=blocks)]
        if message.role == "user":
            out += _user_messages(i, blocks)
        else:
            out.append(_assistant_message(i, blocks))
    return out


def _refuse_media(block: Any, where: str) -> None:
    if isinstance(block, a.MediaBlock):
        raise ApiError(400, f"{where}: {block.type} blocks are not supported", param=where)
    if isinstance(block, a.ImageBlock):
        raise ApiError(400, f"{where}: image blocks go in a user message's content (not in "
                            "tool results or assistant messages)", param=where)


def image_part(block: a.ImageBlock, where: str) -> dict[str, Any]:
    """An image block as the chat path's image_url part (which refuses remote URLs)."""
    source = block.source
    if source.type == "base64":
        if not source.data or not source.media_type:
            raise ApiError(400, f"{where}: a base64 image source needs media_type and data",
                           param=where)
        return {"type": "image_url",
                "image_url": {"url": f"data:{source.media_type};base64,{source.data}"}}
    if source.type == "url":
        if not source.url:
            raise ApiError(400, f"{where}: a url image source needs url", param=where)
        return {"type": "image_url", "image_url": {"url": source.url}}
    raise ApiError(400, f"{where}: file image sources (the Files API) are not supported: send "
                        "the image as base64", param=where)


def _user_messages(i: int, blocks: list[Any]) -> list[dict[str, Any]]:
    """Tool results become tool messages (the chat template's way), the text (and images,
    in order) one user message after them."""
    out: list[dict[str, Any]] = []
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        if isinstance(block, a.ImageBlock):
            parts.append(image_part(block, where))
            continue
        _refuse_media(block, where)
        if isinstance(block, a.TextBlock):
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, a.ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id,
                        "content": _tool_result_text(block, where)})
        elif not isinstance(block, a.ThinkingBlock | a.RedactedThinkingBlock):
            raise ApiError(400, f"{where}: a user message cannot hold {block.type} blocks",
                           param=where)
    if len(parts) > len(texts):  # images: the parts in order
        out.append({"role": "user", "content": parts})
    elif texts or not out:
        out.append({"role": "user", "content": "\n\n".join(texts)})
    return out


def _tool_result_text(block: a.ToolResultBlock, where: str) -> str:
    content = block.content
    if not isinstance(content, str):
        for k, part in enumerate(content):
            _refuse_media(part, f"{where}.content.{k}")
        content = "\n\n".join(part.text for part in content)
    # The model must know a call failed: Anthropic's is_error has no place in the template.
    return f"Error: {content}" if block.is_error else content


def _assistant_message(i: int, blocks: list[Any]) -> dict[str, Any]:
    """Text and tool calls; earlier thinking is left out of the prompt, as reasoning models'
    templates leave it out."""
    texts, calls = [], []
    for j, block in enumerate(blocks):
        where = f"messages.{i}.content.{j}"
        _refuse_media(block, where)
        if isinstance(block, a.TextBlock):
            texts.append(block.text)
        elif isinstance(block, a.ToolUseBlock):
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, a.ToolResultBlock):
            raise ApiError(400, f"{where}: tool_result blocks belong in user messages",
                           param=where)
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
    if calls:
        message["tool_calls"] = calls
    return message


# ---- the reply ----------------------------------------------------------------------------


def tool_use_id(call_id: str | None) -> str:
    return "toolu_" + (call_id or "").removeprefix("call_")


def content_block(block: Block, whole: bool) -> dict[str, Any]:
    """Anthropic's block: whole, or as content_block_start opens it (empty)."""
    text = block.text if whole else ""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == "text":
        return {"type": "text", "text": text}
    arguments: Any = {}
    if whole:
        try:
            arguments = json.loads(block.text or "{}")
        except NOT_JSON:
            # Cut off by max_tokens (stop_reason says so), or nested past the recursion
            # limit (a schema that refers to itself): its text is what there is.
            return {"type": "text", "text": block.text}
    return {"type": "tool_use", "id": tool_use_id(block.call_id), "name": block.name or "",
            "input": arguments}


def block_delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if block.kind == "text":
        return {"type": "text_delta", "text": text}
    return {"type": "input_json_delta", "partial_json": text}


def stop_reason(blocks: BlockStream) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) from the chat path's finish reason."""
    if blocks.finish_reason == "tool_calls":
        return "tool_use", None
    if blocks.finish_reason == "length":
        return "max_tokens", None
    if isinstance(blocks.stop_reason, str):
        return "stop_sequence", blocks.stop_reason
    return "end_turn", None


def usage(tally: Tally) -> dict[str, int]:
    """Anthropic counts cached prompt tokens apart: input_tokens are those computed anew."""
    u = tally.usage()
    cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
    return {"input_tokens": u.prompt_tokens - cached, "output_tokens": u.completion_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def message_object(message_id: str, model: str, blocks: BlockStream, tally: Tally
                   ) -> dict[str, Any]:
    reason, sequence = stop_reason(blocks)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": [content_block(b, whole=True) for b in blocks.blocks],
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage(tally)}
