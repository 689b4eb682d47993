"""The model-facing state layer of LFM2's short convolution: the depthwise causal conv (no
activation) over B * x, the part that reads and writes a request's state slot. The mixer keeps
its projections and the B / C gating around it; the runner binds the SHORT_CONV backend's impl."""

from __future__ import annotations

import torch

from pagedserve.attention.state import StateLayer
from pagedserve.kv_cache.specs import StateSpec, StateTensor


class ShortConvLayer(StateLayer):
    """x [T, hidden] in packed batch order. A slot holds the conv window [hidden, L - 1]: the
    last inputs the conv of length L still needs, in the model dtype."""

    backend_name = "SHORT_CONV"

    def __init__(self, hidden_size: int, kernel_size: int, layer_idx: int) -> None:
        super().__init__(layer_idx)
        if kernel_size < 2:
            raise ValueError(f"a short conv of length {kernel_size} keeps no window (>= 2)")
        self.hidden_size = hidden_size
        self.kernel_size = kernel_size

    def state_spec(self, dtype: torch.dtype) -> StateSpec:
        return StateSpec(self.backend_name, (
            StateTensor("conv", (self.hidden_size, self.kernel_size - 1), dtype),))

    def conv(self, x: torch.Tensor, weight: torch.Tensor,
             bias: torch.Tensor | None) -> torch.Tensor:
        """Depthwise causal conv (weight [hidden, L]) without activation, continuing each
        request's saved inputs: [T, hidden]."""
        return self.run(lambda s, md, x: self.impl.conv(x, weight, bias, s["conv"], md),
                        (x,), "conv")
