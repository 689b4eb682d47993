"""The model-facing state layer of a Mamba mixer: the causal conv and the selective scan, the
two parts that read and write a request's state slot. The model keeps the projections around
them; the model runner binds the MAMBA backend's impl and sets the step's metadata and state
tensors in the forward context."""

from __future__ import annotations

import torch

from pagedserve.attention.state import StateLayer
from pagedserve.kv_cache.specs import StateSpec, StateTensor


class MambaLayer(StateLayer):
    """x [T, d_inner] in packed batch order. A slot holds the conv state [d_inner, K - 1] (the
    last inputs the causal conv still needs, in the model dtype) and the SSM state
    [d_inner, state_size] (float32)."""

    backend_name = "MAMBA"

    def __init__(self, d_inner: int, conv_kernel: int, state_size: int, layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.d_inner = d_inner
        self.conv_kernel = conv_kernel
        self.state_size = state_size

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(self.backend_name, (
            StateTensor("conv", (self.d_inner, self.conv_kernel - 1), dtype),
            StateTensor("ssm", (self.d_inner, self.state_size), torch.float32)))

    def conv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Depthwise causal conv (weight [d_inner, K]) + SiLU, continuing each request's
        saved inputs."""
        states, metadata = self.states()
        return self.impl.conv(x, weight, bias, states["conv"], metadata)

    def scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
             dt_bias: torch.Tensor) -> torch.Tensor:
        """Selective scan from each request's saved SSM state, gated by SiLU(z): y [T, d]."""
        states, metadata = self.states()
        return self.impl.scan(x, dt, A, B, C, D, z, dt_bias, states["ssm"], metadata)
