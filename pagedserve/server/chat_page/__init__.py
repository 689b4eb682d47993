"""The chat page at `/`: one static HTML file (its script and styles inline, nothing fetched
from a network) that talks to /v1/models and streams /v1/chat/completions. It holds no data,
so it is served without the API key; it asks for the key once and keeps it in the browser.
`--disable-chat-page` leaves it out."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse


@cache
def page() -> str:
    return resources.files(__package__).joinpath("index.html").read_text(encoding="utf-8")


def chat_page_routes() -> APIRouter:
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def chat_page() -> HTMLResponse:
        return HTMLResponse(page())

    return router
