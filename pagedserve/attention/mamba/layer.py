"""The model-facing state layers of Mamba-1 and Mamba-2 mixers: the causal conv and the scan, the
two parts that read and write a request's state slot. The model keeps the projections around
them; the model runner binds the layer's backend impl (MAMBA, MAMBA2) and sets the step's
metadata and state tensors in the forward context."""

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
        return self.run(lambda s, md, x: self.impl.conv(x, weight, bias, s["conv"], md),
                        (x,), "conv")

    def scan(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
             C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
             dt_bias: torch.Tensor) -> torch.Tensor:
        """Selective scan from each request's saved SSM state, gated by SiLU(z): y [T, d]."""
        return self.run(
            lambda s, md, x, dt, B, C, z: self.impl.scan(x, dt, A, B, C, D, z, dt_bias,
                                                         s["ssm"], md),
            (x, dt, B, C, z), "ssm")


class Mamba2Layer(StateLayer):
    """The stateful parts of a Mamba-2 mixer (Mamba2, Bamba): the causal conv + SiLU over xBC
    [T, conv_dim] (x, B and C side by side, conv_dim = H * P + 2 * G * N) and the SSD scan. A
    slot holds the conv window [conv_dim, K - 1] (model dtype) and the SSM state [H, P, N]
    (float32). `dt_limit` clamps the prefill's step sizes; decodes are not clamped, as
    transformers' single-step update is not."""

    backend_name = "MAMBA2"

    def __init__(self, num_heads: int, head_dim: int, n_groups: int, state_size: int,
                 conv_kernel: int, chunk_size: int, dt_limit: tuple[float, float],
                 layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.state_size = n_groups, state_size
        self.conv_kernel, self.chunk_size = conv_kernel, chunk_size
        self.dt_limit = (float(dt_limit[0]), float(dt_limit[1]))
        self.conv_dim = num_heads * head_dim + 2 * n_groups * state_size

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(self.backend_name, (
            StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
            StateTensor("ssm", (self.num_heads, self.head_dim, self.state_size), torch.float32)))

    def conv(self, xbc: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Depthwise causal conv (weight [conv_dim, K]) + SiLU, continuing each request's saved
        inputs: [T, conv_dim]."""
        return self.run(lambda s, md, x: self.impl.conv(x, weight, bias, s["conv"], md),
                        (xbc,), "conv")

    def ssd(self, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
            C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor) -> torch.Tensor:
        """SSD from each request's saved state: x [T, H, P], dt [T, H], B and C [T, G, N]
        (A float32, D, dt_bias [H]) -> y [T, H, P] with the D skip, before gate and norm."""
        return self.run(
            lambda s, md, x, dt, B, C: self.impl.ssd(x, dt, A, B, C, D, dt_bias, s["ssm"], md,
                                                     self.chunk_size, self.dt_limit),
            (x, dt, B, C), "ssm")
