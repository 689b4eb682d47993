"""Stored responses (`store`, the default): each with the conversation that led to it, as chat
messages, so that `previous_response_id` continues it. In memory, least recently used out
first, at most `--responses-store-size` of them."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it
    messages: list[dict[str, Any]]  # its conversation as chat messages, its output included
    # (instructions are not: each request gives its own)


class ResponseStore:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        if self.capacity == 0:
            return
        self.entries[response_id] = entry
        self.entries.move_to_end(response_id)
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if none was stored under that id."""
        return self.entries.pop(response_id, None) is not None

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry
