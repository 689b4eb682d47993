"""The first thing every HTTP request meets, before its body is read or parsed: whether the
server still takes new work (it drains on shutdown), the API key (`Authorization: Bearer` or
Anthropic's `x-api-key`), and the body's size.

A pure ASGI middleware, so it works the same for streamed responses. The body is read here,
up to the limit, and replayed to the app: a client cannot make the server parse (or even hold)
more than `max_body_bytes`, and an unauthenticated client gets its 401 before any JSON is
decoded. It also counts the API requests in flight, which is what a draining server waits for.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Awaitable, Callable
from typing import Any

from pagedserve.server.anthropic.errors import error_body as anthropic_error
from pagedserve.server.anthropic.errors import is_anthropic_path

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

# Probes and scrapes, and the chat page (it holds no data; it asks for the key and sends it
# with its API calls): never authenticated, never drained away.
OPEN_PATHS = frozenset({"/health", "/version", "/metrics", "/"})


def error_body(message: str, type_: str, code: str | None = None) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None,
                                 "code": code}}).encode()


async def send_error(send: Send, status: int, message: str, type_: str,
                     code: str | None = None, path: str = "") -> None:
    """The error in OpenAI's shape, or Anthropic's for a route under /v1/messages."""
    if is_anthropic_path(path):
        body = json.dumps(anthropic_error(status, message)).encode()
    else:
        body = error_body(message, type_, code)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class Gatekeeper:
    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, state: Any) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        # The server's state: reads its `draining` flag, counts its `in_flight` requests.
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.state.draining:
            await send_error(send, 503, "the server is shutting down; send it elsewhere",
                             "server_error", "shutting_down", path)
            return
        if not self._authorized(scope):
            await send_error(send, 401, "Incorrect or missing API key: send Authorization: "
                                        "Bearer <key> (or x-api-key: <key>).",
                             "invalid_request_error", "invalid_api_key", path)
            return
        body = await self._read_body(scope, receive)
        if body is None:
            await send_error(send, 413, f"the request body is larger than the server takes "
                                        f"({self.max_body_bytes} bytes)",
                             "invalid_request_error", "request_too_large", path)
            return
        self.state.in_flight += 1
        try:
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.state.in_flight -= 1

    def _authorized(self, scope: Scope) -> bool:
        if self.api_key is None:
            return True
        headers = dict(scope["headers"])
        key = self.api_key.encode()
        # Anthropic's clients send the key as x-api-key; either header will do.
        if b"x-api-key" in headers and secrets.compare_digest(headers[b"x-api-key"].strip(),
                                                              key):
            return True
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(
            token.strip().encode("latin-1"), key)

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None once it passes the limit (declared or as it arrives)."""
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left mid-body
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body in one message, then the client's own messages (its disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
