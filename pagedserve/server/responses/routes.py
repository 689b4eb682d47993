"""POST /v1/responses, GET /v1/responses/{id} and DELETE /v1/responses/{id}."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.server.chat import ChatRun, start_chat
from pagedserve.server.common import ApiError, ServerState
from pagedserve.server.output_blocks import BlockStream, final_blocks
from pagedserve.server.responses import protocol as r
from pagedserve.server.responses.store import ResponseStore, StoredResponse
from pagedserve.server.responses.stream import stream_response
from pagedserve.server.responses.translate import (
    assistant_message,
    chat_request,
    input_messages,
    renamed,
    response_object,
    usage,
)
from pagedserve.server.streaming import SSEResponse, Tally, until_disconnect


def responses_routes(state: ServerState, store: ResponseStore) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses", response_model=None)
    async def create(body: r.ResponsesRequest, request: Request) -> Any:
        start, created = time.monotonic(), time.time()
        history, origins = _history(store, body)
        if body.instructions:
            origins.insert(0, "instructions")
        try:
            run = await start_chat(state, chat_request(body, history), id_prefix="resp_")
        except ApiError as exc:
            raise renamed(exc, origins) from None
        response_id = run.request_id

        def finish(blocks: BlockStream, tally: Tally) -> dict[str, Any]:
            reasoning = "".join(b.text for b in blocks.blocks if b.kind == "reasoning")
            reasoning_tokens = len(state.tokenizer.encode(reasoning, add_special_tokens=False)
                                   ) if reasoning else 0
            response = response_object(response_id, run.model, body, created, blocks,
                                       usage(tally, reasoning_tokens))
            if body.store:
                store.put(response_id, StoredResponse(
                    response, [*history, assistant_message(blocks)]))
            return response

        if body.stream:
            opened = response_object(response_id, run.model, body, created)
            return SSEResponse(stream_response(state, run, response_id, opened, finish, start),
                               run.streams)
        return await until_disconnect(request, _whole(state, run, finish, start))

    @router.get("/v1/responses/{response_id}")
    async def get(response_id: str) -> dict[str, Any]:
        entry = store.get(response_id)
        if entry is None:
            raise _not_stored(response_id)
        return entry.response

    @router.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> dict[str, Any]:
        if not store.delete(response_id):
            raise _not_stored(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return router


def _not_stored(response_id: str) -> ApiError:
    return ApiError(404, f"No response with id {response_id!r} is stored here (it was made "
                         "with store=false, was deleted, or the store has since dropped it)",
                    param="response_id", code="not_found")


def _history(store: ResponseStore, body: r.ResponsesRequest
             ) -> tuple[list[dict[str, Any]], list[str]]:
    """The conversation so far: the previous response's (if any), then this input; and where
    each of its messages came from."""
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        previous = store.get(body.previous_response_id)
        if previous is None:
            raise ApiError(400, f"Previous response with id {body.previous_response_id!r} not "
                                "found (store=false, deleted, or the store has since dropped "
                                "it)",
                           param="previous_response_id", code="previous_response_not_found")
        history = list(previous.messages)
    messages, origins = input_messages(body.input)
    return history + messages, ["previous_response_id"] * len(history) + origins


async def _whole(state: ServerState, run: ChatRun, finish: Any, start: float) -> dict[str, Any]:
    tally = Tally()
    try:
        blocks = await final_blocks(run.streams, run.parsers[0], tally)
        return finish(blocks, tally)
    finally:
        tally.log(run.request_id, start, state.log_requests)
