"""POST /v1/completions: whole responses and streamed chunks, echo and logprobs."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from pagedserve.engine.async_llm import EngineDeadError, RequestStream
from pagedserve.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.server import protocol as p
from pagedserve.server.common import (
    ApiError,
    ServerState,
    check_token_ids,
    common_checks,
    finite,
    sampling_params,
    tokenize_prompts,
)
from pagedserve.server.guided import guided_decoding, with_guided
from pagedserve.server.streaming import (
    SSE_DONE,
    SSEResponse,
    Tally,
    add_all,
    close_all,
    final_outputs,
    merge_streams,
    sse,
    until_disconnect,
)


def _prompt_list(prompt: p.PromptInput) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]  # type: ignore[arg-type]
    return list(prompt)  # type: ignore[arg-type]


def _completion_logprobs(state: ServerState, token_ids: list[int],
                         positions: list[PositionLogprobs | None], offset: int
                         ) -> p.CompletionLogprobs:
    out = p.CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position.get(token_id) if position else None
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else \
            state.decode([token_id])
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if position is None or chosen is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(finite(chosen.logprob))
        out.top_logprobs.append({(lp.decoded_token or ""): finite(lp.logprob)
                                 for lp in position.values()})
    return out


def _merge_logprobs(a: p.CompletionLogprobs, b: p.CompletionLogprobs) -> p.CompletionLogprobs:
    return p.CompletionLogprobs(text_offset=a.text_offset + b.text_offset,
                                token_logprobs=a.token_logprobs + b.token_logprobs,
                                tokens=a.tokens + b.tokens,
                                top_logprobs=a.top_logprobs + b.top_logprobs)


class _CompletionChoices:
    """Builds completion choices (whole or streamed deltas), echo and logprobs included."""

    def __init__(self, state: ServerState, body: p.CompletionRequest, n: int) -> None:
        self.state, self.body, self.n = state, body, n
        # Without a tokenizer the text stays empty: token ids are what a client can read.
        self.return_token_ids = body.return_token_ids or state.llm.tokenizer is None
        self.offsets: dict[int, int] = {}
        self.echoed: set[int] = set()
        self.finished: set[int] = set()

    def _prompt_part(self, output: RequestOutput, key: int
                     ) -> tuple[str, p.CompletionLogprobs | None]:
        """The echoed prompt (and its logprobs), once per choice."""
        if not self.body.echo or key in self.echoed:
            return "", None
        self.echoed.add(key)
        text = output.prompt if output.prompt is not None else \
            self.state.decode(output.prompt_token_ids)
        logprobs = None
        if self.body.logprobs is not None:
            positions = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
            logprobs = _completion_logprobs(self.state, output.prompt_token_ids, positions, 0)
        self.offsets[key] = len(text)
        return text, logprobs

    def choice(self, index: int, output: RequestOutput, c: CompletionOutput, delta: bool
               ) -> p.CompletionChoice | None:
        key = index * self.n + c.index
        if delta and key in self.finished:  # n > 1: a done sequence rides along
            return None
        if c.finish_reason is not None:
            self.finished.add(key)
        prefix, prefix_lp = self._prompt_part(output, key)
        text = c.delta_text if delta else c.text
        token_ids = c.delta_token_ids if delta else c.token_ids
        positions = c.delta_logprobs if delta else c.logprobs
        logprobs = prefix_lp
        if self.body.logprobs is not None and positions is not None:
            gen = _completion_logprobs(self.state, token_ids, positions,
                                       self.offsets.get(key, 0))
            self.offsets[key] = (gen.text_offset[-1] + len(gen.tokens[-1]) if gen.tokens
                                 else self.offsets.get(key, 0))
            logprobs = gen if logprobs is None else _merge_logprobs(logprobs, gen)
        ids = list(token_ids) if self.return_token_ids else None
        if delta and not (prefix or text or c.finish_reason or ids
                          or (logprobs and logprobs.tokens)):
            return None
        return p.CompletionChoice(index=key, text=prefix + text, logprobs=logprobs,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                  token_ids=ids)


async def create_completion(state: ServerState, body: p.CompletionRequest,
                       request: Request) -> Any:
    start = time.monotonic()
    prompts = _prompt_list(body.prompt)
    common_checks(state, body, len(prompts))
    if body.suffix:
        raise ApiError(400, "suffix is not supported (this server does no fill-in-the-middle)",
                       param="suffix")
    for prompt in prompts:
        if isinstance(prompt, list):
            check_token_ids(state, prompt, "prompt")
    params = sampling_params(state, body, "prompt")
    params = await with_guided(state, params, *guided_decoding(body))
    prompts = await tokenize_prompts(state, prompts)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await add_all(state, request_id, prompts, params, body.cache_salt, "prompt",
                            model=body.model)
    builder = _CompletionChoices(state, body, params.n)
    if body.stream:
        return SSEResponse(_stream_completion(state, body, request_id, streams, builder,
                                               start), streams)
    return await until_disconnect(
        request, _full_completion(state, request_id, streams, builder, start))


async def _full_completion(state: ServerState, request_id: str, streams: list[RequestStream],
                           builder: _CompletionChoices, start: float) -> p.CompletionResponse:
    tally = Tally()
    try:
        finals = await final_outputs(streams)
        choices = []
        for index, output in enumerate(finals):
            tally.add(index, output)
            for c in output.outputs:
                choice = builder.choice(index, output, c, delta=False)
                assert choice is not None
                choices.append(choice)
        model = state.response_model(builder.body.model)
        return p.CompletionResponse(id=request_id, model=model, choices=choices,
                                    usage=tally.usage(), system_fingerprint=state.fingerprint)
    finally:
        tally.log(request_id, start, state.log_requests)


async def _stream_completion(state: ServerState, body: p.CompletionRequest, request_id: str,
                             streams: list[RequestStream], builder: _CompletionChoices,
                             start: float) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    created = int(time.time())
    tally = Tally()
    try:
        async for index, output in merge_streams(streams):
            tally.add(index, output)
            for c in output.outputs:
                choice = builder.choice(index, output, c, delta=True)
                if choice is not None:
                    chunk = p.CompletionStreamResponse(
                        id=request_id, created=created, model=state.response_model(body.model),
                        choices=[choice], system_fingerprint=state.fingerprint)
                    yield sse(chunk, exclude)
        if include_usage:
            yield sse(p.CompletionStreamResponse(
                id=request_id, created=created, model=state.response_model(body.model), choices=[],
                usage=tally.usage(), system_fingerprint=state.fingerprint))
        yield SSE_DONE
    except EngineDeadError as exc:
        yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error")))
        yield SSE_DONE
    finally:
        close_all(streams)
        tally.log(request_id, start, state.log_requests)
