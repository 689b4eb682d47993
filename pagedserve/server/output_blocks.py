"""One chat choice's output as a list of blocks (reasoning, text, tool calls): the shape of both
the Responses API's output items and Anthropic's content blocks. The chat parser's stream
deltas become block starts, deltas and stops; a whole message becomes its blocks. Both APIs
build on these, so they read a reply exactly as chat completions does."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagedserve.engine.async_llm import RequestStream
from pagedserve.server import protocol as p
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.streaming import Tally, final_outputs


@dataclass
class Block:
    kind: str  # "reasoning", "text" or "tool_call"
    index: int  # its place in the output
    text: str = ""  # the reasoning or text; a tool call's arguments (JSON text)
    call_id: str | None = None
    name: str | None = None


@dataclass
class BlockEvent:
    type: str  # "output" (an engine output arrived, before its blocks' events), "start",
    #            "delta" or "stop"
    block: Block | None = None
    delta: str = ""


@dataclass
class BlockStream:
    """Cuts DeltaMessages into blocks: a change of kind (or a new tool call) stops the open
    block and starts the next."""

    blocks: list[Block] = field(default_factory=list)
    open: Block | None = None
    calls: dict[int, Block] = field(default_factory=dict)  # a delta's call index -> its block
    finish_reason: str | None = None  # chat's: stop, length, tool_calls, abort
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def feed(self, delta: p.DeltaMessage | None) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        if delta is None:
            return out
        if delta.reasoning_content:
            self._text("reasoning", delta.reasoning_content, out)
        if delta.content:
            self._text("text", delta.content, out)
        for call in delta.tool_calls or []:
            fn = call.function or p.DeltaFunctionCall()
            block = self.calls.get(call.index)
            if block is None:
                block = self._start(Block("tool_call", len(self.blocks), call_id=call.id,
                                          name=fn.name), out)
                self.calls[call.index] = block
            if fn.arguments:
                block.text += fn.arguments
                out.append(BlockEvent("delta", block, fn.arguments))
        return out

    def finish(self) -> list[BlockEvent]:
        out: list[BlockEvent] = []
        self._close(out)
        return out

    def _text(self, kind: str, text: str, out: list[BlockEvent]) -> None:
        block = self.open
        if block is None or block.kind != kind:
            block = self._start(Block(kind, len(self.blocks)), out)
        block.text += text
        out.append(BlockEvent("delta", block, text))

    def _start(self, block: Block, out: list[BlockEvent]) -> Block:
        self._close(out)
        self.blocks.append(block)
        self.open = block
        out.append(BlockEvent("start", block))
        return block

    def _close(self, out: list[BlockEvent]) -> None:
        if self.open is not None:
            out.append(BlockEvent("stop", self.open))
            self.open = None


async def stream_blocks(stream: RequestStream, parser: ChatChoiceParser, tally: Tally,
                        blocks: BlockStream) -> AsyncIterator[BlockEvent]:
    """The block events of a one-choice request as it runs; `blocks` ends holding the output,
    its finish and stop reasons, `tally` its token counts."""
    async for output in stream:
        tally.add(0, output)
        yield BlockEvent("output")
        c = output.outputs[0]
        finished = c.finish_reason is not None
        for event in blocks.feed(parser.delta(c.delta_text, finished)):
            yield event
        if finished:
            blocks.finish_reason = parser.finish_reason(c.finish_reason)
            blocks.stop_reason = c.stop_reason
    for event in blocks.finish():
        yield event


def message_blocks(message: p.ChatResponseMessage, finish_reason: str | None,
                   stop_reason: int | str | None) -> BlockStream:
    """A whole chat message's blocks, in the order a stream would have sent them."""
    blocks = BlockStream(finish_reason=finish_reason, stop_reason=stop_reason)
    blocks.feed(p.DeltaMessage(
        reasoning_content=message.reasoning_content, content=message.content or None,
        tool_calls=[p.DeltaToolCall(index=i, id=c.id, function=p.DeltaFunctionCall(
            name=c.function.name, arguments=c.function.arguments))
            for i, c in enumerate(message.tool_calls)] or None))
    blocks.finish()
    return blocks


async def final_blocks(streams: list[RequestStream], parser: ChatChoiceParser, tally: Tally
                       ) -> BlockStream:
    """The blocks of a one-choice request once it has finished."""
    output = (await final_outputs(streams))[0]
    tally.add(0, output)
    c = output.outputs[0]
    message = parser.message(c.text)
    return message_blocks(message, parser.finish_reason(c.finish_reason), c.stop_reason)
