"""LoRA's CUDA path as Triton kernels in the manner of Punica: a shrink (x A^T, to the rank)
and an expand (r B^T added into the layer's output), each ONE launch per layer for every
adapter of the step and every fused part (q/k/v, gate/up: a grid axis). Tokens of the base
model (slot -1) are skipped. The reference is `ops.lora_torch`; the layout is ops.py's.

- SGMV (prefill and mixed steps): one program per (segment, BLOCK_M rows of it, part or part
  x output block), where a segment is a run of consecutive tokens with one adapter
  (`LoRABatch`). Tiles go through `tl.dot`. The grid needs the number of segments and the
  longest, host ints the manager computed, so launching syncs nothing.
- BGMV (decode, and any step under a CUDA graph): one program per (token, part or part x
  output block), reading the token's slot from `token_slots`; a fixed grid over the padded
  rows, so the launch is graph-safe. Rows are dot products (a one-row tile cannot use
  `tl.dot`). Each row reads its adapter's factors again (from L2 when rows share them).

The shrink's output stays float32 in memory and is rounded to the factors' dtype before the
expand, as PEFT rounds lora_A's output. Float32 factors use IEEE dots (no tf32). Importing
this module imports triton: `ops.add_lora` does so on its first CUDA step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # shrink: reduction step over the input features
BLOCK_N = 64  # expand: output columns per program


@triton.jit
def _sgmv_shrink(x_ptr, a_ptr, r_ptr, seg_bounds_ptr, seg_slots_ptr, in_features,
                 stride_x, stride_as, stride_ar, stride_r,
                 RANK: tl.constexpr, R_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seg, block, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    end = tl.load(seg_bounds_ptr + 2 * seg + 1)
    row0 = tl.load(seg_bounds_ptr + 2 * seg) + block * BLOCK_M
    if row0 < end:
        slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        ranks = tl.arange(0, R_PAD)
        row_ok, rank_ok = rows < end, ranks < RANK
        a_rows = a_ptr + slot * stride_as + (part * RANK + ranks) * stride_ar
        acc = tl.zeros((BLOCK_M, R_PAD), dtype=tl.float32)
        for k in range(0, in_features, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            a = tl.load(a_rows[None, :] + ks[:, None], mask=k_ok[:, None] & rank_ok[None, :],
                        other=0.0)
            acc = tl.dot(x.to(a.dtype), a, acc, input_precision=DOT_PRECISION)
        tl.store(r_ptr + rows[:, None].to(tl.int64) * stride_r + part * RANK + ranks[None, :],
                 acc, mask=row_ok[:, None] & rank_ok[None, :])


@triton.jit
def _sgmv_expand(r_ptr, b_ptr, y_ptr, bounds_ptr, seg_bounds_ptr, seg_slots_ptr,
                 stride_r, stride_bs, stride_bn, stride_y,
                 RANK: tl.constexpr, R_PAD: tl.constexpr, N_BLOCKS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    seg, block, pid_n = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    part, n_block = pid_n // N_BLOCKS, pid_n % N_BLOCKS
    end = tl.load(seg_bounds_ptr + 2 * seg + 1)
    row0 = tl.load(seg_bounds_ptr + 2 * seg) + block * BLOCK_M
    col0 = tl.load(bounds_ptr + part) + n_block * BLOCK_N
    part_end = tl.load(bounds_ptr + part + 1)
    if (row0 < end) & (col0 < part_end):
        slot = tl.load(seg_slots_ptr + seg).to(tl.int64)
        rows = row0 + tl.arange(0, BLOCK_M)
        cols = col0 + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, R_PAD)
        row_ok, col_ok, rank_ok = rows < end, cols < part_end, ranks < RANK
        b = tl.load(b_ptr + slot * stride_bs + cols[None, :] * stride_bn + ranks[:, None],
                    mask=rank_ok[:, None] & col_ok[None, :], other=0.0)  # [R_PAD, BLOCK_N]
        r = tl.load(r_ptr + rows[:, None].to(tl.int64) * stride_r + part * RANK
                    + ranks[None, :], mask=row_ok[:, None] & rank_ok[None, :], other=0.0)
        delta = tl.dot(r.to(b.dtype), b, input_precision=DOT_PRECISION)
        y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_y + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_shrink(x_ptr, a_ptr, r_ptr, slots_ptr, in_features,
                 stride_x, stride_as, stride_ar, stride_r,
                 RANK: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        ranks = tl.arange(0, R_PAD)
        rank_ok = ranks < RANK
        a_rows = a_ptr + slot * stride_as + (part * RANK + ranks) * stride_ar
        acc = tl.zeros((R_PAD,), dtype=tl.float32)
        for k in range(0, in_features, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            x = tl.load(x_ptr + row * stride_x + ks, mask=k_ok, other=0.0)
            a = tl.load(a_rows[:, None] + ks[None, :], mask=rank_ok[:, None] & k_ok[None, :],
                        other=0.0)
            x = x.to(a.dtype).to(tl.float32)
            acc += tl.sum(a.to(tl.float32) * x[None, :], axis=1)
        tl.store(r_ptr + row * stride_r + part * RANK + ranks, acc, mask=rank_ok)


@triton.jit
def _bgmv_expand(r_ptr, b_ptr, y_ptr, bounds_ptr, slots_ptr,
                 stride_r, stride_bs, stride_bn, stride_y,
                 RANK: tl.constexpr, R_PAD: tl.constexpr, N_BLOCKS: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    row, pid_n = tl.program_id(0).to(tl.int64), tl.program_id(1)
    part, n_block = pid_n // N_BLOCKS, pid_n % N_BLOCKS
    slot = tl.load(slots_ptr + row).to(tl.int64)
    col0 = tl.load(bounds_ptr + part) + n_block * BLOCK_N
    part_end = tl.load(bounds_ptr + part + 1)
    if (slot >= 0) & (col0 < part_end):
        cols = col0 + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, R_PAD)
        col_ok, rank_ok = cols < part_end, ranks < RANK
        b = tl.load(b_ptr + slot * stride_bs + cols[:, None] * stride_bn + ranks[None, :],
                    mask=col_ok[:, None] & rank_ok[None, :], other=0.0)  # [BLOCK_N, R_PAD]
        r = tl.load(r_ptr + row * stride_r + part * RANK + ranks, mask=rank_ok, other=0.0)
        r = r.to(b.dtype).to(tl.float32)
        delta = tl.sum(b.to(tl.float32) * r[None, :], axis=1)
        y_ptrs = y_ptr + row * stride_y + cols
        y = tl.load(y_ptrs, mask=col_ok, other=0.0).to(tl.float32)
        tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=col_ok)


def _shapes(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
            bounds: list[int]) -> tuple[int, int, int, torch.Tensor]:
    """(parts, rank, padded rank, the shrink's float32 output [T, parts * rank])."""
    assert x.stride(-1) == 1 and y.stride(-1) == 1 and lora_a.is_contiguous() \
        and lora_b.is_contiguous(), "LoRA kernels need row-major x, y and factors"
    parts, rank = len(bounds) - 1, lora_b.shape[-1]
    shrunk = torch.empty(x.shape[0], parts * rank, dtype=torch.float32, device=x.device)
    return parts, rank, max(16, triton.next_power_of_2(rank)), shrunk


def _n_blocks(bounds: list[int]) -> int:
    return triton.cdiv(max(b - a for a, b in zip(bounds, bounds[1:], strict=False)), BLOCK_N)


def _precision(lora_a: torch.Tensor) -> str | None:
    return "ieee" if lora_a.dtype == torch.float32 else None


def sgmv(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         bounds: list[int], bounds_device: torch.Tensor, seg_bounds: torch.Tensor,
         seg_slots: torch.Tensor, num_segments: int, max_segment_len: int) -> None:
    """y [T, out] += x [T, in]'s LoRA term over the step's segments (two launches)."""
    if not num_segments or not x.shape[0]:
        return
    parts, rank, r_pad, shrunk = _shapes(x, y, lora_a, lora_b, bounds)
    block_m = min(64, max(16, triton.next_power_of_2(max_segment_len)))
    m_blocks = triton.cdiv(max_segment_len, block_m)
    precision = _precision(lora_a)
    _sgmv_shrink[(num_segments, m_blocks, parts)](
        x, lora_a, shrunk, seg_bounds, seg_slots, x.shape[1],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        RANK=rank, R_PAD=r_pad, BLOCK_M=block_m, BLOCK_K=BLOCK_K, DOT_PRECISION=precision)
    n_blocks = _n_blocks(bounds)
    _sgmv_expand[(num_segments, m_blocks, parts * n_blocks)](
        shrunk, lora_b, y, bounds_device, seg_bounds, seg_slots,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        RANK=rank, R_PAD=r_pad, N_BLOCKS=n_blocks, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        DOT_PRECISION=precision)


def bgmv(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         bounds: list[int], bounds_device: torch.Tensor, token_slots: torch.Tensor) -> None:
    """y [T, out] += x [T, in]'s LoRA term, each row through `token_slots[row]`'s adapter
    (-1: none); a fixed grid over the T rows (two launches)."""
    if not x.shape[0]:
        return
    parts, rank, r_pad, shrunk = _shapes(x, y, lora_a, lora_b, bounds)
    _bgmv_shrink[(x.shape[0], parts)](
        x, lora_a, shrunk, token_slots, x.shape[1],
        x.stride(0), lora_a.stride(0), lora_a.stride(1), shrunk.stride(0),
        RANK=rank, R_PAD=r_pad, BLOCK_K=BLOCK_K)
    n_blocks = _n_blocks(bounds)
    _bgmv_expand[(x.shape[0], parts * n_blocks)](
        shrunk, lora_b, y, bounds_device, token_slots,
        shrunk.stride(0), lora_b.stride(0), lora_b.stride(1), y.stride(0),
        RANK=rank, R_PAD=r_pad, N_BLOCKS=n_blocks, BLOCK_N=BLOCK_N)
