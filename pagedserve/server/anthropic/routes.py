"""POST /v1/messages and POST /v1/messages/count_tokens."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request

from pagedserve.server.anthropic import protocol as a
from pagedserve.server.anthropic.stream import stream_message
from pagedserve.server.anthropic.translate import chat_request, message_object
from pagedserve.server.chat import chat_prompt, start_chat, template_variables
from pagedserve.server.chat_tools import tool_plan
from pagedserve.server.common import ServerState
from pagedserve.server.output_blocks import final_blocks
from pagedserve.server.streaming import SSEResponse, Tally, until_disconnect


def anthropic_routes(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/messages", response_model=None)
    async def messages(body: a.MessagesRequest, request: Request) -> Any:
        start = time.monotonic()
        run = await start_chat(state, chat_request(body), id_prefix="msg_")
        if body.stream:
            return SSEResponse(stream_message(state, run, start), run.streams)

        async def whole() -> dict[str, Any]:
            tally = Tally()
            try:
                blocks = await final_blocks(run.streams, run.parsers[0], tally)
                return message_object(run.request_id, run.model, blocks, tally)
            finally:
                tally.log(run.request_id, start, state.log_requests)

        return await until_disconnect(request, whole())

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(body: a.CountTokensRequest) -> dict[str, int]:
        """The prompt's length as /v1/messages would render it (tools and images
        included)."""
        state.check_model(body.model)
        chat = chat_request(body)
        plan = tool_plan(state, chat)
        prompt = await chat_prompt(state, chat.messages, chat.add_generation_prompt, plan.prompt,
                                   chat.continue_final_message, template_variables(chat))
        return {"input_tokens": len(prompt.token_ids)}

    return router
