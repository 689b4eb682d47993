"""Fused Triton kernels for a decoder layer's elementwise steps (CUDA, 16-bit models).

Unfused, a Llama layer spends ~30 small kernels on RMSNorm, the residual add, rotary embedding
and SiLU-and-mul; in a batch-128 decode step of an 8B model those launches cost more than a
millisecond. Each kernel here replaces one chain and rounds to the model dtype at exactly the
points where transformers' eager code does, so its results equal the torch path's (up to the
order of the float32 sum of squares in the norm):

- `fused_add_rms_norm`: z = dt(x + residual); out = dt(weight * dt(z * rsqrt(mean(z^2) + eps)))
  with the statistics in float32; `rms_norm` is the same without the residual.
- `rotary_embedding_`: in place on strided q/k views (a split of the fused qkv output), rotate-
  half convention: (x1, x2) -> (dt(dt(x1 c) - dt(x2 s)), dt(dt(x2 c) + dt(x1 s))).
- `silu_and_mul`: [T, 2I] (gate | up) -> dt(dt(silu(gate)) * up), silu in float32.

Grids: one program per token (norm, rotary: all heads of the token) or per (token, column
block) (silu). Float32 models keep the torch path (`layers.fused_kernels` decides), so CPU and
float32 results match transformers op for op. Importing this module imports triton: only
`models/layers.py` does, on first use on CUDA.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, w_ptr, stride_x, stride_r, stride_o, eps,
                     N: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    if ADD:
        z = (x.to(tl.float32) + tl.load(res_ptr + row * stride_r + cols, mask=ok,
                                        other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(res_ptr + row * stride_r + cols, z, mask=ok)  # the new residual stream
    else:
        z = x
    z32 = z.to(tl.float32)
    normed = (z32 * tl.rsqrt(tl.sum(z32 * z32, 0) / N + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * stride_o + cols,
             (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=ok)


def _norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
          eps: float) -> torch.Tensor:
    if x.stride(-1) != 1 or (residual is not None and residual.stride(-1) != 1):
        raise ValueError("rms_norm needs rows with contiguous channels")
    n = x.shape[-1]
    out = torch.empty_like(x)
    block = triton.next_power_of_2(n)
    res = x if residual is None else residual
    _rms_norm_kernel[(x.shape[0],)](
        x, res, out, weight, x.stride(0), res.stride(0), out.stride(0), eps, N=n, BLOCK=block,
        ADD=residual is not None, num_warps=min(16, max(1, block // 256)))
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, N] -> RMSNorm(x) * weight, in x's dtype."""
    return _norm(x, None, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x + residual) * weight, x + residual); `residual` is updated in place to the
    sum (the layer's residual stream) and returned as the second value."""
    return _norm(x, residual, weight, eps), residual


@triton.jit
def _rotate_heads(base, tok, stride_t, stride_h, cos, sin, heads,
                  HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    h = tl.arange(0, HEADS_PAD)
    d = tl.arange(0, HALF_PAD)
    ok = (h < heads)[:, None] & (d < HALF)[None, :]
    p1 = base + tok * stride_t + h[:, None] * stride_h + d[None, :]
    x1 = tl.load(p1, mask=ok, other=0.0)
    x2 = tl.load(p1 + HALF, mask=ok, other=0.0)
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    # Each product rounds to the model dtype before the sum, as in transformers.
    a = (x1 * cos).to(dt).to(tl.float32)
    b = (x2 * sin).to(dt).to(tl.float32)
    c = (x2 * cos).to(dt).to(tl.float32)
    e = (x1 * sin).to(dt).to(tl.float32)
    tl.store(p1, (a - b).to(dt), mask=ok)
    tl.store(p1 + HALF, (c + e).to(dt), mask=ok)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, cos_sin_ptr, pos_ptr, stride_qt, stride_qh, stride_kt,
                   stride_kh, stride_cs, NUM_Q: tl.constexpr, NUM_K: tl.constexpr,
                   HALF: tl.constexpr, HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    d = tl.arange(0, HALF_PAD)
    d_ok = d < HALF
    cos = tl.load(cos_sin_ptr + pos * stride_cs + d, mask=d_ok, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, tok, stride_qt, stride_qh, cos[None, :], sin[None, :], NUM_Q, HALF,
                  HEADS_PAD, HALF_PAD)
    _rotate_heads(k_ptr, tok, stride_kt, stride_kh, cos[None, :], sin[None, :], NUM_K, HALF,
                  HEADS_PAD, HALF_PAD)


def rotary_embedding_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> None:
    """Rotate query [T, H, D] and key [T, Hkv, D] in place (rotate-half) by the rows
    `positions` [T] of cos_sin_cache [P, D] (cos | sin halves, in the model dtype). The last dim
    must be contiguous; token and head strides are free."""
    t, num_q, head = query.shape
    num_k = key.shape[1]
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("rotary_embedding_ needs contiguous head channels")
    if t == 0:
        return
    half = head // 2
    _rotary_kernel[(t,)](
        query, key, cos_sin_cache, positions, query.stride(0), query.stride(1), key.stride(0),
        key.stride(1), cos_sin_cache.stride(0), NUM_Q=num_q, NUM_K=num_k, HALF=half,
        HEADS_PAD=triton.next_power_of_2(max(num_q, num_k)),
        HALF_PAD=triton.next_power_of_2(half), num_warps=4)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, N: tl.constexpr,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=ok, other=0.0)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype)
    tl.store(out_ptr + row * stride_o + cols,
             (act.to(tl.float32) * up.to(tl.float32)).to(gate.dtype), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]."""
    t, two_n = x.shape
    n = two_n // 2
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if x.stride(-1) != 1:
        raise ValueError("silu_and_mul needs contiguous rows")
    block = min(1024, triton.next_power_of_2(n))
    _silu_and_mul_kernel[(t, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), N=n,
                                                     BLOCK=block, num_warps=4)
    return out
