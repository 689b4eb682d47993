"""MAMBA backend: the state-slot path of Mamba layers (chosen automatically for them).

A Mamba layer keeps no K/V pages: each running request owns one state slot (conv state and SSM
state per layer; `attention/state.py` says how slots and the step's `StateMetadata` work).
Prefill chunks run the causal conv and the selective scan from the saved state and write
the final state back; decodes advance every state one step in one batched update.

Kernels: Triton on CUDA (`attention/ops/mamba_kernels.py`), vectorised torch elsewhere
(`attention/mamba/torch_ops.py`, also their reference). PAGEDSERVE_STATE_KERNELS=torch forces
the torch path on CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.attention.mamba import torch_ops
from pagedserve.attention.state import StateBackend, StateMetadata


class MambaImpl:
    """Runs a layer's conv and scan over the step's packed tokens: prefills [0, P) then
    decodes [P, T), as the batch order puts them."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        if self.use_triton:
            from pagedserve.attention.ops import mamba_kernels

            return mamba_kernels.causal_conv1d(x, weight, bias, conv_state, md.query_start_loc,
                                               md.state_indices, md.has_initial_state,
                                               md.max_query_len)
        p, tp = md.num_prefills, md.num_prefill_tokens
        out = torch.empty_like(x)
        if p:
            out[:tp] = torch_ops.causal_conv1d_prefill(
                x[:tp], weight, bias, conv_state, md.state_indices[:p],
                md.has_initial_state[:p], md.prefill_token_index, md.prefill_lens,
                md.max_prefill_len)
        if md.num_decodes:
            out[tp:] = torch_ops.causal_conv1d_decode(
                x[tp:], weight, bias, conv_state, md.state_indices[p:], md.has_initial_state[p:])
        return out

    def scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor,
             ssm_state: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        p, tp = md.num_prefills, md.num_prefill_tokens
        if self.use_triton:
            from pagedserve.attention.ops import mamba_kernels as ops

            out = torch.empty_like(x)
            if p:
                ops.selective_scan(
                    x[:tp], dt[:tp], A, B[:tp], C[:tp], D, z[:tp], dt_bias, ssm_state,
                    md.query_start_loc[:p + 1], md.state_indices[:p], md.has_initial_state[:p],
                    out=out[:tp])
            if md.num_decodes:
                ops.selective_state_update(
                    x[tp:], dt[tp:], A, B[tp:], C[tp:], D, z[tp:], dt_bias, ssm_state,
                    md.state_indices[p:], md.has_initial_state[p:], out=out[tp:])
            return out
        out = torch.empty_like(x)
        if p:
            out[:tp] = torch_ops.selective_scan_prefill(
                x[:tp], dt[:tp], A, B[:tp], C[:tp], D, z[:tp], dt_bias, ssm_state,
                md.state_indices[:p], md.has_initial_state[:p], md.prefill_token_index,
                md.max_prefill_len)
        if md.num_decodes:
            out[tp:] = torch_ops.selective_state_update(
                x[tp:], dt[tp:], A, B[tp:], C[tp:], D, z[tp:], dt_bias, ssm_state,
                md.state_indices[p:], md.has_initial_state[p:])
        return out


class MambaBackend(StateBackend):
    name = "MAMBA"
    description = "Mamba state slots: causal conv1d + selective scan"
    impl_cls = MambaImpl
