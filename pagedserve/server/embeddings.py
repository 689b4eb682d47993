"""POST /v1/embeddings, in OpenAI's shape: `input` as a string, a list of strings, token ids
or a list of token-id lists; `encoding_format` float or base64 (little-endian float32 bytes,
what the official client asks for by default); `dimensions` (Matryoshka truncation); usage.
vLLM's `truncate_prompt_tokens` truncates an input to k tokens instead of refusing it (text by
the tokenizer, special tokens kept; token ids to their last k).

The texts are tokenized in one batched call in a worker thread, all inputs are queued before
any is awaited (they batch into the same steps), and a response is built from numpy arrays:
no per-value Python beyond the JSON encoder's for float output."""

from __future__ import annotations

import asyncio
import base64
import time
import uuid
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field, StrictInt

from pagedserve.engine.async_llm import RequestStream
from pagedserve.pooling import PoolingParams
from pagedserve.pooling.core_hooks import POOLING_SAMPLING
from pagedserve.pooling.front import tokenize_inputs
from pagedserve.pooling.params import check_params, truncation_length
from pagedserve.server.common import ApiError, ServerState, bad_value, check_token_ids
from pagedserve.server.protocol import OpenAIModel
from pagedserve.server.streaming import close_all, final_outputs, until_disconnect

# OpenAI's limit on inputs per request.
MAX_INPUTS = 2048

EmbeddingInput = str | list[str] | list[StrictInt] | list[list[StrictInt]]


class EmbeddingRequest(OpenAIModel):
    input: EmbeddingInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


def _inputs(value: EmbeddingInput) -> list[str | list[int]]:
    if isinstance(value, str):
        return [value]
    if not value:
        raise ApiError(400, "input is empty", param="input")
    if isinstance(value[0], int):
        return [list(value)]  # type: ignore[arg-type]
    return list(value)  # type: ignore[arg-type]


async def create_embeddings(state: ServerState, body: EmbeddingRequest,
                            request: Request) -> Any:
    state.check_model(body.model)
    engine = state.llm.engine
    if engine.pooler_config is None:
        raise ApiError(400, "this model generates text: it serves no embeddings (an embedding "
                            "model is served with --runner pooling)", param="model")
    if engine.pooler_config.task != "embed":
        kind = "reranker" if engine.pooler_config.task == "score" else "classifier"
        raise ApiError(400, f"this model is a {kind}: it scores pairs (/score, /rerank) or "
                            "classifies (/classify), it does not embed", param="model")
    inputs = _inputs(body.input)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}",
                       param="input")
    params = PoolingParams(body.dimensions, body.truncate_prompt_tokens)
    try:
        check_params(params, engine.pooler_config)
    except ValueError as exc:
        raise ApiError(400, str(exc), param=str(exc).split(" ", 1)[0]) from None
    for i, item in enumerate(inputs):
        if isinstance(item, list):
            if not item:
                raise ApiError(400, f"input {i} is empty", param="input")
            check_token_ids(state, item, "input")
        elif not item:
            raise ApiError(400, f"input {i} is an empty string", param="input")
    prompts = await tokenized_prompts(state, inputs, params)
    request_id = f"embd-{uuid.uuid4().hex}"
    streams = await add_pooling_requests(state, request_id, prompts, params)
    return await until_disconnect(request, _respond(state, request_id, streams,
                                                    body.encoding_format))


async def tokenized_prompts(state: ServerState, inputs: list[str | list[int]],
                            params: PoolingParams) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per input: the texts tokenized in one batched call off the
    event loop, truncated as `params` asks; a truncation the tokenizer cannot make is a 400."""
    texts = [t for t in inputs if isinstance(t, str)]
    try:
        encoded = iter(await asyncio.to_thread(
            tokenize_inputs, state.tokenizer, texts,
            truncation_length(params, state.llm.engine.max_model_len)) if texts else [])
    except ValueError as exc:  # a truncation it cannot make, or no tokenizer for text
        param = "truncate_prompt_tokens" if "truncate_prompt_tokens" in str(exc) else "input"
        raise ApiError(400, str(exc), param=param) from None
    return [(t, next(encoded)) if isinstance(t, str) else (None, t) for t in inputs]


async def add_pooling_requests(state: ServerState, request_id: str,
                   prompts: list[tuple[str | None, list[int]]], params: PoolingParams,
                   item: str = "input", param: str = "input") -> list[RequestStream]:
    """Every input queued at once (one engine request each), then awaited; all or none. An
    input refused is named by its index (`item` i) when there are several, and its 400 by
    the request's field `param`."""
    limit = state.llm.max_waiting_requests
    if len(prompts) > limit:  # all wait at once: such a batch could never be admitted
        raise ApiError(400, f"this request has {len(prompts)} {item}s, more than the {limit} "
                            "the server queues at once (--max-waiting-requests): send them in "
                            "smaller batches", param=param)
    adds = [state.llm.add_request(request_id if len(prompts) == 1 else f"{request_id}-{i}",
                                  ids, POOLING_SAMPLING, prompt_text=text, pooling=params)
            for i, (text, ids) in enumerate(prompts)]
    results = await asyncio.gather(*adds, return_exceptions=True)
    streams = [r for r in results if isinstance(r, RequestStream)]
    index, error = next(((i, r) for i, r in enumerate(results)
                         if isinstance(r, BaseException)), (0, None))
    if error is not None:
        close_all(streams)
        if isinstance(error, ValueError):
            if len(prompts) > 1:
                error = ValueError(f"{item} {index}: {error}")
            raise bad_value(error, param) from None
        raise error
    return streams


async def _respond(state: ServerState, request_id: str, streams: list[RequestStream],
                   encoding_format: str) -> JSONResponse:
    finals = await final_outputs(streams)
    data, num_tokens = [], 0
    for index, output in enumerate(finals):
        vector = output.outputs.data
        num_tokens += len(output.prompt_token_ids)
        value = (base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
                 if encoding_format == "base64" else vector.tolist())
        data.append({"object": "embedding", "index": index, "embedding": value})
    return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                         "model": state.model_name, "data": data,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
