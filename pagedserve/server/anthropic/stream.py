"""A Messages request streamed in Anthropic's events: message_start, ping, then per block
content_block_start / _delta / _stop, then message_delta (stop reason, usage) and
message_stop; an engine failure mid-stream is an `error` event."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from pagedserve.engine.async_llm import EngineDeadError
from pagedserve.server.anthropic.errors import error_body
from pagedserve.server.anthropic.translate import (
    block_delta,
    content_block,
    stop_reason,
    usage,
)
from pagedserve.server.chat import ChatRun
from pagedserve.server.common import ServerState
from pagedserve.server.output_blocks import BlockStream, stream_blocks
from pagedserve.server.streaming import Tally


def event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps({'type': name, **data})}\n\n"


def _message_start(run: ChatRun, model: str, tally: Tally) -> str:
    return event("message_start", {"message": {
        "id": run.request_id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage(tally)}})


async def stream_message(state: ServerState, run: ChatRun, start: float) -> AsyncIterator[str]:
    stream = run.streams[0]
    tally = Tally()
    blocks = BlockStream()
    started = False
    try:
        # message_start waits for the first output: its usage has the prefix-cache hits then.
        async for e in stream_blocks(stream, run.parsers[0], tally, blocks):
            if e.type == "output":
                if not started:
                    started = True
                    yield _message_start(run, run.model, tally)
                    yield event("ping", {})
                continue
            assert e.block is not None
            index = e.block.index
            if e.type == "start":
                yield event("content_block_start", {
                    "index": index, "content_block": content_block(e.block, whole=False)})
            elif e.type == "delta":
                yield event("content_block_delta", {"index": index,
                                                    "delta": block_delta(e.block, e.delta)})
            else:
                yield event("content_block_stop", {"index": index})
        if not started:
            yield _message_start(run, run.model, tally)
        reason, sequence = stop_reason(blocks)
        yield event("message_delta", {"delta": {"stop_reason": reason,
                                                "stop_sequence": sequence},
                                      "usage": usage(tally)})
        yield event("message_stop", {})
    except EngineDeadError as exc:
        yield f"event: error\ndata: {json.dumps(error_body(503, str(exc)))}\n\n"
    finally:
        stream.close()
        tally.log(run.request_id, start, state.log_requests)
