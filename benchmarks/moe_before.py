"""The MoE experts' host-side parts as they were before 2026-12-06, kept only so benchmarks can
time them beside today's in the same run (`moe_kernels.py`'s align columns, `moe_host.py`'s
`before` and `align` variants):

- the alignment as torch ops: about fourteen a layer (a stable sort, two searchsorteds, a
  cumsum, a scatter, ...), each a launch with its own host time; `models/moe_align.py`'s
  Triton kernels replaced it;
- moe_kernels' launch-shape table as it was chosen by reasoning, before the H100 sweep.
"""

from __future__ import annotations

import torch
import triton

from pagedserve.models.moe_align import max_blocks
from pagedserve.models.moe_kernels import MoeTiles

TILES_16BIT_BEFORE = (
    (2.0, MoeTiles(16, 32, 64, 128, 1, 4, 4)),
    (8.0, MoeTiles(16, 64, 128, 128, 1, 4, 3)),
    (32.0, MoeTiles(32, 64, 128, 64, 4, 4, 4)),
    (128.0, MoeTiles(64, 64, 128, 64, 8, 4, 4)),
    (float("inf"), MoeTiles(128, 64, 128, 64, 8, 8, 3)),
)

# Every arange made so far, per device, the longest last. The shorter ones are kept alive too:
# a captured CUDA graph may read one, and freed memory would be handed to other tensors.
_ARANGES: dict[torch.device, list[torch.Tensor]] = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) as a prefix of a kept tensor: a kernel launch fewer per use. One made while a
    CUDA graph is being captured is filled only on replay, so it is not kept."""
    kept = _ARANGES.setdefault(device, [])
    if kept and kept[-1].numel() >= n:
        return kept[-1][:n]
    fresh = torch.arange(triton.next_power_of_2(max(n, 1024)), device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        kept.append(fresh)
    return fresh[:n]


def align_by_expert_torch_ops(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [max_blocks * block_m] int32: pair ids t * k + j, grouped by
    expert in expert order, each group padded to a multiple of block_m with T * k;
    block_expert [max_blocks] int32: the expert of each block (past the end: a valid id that is
    never used); num_padded [1]: the padded length). No host sync."""
    flat = ids.reshape(-1).long()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    sorted_ids, order = torch.sort(flat, stable=True)
    # starts[e]: where expert e's pairs begin in the sorted list (starts[E] = P).
    starts = torch.searchsorted(sorted_ids, _arange(num_experts + 1, flat.device))
    counts = starts[1:] - starts[:-1]
    padded = (counts + (block_m - 1)).div_(block_m, rounding_mode="floor").mul_(block_m)
    padded_ends = padded.cumsum(0)
    # Each pair moves right by the padding of the experts before its own.
    shift = padded_ends - padded - starts[:-1]
    dest = shift.index_select(0, sorted_ids) + _arange(num_pairs, flat.device)
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=flat.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    block_starts = _arange(blocks, flat.device) * block_m
    # The first expert whose padded run ends after the block's start; blocks past the end get
    # the last expert (dropping padded_ends[-1]), an index the kernels may read but never use.
    block_expert = torch.searchsorted(padded_ends[:-1], block_starts, right=True,
                                      out_int32=True)
    return sorted_pairs, block_expert, padded_ends[-1:]


