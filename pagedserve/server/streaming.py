"""Engine streams to HTTP responses: requests added all or none, Server-Sent Events that
abort their requests however they end, client disconnects, several streams merged, usage
tallied and logged."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from pagedserve.engine.async_llm import RequestStream
from pagedserve.engine.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as p
from pagedserve.server.common import ServerState, bad_value

logger = logging.getLogger("pagedserve.server")

T = TypeVar("T")


async def add_all(state: ServerState, request_id: str,
                  prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                  cache_salt: str | None, prompt_param: str,
                  renames: dict[str, str] | None = None, model: str | None = None,
                  multi_modal: Any = None) -> list[RequestStream]:
    """One engine request per (text, token ids) prompt (ids request_id-0, -1, ...); all or none
    are added. `multi_modal`: a chat prompt's processed images (MultiModalPrompt)."""
    streams: list[RequestStream] = []
    lora = state.lora_request(model)
    try:
        for i, (text, ids) in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.llm.add_request(engine_id, ids, params, cache_salt,
                                                       prompt_text=text, lora_request=lora,
                                                       multi_modal_data=multi_modal))
    except ValueError as exc:
        close_all(streams)
        raise bad_value(exc, prompt_param, renames) from None
    except BaseException:
        close_all(streams)
        raise
    return streams


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


class SSEResponse(StreamingResponse):
    """Server-Sent Events that abort their engine requests however the response ends, also
    when the client leaves before the body generator ever started."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], streams: list[RequestStream]) -> None:
        super().__init__(content)
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            close_all(self.streams)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Run `work`, cancelling it (so its requests are aborted) when the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody reads it; nginx's "client closed request"


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def merge_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Outputs of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for output in stream:
                queue.put_nowait((index, output))
        except Exception as exc:
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def sse(data: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(data, BaseModel):
        return f"data: {data.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None
          ) -> p.UsageInfo:
    details = None if cached_tokens is None else p.PromptTokensDetails(
        cached_tokens=cached_tokens)
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens,
                       prompt_tokens_details=details)

def log_request(request_id: str, prompt_tokens: int, completion_tokens: int,
                 finish_reasons: list[str | None], start: float, ttft: float | None) -> None:
    reasons = ",".join(sorted({r or "aborted" for r in finish_reasons})) or "aborted"
    first = f"{ttft:.3f} s" if ttft is not None else "-"
    logger.info("%s: %d prompt + %d completion tokens, finish %s, first token %s, "
                "total %.3f s", request_id, prompt_tokens, completion_tokens, reasons, first,
                time.monotonic() - start)


@dataclass
class Tally:
    """Token counts of one HTTP request for its usage and its log line."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    cached_tokens: dict[int, int] = field(default_factory=dict)  # prefix-cache hits per prompt
    completion_tokens: dict[tuple[int, int], int] = field(default_factory=dict)
    finish_reasons: dict[tuple[int, int], str | None] = field(default_factory=dict)
    ttft: float | None = None  # arrival to the first token, the earliest over the prompts

    def add(self, index: int, output: RequestOutput) -> None:
        self.prompt_tokens[index] = len(output.prompt_token_ids)
        self.cached_tokens[index] = output.num_cached_tokens
        for c in output.outputs:
            self.completion_tokens[(index, c.index)] = len(c.token_ids)
            self.finish_reasons[(index, c.index)] = c.finish_reason
        m = output.metrics
        if m is not None and m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            self.ttft = ttft if self.ttft is None else min(self.ttft, ttft)

    def usage(self) -> p.UsageInfo:
        return usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()),
                     sum(self.cached_tokens.values()))

    @property
    def completion_total(self) -> int:
        return sum(self.completion_tokens.values())

    def log(self, request_id: str, start: float, enabled: bool = True) -> None:
        if not enabled:
            return
        log_request(request_id, sum(self.prompt_tokens.values()),
                     sum(self.completion_tokens.values()), list(self.finish_reasons.values()),
                     start, self.ttft)


async def final_outputs(streams: list[RequestStream]) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(s.final() for s in streams)))
    finally:
        close_all(streams)
