"""Request bodies' text must be valid Unicode: the check every API's request model runs
before its fields are read."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def unpaired_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string in `value` (nested lists and dicts, keys too) holding a
    lone UTF-16 surrogate: JSON's "\\ud800" escapes decode to such strings, which no
    tokenizer, hash or response encoder can take. A bad key is named by its escape, so the
    path itself encodes. Walked depth first without recursion (a body may nest as deep as the
    JSON parser lets it, past the interpreter's recursion limit), holding one iterator and one
    key per level: time in the body's size, memory in its depth; the path is joined only for
    the string it names."""
    def named(keys: list[str], last: str | None = None) -> str:
        return ".".join([*([path] if path else []), *keys, *([last] if last is not None else [])])

    if isinstance(value, str):
        return None if _encodes(value) else path or "body"
    children = _children(value)
    if children is None:
        return None
    levels, keys = [children], []  # keys[i]: the key of levels[i + 1]'s container
    while levels:
        entry = next(levels[-1], None)
        if entry is None:
            levels.pop()
            if keys:
                keys.pop()
            continue
        key, item = entry
        name = str(key)
        if not _encodes(name):
            return named(keys, name.encode("utf-8", "backslashreplace").decode("utf-8"))
        if isinstance(item, str):
            if not _encodes(item):
                return named(keys, name)
            continue
        children = _children(item)
        if children is not None:
            levels.append(children)
            keys.append(name)
    return None


def _children(item: Any) -> Iterator[tuple[Any, Any]] | None:
    if isinstance(item, dict):
        return iter(item.items())
    if isinstance(item, list | tuple):
        return enumerate(item)
    return None


def _encodes(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
