"""The Responses and Messages event streams over a scripted engine stream (no server): every
event validates strictly against the official SDKs' own event types, and reasoning (from
--reasoning-parser), text and a tool call come out as their own items / blocks, in order."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pydantic
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import RawMessageStreamEvent
from openai.types.responses import ResponseStreamEvent

from pagedserve.engine.outputs import CompletionOutput, RequestOutput
from pagedserve.server.anthropic.stream import stream_message
from pagedserve.server.chat import ChatRun
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.reasoning import get_reasoning_parser
from pagedserve.server.responses.protocol import ResponsesRequest
from pagedserve.server.responses.stream import stream_response
from pagedserve.server.responses.translate import response_object, usage
from pagedserve.server.tool_parsers import get_tool_parser

CALL = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
PIECES = ["<think>", "let me ", "see</think>", "Hello", " world.", CALL]


class ScriptedStream:
    """A RequestStream that yields one output per piece of text."""

    def __init__(self, pieces: list[str], finish: str = "stop") -> None:
        self.pieces = pieces
        self.finish = finish
        self.closed = False

    async def __aiter__(self):
        text = ""
        for i, piece in enumerate(self.pieces):
            text += piece
            last = i == len(self.pieces) - 1
            yield RequestOutput("r", None, [1] * 40, None, [CompletionOutput(
                0, text, list(range(i + 1)), delta_text=piece,
                finish_reason=self.finish if last else None)], last, num_cached_tokens=32)

    def close(self) -> None:
        self.closed = True


def _run(pieces: list[str], request_id: str) -> ChatRun:
    parser = ChatChoiceParser("auto", get_reasoning_parser("qwen3"), get_tool_parser("hermes"))
    return ChatRun(request_id, [1] * 40, [ScriptedStream(pieces)], [parser], "m")


STATE = SimpleNamespace(model_name="m", log_requests=False)


async def _collect(gen) -> list[str]:
    return [chunk async for chunk in gen]


def _events(chunks: list[str]) -> list[tuple[str, dict]]:
    out = []
    for chunk in chunks:
        name, data = chunk.strip().split("\n")
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_messages_events_validate_and_accumulate() -> None:
    run = _run(PIECES, "msg_1")
    events = _events(asyncio.run(_collect(stream_message(STATE, run, 0.0))))
    adapter = pydantic.TypeAdapter(RawMessageStreamEvent)
    snapshot, bufs = None, {}
    for name, data in events:
        if name == "ping":
            continue
        assert data["type"] == name
        event = adapter.validate_python(data)  # strict: every field of the SDK's type
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=bufs)
    assert [b.type for b in snapshot.content] == ["thinking", "text", "tool_use"]
    assert snapshot.content[0].thinking == "let me see"
    assert snapshot.content[1].text == "Hello world."
    assert snapshot.content[2].name == "f" and snapshot.content[2].input == {"x": 1}
    assert snapshot.stop_reason == "tool_use"
    assert snapshot.usage.cache_read_input_tokens == 32 and snapshot.usage.input_tokens == 8
    assert run.streams[0].closed


def test_responses_events_validate_in_order() -> None:
    run = _run(PIECES, "resp_1")
    body = ResponsesRequest(input="x")
    opened = response_object("resp_1", "m", body, 0)

    def finish(blocks, tally):
        return response_object("resp_1", "m", body, 0, blocks, usage(tally, 2))

    chunks = asyncio.run(_collect(stream_response(STATE, run, "resp_1", opened, finish, 0.0)))
    events = _events(chunks)
    adapter = pydantic.TypeAdapter(ResponseStreamEvent)
    for i, (name, data) in enumerate(events):
        assert data["type"] == name and data["sequence_number"] == i
        adapter.validate_python(data)
    names = [n for n, _ in events]
    assert names[:2] == ["response.created", "response.in_progress"]
    assert names[-1] == "response.completed"
    final = events[-1][1]["response"]
    assert [o["type"] for o in final["output"]] == ["reasoning", "message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "let me see"
    assert final["output"][1]["content"][0]["text"] == "Hello world."
    assert json.loads(final["output"][2]["arguments"]) == {"x": 1}
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 32
    # Each item opens, streams and closes before the next opens.
    added = [d["output_index"] for n, d in events if n == "response.output_item.added"]
    done = [d["output_index"] for n, d in events if n == "response.output_item.done"]
    assert added == done == [0, 1, 2]
