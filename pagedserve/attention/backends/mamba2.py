"""MAMBA2 backend: the state-slot path of Mamba-2 mixers (Mamba2, Bamba), chosen automatically
for their layers.

A slot holds the conv window over xBC and the SSM state [H, P, N] (`Mamba2Layer`). Prefill
chunks run the causal conv + SiLU and the SSD chunk scan from the saved state and write the final
state back; decodes advance every state one step in one batched update. The gated RMSNorm and
the projections stay in the model's mixer.

dt_limit: the prefill clamps the step sizes to the layer's limit, decodes do not, as
transformers' mixers (chunk scan with `dt_limit`, single-step update without) so that greedy
outputs agree for a model with a limit other than (0, inf).

Kernels: Triton on CUDA (`attention/ops/mamba_kernels.py` for the conv, `ssd_kernels.py`),
vectorised torch elsewhere (`attention/mamba/torch_ops.py`, `ssd_torch.py`, also their
reference). PAGEDSERVE_STATE_KERNELS=torch forces the torch path on CUDA.
"""

from __future__ import annotations

import torch

from pagedserve.attention.backends.mamba import MambaImpl
from pagedserve.attention.mamba import ssd_torch
from pagedserve.attention.state import StateBackend, StateMetadata


class Mamba2Impl:
    """Runs a layer's conv and SSD over the step's packed tokens: prefills [0, P) then decodes
    [P, T), as the batch order puts them."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton
        self._conv = MambaImpl(use_triton)  # the same causal conv + SiLU, wider channels

    def conv(self, xbc: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, md: StateMetadata) -> torch.Tensor:
        return self._conv.conv(xbc, weight, bias, conv_state, md)

    def ssd(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor, ssm_state: torch.Tensor,
            md: StateMetadata, chunk_size: int,
            dt_limit: tuple[float, float]) -> torch.Tensor:
        p, tp = md.num_prefills, md.num_prefill_tokens
        out = torch.empty_like(x)
        prefill = (x[:tp], dt[:tp], A, B[:tp], C[:tp], D, dt_bias, ssm_state,
                   md.query_start_loc[:p + 1], md.state_indices[:p], md.has_initial_state[:p])
        decode = (x[tp:], dt[tp:], A, B[tp:], C[tp:], D, dt_bias, ssm_state,
                  md.state_indices[p:], md.has_initial_state[p:])
        no_limit = ssd_torch.DEFAULT_DT_LIMIT
        if self.use_triton:
            from pagedserve.attention.ops import ssd_kernels

            if p:
                ssd_kernels.ssd_chunk_scan(*prefill, chunk_size=chunk_size, dt_limit=dt_limit,
                                           out=out[:tp])
            if md.num_decodes:
                ssd_kernels.ssd_state_update(*decode, dt_limit=no_limit, out=out[tp:])
            return out
        if p:
            out[:tp] = ssd_torch.ssd_chunk_scan(*prefill, chunk_size=chunk_size,
                                                dt_limit=dt_limit)
        if md.num_decodes:
            out[tp:] = ssd_torch.ssd_state_update(*decode, dt_limit=no_limit)
        return out


class Mamba2Backend(StateBackend):
    name = "MAMBA2"
    description = "Mamba-2 state slots: causal conv1d + SSD"
    impl_cls = Mamba2Impl
