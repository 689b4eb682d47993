"""The OpenAI-compatible FastAPI app over an AsyncLLM."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve import __version__
from pagedserve.engine.async_llm import AsyncLLM, EngineDeadError, QueueFullError
from pagedserve.lora.registry import AdapterRegistry
from pagedserve.server import protocol as p
from pagedserve.server.anthropic.errors import error_body as anthropic_error
from pagedserve.server.anthropic.errors import is_anthropic_path
from pagedserve.server.anthropic.routes import anthropic_routes
from pagedserve.server.chat import (
    chat_prompt,
    check_continue_final_message,
    create_chat_completion,
    template_variables,
)
from pagedserve.server.chat_media import MediaPool, MediaSettings
from pagedserve.server.chat_page import chat_page_routes
from pagedserve.server.classify import ClassificationRequest, create_classify
from pagedserve.server.common import (
    ApiError,
    ServerState,
    check_token_ids,
    error_json,
    error_response,
)
from pagedserve.server.completions import create_completion
from pagedserve.server.embeddings import EmbeddingRequest, create_embeddings
from pagedserve.server.gatekeeper import Gatekeeper
from pagedserve.server.lora_routes import adapter_cards, lora_routes
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.reasoning import get_reasoning_parser
from pagedserve.server.rerank import RerankRequest, ScoreRequest, create_rerank, create_score
from pagedserve.server.responses.routes import responses_routes
from pagedserve.server.responses.store import ResponseStore
from pagedserve.server.tool_parsers import get_tool_parser
from pagedserve.server_config import ServerConfig

logger = logging.getLogger("pagedserve.server")

def build_app(llm: AsyncLLM, config: ServerConfig | None = None) -> FastAPI:
    """The app for one engine. With `config.api_key`, every route but /health, /version and
    /metrics needs `Authorization: Bearer <key>`, checked (like the body's size, by
    `Gatekeeper`) before the body is read."""
    config = config or ServerConfig()
    state = ServerState(llm, config.served_model_name or llm.engine.model_name,
                        ServerMetrics(llm), log_requests=config.enable_log_requests,
                        max_n=config.max_n)
    if llm.engine.config.lora.enable_lora:
        state.loras = AdapterRegistry(llm.engine.config.lora, state.model_name)
    if config.tool_call_parser is not None:
        state.tool_parser = get_tool_parser(config.tool_call_parser)
    if config.reasoning_parser is not None:
        state.reasoning_parser = get_reasoning_parser(config.reasoning_parser)
    state.media = MediaPool(MediaSettings(
        config.allowed_local_media_path, config.max_image_pixels, config.enable_mm_embeds,
        config.media_workers))
    llm.observer = state.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        llm.start()
        yield
        state.media.shutdown()
        await asyncio.to_thread(llm.shutdown)

    app = FastAPI(title="pagedserve", version=__version__, lifespan=lifespan)
    app.state.server = state
    _add_error_handlers(app)
    app.include_router(_open_routes(state))
    app.include_router(_api_routes(state))
    app.include_router(anthropic_routes(state))
    app.include_router(lora_routes(state, config.allow_runtime_lora_updating))
    app.include_router(responses_routes(state, ResponseStore(
        config.responses_store_size, config.responses_store_bytes)))
    if config.enable_chat_page:
        app.include_router(chat_page_routes())
    body_limit = config.max_request_body_bytes or default_body_limit(
        llm.engine.max_model_len, llm.engine.mm_processor is not None)
    app.add_middleware(Gatekeeper, api_key=config.api_key, max_body_bytes=body_limit,
                       state=state)
    return app


def default_body_limit(max_model_len: int, takes_images: bool = False) -> int:
    """Room for max_model_len tokens as text or ids in a JSON body many times over (JSON
    escapes take up to 6 bytes a character), and never less than 4 MiB; 64 MiB for a model
    that takes images (a few photos as base64, at 4/3 bytes a byte)."""
    return max(64 << 20 if takes_images else 4 << 20, 64 * max_model_len)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, exc.status,
                    exc.body.error.message)
        return _shaped(request, exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":  # its loc is the character, not a field
            reason = (first.get("ctx") or {}).get("error", "JSON decode error")
            message, param = (f"the request body is not valid JSON: {reason} at character "
                              f"{first['loc'][-1]}"), None
        else:
            message, param = describe_invalid_body(errors)
        logger.info("%s %s -> 400: %s", request.method, request.url.path, message)
        return _shaped(request, ApiError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _shaped(request, ApiError(exc.status_code, str(exc.detail)))

    @app.exception_handler(QueueFullError)
    async def queue_full(request: Request, exc: QueueFullError) -> JSONResponse:
        logger.warning("%s %s -> 503: %s", request.method, request.url.path, exc)
        return _shaped(request, ApiError(503, str(exc), type_="server_error", code="overloaded"))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return _shaped(request, ApiError(503, str(exc), type_="server_error",
                                         code="engine_dead"))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the client's: logged with its traceback, answered in OpenAI's shape.
        logger.exception("%s %s -> 500", request.method, request.url.path)
        return _shaped(request, ApiError(500, f"internal error: {type(exc).__name__}",
                                         type_="server_error"))


def describe_invalid_body(errors: Sequence[Any]) -> tuple[str, str | None]:
    """The message and param of a body that failed validation: its deepest error (inside a
    union, that of the branch the body got furthest in), named by fields only."""
    if not errors:
        return "invalid request body", None
    first = max(errors, key=lambda e: len(e.get("loc", ())))  # the first of the deepest
    loc = _field_path(first.get("loc", ()))
    param = ".".join(loc) or None
    msg = str(first.get("msg"))
    if first.get("type") == "value_error":  # our validators' own words, without pydantic's tag
        msg = msg.removeprefix("Value error, ")
    message = f"{param}: {msg}" if param else msg
    if not loc and first.get("type") in ("model_attributes_type", "dict_type"):
        message = "the request body must be a JSON object (Content-Type: application/json)"
    # the other branches of a union on the way stop at a field above this one
    more = sum(1 for e in errors if e is not first
               and not _is_above(_field_path(e.get("loc", ())), loc))
    if more:
        message += f" (and {more} more error(s))"
    return message, param


# pydantic's labels of a union's branches in an error's loc ('str', 'list[int]', ...)
_TYPE_LABELS = {"str", "int", "float", "bool", "dict", "list", "none"}


def _is_above(path: list[str], other: list[str]) -> bool:
    return len(path) < len(other) and other[:len(path)] == path


def _field_path(loc: Sequence[Any]) -> list[str]:
    """An error's loc without "body", union branch labels, and the tags that follow a tagged
    union's label (after a list index, for a list of them)."""
    path, tag_next = [], False
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, str) and ("[" in part or part in _TYPE_LABELS):
            tag_next = "tagged-union[" in part
            continue
        if tag_next and isinstance(part, str):
            tag_next = False
            continue
        path.append(str(part))
    return path


def _shaped(request: Request, exc: ApiError) -> JSONResponse:
    """The error in the shape of the API the request was for: Anthropic's under
    /v1/messages, OpenAI's everywhere else."""
    if is_anthropic_path(request.url.path):
        return JSONResponse(anthropic_error(exc.status, exc.body.error.message),
                            status_code=exc.status)
    return error_response(exc)


# ---- open routes --------------------------------------------------------------------------


def _open_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> Response:
        if state.draining:
            return error_json(503, "the server is shutting down", type_="server_error",
                              code="shutting_down")
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
                                             root=engine.config.model.model or engine.model_name,
                                             max_model_len=engine.max_model_len),
                                 *adapter_cards(state, int(state.started))])

    @router.get("/v1/models/{model_id:path}")  # a name may hold "/" (org/model)
    async def model(model_id: str) -> p.ModelCard:
        """OpenAI's models.retrieve: one card of the list, else the 404 naming what is
        served."""
        for card in (await models()).data:
            if card.id == model_id:
                return card
        state.check_model(model_id)
        raise AssertionError(f"{model_id} is served but has no card")

    @router.post("/v1/completions", response_model=None)
    async def completions(body: p.CompletionRequest, request: Request) -> Any:
        return await create_completion(state, body, request)

    @router.post("/v1/chat/completions", response_model=None)
    async def chat(body: p.ChatCompletionRequest, request: Request) -> Any:
        return await create_chat_completion(state, body, request)

    @router.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingRequest, request: Request) -> Any:
        return await create_embeddings(state, body, request)

    @router.post("/classify", response_model=None)
    async def classify(body: ClassificationRequest, request: Request) -> Any:
        return await create_classify(state, body, request)

    @router.post("/score", response_model=None)
    @router.post("/v1/score", response_model=None)  # vLLM serves both paths
    async def score(body: ScoreRequest, request: Request) -> Any:
        return await create_score(state, body, request)

    @router.post("/rerank", response_model=None)
    @router.post("/v1/rerank", response_model=None)
    @router.post("/v2/rerank", response_model=None)  # Cohere's v2 path, as vLLM serves it
    async def rerank(body: RerankRequest, request: Request) -> Any:
        return await create_rerank(state, body, request)

    @router.post("/tokenize")
    async def tokenize(body: p.TokenizeRequest) -> p.TokenizeResponse:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:  # images counted as the tokens they expand to
            check_continue_final_message(body)
            tokens = (await chat_prompt(state, body.messages, body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message,
                                        template_kwargs=template_variables(body))).token_ids
        else:
            # As completions and embeddings tokenize a prompt: with the special tokens.
            special = body.add_special_tokens is not False
            tokens = await asyncio.to_thread(state.tokenizer.encode, body.prompt,
                                             add_special_tokens=special)
        return p.TokenizeResponse(tokens=list(tokens), count=len(tokens),
                                  max_model_len=state.llm.engine.max_model_len)

    @router.post("/detokenize")
    async def detokenize(body: p.DetokenizeRequest) -> p.DetokenizeResponse:
        state.check_model(body.model)
        check_token_ids(state, body.tokens, "tokens")
        return p.DetokenizeResponse(prompt=await asyncio.to_thread(state.decode, body.tokens))

    return router
