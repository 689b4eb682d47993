"""A step's (token, slot) pairs grouped by expert for the grouped GEMMs of `moe_kernels`: three
small Triton kernels, no host sync, and few enough launches that a prefill step's host time
is not spent here (the torch-op version took ~14 launches and 0.3-1.3 ms of host time a layer
on the H200, more than the layer's device time at 2,048 tokens; vLLM's
`moe_align_block_size` is one CUDA kernel for the same reason).

1. `_count_kernel`, one program per CHUNK pairs: a histogram of the chunk's experts, added to
   the per-expert counts with one atomic per expert.
2. `_offsets_kernel`, one program: each expert's run padded to a multiple of BLOCK_M, the
   padded length, the expert of every BLOCK_M block, and, over the counts, a cursor at the
   start of each expert's run.
3. `_scatter_kernel`, one program per CHUNK pairs: each pair takes the next free place of its
   expert's run (an atomic increment of the cursor) and writes its id there.

Within an expert's run the order follows the atomics and may differ from run to run. No result
depends on it: the GEMMs compute each row from its own input row alone and write it back to
its pair's row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Pairs per program of the counting and scattering kernels; blocks per step of the offsets
# kernel's loop over the block list.
CHUNK = 1024
BLOCK_B = 64


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the BLOCK_M blocks of the aligned list: each expert that gets a pair (at
    most min(P, E) of them) pads by at most block_m - 1."""
    return (num_pairs + min(num_pairs, num_experts) * (block_m - 1)) // block_m


@triton.jit(do_not_specialize=["num_pairs"])
def _count_kernel(ids_ptr, counts_ptr, num_pairs, NUM_EXPERTS: tl.constexpr,
                  NUM_BINS: tl.constexpr, CHUNK: tl.constexpr):
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    # Lanes past the end count in bin NUM_EXPERTS, which is never added (no histogram mask:
    # the interpreter's differs from the compiled one).
    experts = tl.load(ids_ptr + pairs, mask=valid, other=NUM_EXPERTS).to(tl.int32)
    hist = tl.histogram(experts, NUM_BINS)
    bins = tl.arange(0, NUM_BINS)
    tl.atomic_add(counts_ptr + bins, hist, mask=(bins < NUM_EXPERTS) & (hist > 0))


@triton.jit(do_not_specialize=["num_blocks"])
def _offsets_kernel(counts_ptr, block_expert_ptr, num_padded_ptr, num_blocks,
                    NUM_EXPERTS: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_B: tl.constexpr):
    bins = tl.arange(0, NUM_BINS)
    real = bins < NUM_EXPERTS
    counts = tl.load(counts_ptr + bins, mask=real, other=0)
    padded = (counts + (BLOCK_M - 1)) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    tl.store(counts_ptr + bins, ends - padded, mask=real)
    # A block's expert: how many runs end at or before its start. Past the padded length that
    # is E; clamped to E - 1, a valid id the GEMMs may read but never use.
    ends = tl.where(real, ends, 2**30)
    for b0 in range(0, num_blocks, BLOCK_B):
        blocks = b0 + tl.arange(0, BLOCK_B)
        starts = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= starts[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.minimum(expert, NUM_EXPERTS - 1),
                 mask=blocks < num_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _scatter_kernel(ids_ptr, cursors_ptr, sorted_ptr, num_pairs, CHUNK: tl.constexpr):
    pairs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    valid = pairs < num_pairs
    experts = tl.load(ids_ptr + pairs, mask=valid, other=0)
    places = tl.atomic_add(cursors_ptr + experts, 1, mask=valid)
    tl.store(sorted_ptr + places, pairs, mask=valid)


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_pairs [max_blocks * block_m] int32: pair ids t * k + j, grouped by
    expert in expert order, each group padded to a multiple of block_m with T * k;
    block_expert [max_blocks] int32: the expert of each block (past the end: a valid id that is
    never used); num_padded [1] int32: the padded length)."""
    flat = ids.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    num_pairs = flat.numel()
    blocks = max_blocks(num_pairs, num_experts, block_m)
    num_bins = triton.next_power_of_2(num_experts + 1)
    # counts (then cursors) for every bin, and the padded length after them: one allocation.
    scratch = torch.zeros(num_bins + 1, dtype=torch.int32, device=flat.device)
    counts, num_padded = scratch[:num_bins], scratch[num_bins:]
    sorted_pairs = torch.full((blocks * block_m,), num_pairs, dtype=torch.int32,
                              device=flat.device)
    block_expert = torch.empty(blocks, dtype=torch.int32, device=flat.device)
    grid = (triton.cdiv(num_pairs, CHUNK),)
    _count_kernel[grid](flat, counts, num_pairs, NUM_EXPERTS=num_experts, NUM_BINS=num_bins,
                        CHUNK=CHUNK)
    _offsets_kernel[(1,)](counts, block_expert, num_padded, blocks, NUM_EXPERTS=num_experts,
                          NUM_BINS=num_bins, BLOCK_M=block_m, BLOCK_B=BLOCK_B)
    _scatter_kernel[grid](flat, counts, sorted_pairs, num_pairs, CHUNK=CHUNK)
    return sorted_pairs, block_expert, num_padded
