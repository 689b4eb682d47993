"""What every route shares: the server's state, errors in OpenAI's shape, and the checks
a sampling request passes before it reaches the engine."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from fastapi.responses import JSONResponse

from pagedserve import __version__
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.lora import LoRARequest
from pagedserve.lora.registry import AdapterRegistry
from pagedserve.pooling.front import GENERATION_REFUSED
from pagedserve.sampling_params import SamplingParams
from pagedserve.server import protocol as p
from pagedserve.server.metrics import ServerMetrics
from pagedserve.server.reasoning import ReasoningParser
from pagedserve.server.tool_parsers import ToolParser

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
    return error_response(ApiError(status, message, type_, param, code))


def error_response(exc: ApiError) -> JSONResponse:
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
    log_requests: bool = True  # a line per finished request
    max_n: int = 128  # most sequences per prompt, and prompts per request
    draining: bool = False  # shutting down: new requests get 503
    in_flight: int = 0  # API requests whose response has not ended (Gatekeeper counts)
    tool_parser: ToolParser | None = None  # --tool-call-parser: tool_choice "auto"
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    loras: AdapterRegistry | None = None  # --enable-lora: adapters a request's model may name
    media: Any = None  # chat_media.MediaPool (build_app makes it): decodes, processes images
    reads_parts: bool | None = None  # the chat template prints typed content parts only

    @property
    def mm_processor(self) -> Any:
        """The model's image processor (None: the model takes text only)."""
        return self.llm.engine.mm_processor

    @property
    def image_limit(self) -> int | None:
        """--limit-mm-per-prompt's images (None: no limit)."""
        return self.llm.engine.mm_limits.get("image")

    @property
    def tokenizer(self) -> Any:
        tokenizer = self.llm.tokenizer
        if tokenizer is None:
            # Said for logprobs too, whose prompt may already be token ids.
            raise ApiError(400, "this model has no tokenizer, which this request needs (text "
                                "prompts, chat messages and logprobs do): send token ids, or "
                                "serve it with --tokenizer DIR")
        return tokenizer

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name and self.lora_request(model) is None:
            adapters = ", ".join(f"`{name}`" for name in self.loras.adapters) if self.loras else ""
            also = f" and its LoRA adapters {adapters}" if adapters else ""
            raise ApiError(404, f"The model `{model}` does not exist. This server serves "
                                f"`{self.model_name}`{also}.", param="model",
                           code="model_not_found")

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter the request named, else the base."""
        return model if self.lora_request(model) is not None else self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model)."""
        if self.loras is None or model is None:
            return None
        return self.loras.get(model)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

async def tokenize_prompts(state: ServerState, prompts: list[str | list[int]]
                           ) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt. Text is tokenized in a worker thread: a long
    prompt must hold up neither the event loop nor the engine's steps; with the tokenizer's
    special tokens (a Llama BOS), as LLM.generate and vLLM's completions tokenize it."""
    texts = [prompt for prompt in prompts if isinstance(prompt, str)]
    encoded: list[list[int]] = []
    if texts:
        tokenizer = state.tokenizer
        encoded = await asyncio.to_thread(
            lambda: [tokenizer.encode(t) for t in texts])
    it = iter(encoded)
    return [(prompt, next(it)) if isinstance(prompt, str) else (None, list(prompt))
            for prompt in prompts]


def check_token_ids(state: ServerState, token_ids: list[int], param: str) -> None:
    vocab = state.llm.engine.vocab_size
    bad = [t for t in token_ids if not 0 <= t < vocab]
    if bad:
        raise ApiError(400, f"token id {bad[0]} is out of range [0, {vocab})", param=param)


def common_checks(state: ServerState, body: p.SamplingRequest, num_prompts: int = 1) -> None:
    state.check_model(body.model)
    if getattr(state.llm.engine, "pooler_config", None) is not None:  # every generating route
        raise ApiError(400, GENERATION_REFUSED, param="model")
    if body.n is not None and body.n > state.max_n:
        raise ApiError(400, f"n must be <= {state.max_n}, got {body.n}", param="n")
    if num_prompts > state.max_n:
        raise ApiError(400, f"at most {state.max_n} prompts per request, got {num_prompts}",
                       param="prompt")
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed with stream=true",
                       param="stream_options")


def sampling_params(state: ServerState, body: p.CompletionRequest | p.ChatCompletionRequest,
                    prompt_param: str, renames: dict[str, str] | None = None) -> SamplingParams:
    """The request's sampling settings over the model's defaults (generation_config.json),
    checked against the engine's limits."""
    try:
        params = body.sampling_params(state.llm.engine.default_sampling)
        state.llm.engine.check_sampling(params)
    except ValueError as exc:
        raise bad_value(exc, prompt_param, renames) from None
    return params


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)
