"""SHORT_CONV backend: the state slots of LFM2's short convolution layers (chosen automatically
for them).

A slot holds the conv window (the last L - 1 inputs of a conv of length L). Prefill chunks run
the depthwise causal conv from the saved window and write the last inputs back; decodes shift
one token in. No activation: LFM2 gates the conv's input and output by projections instead.

Kernels: the causal conv shared with Mamba, Triton on CUDA (`attention/ops/mamba_kernels.py`),
vectorised torch elsewhere (`attention/mamba/torch_ops.py`). PAGEDSERVE_STATE_KERNELS=torch
forces the torch path on CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.attention.mamba import torch_ops
from pagedserve.attention.state import StateBackend, StateMetadata


class ShortConvImpl:
    """Runs a layer's conv over the step's packed tokens: prefills [0, P) then decodes [P, T)."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        if self.use_triton:
            from pagedserve.attention.ops import mamba_kernels

            return mamba_kernels.causal_conv1d(x, weight, bias, conv_state, md.query_start_loc,
                                               md.state_indices, md.has_initial_state,
                                               md.max_query_len, activation=None)
        p, tp = md.num_prefills, md.num_prefill_tokens
        out = torch.empty_like(x)
        if p:
            out[:tp] = torch_ops.causal_conv1d_prefill(
                x[:tp], weight, bias, conv_state, md.state_indices[:p],
                md.has_initial_state[:p], md.prefill_token_index, md.prefill_lens,
                md.max_prefill_len, activation=None)
        if md.num_decodes:
            out[tp:] = torch_ops.causal_conv1d_decode(
                x[tp:], weight, bias, conv_state, md.state_indices[p:],
                md.has_initial_state[p:], activation=None)
        return out


class ShortConvBackend(StateBackend):
    name = "SHORT_CONV"
    description = "short convolution state slots (LFM2): causal conv1d window"
    impl_cls = ShortConvImpl
