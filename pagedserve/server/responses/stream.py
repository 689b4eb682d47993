"""A Responses request streamed in the official event order, every event with the next
sequence_number: response.created, response.in_progress; per output item
output_item.added, (content_part.added, output_text / reasoning_text deltas and done,
content_part.done | function_call_arguments deltas and done), output_item.done; then
response.completed (response.incomplete when max_output_tokens cut it short)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.server.chat import ChatRun
from pagedserve.server.common import ServerState
from pagedserve.server.output_blocks import Block, BlockStream, stream_blocks
from pagedserve.server.responses.translate import (
    item_id,
    output_item,
    output_text,
    reasoning_text,
)
from pagedserve.server.streaming import Tally

# Called when the run ends: the final response object (stored, if asked).
Finish = Callable[[BlockStream, Tally], dict[str, Any]]

DELTA = {"text": "response.output_text.delta", "reasoning": "response.reasoning_text.delta",
         "tool_call": "response.function_call_arguments.delta"}


class Events:
    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, type_: str, **data: Any) -> str:
        payload = {"type": type_, "sequence_number": self.sequence_number, **data}
        self.sequence_number += 1
        return f"event: {type_}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _part(block: Block, text: str) -> dict[str, Any]:
    return output_text(text) if block.kind == "text" else reasoning_text(text)


def _block_events(ev: Events, response_id: str, kind: str, block: Block, delta: str
                  ) -> list[str]:
    where = {"item_id": item_id(response_id, block), "output_index": block.index}
    has_part = block.kind != "tool_call"
    if kind == "start":
        out = [ev("response.output_item.added", output_index=block.index,
                  item=output_item(response_id, block, done=False))]
        if has_part:
            out.append(ev("response.content_part.added", **where, content_index=0,
                          part=_part(block, "")))
        return out
    if kind == "delta":
        extra: dict[str, Any] = {"content_index": 0} if has_part else {}
        if block.kind == "text":
            extra["logprobs"] = []
        return [ev(DELTA[block.kind], **where, **extra, delta=delta)]
    if block.kind == "tool_call":
        out = [ev("response.function_call_arguments.done", **where, name=block.name,
                  arguments=block.text)]
    else:
        done = "output_text" if block.kind == "text" else "reasoning_text"
        extra = {"logprobs": []} if block.kind == "text" else {}
        out = [ev(f"response.{done}.done", **where, content_index=0, text=block.text, **extra),
               ev("response.content_part.done", **where, content_index=0,
                  part=_part(block, block.text))]
    out.append(ev("response.output_item.done", output_index=block.index,
                  item=output_item(response_id, block, done=True)))
    return out


async def stream_response(state: ServerState, run: ChatRun, response_id: str,
                          opened: dict[str, Any], finish: Finish, start: float
                          ) -> AsyncIterator[str]:
    """`opened`: the response object in progress, as response.created carries it."""
    stream = run.streams[0]
    ev = Events()
    tally = Tally()
    blocks = BlockStream()
    try:
        yield ev("response.created", response=opened)
        yield ev("response.in_progress", response=opened)
        async for e in stream_blocks(stream, run.parsers[0], tally, blocks):
            if e.block is not None:
                for line in _block_events(ev, response_id, e.type, e.block, e.delta):
                    yield line
        final = finish(blocks, tally)
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield ev(kind, response=final)
    except EngineDeadError as exc:
        yield ev("error", code="server_error", message=str(exc), param=None)
    finally:
        stream.close()
        tally.log(run.request_id, start, state.log_requests)
