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
    """positions [3, T] (or [T]: all rows equal) -> rotated query and key.

    interleaved (Qwen3-VL): the frequencies cycle temporal, height, width (frequency j of
    the first 3 * section[1] turns by height when j % 3 == 1, of the first 3 * section[2] by
    width when j % 3 == 2, the rest by the temporal row) instead of lying in three blocks."""

    def __init__(self, config: PretrainedConfig, head_dim: int,
                 interleaved: bool = False) -> None:
        section = rope_parameters(config).get("mrope_section")
        self.section, self.interleaved = section, interleaved
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
        self.row_of_column = self._row_of_column().to(device)
        self._rows_of = self._table = None

    def _row_of_column(self) -> torch.Tensor:
        """For each column of the cos | sin table, the position row it is read at."""
        section = list(self.section or [self.rotary_dim // 2])
        if not self.interleaved:
            row = torch.repeat_interleave(torch.arange(len(section)) % 3,
                                          torch.tensor(section))
        else:
            row = torch.zeros(self.rotary_dim // 2, dtype=torch.long)
            row[1:section[1] * 3:3] = 1
            row[2:section[2] * 3:3] = 2
        return row.repeat(2)

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
