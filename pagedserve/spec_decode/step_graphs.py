"""The proposer's part of the target's steps replayed from CUDA graphs (engine/cuda_graphs.py,
engine/verify_graphs.py), for a proposer with K/V of its own (a draft model, an EAGLE head, an
MTP layer); vLLM's graphed target forward likewise hands out an EAGLE-3 head's tapped hidden
states from persistent buffers.

An eager step runs `Proposer.forward_step` after the target, under the step's forward context:
a draft model's forward over the step's tokens (its K/V), or a head's capture of the target's
hidden states, which the runner keeps with the step (`PendingStep.captured`). A graphed step
must hold the same work, so the runner's graphed forward (`ModelRunner.run_model`) calls
`ProposerStep.run` after the target: the draft runs over the same padded input ids, positions
and metadata (its layers' metadata comes from the same builders), and what a head captures is
copied into a persistent buffer, sized for the largest graph's tokens, that the graph writes
and the step reads after the replay (a copy of its real rows) as `captured`. Padding rows
write nothing real: their K/V slots are -1 and their buffer rows are never read.

The start-up check (`DecodeGraphs.check_against_eager`) compares what this part leaves behind
too (`ProposerStep.clear` / `read`): the captured rows and the proposer's K/V at the real
tokens' slots, cleared before each run so that a graph that writes none of them fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


class ProposerStep:
    """The proposer's per-step work inside the target's graphed forward, and what it leaves
    for the step (`captured`) and for the start-up check (`clear`, `read`). `layers`: the
    proposer's attention layers (in the runner's cache), `backend`: their backend."""

    def __init__(self, proposer: Any, layers: list[Any], max_tokens: int) -> None:
        self.proposer = proposer
        self.layers = layers
        self.max_tokens = max_tokens
        self.backend: Any = None  # the attention backend, for its cache layout (`read`)
        self.kv_caches: list[torch.Tensor] = []  # the runner's, set with `bind`
        # What `forward_step` returned, in rows 0..T-1 of the last graphed forward (allocated
        # at the first such forward, outside a capture; None while it returns nothing).
        self.buffer: torch.Tensor | None = None
        # The check's eager reference: `forward_step`'s result as the eager step keeps it.
        self._reference = False
        self._returned: torch.Tensor | None = None

    def bind(self, backend: Any, kv_caches: list[torch.Tensor], max_tokens: int) -> None:
        """Before the graphs are captured: the cache the check reads and the buffer's rows
        (the largest graph's tokens; a buffer already made keeps its size)."""
        self.backend, self.kv_caches = backend, kv_caches
        if self.buffer is None:
            self.max_tokens = max_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            hidden: torch.Tensor) -> None:
        """After the target, under the graphed step's forward context (what a graph captures):
        the proposer's `forward_step`, its result copied into the persistent buffer."""
        out = self.proposer.forward_step(input_ids, positions, hidden)
        if self._reference:
            self._returned = out
            return
        if out is None:
            return
        if self.buffer is None:
            if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("the proposer's step buffer must exist before a capture")
            self.buffer = out.new_zeros((self.max_tokens, *out.shape[1:]))
        if len(out) > len(self.buffer):
            raise RuntimeError(f"a graphed step of {len(out)} tokens exceeds the proposer's "
                               f"buffer of {len(self.buffer)}")
        self.buffer[:len(out)].copy_(out)

    def captured(self, num_tokens: int) -> torch.Tensor | None:
        """The real rows the last graphed step captured, copied out of the buffer: a step is
        proposed from after its samples, and with steps overlapping (async scheduling while
        `disable_by_batch_size` holds drafts back) the next step's replay may come first."""
        return None if self.buffer is None else self.buffer[:num_tokens].clone()

    # ---- the start-up check (engine/cuda_graphs.py's `StepOutputs`) --------------------------

    def reference(self, forward: Callable[[], Any]) -> Any:
        """`forward()` as the eager step runs the proposer: what `forward_step` returns is
        kept as returned (the eager step's `captured`), not copied; `read` then reads it."""
        self._reference = True
        try:
            return forward()
        finally:
            self._reference = False

    def clear(self, slots: torch.Tensor) -> None:
        """Zero what a step leaves at the real tokens `slots`: the buffer's rows and the
        proposer's K/V there (and forget a reference's result)."""
        self._returned = None
        if self.buffer is not None:
            self.buffer[:len(slots)].zero_()
        for k, v in self._views():
            block_size = k.shape[1]
            for part in (k, v):  # (bytes: a float8 cache has no index_put)
                raw = part.view(torch.uint8) if part.element_size() == 1 else part
                raw[slots // block_size, slots % block_size] = 0

    def read(self, slots: torch.Tensor) -> torch.Tensor | None:
        """What a step left at the real tokens `slots`, flattened in float32 (None: nothing)."""
        rows = self._returned if self._returned is not None else self.buffer
        parts = [] if rows is None else [rows[:len(slots)].float().flatten()]
        for k, v in self._views():
            block_size = k.shape[1]
            blocks, offsets = slots // block_size, slots % block_size
            parts += [k[blocks, offsets].float().flatten(), v[blocks, offsets].float().flatten()]
        return torch.cat(parts) if parts else None

    def _views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each proposer layer's K and V views [num_blocks, block_size, heads, head size]."""
        views = []
        for layer in self.layers:
            cache = self.kv_caches[layer.layer_idx]
            if layer.head_size_v != layer.head_size:
                views.append(self.backend.kv_cache_views(cache, layer.head_size_v))
            else:
                views.append(self.backend.kv_cache_views(cache))
        return views
