"""The model-facing state layer of a gated delta net (Qwen3-Next's linear attention): the causal
conv over the mixed q/k/v channels and the gated delta rule, the two parts that read and write a
request's state slot. The model keeps the projections, the gates and the output norm around
them; the model runner binds the GDN_ATTN backend's impl and sets the step's metadata and state
tensors in the forward context."""

from __future__ import annotations

import torch

from pagedserve.attention.state import StateLayer
from pagedserve.kv_cache.specs import StateSpec, StateTensor


class GDNLayer(StateLayer):
    """Tokens in packed batch order. A slot holds the conv window [conv_dim, K - 1] (the last
    mixed q/k/v inputs the causal conv still needs, in the model dtype; conv_dim = 2 * key heads
    * head_k_dim + value heads * head_v_dim) and the recurrent state [value heads, head_k_dim,
    head_v_dim] (float32)."""

    backend_name = "GDN_ATTN"

    def __init__(self, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                 conv_kernel: int, layer_idx: int) -> None:
        super().__init__(layer_idx)
        if num_v_heads % num_k_heads:
            raise ValueError(f"{num_v_heads} value heads do not group over {num_k_heads} key "
                             "heads")
        self.num_k_heads = num_k_heads
        self.num_v_heads = num_v_heads
        self.head_k_dim = head_k_dim
        self.head_v_dim = head_v_dim
        self.conv_kernel = conv_kernel
        self.key_dim = num_k_heads * head_k_dim
        self.value_dim = num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(self.backend_name, (
            StateTensor("conv", (self.conv_dim, self.conv_kernel - 1), dtype),
            StateTensor("recurrent", (self.num_v_heads, self.head_k_dim, self.head_v_dim),
                        torch.float32)))

    def conv(self, mixed_qkv: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Depthwise causal conv (weight [conv_dim, K], no bias) + SiLU of mixed_qkv
        [T, conv_dim], continuing each request's saved inputs."""
        return self.run(lambda s, md, x: self.impl.conv(x, weight, s["conv"], md),
                        (mixed_qkv,), "conv")

    def delta_rule(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor) -> torch.Tensor:
        """q, k [T, key heads, Dk], v [T, value heads, Dv], decay g <= 0 and beta [T, value
        heads]: o [T, value heads, Dv] from each request's saved recurrent state. Each key head
        serves value_heads / key_heads consecutive value heads (expanded here)."""
        group = self.num_v_heads // self.num_k_heads
        if group > 1:
            q = q.repeat_interleave(group, dim=1)
            k = k.repeat_interleave(group, dim=1)
        return self.run(lambda s, md, *xs: self.impl.delta_rule(*xs, s["recurrent"], md),
                        (q, k, v, g, beta), "recurrent")
