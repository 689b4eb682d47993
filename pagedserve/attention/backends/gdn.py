"""GDN_ATTN backend: the state-slot path of gated delta net layers (Qwen3-Next's linear
attention), chosen automatically for them.

A gated delta net layer keeps no K/V pages: each running request owns one state slot holding
the causal conv's window over the mixed q/k/v channels and the delta rule's recurrent state
(`attention/state.py` says how slots and the step's `StateMetadata` work). Prefill chunks run
the conv and the chunked gated delta rule from the saved state and write the final state back;
decodes advance every state one token in one batched update.

Kernels: Triton on CUDA (`attention/ops/mamba_kernels.causal_conv1d`,
`attention/ops/gdn_kernels.py`), vectorised torch elsewhere (`attention/mamba/torch_ops.py`,
`attention/linear/gdn_torch.py`, also their reference). PAGEDSERVE_STATE_KERNELS=torch forces
the torch path on CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.attention.linear import gdn_torch
from pagedserve.attention.mamba import torch_ops
from pagedserve.attention.state import StateBackend, StateMetadata


class GDNImpl:
    """Runs a layer's conv and delta rule over the step's packed tokens: prefills [0, P) then
    decodes [P, T), as the batch order puts them."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton

    def conv(self, x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
             md: StateMetadata) -> torch.Tensor:
        """Depthwise causal conv + SiLU of x [T, conv_dim] (weight [conv_dim, K], no bias)."""
        if self.use_triton:
            from pagedserve.attention.ops import mamba_kernels

            return mamba_kernels.causal_conv1d(x, weight, None, conv_state, md.query_start_loc,
                                               md.state_indices, md.has_initial_state,
                                               md.max_query_len, activation="silu")
        p, tp = md.num_prefills, md.num_prefill_tokens
        out = torch.empty_like(x)
        if p:
            out[:tp] = torch_ops.causal_conv1d_prefill(
                x[:tp], weight, None, conv_state, md.state_indices[:p],
                md.has_initial_state[:p], md.prefill_token_index, md.prefill_lens,
                md.max_prefill_len, activation="silu")
        if md.num_decodes:
            out[tp:] = torch_ops.causal_conv1d_decode(
                x[tp:], weight, None, conv_state, md.state_indices[p:],
                md.has_initial_state[p:], activation="silu")
        return out

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, state: torch.Tensor,
                   md: StateMetadata) -> torch.Tensor:
        """The gated delta rule (q, k L2-normalised inside) of q, k [T, H, Dk], v [T, H, Dv],
        g, beta [T, H], heads already expanded to v's: o [T, H, Dv]."""
        p, tp = md.num_prefills, md.num_prefill_tokens
        out = torch.empty_like(v)
        if self.use_triton:
            from pagedserve.attention.ops import gdn_kernels as ops

            if p:
                ops.chunk_gated_delta_rule(
                    q[:tp], k[:tp], v[:tp], g[:tp], beta[:tp], state,
                    md.query_start_loc[:p + 1], md.state_indices[:p], md.has_initial_state[:p],
                    out=out[:tp])
            if md.num_decodes:
                ops.recurrent_gated_delta_rule(
                    q[tp:], k[tp:], v[tp:], g[tp:], beta[tp:], state, md.state_indices[p:],
                    md.has_initial_state[p:], out=out[tp:])
            return out
        if p:
            out[:tp] = gdn_torch.chunk_gated_delta_rule(
                q[:tp], k[:tp], v[:tp], g[:tp], beta[:tp], state, md.query_start_loc[:p + 1],
                md.state_indices[:p], md.has_initial_state[:p],
                max_query_len=md.max_prefill_len)
        if md.num_decodes:
            out[tp:] = gdn_torch.recurrent_gated_delta_rule(
                q[tp:], k[tp:], v[tp:], g[tp:], beta[tp:], state, md.state_indices[p:],
                md.has_initial_state[p:])
        return out


class GDNBackend(StateBackend):
    name = "GDN_ATTN"
    description = "gated delta net state slots: causal conv1d + gated delta rule"
    impl_cls = GDNImpl
