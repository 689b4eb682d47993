"""LINEAR_ATTN backend: the state slots of MiniMax-Text-01's lightning attention layers (chosen
automatically for them).

A slot holds one float32 kv state [H, D, D] per layer. Prefill chunks run block-wise linear
attention from the saved state and write the final state back; decodes advance every state one
token in one batched update (`attention/linear/lightning_torch.py` says the arithmetic).

Kernels: Triton on CUDA (`attention/ops/lightning_kernels.py`), vectorised torch elsewhere
(`attention/linear/lightning_torch.py`, also their reference). PAGEDSERVE_STATE_KERNELS=torch
forces the torch path on CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.attention.linear import lightning_torch
from pagedserve.attention.state import StateBackend, StateMetadata


class LinearAttentionImpl:
    """Runs a layer's lightning attention over the step's packed tokens: prefills [0, P) then
    decodes [P, T)."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slope: torch.Tensor,
               kv_state: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        p, tp = md.num_prefills, md.num_prefill_tokens
        if self.use_triton:
            from pagedserve.attention.ops import lightning_kernels as ops
        else:
            ops = lightning_torch
        out = torch.empty_like(v)
        if p:
            prefill = (q[:tp], k[:tp], v[:tp], slope, kv_state, md.query_start_loc[:p + 1],
                       md.state_indices[:p], md.has_initial_state[:p])
            if self.use_triton:
                ops.lightning_attention_prefill(*prefill, out=out[:tp])
            else:
                out[:tp] = ops.lightning_attention_prefill(
                    *prefill, _torch_block_size(md.max_prefill_len),
                    max_query_len=md.max_prefill_len)
        if md.num_decodes:
            decode = (q[tp:], k[tp:], v[tp:], slope, kv_state, md.state_indices[p:],
                      md.has_initial_state[p:])
            if self.use_triton:
                ops.lightning_attention_decode(*decode, out=out[tp:])
            else:
                out[tp:] = ops.lightning_attention_decode(*decode)
        return out


def _torch_block_size(max_prefill_len: int) -> int:
    """The torch op's token block: 256 (transformers' MiniMax block), smaller for short chunks,
    whose padding to a whole block would be most of the work."""
    return min(256, max(16, 1 << (max_prefill_len - 1).bit_length()))


class LinearAttentionBackend(StateBackend):
    name = "LINEAR_ATTN"
    description = "linear attention state slots (MiniMax lightning attention): kv state"
    impl_cls = LinearAttentionImpl
