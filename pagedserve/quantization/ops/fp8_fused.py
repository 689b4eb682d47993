"""The kernels that produce a projection's input, emitting it in FP8 with its scales: the
activation never goes through memory in 16 bits and its quantization costs no launch of its
own (FlashRT's `residual_add_rms_norm_fp8` family is the model).

- `rms_norm_fp8`: [T, N] (+ residual, updated in place to the sum) -> RMSNorm * weight,
  rounded to the model dtype as the unfused norm rounds, then quantized to e4m3 per token
  (`group` = None: one scale per row) or per 1 x group (the block GEMM's activation groups).
  One program per token, the whole row in registers (as `models/layer_kernels.py`'s norm).
- `silu_and_mul_fp8`: [T, 2I] (gate | up) -> silu(gate) * up, rounded to the model dtype,
  quantized the same way. Per group: one program per (token, group); per token: one program
  per token in two passes over the row (the maximum, then the codes; the product is
  recomputed rather than stored).

Both return an `Fp8Activation` that the FP8 linear method consumes as it is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-10


@dataclass
class Fp8Activation:
    """A projection's input already in FP8: codes [T, K] and float32 scales [T, ceil(K / group)]
    (group = K: one per token). `dtype` is the model's, for the product's output."""

    q: torch.Tensor
    scale: torch.Tensor
    group: int
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.q.shape


@triton.jit
def _rms_norm_fp8_kernel(x_ptr, res_ptr, w_ptr, q_ptr, s_ptr, stride_x, stride_r, stride_q,
                         num_groups, eps, N: tl.constexpr, BLOCK: tl.constexpr,
                         GROUP: tl.constexpr, ADD: tl.constexpr, FP8_MAX_: tl.constexpr,
                         MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        z = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, z, mask=ok)
    else:
        z = x
    z32 = z.to(tl.float32)
    normed = (z32 * tl.rsqrt(tl.sum(z32 * z32, 0) / N + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype).to(tl.float32)
    y = tl.where(ok, y, 0.0)
    groups = tl.reshape(y, (BLOCK // GROUP, GROUP))
    scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_MAX_, MIN_SCALE_)
    q = tl.clamp(groups / scale[:, None], -FP8_MAX_, FP8_MAX_)
    tl.store(q_ptr + row * stride_q + cols, tl.reshape(q, (BLOCK,)).to(q_ptr.dtype.element_ty),
             mask=ok)
    g = tl.arange(0, BLOCK // GROUP)
    tl.store(s_ptr + row * num_groups + g, scale, mask=g < num_groups)


def rms_norm_fp8(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, group: int | None) -> Fp8Activation:
    """See the module's docstring; `group` a power of two, or None for per token."""
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm_fp8 needs rows with contiguous channels")
    t, n = x.shape
    block = max(triton.next_power_of_2(n), group or 1)
    g = block if group is None else group
    if block % g:
        raise ValueError(f"group {g} does not divide the row's padded width {block}")
    groups = 1 if group is None else math.ceil(n / g)
    q = torch.empty((t, n), dtype=FP8, device=x.device)
    s = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    res = x if residual is None else residual
    if t:
        _rms_norm_fp8_kernel[(t,)](x, res, weight, q, s, x.stride(0), res.stride(0), q.stride(0),
                                   groups, eps, N=n, BLOCK=block, GROUP=g,
                                   ADD=residual is not None, FP8_MAX_=FP8_MAX,
                                   MIN_SCALE_=MIN_SCALE, num_warps=min(16, max(1, block // 256)))
    return Fp8Activation(q, s, n if group is None else group, x.dtype)


@triton.jit
def _silu_mul(x_ptr, row, stride_x, cols, ok, N: tl.constexpr):
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    y = (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype).to(tl.float32)
    return tl.where(ok, y, 0.0)


@triton.jit
def _silu_mul_fp8_group_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, num_groups,
                               N: tl.constexpr, GROUP: tl.constexpr, FP8_MAX_: tl.constexpr,
                               MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    ok = cols < N
    y = _silu_mul(x_ptr, row, stride_x, cols, ok, N)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX_, MIN_SCALE_)
    q = tl.clamp(y / scale, -FP8_MAX_, FP8_MAX_)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row * num_groups + group, scale)


@triton.jit
def _silu_mul_fp8_token_kernel(x_ptr, q_ptr, s_ptr, stride_x, stride_q, N: tl.constexpr,
                               CHUNK: tl.constexpr, FP8_MAX_: tl.constexpr,
                               MIN_SCALE_: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    amax = tl.zeros((CHUNK,), dtype=tl.float32)
    for start in range(0, N, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        amax = tl.maximum(amax, tl.abs(_silu_mul(x_ptr, row, stride_x, cols, cols < N, N)))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_, MIN_SCALE_)
    for start in range(0, N, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        ok = cols < N
        q = tl.clamp(_silu_mul(x_ptr, row, stride_x, cols, ok, N) / scale, -FP8_MAX_, FP8_MAX_)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + row, scale)


def silu_and_mul_fp8(x: torch.Tensor, group: int | None) -> Fp8Activation:
    """See the module's docstring; `group` a power of two, or None for per token."""
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul_fp8 needs contiguous rows")
    t, two_n = x.shape
    n = two_n // 2
    groups = 1 if group is None else math.ceil(n / group)
    q = torch.empty((t, n), dtype=FP8, device=x.device)
    s = torch.empty((t, groups), dtype=torch.float32, device=x.device)
    if t and group is None:
        chunk = min(1024, triton.next_power_of_2(n))
        _silu_mul_fp8_token_kernel[(t,)](x, q, s, x.stride(0), q.stride(0), N=n, CHUNK=chunk,
                                         FP8_MAX_=FP8_MAX, MIN_SCALE_=MIN_SCALE, num_warps=4)
    elif t:
        _silu_mul_fp8_group_kernel[(t, groups)](x, q, s, x.stride(0), q.stride(0), groups,
                                                N=n, GROUP=group, FP8_MAX_=FP8_MAX,
                                                MIN_SCALE_=MIN_SCALE, num_warps=4)
    return Fp8Activation(q, s, n if group is None else group, x.dtype)
