"""The step's attention state, set around one model forward so layers need no extra arguments."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardContext:
    # Backend metadata per distinct layer configuration (most models have one).
    attn_metadata: dict[Any, Any]
    kv_caches: list[torch.Tensor]
    # State layers (attention/state.py): each one's tensors by name, and the step's metadata.
    state_caches: list[dict[str, torch.Tensor]] = field(default_factory=list)
    state_metadata: Any = None
    # Piecewise CUDA graphs (engine/piecewise_graphs.py): when set, every decoder attention
    # layer hands its call to it, `hook(layer, query, key, value) -> output`, instead of
    # running its backend.
    attention_hook: Callable[..., torch.Tensor] | None = None


_CONTEXT: ForwardContext | None = None


def get_forward_context() -> ForwardContext:
    if _CONTEXT is None:
        raise RuntimeError("attention layer called outside set_forward_context()")
    return _CONTEXT


@contextlib.contextmanager
def set_forward_context(attn_metadata: dict[Any, Any], kv_caches: list[torch.Tensor],
                        state_caches: list[dict[str, torch.Tensor]] | None = None,
                        state_metadata: Any = None,
                        attention_hook: Callable[..., torch.Tensor] | None = None
                        ) -> Iterator[None]:
    global _CONTEXT
    previous, _CONTEXT = _CONTEXT, ForwardContext(attn_metadata, kv_caches,
                                                  state_caches or [], state_metadata,
                                                  attention_hook)
    try:
        yield
    finally:
        _CONTEXT = previous
