"""POST /v1/chat/completions: messages through the chat template, whole responses and
streamed deltas in OpenAI's chunk shape; structured outputs, tool calls and reasoning
(chat_tools and chat_output hold how)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from pagedserve.engine.async_llm import EngineDeadError, RequestStream
from pagedserve.engine.llm import render_chat, template_options
from pagedserve.engine.outputs import PositionLogprobs
from pagedserve.multimodal.chat import render_with_images
from pagedserve.multimodal.inputs import MultiModalPrompt
from pagedserve.server import protocol as p
from pagedserve.server.chat_media import (
    TemplateInput,
    as_parts,
    template_input,
    template_reads_parts,
)
from pagedserve.server.chat_output import ChatChoiceParser
from pagedserve.server.chat_tools import ToolPrompt, calls_as_text, tool_plan
from pagedserve.server.common import ApiError, ServerState, common_checks, finite, sampling_params
from pagedserve.server.guided import guided_decoding, with_guided
from pagedserve.server.streaming import (
    SSE_DONE,
    SSEResponse,
    Tally,
    add_all,
    final_outputs,
    sse,
    until_disconnect,
)
from pagedserve.server.tool_parsers import HermesToolParser


def template_messages(state: ServerState, messages: list[p.ChatMessage]) -> TemplateInput:
    """The messages as the chat template takes them, and their images (refused here, before
    any decoding, when the request cannot have them)."""
    return template_input(messages, state.mm_processor, state.image_limit, state.media.settings,
                          state.model_name)


def developer_as_system(messages: list[dict[str, Any]], template: str
                        ) -> list[dict[str, Any]]:
    """OpenAI's developer role is its newer name for system: a template that does not know
    the role would render it as a turn of its own (under its default system prompt)."""
    if "developer" in template:
        return messages
    return [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]


def template_variables(body: p.ChatCompletionRequest | p.TokenizeRequest
                       ) -> dict[str, Any] | None:
    """The chat template's variables a request sets: vLLM's chat_template_kwargs, and
    reasoning_effort under its own name unless they set it. A key that is an argument of the
    template call itself (tools, add_generation_prompt, ...) is refused by name."""
    variables = dict(body.chat_template_kwargs or {})
    effort = getattr(body, "reasoning_effort", None)
    if effort is not None:
        variables.setdefault("reasoning_effort", effort)
    try:
        template_options(add_generation_prompt=False, chat_template_kwargs=variables)
    except ValueError as exc:
        raise ApiError(400, str(exc), param="chat_template_kwargs") from None
    return variables or None


def render_template(state: ServerState, rendered: list[dict[str, Any]],
                    add_generation_prompt: bool, tools: ToolPrompt | None = None,
                    num_images: int = 0, continue_final_message: bool = False,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Template messages -> prompt token ids (one placeholder per image, not yet expanded,
    rendered as `LLM.chat` renders them); `template_kwargs`: the template's variables."""
    template = state.llm.engine.chat_template or getattr(state.tokenizer, "chat_template", "")
    rendered = developer_as_system(rendered, template or "")
    template_tools = None
    if tools is not None:
        template_tools, rendered = tools.apply(rendered, template or "")
    else:
        rendered = calls_as_text(rendered, template or "", state.tool_parser or HermesToolParser())
    if state.mm_processor is not None:
        if state.reads_parts is None:  # checked once, on the first chat
            state.reads_parts = template_reads_parts(state.tokenizer,
                                                     state.llm.engine.chat_template)
        if state.reads_parts:
            rendered = as_parts(rendered)
    try:
        if num_images and template_tools is None:
            return render_with_images(state.tokenizer, rendered, num_images,
                                      state.mm_processor.image_placeholder,
                                      add_generation_prompt, state.llm.engine.chat_template,
                                      continue_final_message, template_kwargs=template_kwargs)
        return render_chat(state.tokenizer, rendered, add_generation_prompt,
                           state.llm.engine.chat_template, template_tools,
                           continue_final_message, template_kwargs)
    except ApiError:
        raise
    except Exception as exc:  # template errors are the request's fault, not the server's
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None


@dataclass
class ChatPrompt:
    token_ids: list[int]  # with each image's placeholder expanded to its tokens
    multi_modal: MultiModalPrompt | None = None  # the processed images, if any


async def chat_prompt(state: ServerState, messages: list[p.ChatMessage],
                      add_generation_prompt: bool, tools: ToolPrompt | None = None,
                      continue_final_message: bool = False,
                      template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """Render (in a worker thread: a long chat holds nothing up) while the media pool decodes
    the images, then expand their placeholders on the pool. A bad image is named before a
    template error."""
    inputs = template_messages(state, messages)
    render = asyncio.to_thread(render_template, state, inputs.messages, add_generation_prompt,
                               tools, len(inputs.images), continue_final_message,
                               template_kwargs)
    if not inputs.images:
        return ChatPrompt(await render)
    processor = state.mm_processor
    ids, items = await asyncio.gather(render, state.media.load_all(inputs.images, processor),
                                      return_exceptions=True)
    for result in (items, ids):
        if isinstance(result, BaseException):
            raise result
    processed = await state.media.process(processor, ids, items, state.llm.engine.mm_limits,
                                          state.model_name)
    return ChatPrompt(processed.prompt_token_ids, processed)


def _chat_logprobs(state: ServerState, token_ids: list[int],
                   positions: list[PositionLogprobs] | None, top_n: int
                   ) -> p.ChatChoiceLogprobs | None:
    if positions is None:
        return None
    content = []
    for token_id, position in zip(token_ids, positions, strict=False):
        chosen = position[token_id]
        ranked = sorted(position.items(), key=lambda kv: kv[1].rank or 0)[:top_n]
        top = [_top_logprob(state, tid, lp.decoded_token, lp.logprob) for tid, lp in ranked]
        first = _top_logprob(state, token_id, chosen.decoded_token, chosen.logprob)
        content.append(p.ChatTokenLogprob(**first.model_dump(), top_logprobs=top))
    return p.ChatChoiceLogprobs(content=content)


def _top_logprob(state: ServerState, token_id: int, text: str | None, logprob: float
                 ) -> p.TopLogprob:
    text = text if text is not None else state.decode([token_id])
    return p.TopLogprob(token=text, logprob=finite(logprob), bytes=list(text.encode()))


CHAT_RENAMES = {"logprobs": "top_logprobs"}


def check_continue_final_message(body: p.ChatCompletionRequest | p.TokenizeRequest) -> None:
    """vLLM's rules: a prefill continues an assistant message, and opens no new turn."""
    if not body.continue_final_message:
        return
    if body.add_generation_prompt:
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be "
                            "true: set add_generation_prompt to false",
                       param="continue_final_message")
    messages = body.messages or []
    if not messages or messages[-1].role != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to be the "
                            "assistant's (the text the reply goes on from)",
                       param="continue_final_message")


@dataclass
class ChatRun:
    """A chat request in the engine: its id, prompt, streams (one) and choice parsers (n)."""

    request_id: str
    prompt: list[int]
    streams: list[RequestStream]
    parsers: list[ChatChoiceParser]
    model: str  # what a response names: the adapter the request named, else the base


async def start_chat(state: ServerState, body: p.ChatCompletionRequest,
                     id_prefix: str = "chatcmpl-") -> ChatRun:
    """Check, render and add one chat request: the path every chat-shaped API (chat
    completions, Responses, Anthropic's Messages) takes to the engine."""
    common_checks(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    check_continue_final_message(body)
    variables = template_variables(body)
    renames = dict(CHAT_RENAMES)
    if body.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    params = sampling_params(state, body, "messages", renames)
    plan = tool_plan(state, body)
    guided, field = guided_decoding(body)
    if plan.guided is not None:
        if guided is not None:
            raise ApiError(400, f"{field} cannot be combined with tool_choice "
                                f"{plan.mode!r}: the tool call's grammar applies",
                           param=field)
        guided, field = plan.guided, "tool_choice"
    params = await with_guided(state, params, guided, field)
    prompt = await chat_prompt(state, body.messages, body.add_generation_prompt, plan.prompt,
                               body.continue_final_message, variables)
    request_id = f"{id_prefix}{uuid.uuid4().hex}"
    streams = await add_all(state, request_id, [(None, prompt.token_ids)], params,
                            body.cache_salt, "messages", renames, model=body.model,
                            multi_modal=prompt.multi_modal)
    return ChatRun(request_id, prompt.token_ids, streams,
                   [plan.parser(state) for _ in range(params.n)],
                   state.response_model(body.model))


async def create_chat_completion(state: ServerState, body: p.ChatCompletionRequest,
                                 request: Request) -> Any:
    start = time.monotonic()
    run = await start_chat(state, body)
    if body.stream:
        return SSEResponse(_stream_chat(state, body, run.request_id, run.streams[0],
                                        run.parsers, start), run.streams)
    return await until_disconnect(request, _full_chat(state, body, run.request_id,
                                                      run.streams, run.parsers, start))


async def _full_chat(state: ServerState, body: p.ChatCompletionRequest, request_id: str,
                     streams: list[RequestStream], parsers: list[ChatChoiceParser],
                     start: float) -> p.ChatCompletionResponse:
    tally = Tally()
    try:
        output = (await final_outputs(streams))[0]
        tally.add(0, output)
        top_n = body.top_logprobs or 0
        choices = []
        for c in output.outputs:
            parser = parsers[c.index]
            message = parser.message(c.text)
            choices.append(p.ChatCompletionChoice(
                index=c.index, message=message,
                logprobs=_chat_logprobs(state, c.token_ids, c.logprobs, top_n) if body.logprobs
                else None, finish_reason=parser.finish_reason(c.finish_reason),
                stop_reason=c.stop_reason))
        return p.ChatCompletionResponse(id=request_id, model=state.response_model(body.model),
                                        choices=choices, usage=tally.usage(),
                                        system_fingerprint=state.fingerprint)
    finally:
        tally.log(request_id, start, state.log_requests)


def _chat_chunk(chunk: p.ChatCompletionStreamResponse, include_usage: bool) -> str:
    """OpenAI's chunk shape: a delta carries only the keys it sets ({} at the end)."""
    data = chunk.model_dump(exclude=None if include_usage else {"usage"})
    for choice, original in zip(data["choices"], chunk.choices, strict=True):
        choice["delta"] = original.delta.model_dump(exclude_none=True)
    return sse(data)


async def _stream_chat(state: ServerState, body: p.ChatCompletionRequest, request_id: str,
                       stream: RequestStream, parsers: list[ChatChoiceParser], start: float
                       ) -> AsyncIterator[str]:
    n = len(parsers)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = int(time.time())
    top_n = body.top_logprobs or 0
    tally = Tally()
    finished: set[int] = set()

    def chunk(choices: list[p.ChatCompletionStreamChoice]) -> str:
        return _chat_chunk(p.ChatCompletionStreamResponse(
            id=request_id, created=created, model=state.response_model(body.model), choices=choices,
            system_fingerprint=state.fingerprint), include_usage)

    try:
        for i in range(n):
            yield chunk([p.ChatCompletionStreamChoice(
                index=i, delta=p.DeltaMessage(role="assistant", content=""))])
        async for output in stream:
            tally.add(0, output)
            for c in output.outputs:
                if c.index in finished:  # n > 1: a done sequence rides along with the others
                    continue
                logprobs = None
                if body.logprobs and c.delta_logprobs:
                    logprobs = _chat_logprobs(state, c.delta_token_ids, c.delta_logprobs, top_n)
                parser = parsers[c.index]
                delta = parser.delta(c.delta_text, c.finish_reason is not None)
                if delta is not None or logprobs is not None:
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=delta or p.DeltaMessage(), logprobs=logprobs)])
                if c.finish_reason is not None and c.index not in finished:
                    finished.add(c.index)
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=p.DeltaMessage(),
                        finish_reason=parser.finish_reason(c.finish_reason),
                        stop_reason=c.stop_reason)])
        if include_usage:
            yield _chat_chunk(p.ChatCompletionStreamResponse(
                id=request_id, created=created, model=state.response_model(body.model), choices=[],
                usage=tally.usage(), system_fingerprint=state.fingerprint), True)
        yield SSE_DONE
    except EngineDeadError as exc:
        yield sse(p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error")))
        yield SSE_DONE
    finally:
        stream.close()
        tally.log(request_id, start, state.log_requests)
