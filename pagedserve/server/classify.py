"""POST /classify, in vLLM's shape: `input` as a string, a list of strings, token ids or a
list of token-id lists; `data[{index, label, probs, num_classes}]` (probs: softmax over the
labels, the sigmoid for one; pooling/classify.py) and usage. Served by a
`*ForSequenceClassification` model; texts are tokenized in a worker thread and every input is
queued before any is awaited, as for /v1/embeddings."""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import Field

from pagedserve.pooling import PoolingParams
from pagedserve.pooling.classify import probabilities
from pagedserve.server.common import ApiError, ServerState, check_token_ids
from pagedserve.server.embeddings import (
    MAX_INPUTS,
    EmbeddingInput,
    _inputs,
    add_pooling_requests,
    tokenized_prompts,
)
from pagedserve.server.protocol import OpenAIModel
from pagedserve.server.streaming import final_outputs, until_disconnect


class ClassificationRequest(OpenAIModel):
    input: EmbeddingInput
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1)


async def create_classify(state: ServerState, body: ClassificationRequest,
                          request: Request) -> Any:
    state.check_model(body.model)
    pooler = state.llm.engine.pooler_config
    if pooler is None or pooler.task != "classify":
        raise ApiError(400, "this model does not classify: /classify needs a "
                            "*ForSequenceClassification model served with --runner pooling",
                       param="model")
    inputs = _inputs(body.input)
    if len(inputs) > MAX_INPUTS:
        raise ApiError(400, f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}",
                       param="input")
    for i, item in enumerate(inputs):
        if not item:
            raise ApiError(400, f"input {i} is empty", param="input")
        if isinstance(item, list):
            check_token_ids(state, item, "input")
    params = PoolingParams(truncate_prompt_tokens=body.truncate_prompt_tokens)
    prompts = await tokenized_prompts(state, inputs, params)
    request_id = f"classify-{uuid.uuid4().hex}"
    streams = await add_pooling_requests(state, request_id, prompts, params)
    labels = pooler.labels

    async def respond() -> JSONResponse:
        finals = await final_outputs(streams)
        logits = np.stack([o.outputs.data for o in finals])
        probs = probabilities(logits)
        best = probs.argmax(axis=1)
        num_tokens = sum(len(o.prompt_token_ids) for o in finals)
        data = [{"index": i, "label": labels[int(best[i])], "probs": probs[i].tolist(),
                 "num_classes": int(probs.shape[1])} for i in range(len(finals))]
        return JSONResponse({"id": request_id, "object": "list", "created": int(time.time()),
                             "model": state.model_name, "data": data,
                             "usage": {"prompt_tokens": num_tokens,
                                       "total_tokens": num_tokens}})

    return await until_disconnect(request, respond())
