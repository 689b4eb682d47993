"""Two alternatives to `w4a16_gemm._w4a16_kernel` that never reshape a weight tile, which
`benchmarks/int4_linear.py --sweep` weighs against it and the tiles table takes only where a
sweep finds them faster (`Tiles.gemv`, `Tiles.field_dots`; off in the table until then):

- `_w4a16_gemv_kernel`, one row of x a program: the codes stay in their words' [R, PER,
  BLOCK_N] shape and x is read as [R, PER] to match; elementwise float32 products summed once.
- `_w4a16_field_dots_kernel`, from 16 rows: one [R, BLOCK_N] operand per bit-field i
  (positions r * PER + i), each dotted with the x columns it reads.

Both read one row of scales and zeros per word row, so they need groups of whole words (every
format's group sizes are); the layout and its meaning are `w4a16_gemm`'s.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from pagedserve.quantization.ops.tile_order import grouped_tile, k_slice


@triton.jit
def _w4a16_gemv_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, y_ptr, M, N, K, group_size,
                       group_offset, stride_xm, stride_qk, stride_sg, stride_zg, stride_ys,
                       stride_ym, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLIT_K: tl.constexpr, BITS: tl.constexpr, OFFSETS: tl.constexpr,
                       PERMUTED: tl.constexpr):
    """One row of x (a program per row, output tile and K slice), the codes kept in their
    words' [R, PER, BLOCK_N] shape: x is read as [R, PER] to match, so no tile is reshaped,
    and each word row reads its group's scale and zero (groups are whole words). The weight
    is code * scale + offset in float32, not rounded to x's dtype, as `_w4a16_kernel`'s
    one-row path; products accumulate elementwise and are summed once at the end."""
    PER: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PER
    row = tl.program_id(0) // tl.cdiv(N, BLOCK_N)
    cols = (tl.program_id(0) % tl.cdiv(N, BLOCK_N)) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    first, last = k_slice(K, BLOCK_K, SPLIT_K)
    shifts = tl.arange(0, PER) * BITS
    acc = tl.zeros((R, PER, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        start = t * BLOCK_K
        word_rows = start // PER + tl.arange(0, R)
        rows_ok = word_rows * PER < K
        words = tl.load(qw_ptr + word_rows[:, None] * stride_qk + cols[None, :],
                        mask=rows_ok[:, None] & col_ok[None, :], other=0)
        codes = ((words[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)).to(tl.float32)
        group = (word_rows * PER + group_offset) // group_size
        mask = rows_ok[:, None] & col_ok[None, :]
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :], mask=mask,
                       other=0).to(tl.float32)
        if OFFSETS:
            w = codes * scale[:, None, :] + zero[:, None, :]
        else:
            w = (codes - zero[:, None, :]) * scale[:, None, :]
        pos = start + tl.arange(0, R)[:, None] * PER + tl.arange(0, PER)[None, :]
        pos_ok = pos < K
        if PERMUTED:
            src = tl.load(perm_ptr + pos, mask=pos_ok, other=0)
        else:
            src = pos
        a = tl.load(x_ptr + row * stride_xm + src, mask=pos_ok, other=0.0).to(tl.float32)
        acc += a[:, :, None] * w
    out = tl.sum(tl.sum(acc, 1), 0)
    tl.store(y_ptr + tl.program_id(1) * stride_ys + row * stride_ym + cols,
             out.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _w4a16_field_dots_kernel(x_ptr, qw_ptr, s_ptr, z_ptr, perm_ptr, y_ptr, M, N, K,
                             group_size, group_offset, stride_xm, stride_qk, stride_sg,
                             stride_zg, stride_ys, stride_ym, BLOCK_M: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                             GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, BITS: tl.constexpr,
                             OFFSETS: tl.constexpr, PERMUTED: tl.constexpr,
                             IEEE: tl.constexpr):
    """`_w4a16_kernel` without the tile's reshape: a K step's words give one [R, BLOCK_N]
    operand per bit-field i (positions r * PER + i), each dotted with the x columns it
    reads, PER dots of R inputs (R >= 16); scales and zeros one row per word row (groups are
    whole words)."""
    PER: tl.constexpr = 32 // BITS
    R: tl.constexpr = BLOCK_K // PER
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    first, last = k_slice(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(first, last):
        start = t * BLOCK_K
        word_rows = start // PER + tl.arange(0, R)
        rows_ok = word_rows * PER < K
        mask = rows_ok[:, None] & col_ok[None, :]
        words = tl.load(qw_ptr + word_rows[:, None] * stride_qk + cols[None, :], mask=mask,
                        other=0)
        group = (word_rows * PER + group_offset) // group_size
        scale = tl.load(s_ptr + group[:, None] * stride_sg + cols[None, :], mask=mask,
                        other=0.0).to(tl.float32)
        zero = tl.load(z_ptr + group[:, None] * stride_zg + cols[None, :], mask=mask,
                       other=0).to(tl.float32)
        for i in tl.static_range(PER):
            codes = ((words >> (i * BITS)) & ((1 << BITS) - 1)).to(tl.float32)
            if OFFSETS:
                w = codes * scale + zero
            else:
                w = (codes - zero) * scale
            pos = word_rows * PER + i
            pos_ok = pos < K
            if PERMUTED:
                src = tl.load(perm_ptr + pos, mask=pos_ok, other=0)
            else:
                src = pos
            a = tl.load(x_ptr + rows[:, None] * stride_xm + src[None, :],
                        mask=row_ok[:, None] & pos_ok[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
            else:
                acc += tl.dot(a, w.to(a.dtype))
    out = y_ptr + tl.program_id(1) * stride_ys + rows[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def launch(t: Any, args: tuple, weight: Any, split: int) -> bool:
    """Run the alternative `t` (`w4a16_gemm.Tiles`) asks for, where it applies to `weight` (a
    `w4a16_gemm.W4A16Weight`: that module imports this one), with `w4a16_mm`'s leading kernel
    arguments `args` (x first, m and n at 6 and 7); False where neither applies (the default
    kernel runs)."""
    x, m, n = args[0], args[6], args[7]
    common = {"BLOCK_N": t.block_n, "BLOCK_K": t.block_k, "SPLIT_K": split, "BITS": weight.bits,
              "OFFSETS": weight.offsets, "PERMUTED": weight.perm is not None,
              "num_warps": t.num_warps, "num_stages": t.num_stages}
    if t.gemv and t.block_m == 1 and weight.whole_word_groups:
        _w4a16_gemv_kernel[(m * triton.cdiv(n, t.block_n), split)](*args, **common)
    elif t.field_dots and t.block_m >= 16 and weight.whole_word_groups:
        grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), split)
        _w4a16_field_dots_kernel[grid](*args, BLOCK_M=t.block_m, GROUP_M=t.group_m,
                                       IEEE=x.dtype == torch.float32, **common)
    else:
        return False
    return True
