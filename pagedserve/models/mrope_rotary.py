"""M-RoPE (Qwen2-VL family): the rotary embedding turned by three position rows.

Each position is (temporal, height, width); the head's rotary frequencies are cut into
`mrope_section` parts (e.g. 16, 24, 24 of 64) and part i turns by row i. A text token has the
same value on all three rows, so for it M-RoPE is the ordinary rotary embedding: positions
given as [T] mean exactly that (decode steps, text-only prompts, CUDA graph replays of them),
and cost nothing over the ordinary path.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from pagedserve.models.layers import RotaryEmbedding, _rotate, fused_kernels, rope_parameters


class MRotaryEmbedding(RotaryEmbedding):
    """positions [3, T] (or [T]: all rows equal) -> rotated query and key."""

    def __init__(self, config: PretrainedConfig, head_dim: int) -> None:
        params = rope_parameters(config)
        section = params.get("mrope_section")
        super().__init__(config, head_dim)
        if section is None:
            raise ValueError("an M-RoPE model's rope parameters need an mrope_section")
        if sum(section) * 2 != self.rotary_dim or self.rotary_dim != head_dim:
            raise ValueError(f"mrope_section {section} covers {sum(section) * 2} rotary dims, "
                             f"the heads turn {self.rotary_dim}")
        # For each column of the cos | sin table, the position row it is read at.
        row = torch.repeat_interleave(torch.arange(len(section)) % 3,
                                      torch.tensor(section)).repeat(2)
        self.register_buffer("row_of_column", row, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        t = positions.shape[1]
        # [3, T, D] -> each column from its row: [T, D]
        table = self.cos_sin_cache[positions]
        index = self.row_of_column.to(positions.device)[None, None].expand(1, t, -1)
        cos_sin = table.gather(0, index)[0]
        kernels = fused_kernels(query)
        if kernels is not None:  # the per-token table indexed by token
            rows = torch.arange(t, device=positions.device)
            kernels.rotary_embedding_(rows, query, key, cos_sin.contiguous())
            return query, key
        cos, sin = cos_sin.unsqueeze(1).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)
