"""POST /score and /v1/score (vLLM's: `text_1` / `text_2`, or `queries` / `documents`) and
POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape: `query`, `documents`, `top_n`
(0, as vLLM reads it, or left out: all of them), and `results[{index, document,
relevance_score}]` best first) over a reranker (pooling/scoring.py) or an encoder
cross-encoder of one label (pooling/classify.py). Pairs are rendered and tokenized in a worker
thread; every pair is queued before any is awaited, so they batch into the same steps."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from pagedserve.pooling import PoolingParams
from pagedserve.pooling.params import truncation_length
from pagedserve.pooling.scoring import pair_list, pair_token_ids, row_score
from pagedserve.server.common import ApiError, ServerState
from pagedserve.server.embeddings import MAX_INPUTS, add_pooling_requests
from pagedserve.server.protocol import OpenAIModel
from pagedserve.server.streaming import final_outputs, until_disconnect


class ScoreRequest(OpenAIModel):
    model: str | None = None
    text_1: str | list[str] | None = None
    text_2: str | list[str] | None = None
    queries: str | list[str] | None = None
    documents: str | list[str] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


class RerankRequest(OpenAIModel):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


async def _scores(state: ServerState, request_id: str, text_1: str | list[str],
                  text_2: str | list[str], truncate: int | None, request: Request,
                  param: str) -> tuple[list[float], int] | Any:
    """(score per pair, prompt tokens in all), or the response of a client that left;
    `param`: the field a pair's 400 names (the documents')."""
    pooler = state.llm.engine.pooler_config
    if pooler is None or not pooler.scores_pairs:
        raise ApiError(400, "this model does not score pairs: /score and /rerank need a "
                            "reranker (a cross-encoder served with --runner pooling)",
                       param="model")
    try:
        pairs = pair_list(text_1, text_2)
        if len(pairs) > MAX_INPUTS:
            raise ValueError(f"at most {MAX_INPUTS} pairs per request, got {len(pairs)}")
        params = PoolingParams(truncate_prompt_tokens=truncate)
        prompts = await asyncio.to_thread(
            pair_token_ids, state.tokenizer, pairs, pooler,
            truncation_length(params, state.llm.engine.max_model_len))
    except ValueError as exc:
        raise ApiError(400, str(exc)) from None
    streams = await add_pooling_requests(state, request_id, [(None, p) for p in prompts],
                                         params, "pair", param)

    async def collect() -> tuple[list[float], int]:
        finals = await final_outputs(streams)
        return ([row_score(o.outputs.data, pooler) for o in finals],
                sum(len(o.prompt_token_ids) for o in finals))

    return await until_disconnect(request, collect())


async def create_score(state: ServerState, body: ScoreRequest, request: Request) -> Any:
    state.check_model(body.model)
    given = [(a, b) for a, b in [(body.text_1, body.text_2), (body.queries, body.documents)]
             if a is not None or b is not None]
    if len(given) != 1 or None in given[0]:
        raise ApiError(400, "give text_1 and text_2, or queries and documents", param="text_1")
    request_id = f"score-{uuid.uuid4().hex}"
    result = await _scores(state, request_id, *given[0], body.truncate_prompt_tokens, request,
                           "text_2" if body.text_2 is not None else "documents")
    if not isinstance(result, tuple):
        return result
    scores, num_tokens = result
    return JSONResponse({
        "id": request_id, "object": "list", "created": int(time.time()),
        "model": state.model_name,
        "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})


async def create_rerank(state: ServerState, body: RerankRequest, request: Request) -> Any:
    state.check_model(body.model)
    if not body.documents:
        raise ApiError(400, "documents is empty", param="documents")
    request_id = f"rerank-{uuid.uuid4().hex}"
    result = await _scores(state, request_id, body.query, body.documents,
                           body.truncate_prompt_tokens, request, "documents")
    if not isinstance(result, tuple):
        return result
    scores, num_tokens = result
    order = sorted(range(len(scores)), key=lambda i: -scores[i])
    if body.top_n:  # None or 0 (vLLM's default): every document
        order = order[:body.top_n]
    results = [{"index": i, "relevance_score": scores[i],
                **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
               for i in order]
    return JSONResponse({"id": request_id, "model": state.model_name, "results": results,
                         "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens}})
