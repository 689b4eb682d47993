"""The model-facing state layer of MiniMax's lightning attention: linear attention with a
per-head decay, the part that reads and writes a request's kv state. The mixer keeps its qkv
projection and SiLU, its output norm and gate; the runner binds the LINEAR_ATTN backend's
impl."""

from __future__ import annotations

import torch

from pagedserve.attention.linear.lightning_torch import slope_rate
from pagedserve.attention.state import StateLayer
from pagedserve.kv_cache.specs import StateSpec, StateTensor


class LightningAttentionLayer(StateLayer):
    """q, k, v [T, H, D] in packed batch order. A slot holds the kv state [H, D, D] in float32
    (the decayed sum of k v^T over the whole sequence). `slope` [H] float32 is the layer's decay
    rate (`slope_rate` of its place among `num_layers` decoder layers), recomputed by
    `reset_slope` after the model moves to its device and dtype."""

    backend_name = "LINEAR_ATTN"

    def __init__(self, num_heads: int, head_dim: int, decoder_layer_idx: int, num_layers: int,
                 layer_idx: int) -> None:
        super().__init__(layer_idx)
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.decoder_layer_idx = decoder_layer_idx
        self.num_layers = num_layers
        self.register_buffer("slope", slope_rate(num_heads, decoder_layer_idx, num_layers),
                             persistent=False)

    def reset_slope(self, device: torch.device) -> None:
        """The decay rates in float32 on `device` (a model cast to 16 bits casts buffers too)."""
        self.slope = slope_rate(self.num_heads, self.decoder_layer_idx,
                                self.num_layers).to(device)

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(self.backend_name, (
            StateTensor("kv", (self.num_heads, self.head_dim, self.head_dim), torch.float32),))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """o [T, H, D] = each token's q against its request's decayed kv state, which the step
        advances."""
        return self.run(lambda s, md, q, k, v: self.impl.attend(q, k, v, self.slope, s["kv"], md),
                        (q, k, v), "kv")
