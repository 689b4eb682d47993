"""LoRA's CUDA path as two Triton kernels in the manner of Punica's grouped GEMM: a shrink (x A^T,
to the rank) and an expand (r B^T added into the layer's output), each ONE launch per layer
for every adapter of the step, every fused part (q/k/v, gate/up) and every kind of step.

Tokens are grouped by adapter slot on the host (`LoRABatch`): the step's adapter tokens sorted
by slot and cut into blocks of at most 16 tokens of one slot (base-model tokens are in none).
A program takes one block, so the factors it reads serve 16 tokens, not one, and its products
are `tl.dot` tiles. The grid is (blocks, splits) for the shrink, which takes every fused
part's ranks at once (so x is read once), and (blocks, parts x column groups) for the expand,
whose program sums the partials once for several column tiles. Its first dimension is the step's
block count, a host int known before launch, or under a CUDA graph every block a step of its
rows can have, the unused ones empty (a program returns at once). So the grid never depends
on a device value, launching syncs nothing, and it never spans the slots (a grid over slots x
row blocks was 7/8 empty programs with one adapter of eight).

The shrink splits the input features over SPLIT_K programs when they are many (a decode step
has few blocks to spread over the GPU): each split writes its own float32 partial, and the
expand sums the partials in a fixed order, so the result never depends on which program ran
first (no atomics), and the split depends on the layer alone. The sum is rounded to the
factors' dtype before the expand, as PEFT rounds lora_A's output. Float32 factors use IEEE
dots (no tf32). The reference is `ops.lora_torch`; the layout is ops.py's. Importing this
module imports triton: `ops.add_lora` does so on its first CUDA step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.lora.batch import BLOCK_ROWS


@dataclass(frozen=True)
class LoRATiles:
    """Launch shapes of the two kernels (`benchmarks/lora_kernels.py --sweep` times others).
    The shrink splits its input features into pieces of at least `k_per_split` (at most
    `max_splits` of them: a function of the layer alone, so a token's sum is the same in any
    batch); the expand's program adds `n_tiles` tiles of `block_n` output columns, so the
    partials it sums serve them all. The defaults are the sweep's best on an H100 at 256
    tokens (2026-12-07: block_n 64, 1.43 ms a step of the 8B shape's four projections x 32
    layers, against 1.57 at 128; the other five shapes 1.59-1.67)."""

    block_k: int = 64
    k_per_split: int = 256
    max_splits: int = 16
    shrink_warps: int = 4
    block_n: int = 64
    n_tiles: int = 4
    expand_warps: int = 4


TILES = LoRATiles()
# The shrink's ranks a program at most (its float32 accumulator is 16 x this): q/k/v at rank
# 64 (192 ranks) takes two programs a split, not one of 256.
MAX_SHRINK_RANKS = 128
EXPAND_TILE_ELEMENTS = 128 * 64  # the expand's B tile at most (see expand_block_n)


@triton.jit
def _block_rows(sorted_rows_ptr, blocks_ptr, block, BLOCK_M: tl.constexpr):
    """Block `block`: its slot, its token rows, which of them exist, and how many (<= 0: an
    empty block; triton 3.6 takes no bool a helper returns as an `if`'s condition)."""
    slot = tl.load(blocks_ptr + 3 * block).to(tl.int64)
    first = tl.load(blocks_ptr + 3 * block + 1)
    end = tl.load(blocks_ptr + 3 * block + 2)
    idx = first + tl.arange(0, BLOCK_M)
    ok = idx < end
    rows = tl.load(sorted_rows_ptr + idx, mask=ok, other=0).to(tl.int64)
    return slot, rows, ok, end - first


@triton.jit
def _shrink(x_ptr, a_ptr, part_ptr, sorted_rows_ptr, blocks_ptr, in_features, k_per_split,
            stride_x, stride_as, stride_ar, stride_split, stride_r,
            RANKS: tl.constexpr, R_PAD: tl.constexpr, SPLIT_K: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The fused parts' ranks side by side (RANKS = parts x rank), R_PAD of them a program:
    with the usual ranks every part's at once, so x is read once a split."""
    block, pid = tl.program_id(0), tl.program_id(1)
    chunk, split = pid // SPLIT_K, pid % SPLIT_K
    slot, rows, row_ok, num_rows = _block_rows(sorted_rows_ptr, blocks_ptr, block, BLOCK_M)
    if num_rows > 0:
        ranks = chunk * R_PAD + tl.arange(0, R_PAD)
        rank_ok = ranks < RANKS
        a_rows = a_ptr + slot * stride_as + ranks * stride_ar
        acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        k_end = tl.minimum(in_features, (split + 1) * k_per_split)
        for k in range(split * k_per_split, k_end, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < k_end
            x = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows[None, :] + ks[:, None], mask=k_ok[:, None] & rank_ok[None, :],
                        other=0.0)
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
        out = part_ptr + split * stride_split + rows[:, None] * stride_r
        tl.store(out + ranks[None, :], acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _expand(part_ptr, b_ptr, y_ptr, bounds_ptr, sorted_rows_ptr, blocks_ptr,
            stride_split, stride_r, stride_bs, stride_bn, stride_y,
            RANK: tl.constexpr, R_PAD: tl.constexpr, SPLIT_K: tl.constexpr,
            N_GROUPS: tl.constexpr, N_TILES: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    block, pid = tl.program_id(0), tl.program_id(1)
    part, group = pid // N_GROUPS, pid % N_GROUPS
    col0 = tl.load(bounds_ptr + part) + group * (N_TILES * BLOCK_N)
    part_end = tl.load(bounds_ptr + part + 1)
    slot, rows, row_ok, num_rows = _block_rows(sorted_rows_ptr, blocks_ptr, block, BLOCK_M)
    if (num_rows > 0) & (col0 < part_end):
        ranks = tl.arange(0, R_PAD)
        rank_ok = ranks < RANK
        r_ptrs = part_ptr + rows[:, None] * stride_r + part * RANK + ranks[None, :]
        r_ok = row_ok[:, None] & rank_ok[None, :]
        r = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for split in range(SPLIT_K):  # a fixed order: the same sum whichever split ran first
            r += tl.load(r_ptrs + split * stride_split, mask=r_ok, other=0.0)
        b_slot = b_ptr + slot * stride_bs
        for tile in range(N_TILES):
            cols = col0 + tile * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok = cols < part_end
            # [BLOCK_N, R_PAD] as B lies (a column's ranks side by side), then transposed
            b = tl.load(b_slot + cols[:, None] * stride_bn + ranks[None, :],
                        mask=col_ok[:, None] & rank_ok[None, :], other=0.0)
            delta = tl.dot(r.to(b.dtype), tl.trans(b), input_precision=DOT_PRECISION)
            y_ptrs = y_ptr + rows[:, None] * stride_y + cols[None, :]
            mask = row_ok[:, None] & col_ok[None, :]
            y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


def split_k(in_features: int, tiles: LoRATiles | None = None) -> int:
    """Splits of the shrink's input features (a function of the layer alone, so a token's
    sum is the same in any batch)."""
    tiles = tiles or TILES
    return max(1, min(tiles.max_splits, in_features // tiles.k_per_split))


def grouped(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
            bounds: list[int], bounds_device: torch.Tensor, sorted_rows: torch.Tensor,
            blocks: torch.Tensor, num_blocks: int, tiles: LoRATiles | None = None) -> None:
    """y [T, out] += x [T, in]'s LoRA term over the first `num_blocks` of `blocks` (rows
    (slot, first, end) into `sorted_rows`, `LoRABatch`'s; empty ones skipped): two launches,
    none when `num_blocks` is 0. `tiles`: the module's `TILES` unless given."""
    if not num_blocks or not x.shape[0]:
        return
    tiles = tiles or TILES
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and lora_a.is_contiguous() \
        and lora_b.is_contiguous(), "LoRA kernels need row-major x, y and factors"
    parts, rank = len(bounds) - 1, lora_b.shape[-1]
    k_per_split = triton.cdiv(triton.cdiv(x.shape[1], split_k(x.shape[1], tiles)),
                              tiles.block_k) * tiles.block_k
    splits = triton.cdiv(x.shape[1], k_per_split)  # rounding to block_k may leave one out
    partials = torch.empty(splits, x.shape[0], parts * rank, dtype=torch.float32,
                           device=x.device)
    precision = "ieee" if lora_a.dtype == torch.float32 else None
    ranks = parts * rank
    chunk = min(_pad(ranks), MAX_SHRINK_RANKS)
    _shrink[(num_blocks, triton.cdiv(ranks, chunk) * splits)](
        x, lora_a, partials, sorted_rows, blocks, x.shape[1], k_per_split,
        x.stride(0), lora_a.stride(0), lora_a.stride(1), partials.stride(0),
        partials.stride(1), RANKS=ranks, R_PAD=chunk, SPLIT_K=splits,
        BLOCK_M=BLOCK_ROWS, BLOCK_K=tiles.block_k, DOT_PRECISION=precision,
        num_warps=tiles.shrink_warps)
    widest = max(b - a for a, b in zip(bounds, bounds[1:], strict=False))
    block_n = expand_block_n(rank, tiles)
    groups = triton.cdiv(widest, tiles.n_tiles * block_n)
    _expand[(num_blocks, parts * groups)](
        partials, lora_b, y, bounds_device, sorted_rows, blocks,
        partials.stride(0), partials.stride(1), lora_b.stride(0), lora_b.stride(1),
        y.stride(0), RANK=rank, R_PAD=_pad(rank), SPLIT_K=splits, N_GROUPS=groups,
        N_TILES=tiles.n_tiles, BLOCK_M=BLOCK_ROWS, BLOCK_N=block_n,
        DOT_PRECISION=precision, num_warps=tiles.expand_warps)


def expand_block_n(rank: int, tiles: LoRATiles | None = None) -> int:
    """The expand's column tile: `tiles.block_n`, narrowed for large ranks so its B tile stays
    at most EXPAND_TILE_ELEMENTS elements (float32 at rank 256 and 128 columns
    asked for 274 KB of shared memory, past a Hopper block's 227)."""
    tiles = tiles or TILES
    return max(16, min(tiles.block_n, EXPAND_TILE_ELEMENTS // _pad(rank)))


def _pad(ranks: int) -> int:
    """A tile's rank width: a power of two, at least tl.dot's 16."""
    return max(16, triton.next_power_of_2(ranks))
