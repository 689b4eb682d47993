"""Triton kernels of the gated delta rule (Qwen3-Next's gated delta net), the GDN state path on
CUDA; the math, layouts and calling convention are `attention.linear.gdn_torch`'s, which is
also their reference.

Kernel `_chunked_gated_delta_rule_kernel` (prefills)
  form:    chunked (the WY / UT form of the torch op): each program walks its request's tokens
           CHUNK at a time. Per chunk, with G the running sum of g and A_ij = beta_i k_i.k_j
           exp(G_i - G_j) (j < i), the inverse T = (I + A)^-1 is built row by row (forward
           substitution in registers, CHUNK steps over a [CHUNK, CHUNK] tile); then
           U = T (beta v), W = T (beta k exp(G)), the corrected values U - W S, the outputs
           (q exp(G)) S + (q k^T * exp(G_i - G_j), j <= i) (U - W S) and the new state
           exp(G_last) S + (k exp(G_last - G))^T (U - W S) are tl.dots.
  grid:    (num_prefills, H, cdiv(Dv, BLOCK_V))
  tiling:  the state tile [Dk, BLOCK_V] stays in float32 registers across the chunks (all of
           Dk: S^T k and the L2 norms need all of it; the columns of S along Dv evolve
           independently, so Dv splits across programs, each recomputing the chunk's T and W).
           Padding rows of the last chunk load zeros (g = 0, beta = 0): they neither decay nor
           write. Float32 inputs use IEEE float32 dots; bf16/fp16 inputs use tf32.

Kernel `_gated_delta_rule_kernel` (decodes with DECODE=True; prefills token by token otherwise,
kept as the simplest form and a cross-check of the chunked one)
  form:    recurrent over tokens: one step of the recurrence per token.
  grid:    (num_reqs, H, cdiv(Dv, BLOCK_V)), the same state tile in registers.

Both: a request without an initial state loads nothing (its slot may hold garbage) and starts
from zeros. Loads are upcast to float32 at once; q and k are L2-normalised in the kernel (eps
1e-6 inside the root, as the torch op) unless use_qk_l2norm=False, and q is scaled by
1/sqrt(Dk).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

L2NORM_EPS = 1e-6


@triton.jit
def _gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, has_init_ptr,
    head_k_dim, head_v_dim, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    DECODE: tl.constexpr, L2NORM: tl.constexpr, EPS: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    if DECODE:
        start = req
        end = req + 1
    else:
        start = tl.load(qsl_ptr + req)
        end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = kk < head_k_dim
    v_mask = vv < head_v_dim
    kv_mask = k_mask[:, None] & v_mask[None, :]

    tile = state_ptr + slot * stride_ss + head * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s = tl.load(tile, mask=kv_mask & has_init, other=0.0).to(tl.float32)
    for t in range(start, end):
        t64 = tl.cast(t, tl.int64)
        q = tl.load(q_ptr + t64 * stride_qt + head * stride_qh + kk, mask=k_mask,
                    other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64 * stride_kt + head * stride_kh + kk, mask=k_mask,
                    other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64 * stride_vt + head * stride_vh + vv, mask=v_mask,
                    other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + head * stride_gh).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + head * stride_bh).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=0) + EPS)
            k = k * tl.rsqrt(tl.sum(k * k, axis=0) + EPS)
        q = q * scale
        s = s * tl.exp(g)
        delta = beta * (v - tl.sum(s * k[:, None], axis=0))  # the part of v S does not predict
        s = s + k[:, None] * delta[None, :]
        o = tl.sum(s * q[:, None], axis=0)
        tl.store(out_ptr + t64 * stride_ot + head * stride_oh + vv,
                 o.to(out_ptr.dtype.element_ty), mask=v_mask)
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _chunked_gated_delta_rule_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, has_init_ptr,
    head_k_dim, head_v_dim, scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_gt, stride_gh, stride_bt, stride_bh,
    stride_ss, stride_sh, stride_sk, stride_ot, stride_oh,
    L2NORM: tl.constexpr, EPS: tl.constexpr, CHUNK: tl.constexpr,
    BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    kk = tl.arange(0, BLOCK_K)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    k_mask = kk < head_k_dim
    v_mask = vv < head_v_dim
    kv_mask = k_mask[:, None] & v_mask[None, :]
    rows = tl.arange(0, CHUNK)
    lower = rows[:, None] > rows[None, :]
    causal = rows[:, None] >= rows[None, :]
    eye = (rows[:, None] == rows[None, :]).to(tl.float32)

    tile = state_ptr + slot * stride_ss + head * stride_sh + kk[:, None] * stride_sk + vv[None, :]
    s = tl.load(tile, mask=kv_mask & has_init, other=0.0).to(tl.float32)
    for chunk_start in range(start, end, CHUNK):
        t = chunk_start + rows
        t_mask = t < end
        t64 = t.to(tl.int64)
        tk_mask = t_mask[:, None] & k_mask[None, :]
        tv_mask = t_mask[:, None] & v_mask[None, :]
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head * stride_qh + kk[None, :],
                    mask=tk_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64[:, None] * stride_kt + head * stride_kh + kk[None, :],
                    mask=tk_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64[:, None] * stride_vt + head * stride_vh + vv[None, :],
                    mask=tv_mask, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + t64 * stride_gt + head * stride_gh, mask=t_mask,
                    other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + t64 * stride_bt + head * stride_bh, mask=t_mask,
                       other=0.0).to(tl.float32)
        if L2NORM:
            q = q * tl.rsqrt(tl.sum(q * q, axis=1) + EPS)[:, None]
            k = k * tl.rsqrt(tl.sum(k * k, axis=1) + EPS)[:, None]
        q = q * scale
        cum = tl.cumsum(g, axis=0)
        gap = cum[:, None] - cum[None, :]
        # exp(G_i - G_j) only where j <= i: -inf first, so no positive gap reaches the exp.
        decay = tl.exp(tl.where(causal, gap, float("-inf")))
        k_beta = k * beta[:, None]
        a = tl.where(lower, tl.dot(k_beta, tl.trans(k), input_precision=PRECISION) * decay, 0.0)
        # T = (I + A)^-1 by forward substitution: row i of T is e_i - sum_{j<i} A_ij T_j, and
        # rows not yet reached are still zero, so the full row of A can be used.
        inv = tl.zeros((CHUNK, CHUNK), dtype=tl.float32)
        for i in tl.static_range(CHUNK):
            a_row = tl.sum(tl.where(rows[:, None] == i, a, 0.0), axis=0)  # A[i, :]
            e_row = tl.sum(tl.where(rows[:, None] == i, eye, 0.0), axis=0)
            inv_row = e_row - tl.sum(a_row[:, None] * inv, axis=0)
            inv = tl.where(rows[:, None] == i, inv_row[None, :], inv)
        u = tl.dot(inv, v * beta[:, None], input_precision=PRECISION)
        w = tl.dot(inv, k_beta * tl.exp(cum)[:, None], input_precision=PRECISION)
        corrected = u - tl.dot(w, s, input_precision=PRECISION)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * decay
        o = tl.dot(q * tl.exp(cum)[:, None], s, input_precision=PRECISION)
        o += tl.dot(scores, corrected, input_precision=PRECISION)
        tl.store(out_ptr + t64[:, None] * stride_ot + head * stride_oh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tv_mask)
        total = tl.sum(g, axis=0)  # G at the chunk's last real token (padding has g = 0)
        k_to_end = k * tl.exp(total - cum)[:, None]
        s = s * tl.exp(total) + tl.dot(tl.trans(k_to_end), corrected, input_precision=PRECISION)
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=kv_mask)


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("gated delta rule kernels need unit stride along head dims")


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor | None,
            state_indices: torch.Tensor, has_initial_state: torch.Tensor, use_qk_l2norm: bool,
            out: torch.Tensor | None, block_v: int, num_warps: int,
            chunk_size: int | None) -> torch.Tensor:
    """chunk_size None: the token-by-token kernel (a decode when query_start_loc is None)."""
    num_heads, head_k_dim = q.shape[1], q.shape[2]
    head_v_dim = v.shape[2]
    out = torch.empty_like(v) if out is None else out
    _check_unit_stride(q, k, v, state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    block_k = triton.next_power_of_2(head_k_dim)
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    decode = query_start_loc is None
    common = (q, k, v, g, beta, state, out, state_indices if decode else query_start_loc,
              state_indices, has_initial_state, head_k_dim, head_v_dim, head_k_dim ** -0.5,
              q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
              g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
              state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1))
    if chunk_size is None:
        grid = (num_reqs, num_heads, triton.cdiv(head_v_dim, block_v))
        _gated_delta_rule_kernel[grid](
            *common, DECODE=decode, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, BLOCK_K=block_k,
            BLOCK_V=block_v, num_warps=num_warps)
        return out
    # tl.dot wants every dimension >= 16.
    block_k, block_v = max(block_k, 16), max(block_v, 16)
    grid = (num_reqs, num_heads, triton.cdiv(head_v_dim, block_v))
    _chunked_gated_delta_rule_kernel[grid](
        *common, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS, CHUNK=chunk_size, BLOCK_K=block_k,
        BLOCK_V=block_v, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps)
    return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                           has_initial_state: torch.Tensor, chunk_size: int = 32, *,
                           max_query_len: int | None = None, use_qk_l2norm: bool = True,
                           out: torch.Tensor | None = None, block_v: int = 32,
                           num_warps: int = 4, token_by_token: bool = False) -> torch.Tensor:
    """Prefill, as `gdn_torch.chunk_gated_delta_rule` (q, k [T, H, Dk], v [T, H, Dv], g, beta
    [T, H]; state [num_slots, H, Dk, Dv] float32, final states written back). `chunk_size`
    (a power of two, >= 16) is the chunked kernel's; `token_by_token` runs the recurrent
    kernel instead. `max_query_len` is accepted for the torch op's signature and unused.
    Returns o [T, H, Dv] (into `out` if given)."""
    return _launch(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
                   use_qk_l2norm, out, block_v, num_warps,
                   None if token_by_token else chunk_size)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor, has_initial_state: torch.Tensor, *,
                               use_qk_l2norm: bool = True, out: torch.Tensor | None = None,
                               block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Decode: one token per request (q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]), each
    state slot advanced one step. Returns o [B, H, Dv] (into `out` if given)."""
    return _launch(q, k, v, g, beta, state, None, state_indices, has_initial_state,
                   use_qk_l2norm, out, block_v, num_warps, None)
