"""Stored responses (`store`, the default): each with the conversation that led to it, as chat
messages, so that `previous_response_id` continues it. In memory, least recently used out
first, at most `--responses-store-size` of them holding at most `--responses-store-bytes` of
text (a conversation's images are data URLs: text too, and the most of it; counted in
characters, which for base64 and ASCII are bytes). Each response counts its whole
conversation, though a chain's responses share their earlier messages: the count errs high,
so the store drops responses early rather than outgrow its budget."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object, as GET /v1/responses/{id} returns it
    messages: list[dict[str, Any]]  # its conversation as chat messages, its output included
    # (instructions are not: each request gives its own)
    num_bytes: int = field(default=0, compare=False)  # set by the store


def text_bytes(value: Any) -> int:
    """The characters of every string in a JSON-like value: what keeping it costs, near
    enough (the containers' own overhead is small beside a conversation's text)."""
    total, todo = 0, [value]
    while todo:  # a loop, not recursion: a value may nest deeply
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            todo.extend(item.keys())
            todo.extend(item.values())
        elif isinstance(item, list | tuple):
            todo.extend(item)
    return total


class ResponseStore:
    def __init__(self, capacity: int, max_bytes: int = 1 << 30) -> None:
        self.capacity = capacity
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self.delete(response_id)
        entry.num_bytes = text_bytes(entry.response) + text_bytes(entry.messages)
        if self.capacity == 0 or entry.num_bytes > self.max_bytes:
            return  # GET and previous_response_id answer 404, as for a response dropped
        self.entries[response_id] = entry
        self.num_bytes += entry.num_bytes
        while len(self.entries) > self.capacity or self.num_bytes > self.max_bytes:
            _, dropped = self.entries.popitem(last=False)
            self.num_bytes -= dropped.num_bytes

    def delete(self, response_id: str) -> bool:
        """Forget a response; False if none was stored under that id."""
        entry = self.entries.pop(response_id, None)
        if entry is None:
            return False
        self.num_bytes -= entry.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.entries.get(response_id)
        if entry is not None:
            self.entries.move_to_end(response_id)
        return entry
