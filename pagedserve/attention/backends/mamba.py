"""MAMBA backend: the state-slot path of Mamba layers (chosen automatically for them).

A Mamba layer keeps no K/V pages: each running request owns one state slot (conv state and SSM
state per layer), whose index travels in the first column of the block table. The builder does
the per-step work once for all layers: each request's slot, whether it has an initial state
(anything computed before this step; a fresh or recomputed request starts from zeros), the
query_start_loc of its new tokens, and for the torch path the padded-grid index of the prefill
tokens. Prefill chunks run the causal conv and the selective scan from the saved state and write
the final state back; decodes advance every state one step in one batched update.

Kernels: Triton on CUDA (`attention/ops/mamba_kernels.py`), vectorised torch elsewhere
(`attention/mamba/torch_ops.py`, also their reference). PAGEDSERVE_MAMBA_KERNELS=torch forces
the torch path on CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve import envs
from pagedserve.attention.backend import AttentionBackend, AttentionLayerConfig
from pagedserve.attention.mamba import torch_ops
from pagedserve.attention.metadata import CommonAttentionMetadata
from pagedserve.kv_cache.specs import MambaSpec


def use_triton_kernels(device: torch.device) -> bool:
    if device.type != "cuda" or envs.PAGEDSERVE_MAMBA_KERNELS == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class MambaMetadata:
    num_prefills: int
    num_prefill_tokens: int
    num_decodes: int
    query_start_loc: torch.Tensor  # [B+1] int32
    state_indices: torch.Tensor  # [B] int64, each request's state slot
    has_initial_state: torch.Tensor  # [B] bool, num_computed_tokens > 0
    max_query_len: int
    max_prefill_len: int
    # Torch path only: flat [num_prefills, max_prefill_len] grid index of each prefill token,
    # and each prefill's number of new tokens.
    prefill_token_index: torch.Tensor | None = None
    prefill_lens: torch.Tensor | None = None


class MambaMetadataBuilder:
    def __init__(self, spec: MambaSpec, device: torch.device, use_triton: bool) -> None:
        self.spec = spec
        self.device = device
        self.use_triton = use_triton

    def build(self, common: CommonAttentionMetadata) -> MambaMetadata:
        p = common.num_prefills
        qsl_cpu = common.query_start_loc_cpu
        prefill_lens = np.diff(qsl_cpu[:p + 1])
        max_prefill_len = int(prefill_lens.max()) if p else 0
        metadata = MambaMetadata(
            num_prefills=p, num_prefill_tokens=common.num_prefill_tokens,
            num_decodes=common.num_decodes, query_start_loc=common.query_start_loc,
            state_indices=common.block_table[:, 0].long(),
            has_initial_state=common.context_lens > 0,
            max_query_len=common.max_query_len, max_prefill_len=max_prefill_len)
        if p and not self.use_triton:
            token_req = np.repeat(np.arange(p), prefill_lens)
            offset = np.arange(common.num_prefill_tokens) - qsl_cpu[token_req]
            index = torch.from_numpy(token_req * max_prefill_len + offset)
            metadata.prefill_token_index = index.to(self.device, non_blocking=True)
            metadata.prefill_lens = torch.from_numpy(prefill_lens.astype(np.int64)).to(
                self.device, non_blocking=True)
        return metadata


class MambaImpl:
    """Runs a layer's conv and scan over the step's packed tokens: prefills [0, P) then
    decodes [P, T), as the batch order puts them."""

    def __init__(self, use_triton: bool) -> None:
        self.use_triton = use_triton

    def conv(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             conv_state: torch.Tensor, md: MambaMetadata) -> torch.Tensor:
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
             ssm_state: torch.Tensor, md: MambaMetadata) -> torch.Tensor:
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


class MambaBackend(AttentionBackend):
    """Registered so it is listed and selectable by name for Mamba layers; it runs no attention
    layer (the conformance suite skips it through validate_configuration)."""

    name = "MAMBA"
    description = "Mamba state slots: causal conv1d + selective scan"

    impl_cls = MambaImpl
    builder_cls = MambaMetadataBuilder
    metadata_cls = MambaMetadata

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int) -> tuple[int, ...]:
        raise ValueError("MAMBA keeps state slots, not K/V pages: their shapes are MambaSpec's")

    @classmethod
    def get_kv_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} does not apply to Mamba state "
                             "(kept in the model dtype, SSM state in float32): use auto")
        return model_dtype

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        if torch.cuda.is_available() and use_triton_kernels(torch.device("cuda")):
            return True, "Triton kernels on CUDA; vectorised torch elsewhere"
        return True, "vectorised torch (Triton kernels need CUDA)"

    @classmethod
    def validate_configuration(cls, layer: AttentionLayerConfig, block_size: int,
                               device: torch.device) -> list[str]:
        return ["MAMBA runs Mamba layers only, not attention layers"]
