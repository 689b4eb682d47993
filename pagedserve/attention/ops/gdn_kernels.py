"""Triton kernels of the gated delta rule (Qwen3-Next's gated delta net), the GDN state path on
CUDA; the math, layouts and calling convention are `attention.linear.gdn_torch`'s, which is
also their reference.

Kernel `_gated_delta_rule_kernel` (prefills, and decodes with DECODE=True)
  form:    recurrent over tokens, not chunked: each program walks its request's tokens in order,
           one step of the recurrence per token.
  grid:    (num_reqs, H, cdiv(Dv, BLOCK_V))
  tiling:  the state tile [Dk, BLOCK_V] (all of Dk: the delta rule reads S^T k over all of it,
           and the L2 norms need all of q and k) stays in float32 registers from the slot's load
           to its store; the columns of S along Dv evolve independently, so Dv splits across
           programs. A request without an initial state loads nothing (its slot may hold
           garbage) and starts from zeros.
Loads are upcast to float32 at once; q and k are L2-normalised in the kernel (eps 1e-6 inside
the root, as the torch op) unless use_qk_l2norm=False, and q is scaled by 1/sqrt(Dk).
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


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("gated delta rule kernels need unit stride along head dims")


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
            beta: torch.Tensor, state: torch.Tensor, query_start_loc: torch.Tensor | None,
            state_indices: torch.Tensor, has_initial_state: torch.Tensor, use_qk_l2norm: bool,
            out: torch.Tensor | None, block_v: int, num_warps: int) -> torch.Tensor:
    num_heads, head_k_dim = q.shape[1], q.shape[2]
    head_v_dim = v.shape[2]
    out = torch.empty_like(v) if out is None else out
    _check_unit_stride(q, k, v, state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    grid = (num_reqs, num_heads, triton.cdiv(head_v_dim, block_v))
    decode = query_start_loc is None
    _gated_delta_rule_kernel[grid](
        q, k, v, g, beta, state, out, state_indices if decode else query_start_loc,
        state_indices, has_initial_state, head_k_dim, head_v_dim, head_k_dim ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        DECODE=decode, L2NORM=use_qk_l2norm, EPS=L2NORM_EPS,
        BLOCK_K=triton.next_power_of_2(head_k_dim), BLOCK_V=block_v, num_warps=num_warps)
    return out


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                           has_initial_state: torch.Tensor, chunk_size: int = 64, *,
                           max_query_len: int | None = None, use_qk_l2norm: bool = True,
                           out: torch.Tensor | None = None, block_v: int = 32,
                           num_warps: int = 4) -> torch.Tensor:
    """Prefill, as `gdn_torch.chunk_gated_delta_rule` (q, k [T, H, Dk], v [T, H, Dv], g, beta
    [T, H]; state [num_slots, H, Dk, Dv] float32, final states written back). The kernel walks
    the tokens one by one: `chunk_size` and `max_query_len` are accepted for the torch op's
    signature and unused. Returns o [T, H, Dv] (into `out` if given)."""
    return _launch(q, k, v, g, beta, state, query_start_loc, state_indices, has_initial_state,
                   use_qk_l2norm, out, block_v, num_warps)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor, has_initial_state: torch.Tensor, *,
                               use_qk_l2norm: bool = True, out: torch.Tensor | None = None,
                               block_v: int = 32, num_warps: int = 4) -> torch.Tensor:
    """Decode: one token per request (q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]), each
    state slot advanced one step. Returns o [B, H, Dv] (into `out` if given)."""
    return _launch(q, k, v, g, beta, state, None, state_indices, has_initial_state,
                   use_qk_l2norm, out, block_v, num_warps)
