"""The model-facing state layer of a Mamba mixer: the causal conv and the selective scan, the
two parts that read and write a request's state slot. The model keeps the projections around
them; the model runner binds the MAMBA backend's impl and sets the step's metadata and state
tensors in the forward context."""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.attention.forward_context import get_forward_context
from pagedserve.kv_cache.specs import MambaSpec


class MambaLayer(nn.Module):
    """x [T, d_inner] in packed batch order; the state of layer `layer_idx` is
    `kv_caches[layer_idx] = (conv_state, ssm_state)` over all slots."""

    def __init__(self, d_inner: int, conv_kernel: int, state_size: int, layer_idx: int) -> None:
        super().__init__()
        self.d_inner = d_inner
        self.conv_kernel = conv_kernel
        self.state_size = state_size
        self.layer_idx = layer_idx
        self.impl = None
        self.layer_spec: MambaSpec | None = None

    def spec(self, dtype: torch.dtype) -> MambaSpec:
        return MambaSpec(self.d_inner, self.conv_kernel, self.state_size, dtype)

    def bind(self, impl, layer_spec: MambaSpec) -> None:
        self.impl = impl
        self.layer_spec = layer_spec

    def _context(self):
        if self.impl is None:
            raise RuntimeError("mamba layer has no backend bound")
        ctx = get_forward_context()
        return ctx.kv_caches[self.layer_idx], ctx.attn_metadata[self.layer_spec]

    def conv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Depthwise causal conv (weight [d_inner, K]) + SiLU, continuing each request's
        saved inputs."""
        (conv_state, _), metadata = self._context()
        return self.impl.conv(x, weight, bias, conv_state, metadata)

    def scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
             dt_bias: torch.Tensor) -> torch.Tensor:
        """Selective scan from each request's saved SSM state, gated by SiLU(z): y [T, d]."""
        (_, ssm_state), metadata = self._context()
        return self.impl.scan(x, dt, A, B, C, D, z, dt_bias, ssm_state, metadata)
