"""The block-scaled FP8 GEMM of DeepSeek-style weights: y = x W^T with x quantized per token in
1 x G groups along K (G = the weight block's columns, 128) and W [N, K] in FP8 with one float32
scale per Bn x G block. Two kernels:

1. `_group_quant_kernel`: one program per (row, group) takes the group's absolute maximum,
   scale = amax / 448, and writes the e4m3 codes and the scale ([M, ceil(K / G)] float32).
2. `_block_gemm_kernel`: one program per BLOCK_M x BLOCK_N output tile steps over K by G (one
   weight block column and one activation group per step): an FP8 x FP8 dot into float32,
   scaled by the row's group scale and the columns' block scales, summed in float32, rounded
   once to the output dtype. BLOCK_K is G, so each step reads exactly one scale per row and
   per column.

Partial blocks at the edges (N or K not multiples of the block) are masked: the missing
elements read as zero, which is how the checkpoint's scales were computed (zero padding).
Launch shapes (`BlockTiles`) are keyed by M; the table is a reasoned start, to be swept on the
device (`benchmarks/fp8_linear.py`). The interpreter (TRITON_INTERPRET=1) runs both on CPU
tensors for the tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quantization.ops.tile_order import grouped_tile

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
# A zero group (padding, an all-zero token) must not divide by zero.
MIN_SCALE = 1e-10


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, K, num_groups, stride_xm, stride_qm,
                        GROUP: tl.constexpr, FP8_MAX_: tl.constexpr, MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_xm + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=0) / FP8_MAX_, MIN_SCALE_)
    q = tl.clamp(x / scale, -FP8_MAX_, FP8_MAX_)
    tl.store(q_ptr + row * stride_qm + cols, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * num_groups + group, scale)


def quantize_per_token_group(x: torch.Tensor, group: int = 128
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (16 or 32 bits) -> (e4m3 codes [M, K], float32 scales [M, ceil(K / group)])."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    m, k = x.shape
    groups = math.ceil(k / group)
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _group_quant_kernel[(m, groups)](x, q, s, k, groups, x.stride(0), q.stride(0),
                                         GROUP=group, FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE)
    return q, s


@triton.jit
def _block_gemm_kernel(a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
                       stride_am, stride_bn, stride_cm, stride_asm, stride_bsn,
                       GROUP_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + cols[None, :] * stride_bn + ks[:, None]  # W^T tile [BLOCK_K, BLOCK_N]
    as_ptrs = as_ptr + rows * stride_asm
    bs_ptrs = bs_ptr + (cols // GROUP_N) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = ks < K - step * BLOCK_K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        a_scale = tl.load(as_ptrs + step, mask=row_ok, other=0.0)
        b_scale = tl.load(bs_ptrs + step, mask=col_ok, other=0.0)
        acc += tl.dot(a, b) * a_scale[:, None] * b_scale[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    c = acc.to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], c,
             mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class BlockTiles:
    block_m: int
    block_n: int
    group_m: int
    num_warps: int
    num_stages: int


# Keyed by M. Hopper, chosen by reasoning and not yet swept: decode rows (M <= 16) only stream
# the weight, so narrow N tiles give the SMs enough programs on one layer; larger M reuses each
# weight tile over taller row tiles, towards compute bound at prefill.
_TILES = (
    (16, BlockTiles(16, 64, 1, 4, 4)),
    (64, BlockTiles(32, 64, 4, 4, 4)),
    (256, BlockTiles(64, 128, 8, 4, 3)),
    (math.inf, BlockTiles(128, 128, 8, 8, 3)),
)
INTERPRETER_TILES = BlockTiles(16, 32, 1, 1, 1)


def select_tiles(m: int, device: torch.device) -> BlockTiles:
    if device.type == "cpu":
        return INTERPRETER_TILES
    return next(t for bound, t in _TILES if m <= bound)


def block_scaled_mm(q: torch.Tensor, q_scale: torch.Tensor, weight: torch.Tensor,
                    weight_scale: torch.Tensor, block: tuple[int, int],
                    out_dtype: torch.dtype, tiles: BlockTiles | None = None) -> torch.Tensor:
    """(q [M, K] e4m3, q_scale [M, ceil(K/Bk)]) x (weight [N, K] e4m3, weight_scale
    [ceil(N/Bn), ceil(K/Bk)]) -> [M, N] in `out_dtype`."""
    m, k = q.shape
    n = weight.shape[0]
    bn, bk = block
    if weight_scale.shape != (math.ceil(n / bn), math.ceil(k / bk)):
        raise ValueError(f"weight scale {tuple(weight_scale.shape)} does not cover a [{n}, {k}] "
                         f"weight in {bn}x{bk} blocks")
    if q_scale.shape != (m, math.ceil(k / bk)):
        raise ValueError(f"activation scale {tuple(q_scale.shape)} does not cover [{m}, {k}] "
                         f"in groups of {bk}")
    out = torch.empty((m, n), dtype=out_dtype, device=q.device)
    if m == 0:
        return out
    t = tiles or select_tiles(m, q.device)
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n),)
    _block_gemm_kernel[grid](q, weight, out, q_scale, weight_scale, m, n, k,
                             q.stride(0), weight.stride(0), out.stride(0), q_scale.stride(0),
                             weight_scale.stride(0), GROUP_N=bn, BLOCK_M=t.block_m,
                             BLOCK_N=t.block_n, BLOCK_K=bk, GROUP_M=t.group_m,
                             num_warps=t.num_warps, num_stages=t.num_stages)
    return out


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                     block: tuple[int, int], bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: x quantized per token in groups of block[1], then
    the block-scaled GEMM."""
    flat = x.reshape(-1, x.shape[-1])
    q, s = quantize_per_token_group(flat, block[1])
    out = block_scaled_mm(q, s, weight, weight_scale, block, x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])
