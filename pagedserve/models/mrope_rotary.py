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
        section = rope_parameters(config).get("mrope_section")
        self.section = section
        super().__init__(config, head_dim)
        if section is None:
            raise ValueError("an M-RoPE model's rope parameters need an mrope_section")
        if sum(section) * 2 != self.rotary_dim or self.rotary_dim != head_dim:
            raise ValueError(f"mrope_section {section} covers {sum(section) * 2} rotary dims, "
                             f"the heads turn {self.rotary_dim}")
        self._rows_of: torch.Tensor | None = None  # the step whose table is gathered
        self._table: torch.Tensor | None = None

    def build_cache(self, device: torch.device, dtype: torch.dtype,
                    max_model_len: int | None = None) -> None:
        super().build_cache(device, dtype, max_model_len)
        # For each column of the cos | sin table, the position row it is read at.
        section = torch.tensor(self.section or [self.rotary_dim // 2])
        self.row_of_column = torch.repeat_interleave(
            torch.arange(len(section)) % 3, section).repeat(2).to(device)
        self._rows_of = self._table = None

    def forward(self, positions: torch.Tensor, query: torch.Tensor,
                key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().forward(positions, query, key)
        if positions is not self._rows_of:  # once per step: every layer turns alike
            self._rows_of, self._table = positions, self._gather(positions)
        kernels = fused_kernels(query)
        if kernels is not None:  # the step's own table, indexed by token
            rows = torch.arange(positions.shape[1], device=positions.device)
            kernels.rotary_embedding_(rows, query, key, self._table)
            return query, key
        cos, sin = self._table.unsqueeze(1).chunk(2, dim=-1)
        return _rotate(query, cos, sin), _rotate(key, cos, sin)

    def _gather(self, positions: torch.Tensor) -> torch.Tensor:
        """[T, rotary dim] cos | sin, each column at its section's row of `positions`."""
        table = self.cos_sin_cache[positions]  # [3, T, D]
        index = self.row_of_column[None, None].expand(1, positions.shape[1], -1)
        return table.gather(0, index)[0].contiguous()
