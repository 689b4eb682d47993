"""The FP8 linear at decode: y [M, N] = x [M, K] @ dequant(W) [N, K]^T for M <= SMALL_M_MAX.

Why it exists: at a few rows a linear only streams its weight, so FP8 weights (one byte an
element) should take about half of bf16's time. The prefill kernels do not get there: cuBLASLt's
FP8 GEMM (`torch._scaled_mm`) pads M to 16 and wants the activation quantized by separate
launches first, and the block GEMM (`fp8_block_gemm.py`) also quantizes x first and tiles N
widely for reuse. Per projection at M = 1 both were 3-4x slower than bf16 on an H100.

This kernel reads the weight's e4m3 codes once and everything else in registers:
- W: e4m3 [N, K] as stored, with per-channel scales ([N] or [N, 1] float32) or block scales
  ([ceil(N / Bn), ceil(K / Bk)] float32; partial blocks at the edges are masked, their missing
  elements read as zero as the checkpoint's scales assumed).
- x: the model's dtype (bf16 / fp16 / float32), read as is: no activation quantization at
  decode, so the product is the weight's rounding alone; or an FP8 activation from the fused
  producers (`fp8_fused.py`): codes with float32 scales per row ([M, 1]) or per group
  ([M, ceil(K / G)]).
- The codes become 16-bit in registers (exact: every e4m3 value is a bf16 and an fp16) and go
  through `tl.dot` with BLOCK_M = 16 (M pads to the MMA's 16 rows in registers only: the
  padding costs tensor-core cycles, which decode has to spare, not bytes). Scales that change
  along K (block weights, grouped x) multiply each K step's partial product, which BLOCK_K
  keeps inside one block / group; scales that do not (channel, per row) multiply once at the
  end. float32 accumulation, bias added in float32, one rounding to the output dtype.

The grid: narrow N tiles (BLOCK_N 32 or 64) so one layer gives every SM of a 132-SM H100/H200
about two programs or more, each pipelining its loads over K (num_stages). Where N alone gives
too few tiles (o_proj and down_proj: N = 4096), SPLIT_K programs share a tile's K range and
write float32 partials into a workspace [SPLIT_K, M, N] that a second small kernel sums (then
scales, bias, rounding). A workspace rather than atomics: the sum's order is fixed (the same
bits every step, under CUDA graphs or not), the output needs no zeroing launch, and the
workspace is at most 16 x N x SPLIT_K floats beside an N x K byte weight.

Launch shapes come from `select_small_m_tiles` (reasoned rules from N, K and the SM count,
not yet swept on a GPU: `benchmarks/fp8_linear.py --sweep-small-m` does); `tiles=` overrides.
The interpreter (TRITON_INTERPRET=1) runs it on CPU tensors for the tests.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from pagedserve.quantization.fp8_format import FP8

# Rows up to this take this kernel (the linear method's branch; CUDA graphs fix M per captured
# size, so the branch is taken once per size). 16 is the MMA's row count: one row tile.
SMALL_M_MAX = 16
BLOCK_M = 16
# x's scale modes (constexpr): read as a float, one scale per row, one per K group.
X_FLOAT, X_PER_ROW, X_PER_GROUP = 0, 1, 2
# Programs per SM the rules aim for (two keep one loading while the other computes).
PROGRAMS_PER_SM = 2
# A split keeps at least this many K steps, so its pipeline fills.
MIN_STEPS_PER_SPLIT = 8
REDUCE_BLOCK_N = 128


@triton.jit
def _finish(acc, rows, cols, row_ok, col_ok, xs_ptr, stride_xsm, ws_ptr, bias_ptr,
            X_SCALE: tl.constexpr, W_BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr):
    """The scales that do not change along K, then the bias, all in float32."""
    if X_SCALE == 1:
        acc = acc * tl.load(xs_ptr + rows * stride_xsm, mask=row_ok, other=0.0)[:, None]
    if W_BLOCK_N == 0:
        acc = acc * tl.load(ws_ptr + cols, mask=col_ok, other=0.0)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _dot(a, b):
    if a.dtype == tl.float32:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _small_m_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, bias_ptr, out_ptr, M, N, K, k_per_split,
                    stride_xm, stride_xsm, stride_wn, stride_wsn, stride_om, stride_os,
                    X_SCALE: tl.constexpr, X_GROUP: tl.constexpr, W_BLOCK_N: tl.constexpr,
                    W_BLOCK_K: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
                    BLOCK_M_: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M_)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < M
    col_ok = cols < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    x_ptrs = x_ptr + rows[:, None] * stride_xm + (k_start + ks)[None, :]
    # W^T's tile [BLOCK_K, BLOCK_N], K contiguous in memory.
    w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k_start + ks)[:, None]
    acc = tl.zeros((BLOCK_M_, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        k_ok = ks < k_end - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if X_SCALE == 0:
            # x as it is, the codes in x's dtype (exact); float32 x (tests) sums in float32.
            a = x
            b = w.to(x.dtype)
        else:
            # FP8 x: both codes to fp16, exact (e4m3's range and subnormals fit fp16's).
            a = x.to(tl.float16)
            b = w.to(tl.float16)
        if W_BLOCK_N != 0:
            part = _dot(a, b) * tl.load(ws_ptr + (cols // W_BLOCK_N) * stride_wsn
                                        + k0 // W_BLOCK_K, mask=col_ok, other=0.0)[None, :]
            if X_SCALE == 2:
                part = part * tl.load(xs_ptr + rows * stride_xsm + k0 // X_GROUP, mask=row_ok,
                                      other=0.0)[:, None]
            acc += part
        elif X_SCALE == 2:
            acc += _dot(a, b) * tl.load(xs_ptr + rows * stride_xsm + k0 // X_GROUP, mask=row_ok,
                                        other=0.0)[:, None]
        else:
            acc += _dot(a, b)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:
        tl.store(out_ptr + pid_k * stride_os + rows[:, None] * stride_om + cols[None, :], acc,
                 mask=mask)
    else:
        acc = _finish(acc, rows, cols, row_ok, col_ok, xs_ptr, stride_xsm, ws_ptr, bias_ptr,
                      X_SCALE, W_BLOCK_N, HAS_BIAS)
        tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _reduce_splits_kernel(part_ptr, xs_ptr, ws_ptr, bias_ptr, out_ptr, M, N, splits,
                          stride_ps, stride_pm, stride_xsm, stride_om,
                          X_SCALE: tl.constexpr, W_BLOCK_N: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M_: tl.constexpr,
                          BLOCK_N: tl.constexpr):
    rows = tl.arange(0, BLOCK_M_)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    ptrs = part_ptr + rows[:, None] * stride_pm + cols[None, :]
    acc = tl.zeros((BLOCK_M_, BLOCK_N), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    acc = _finish(acc, rows, cols, row_ok, col_ok, xs_ptr, stride_xsm, ws_ptr, bias_ptr,
                  X_SCALE, W_BLOCK_N, HAS_BIAS)
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class SmallMTiles:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int


INTERPRETER_TILES = SmallMTiles(32, 32, 1, 1, 1)


@functools.lru_cache(maxsize=8)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=256)
def select_small_m_tiles(n: int, k: int, device: torch.device, sms: int | None = None
                         ) -> SmallMTiles:
    """Reasoned rules (M <= 16 only streams the weight, so M does not enter): BLOCK_N 64 where
    that still gives PROGRAMS_PER_SM programs per SM (gate_up), else 32; then split K until the
    programs reach that count, keeping MIN_STEPS_PER_SPLIT steps of 128 per split. 8B on 132
    SMs: qkv 192 tiles x 2, o 128 x 3, gate_up 448 x 1, down 128 x 3."""
    if device.type == "cpu":
        return INTERPRETER_TILES
    sms = sms or _sm_count(device.index if device.index is not None else 0)
    want = PROGRAMS_PER_SM * sms
    block_n = 64 if triton.cdiv(n, 64) >= want else 32
    block_k = 128
    tiles_n = triton.cdiv(n, block_n)
    split = 1
    if tiles_n < want:
        split = max(1, min(triton.cdiv(want, tiles_n),
                           triton.cdiv(k, block_k) // MIN_STEPS_PER_SPLIT))
    return SmallMTiles(block_n, block_k, split, 4, 4)


def small_m_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, *, block: tuple[int, int] | None = None,
                   x_scale: torch.Tensor | None = None, x_group: int | None = None,
                   out_dtype: torch.dtype | None = None, tiles: SmallMTiles | None = None
                   ) -> torch.Tensor:
    """x [M, K] (M <= SMALL_M_MAX; a float dtype, or e4m3 codes with `x_scale` [M, 1] or
    [M, ceil(K / G)], G = `x_group` (else inferred), a power of two >= 16) times the e4m3
    weight [N, K] with per-channel `weight_scale` (block None) or scales per `block` (Bn, Bk)
    -> [M, N] in `out_dtype` (default x's dtype; required for FP8 x), + bias."""
    m, k = x.shape
    n = weight.shape[0]
    if m > SMALL_M_MAX:
        raise ValueError(f"small_m_linear takes at most {SMALL_M_MAX} rows, got {m}")
    if weight.shape[1] != k or weight.dtype != FP8:
        raise ValueError(f"weight {tuple(weight.shape)} {weight.dtype} is not e4m3 [N, {k}]")
    t = tiles or select_small_m_tiles(n, k, x.device)
    block_k = t.block_k
    if block is None:
        w_block_n, w_block_k = 0, 1
        if weight_scale.numel() != n:
            raise ValueError(f"channel scale {tuple(weight_scale.shape)} for {n} rows")
        weight_scale = weight_scale.reshape(n)
    else:
        w_block_n, w_block_k = block
        if weight_scale.shape != (math.ceil(n / w_block_n), math.ceil(k / w_block_k)):
            raise ValueError(f"weight scale {tuple(weight_scale.shape)} does not cover a "
                             f"[{n}, {k}] weight in {w_block_n}x{w_block_k} blocks")
        block_k = _step_within(block_k, w_block_k, "weight block")
    if x.dtype == FP8:
        if x_scale is None or out_dtype is None:
            raise ValueError("FP8 x needs its scales and an output dtype")
        groups = x_scale.shape[1]
        if x_scale.shape[0] != m or (x_group and groups != math.ceil(k / x_group)):
            raise ValueError(f"x scale {tuple(x_scale.shape)} for {m} rows")
        x_mode, x_group = (X_PER_ROW, 1) if groups == 1 else (X_PER_GROUP, x_group)
        if x_mode == X_PER_GROUP:
            x_group = x_group or _group(k, groups)
            block_k = _step_within(block_k, x_group, "activation group")
        xs, stride_xsm = x_scale, x_scale.stride(0)
    else:
        x_mode, x_group, xs, stride_xsm = X_FLOAT, 1, weight_scale, 0  # xs unused
    out_dtype = out_dtype or x.dtype
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    steps = triton.cdiv(k, block_k)
    split = max(1, min(t.split_k, steps))
    k_per_split = triton.cdiv(steps, split) * block_k
    split = triton.cdiv(k, k_per_split)  # no empty split
    has_bias = bias is not None
    bias_arg = bias if has_bias else weight_scale
    common = dict(X_SCALE=x_mode, W_BLOCK_N=w_block_n, HAS_BIAS=has_bias, BLOCK_M_=BLOCK_M)
    grid = (triton.cdiv(n, t.block_n), split)
    target = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32,
                                                device=x.device)
    stride_os = 0 if split == 1 else target.stride(0)
    _small_m_kernel[grid](x, xs, weight, weight_scale, bias_arg, target, m, n, k, k_per_split,
                          x.stride(0), stride_xsm, weight.stride(0),
                          weight_scale.stride(0), target.stride(-2), stride_os,
                          X_GROUP=x_group, W_BLOCK_K=w_block_k, PARTIAL=split > 1,
                          BLOCK_N=t.block_n, BLOCK_K=block_k, num_warps=t.num_warps,
                          num_stages=t.num_stages, **common)
    if split > 1:
        _reduce_splits_kernel[(triton.cdiv(n, REDUCE_BLOCK_N),)](
            target, xs, weight_scale, bias_arg, out, m, n, split, target.stride(0),
            target.stride(1), stride_xsm, out.stride(0), BLOCK_N=REDUCE_BLOCK_N,
            num_warps=4, **common)
    return out


def _step_within(block_k: int, group: int, what: str) -> int:
    """A K step inside one scale group: BLOCK_K must divide it (both powers of two)."""
    if group < 16 or group & (group - 1):
        raise ValueError(f"{what} of {group} columns: the kernel steps by powers of two >= 16")
    return min(block_k, group)


def _group(k: int, groups: int) -> int:
    """The activation group that gives `groups` scales over K columns (a power of two)."""
    group = 16
    while math.ceil(k / group) > groups:
        group *= 2
    if math.ceil(k / group) != groups:
        raise ValueError(f"{groups} activation scales do not split {k} columns in powers of two")
    return group
