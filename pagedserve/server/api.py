"""The OpenAI-compatible FastAPI app over an AsyncLLM."""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve import __version__
from pagedserve.config import ServerConfig
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError, RequestStream
from pagedserve.engine.llm import render_chat
from pagedserve.engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as p
from pagedserve.server.metrics import ServerMetrics

logger = logging.getLogger("pagedserve.server")

T = TypeVar("T")
# The lowest logprob sent: JSON has no -inf.
MIN_LOGPROB = -9999.0
SAMPLING_PARAM_NAMES = {*p.SAMPLING_FIELDS, "max_tokens", "logprobs", "prompt_logprobs"}


class ApiError(Exception):
    """An error answered in OpenAI's shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = p.ErrorResponse(error=p.ErrorInfo(message=message, type=type_, param=param,
                                                      code=code))


def error_json(status: int, message: str, type_: str = "invalid_request_error",
               param: str | None = None, code: str | None = None) -> JSONResponse:
    return _error_response(ApiError(status, message, type_, param, code))


def _error_response(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body.model_dump(), status_code=exc.status)


def bad_value(exc: ValueError, prompt_param: str, renames: dict[str, str] | None = None
              ) -> ApiError:
    """An engine ValueError -> 400 whose `param` names the request field it is about."""
    message = str(exc)
    if "maximum context length" in message or "context length is" in message:
        return ApiError(400, message, param=prompt_param, code="context_length_exceeded")
    first = message.split(" ", 1)[0]
    param = prompt_param if "prompt" in message else None
    if first in SAMPLING_PARAM_NAMES:
        param = (renames or {}).get(first, first)
    return ApiError(400, message, param=param)


@dataclass
class ServerState:
    llm: AsyncLLM
    model_name: str
    metrics: ServerMetrics
    fingerprint: str = f"fp_pagedserve_{__version__}"
    started: float = field(default_factory=time.time)

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer: send token ids")
        return tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.model_name}`.", param="model", code="model_not_found")

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)


def build_app(llm: AsyncLLM, config: ServerConfig | None = None) -> FastAPI:
    """The app for one engine. With `config.api_key`, every route but /health, /version and
    /metrics needs `Authorization: Bearer <key>`."""
    config = config or ServerConfig()
    api_key = config.api_key
    state = ServerState(llm, config.served_model_name or llm.engine.model_name,
                        ServerMetrics(llm))
    llm.observer = state.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app)
    app.include_router(_open_routes(state))
    app.include_router(_api_routes(state), dependencies=[Depends(_auth(api_key))])
    return app


def _auth(api_key: str | None):
    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(),
                                                                    api_key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send Authorization: Bearer "
                                "<key>.", code="invalid_api_key")
    return check


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, exc.status,
                    exc.body.error.message)
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg')}" if param else str(first.get("msg", exc))
        if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "the request body must be a JSON object (Content-Type: application/json)"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more error(s))"
        logger.info("%s %s -> 400: %s", request.method, request.url.path, message)
        return error_json(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        logger.warning("%s %s -> 503: %s", request.method, request.url.path, exc)
        return error_json(503, str(exc), type_="server_error", code="overloaded")

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_json(503, str(exc), type_="server_error", code="engine_dead")


# ---- open routes --------------------------------------------------------------------------


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if state.llm.error is not None:
            return error_json(503, f"the engine stopped: {state.llm.error!r}",
                              type_="server_error")
        return Response(status_code=200)

    @router.get("/version")
    async def version() -> p.VersionResponse:
        return p.VersionResponse(version=__version__)

    @router.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router


# ---- authenticated routes -----------------------------------------------------------------


def _api_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/models")
    async def models() -> p.ModelList:
        engine = state.llm.engine
        return p.ModelList(data=[p.ModelCard(id=state.model_name, created=int(state.started),
                                             root=engine.config.model.model or engine.loaded.name,
                                             max_model_len=engine.max_model_len)])

    @router.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await _completions(state, body, request)

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await _chat(state, body, request)

    @router.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tokens = _render_messages(state, body.messages, body.add_generation_prompt)
        else:
            tokens = state.tokenizer.encode(body.prompt,
                                            add_special_tokens=body.add_special_tokens)
        return p.TokenizeResponse(tokens=list(tokens), count=len(tokens),
                                  max_model_len=state.llm.engine.max_model_len)

    @router.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        state.check_model(body.model)
        _check_token_ids(state, body.tokens, "tokens")
        return p.DetokenizeResponse(prompt=state.decode(body.tokens))

    return router


def _check_token_ids(state: ServerState, token_ids: list[int], param: str) -> None:
    vocab = state.llm.engine.runner.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is out of range [0, {vocab})", param=param)


def _common_checks(state: ServerState, body: p.SamplingRequest) -> None:
    state.check_model(body.model)
    if body.logit_bias:
        raise ApiError(400, "logit_bias is not supported", param="logit_bias")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")


def _sampling_params(body: p.CompletionRequest | p.ChatCompletionRequest, prompt_param: str,
                     renames: dict[str, str] | None = None) -> SamplingParams:
    try:
        return body.sampling_params()
    except ValueError as exc:
        raise bad_value(exc, prompt_param, renames) from None


async def _add_all(state: ServerState, request_id: str, prompts: list[str | list[int]],
                   params: SamplingParams, cache_salt: str | None, prompt_param: str,
                   renames: dict[str, str] | None = None) -> list[RequestStream]:
    """One engine request per prompt (ids request_id-0, -1, ...); all or none are added."""
    streams: list[RequestStream] = []
    try:
        for i, prompt in enumerate(prompts):
            engine_id = request_id if len(prompts) == 1 else f"{request_id}-{i}"
            streams.append(await state.llm.add_request(engine_id, prompt, params, cache_salt))
    except ValueError as exc:
        _close(streams)
        raise bad_value(exc, prompt_param, renames) from None
    except BaseException:
        _close(streams)
        raise
    return streams


def _close(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


class _SSEResponse(StreamingResponse):
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
            _close(self.streams)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
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


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def _sse(data: BaseModel | dict[str, Any], exclude: set[str] | None = None) -> str:
    if isinstance(data, BaseModel):
        return f"data: {data.model_dump_json(exclude=exclude)}\n\n"
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def _usage(prompt_tokens: int, completion_tokens: int) -> p.UsageInfo:
    return p.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                       total_tokens=prompt_tokens + completion_tokens)


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _log_request(request_id: str, prompt_tokens: int, completion_tokens: int,
                 finish_reasons: list[str | None], start: float, ttft: float | None) -> None:
    reasons = ",".join(sorted({r or "aborted" for r in finish_reasons})) or "aborted"
    first = f"{ttft:.3f} s" if ttft is not None else "-"
    logger.info("%s: %d prompt + %d completion tokens, finish %s, first token %s, "
                "total %.3f s", request_id, prompt_tokens, completion_tokens, reasons, first,
                time.monotonic() - start)


@dataclass
class _Tally:
    """Token counts of one HTTP request for its usage and its log line."""

    prompt_tokens: dict[int, int] = field(default_factory=dict)
    completion_tokens: dict[tuple[int, int], int] = field(default_factory=dict)
    finish_reasons: dict[tuple[int, int], str | None] = field(default_factory=dict)
    ttft: float | None = None  # arrival to the first token, the earliest over the prompts

    def add(self, index: int, output: RequestOutput) -> None:
        self.prompt_tokens[index] = len(output.prompt_token_ids)
        for c in output.outputs:
            self.completion_tokens[(index, c.index)] = len(c.token_ids)
            self.finish_reasons[(index, c.index)] = c.finish_reason
        m = output.metrics
        if m is not None and m.first_token_time is not None:
            ttft = m.first_token_time - m.arrival_time
            self.ttft = ttft if self.ttft is None else min(self.ttft, ttft)

    def usage(self) -> p.UsageInfo:
        return _usage(sum(self.prompt_tokens.values()), sum(self.completion_tokens.values()))

    def log(self, request_id: str, start: float) -> None:
        _log_request(request_id, sum(self.prompt_tokens.values()),
                     sum(self.completion_tokens.values()), list(self.finish_reasons.values()),
                     start, self.ttft)


async def _finals(streams: list[RequestStream]) -> list[RequestOutput]:
    try:
        return list(await asyncio.gather(*(s.final() for s in streams)))
    finally:
        _close(streams)


# ---- /v1/completions ----------------------------------------------------------------------


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
        out.token_logprobs.append(_finite(chosen.logprob))
        out.top_logprobs.append({(lp.decoded_token or ""): _finite(lp.logprob)
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


async def _completions(state: ServerState, body: p.CompletionRequest,
                       request: Request) -> Any:
    start = time.monotonic()
    _common_checks(state, body)
    if body.suffix:
        raise ApiError(400, "suffix is not supported (this server does no fill-in-the-middle)",
                       param="suffix")
    prompts = _prompt_list(body.prompt)
    for prompt in prompts:
        if isinstance(prompt, list):
            _check_token_ids(state, prompt, "prompt")
    params = _sampling_params(body, "prompt")
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, request_id, prompts, params, body.cache_salt, "prompt")
    builder = _CompletionChoices(state, body, params.n)
    if body.stream:
        return _SSEResponse(_stream_completion(state, body, request_id, streams, builder,
                                               start), streams)
    return await _until_disconnect(
        request, _full_completion(state, request_id, streams, builder, start))


async def _full_completion(state: ServerState, request_id: str, streams: list[RequestStream],
                           builder: _CompletionChoices, start: float) -> p.CompletionResponse:
    tally = _Tally()
    try:
        finals = await _finals(streams)
        choices = []
        for index, output in enumerate(finals):
            tally.add(index, output)
            for c in output.outputs:
                choice = builder.choice(index, output, c, delta=False)
                assert choice is not None
                choices.append(choice)
        return p.CompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                    usage=tally.usage(), system_fingerprint=state.fingerprint)
    finally:
        tally.log(request_id, start)


async def _stream_completion(state: ServerState, body: p.CompletionRequest, request_id: str,
                             streams: list[RequestStream], builder: _CompletionChoices,
                             start: float) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    exclude = None if include_usage else {"usage"}
    created = int(time.time())
    tally = _Tally()
    try:
        async for index, output in _merge(streams):
            tally.add(index, output)
            for c in output.outputs:
                choice = builder.choice(index, output, c, delta=True)
                if choice is not None:
                    chunk = p.CompletionStreamResponse(
                        id=request_id, created=created, model=state.model_name,
                        choices=[choice], system_fingerprint=state.fingerprint)
                    yield _sse(chunk, exclude)
        if include_usage:
            yield _sse(p.CompletionStreamResponse(
                id=request_id, created=created, model=state.model_name, choices=[],
                usage=tally.usage(), system_fingerprint=state.fingerprint))
        yield SSE_DONE
    except EngineDeadError as exc:
        yield _sse(p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error")))
        yield SSE_DONE
    finally:
        _close(streams)
        tally.log(request_id, start)


# ---- /v1/chat/completions -----------------------------------------------------------------


def _render_messages(state: ServerState, messages: list[p.ChatMessage],
                     add_generation_prompt: bool) -> list[int]:
    rendered = []
    for i, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise ApiError(400, f"messages[{i}]: only text content parts are "
                                        f"supported, got type {part.type!r}",
                                   param=f"messages.{i}.content")
                texts.append(part.text)
            content = "".join(texts)
        item: dict[str, Any] = {"role": message.role, "content": content or ""}
        if message.name is not None:
            item["name"] = message.name
        rendered.append(item)
    try:
        return render_chat(state.tokenizer, rendered, add_generation_prompt)
    except ApiError:
        raise
    except Exception as exc:  # template errors are the request's fault, not the server's
        raise ApiError(400, f"cannot apply the chat template: {exc}", param="messages") from None


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
    return p.TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))


CHAT_RENAMES = {"logprobs": "top_logprobs"}


async def _chat(state: ServerState, body: p.ChatCompletionRequest, request: Request) -> Any:
    start = time.monotonic()
    _common_checks(state, body)
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    renames = dict(CHAT_RENAMES)
    if body.max_completion_tokens is not None:
        renames["max_tokens"] = "max_completion_tokens"
    params = _sampling_params(body, "messages", renames)
    prompt = _render_messages(state, body.messages, body.add_generation_prompt)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await _add_all(state, request_id, [prompt], params, body.cache_salt, "messages",
                             renames)
    if body.stream:
        return _SSEResponse(_stream_chat(state, body, request_id, streams[0], params.n, start),
                            streams)
    return await _until_disconnect(request, _full_chat(state, body, request_id, streams, start))


async def _full_chat(state: ServerState, body: p.ChatCompletionRequest, request_id: str,
                     streams: list[RequestStream], start: float) -> p.ChatCompletionResponse:
    tally = _Tally()
    try:
        output = (await _finals(streams))[0]
        tally.add(0, output)
        top_n = body.top_logprobs or 0
        choices = [p.ChatCompletionChoice(
            index=c.index, message=p.ChatResponseMessage(content=c.text),
            logprobs=_chat_logprobs(state, c.token_ids, c.logprobs, top_n) if body.logprobs
            else None, finish_reason=c.finish_reason, stop_reason=c.stop_reason)
            for c in output.outputs]
        return p.ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices,
                                        usage=tally.usage(),
                                        system_fingerprint=state.fingerprint)
    finally:
        tally.log(request_id, start)


def _chat_chunk(chunk: p.ChatCompletionStreamResponse, include_usage: bool) -> str:
    """OpenAI's chunk shape: a delta carries only the keys it sets ({} at the end)."""
    data = chunk.model_dump(exclude=None if include_usage else {"usage"})
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return _sse(data)


async def _stream_chat(state: ServerState, body: p.ChatCompletionRequest, request_id: str,
                       stream: RequestStream, n: int, start: float) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    created = int(time.time())
    top_n = body.top_logprobs or 0
    tally = _Tally()
    finished: set[int] = set()

    def chunk(choices: list[p.ChatCompletionStreamChoice]) -> str:
        return _chat_chunk(p.ChatCompletionStreamResponse(
            id=request_id, created=created, model=state.model_name, choices=choices,
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
                if c.delta_text or logprobs is not None:
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=p.DeltaMessage(content=c.delta_text),
                        logprobs=logprobs)])
                if c.finish_reason is not None and c.index not in finished:
                    finished.add(c.index)
                    yield chunk([p.ChatCompletionStreamChoice(
                        index=c.index, delta=p.DeltaMessage(), finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason)])
        if include_usage:
            yield _chat_chunk(p.ChatCompletionStreamResponse(
                id=request_id, created=created, model=state.model_name, choices=[],
                usage=tally.usage(), system_fingerprint=state.fingerprint), True)
        yield SSE_DONE
    except EngineDeadError as exc:
        yield _sse(p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error")))
        yield SSE_DONE
    finally:
        stream.close()
        tally.log(request_id, start)
