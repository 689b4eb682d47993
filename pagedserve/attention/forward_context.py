"""The step's attention state, set around one model forward so layers need no extra arguments."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class ForwardContext:
    # Backend metadata per distinct layer configuration (most models have one).
    attn_metadata: dict[Any, Any]
    kv_caches: list[torch.Tensor]


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(attn_metadata: dict[Any, Any],
                        kv_caches: list[torch.Tensor]) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, kv_caches)
    try:
        yield
    finally:
        _CONTEXT = previous
