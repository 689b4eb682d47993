"""Triton kernels of lightning attention (MiniMax-Text-01's linear attention), the lightning
state path on CUDA; the math, layouts and calling convention are
`attention.linear.lightning_torch`'s, which is also their reference.

Kernel `_lightning_prefill_kernel` (prefills)
  form:    block-wise, as transformers' layer: per block of BLOCK_T tokens the intra-block part
           is (q k^T * exp(-s(i-j)), j <= i) v, the inter-block part reads the carried state
           with each query decayed by exp(-s(i+1)), and the state then decays by exp(-s n) and
           gains sum_j exp(-s(n-1-j)) k_j v_j^T (n: the block's real tokens, so a request's
           last, partial block decays the state by its own length only).
  grid:    (num_prefills, H, cdiv(Dv, BLOCK_V))
  tiling:  the state tile [D, BLOCK_V] stays in float32 registers across the request's blocks;
           the three products are tl.dots over [BLOCK_T, D] / [BLOCK_T, BLOCK_V] tiles.
           Float32 inputs use IEEE float32 dots (tf32 would cost the float32 path its
           accuracy); bf16/fp16 inputs, already coarser, use tf32.

Kernel `_lightning_decode_kernel` (decodes)
  grid:    (num_decodes, H, cdiv(Dv, BLOCK_V)); S = exp(-s) S + k v^T, o = S^T q.
A request without an initial state loads nothing from its slot and starts from zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _lightning_prefill_kernel(
    q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, has_init_ptr,
    head_dim, head_v_dim,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ss, stride_sh, stride_sd, stride_ot, stride_oh,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    rate = tl.load(slope_ptr + head).to(tl.float32)
    dd = tl.arange(0, BLOCK_D)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_mask = dd < head_dim
    v_mask = vv < head_v_dim
    i = tl.arange(0, BLOCK_T)
    pos = i.to(tl.float32)
    gap = pos[:, None] - pos[None, :]  # i - j
    # exp(-s(i-j)) on and below the diagonal, 0 above it.
    intra_decay = tl.exp(tl.where(gap >= 0, -rate * gap, float("-inf")))
    q_decay = tl.exp(-rate * (pos + 1.0))

    tile = (state_ptr + slot * stride_ss + head * stride_sh + dd[:, None] * stride_sd
            + vv[None, :])
    s = tl.load(tile, mask=d_mask[:, None] & v_mask[None, :] & has_init, other=0.0)
    s = s.to(tl.float32)
    for block_start in range(start, end, BLOCK_T):
        t = block_start + i
        t_mask = t < end
        t64 = t.to(tl.int64)
        n = tl.minimum(end - block_start, BLOCK_T).to(tl.float32)
        td_mask = t_mask[:, None] & d_mask[None, :]
        tv_mask = t_mask[:, None] & v_mask[None, :]
        q = tl.load(q_ptr + t64[:, None] * stride_qt + head * stride_qh + dd[None, :],
                    mask=td_mask, other=0.0).to(tl.float32)
        k = tl.load(k_ptr + t64[:, None] * stride_kt + head * stride_kh + dd[None, :],
                    mask=td_mask, other=0.0).to(tl.float32)
        v = tl.load(v_ptr + t64[:, None] * stride_vt + head * stride_vh + vv[None, :],
                    mask=tv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * intra_decay
        o = tl.dot(q * q_decay[:, None], s, input_precision=PRECISION)
        o += tl.dot(scores, v, input_precision=PRECISION)
        tl.store(out_ptr + t64[:, None] * stride_ot + head * stride_oh + vv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=tv_mask)
        # Padding rows have k = 0; `where` keeps their exp(+...) from meeting it.
        k_decay = tl.where(t_mask, tl.exp(-rate * (n - 1.0 - pos)), 0.0)
        s = s * tl.exp(-rate * n) + tl.dot(tl.trans(k * k_decay[:, None]), v,
                                           input_precision=PRECISION)
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=d_mask[:, None] & v_mask[None, :])


@triton.jit
def _lightning_decode_kernel(
    q_ptr, k_ptr, v_ptr, slope_ptr, state_ptr, out_ptr, slot_ptr, has_init_ptr,
    head_dim, head_v_dim,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_ss, stride_sh, stride_sd, stride_ot, stride_oh,
    BLOCK_D: tl.constexpr, BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    rate = tl.load(slope_ptr + head).to(tl.float32)
    dd = tl.arange(0, BLOCK_D)
    vv = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    d_mask = dd < head_dim
    v_mask = vv < head_v_dim
    dv_mask = d_mask[:, None] & v_mask[None, :]
    row = req.to(tl.int64)

    tile = (state_ptr + slot * stride_ss + head * stride_sh + dd[:, None] * stride_sd
            + vv[None, :])
    s = tl.load(tile, mask=dv_mask & has_init, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + row * stride_qt + head * stride_qh + dd, mask=d_mask,
                other=0.0).to(tl.float32)
    k = tl.load(k_ptr + row * stride_kt + head * stride_kh + dd, mask=d_mask,
                other=0.0).to(tl.float32)
    v = tl.load(v_ptr + row * stride_vt + head * stride_vh + vv, mask=v_mask,
                other=0.0).to(tl.float32)
    s = s * tl.exp(-rate) + k[:, None] * v[None, :]
    tl.store(tile, s.to(state_ptr.dtype.element_ty), mask=dv_mask)
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(out_ptr + row * stride_ot + head * stride_oh + vv, o.to(out_ptr.dtype.element_ty),
             mask=v_mask)


def _check_unit_stride(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("lightning attention kernels need unit stride along head dims")


def lightning_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                slope: torch.Tensor, state: torch.Tensor,
                                query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                                has_initial_state: torch.Tensor, block_size: int = 64, *,
                                max_query_len: int | None = None,
                                out: torch.Tensor | None = None, block_v: int = 32,
                                num_warps: int = 8) -> torch.Tensor:
    """Prefill, as `lightning_torch.lightning_attention_prefill` (q, k [T, H, D], v [T, H, Dv],
    slope [H]; state [num_slots, H, D, Dv] float32, final states written back). `block_size`
    is the kernel's token block (a power of two, >= 16); `max_query_len` is accepted for the
    torch op's signature and unused. Returns o [T, H, Dv] (into `out` if given)."""
    out = torch.empty_like(v) if out is None else out
    _check_unit_stride(q, k, v, state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    num_heads, head_dim, head_v_dim = q.shape[1], q.shape[2], v.shape[2]
    block_v = max(16, min(block_v, triton.next_power_of_2(head_v_dim)))
    grid = (num_reqs, num_heads, triton.cdiv(head_v_dim, block_v))
    _lightning_prefill_kernel[grid](
        q, k, v, slope, state, out, query_start_loc, state_indices, has_initial_state,
        head_dim, head_v_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BLOCK_T=block_size, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_V=block_v, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps)
    return out


def lightning_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               slope: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor, has_initial_state: torch.Tensor, *,
                               out: torch.Tensor | None = None,
                               block_v: int = 32) -> torch.Tensor:
    """Decode: one token per request (q, k [B, H, D], v [B, H, Dv]), each state slot advanced
    one step. Returns o [B, H, Dv] (into `out` if given)."""
    out = torch.empty_like(v) if out is None else out
    _check_unit_stride(q, k, v, state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    num_heads, head_dim, head_v_dim = q.shape[1], q.shape[2], v.shape[2]
    block_v = min(block_v, triton.next_power_of_2(head_v_dim))
    grid = (num_reqs, num_heads, triton.cdiv(head_v_dim, block_v))
    _lightning_decode_kernel[grid](
        q, k, v, slope, state, out, state_indices, has_initial_state, head_dim, head_v_dim,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        state.stride(0), state.stride(1), state.stride(2), out.stride(0), out.stride(1),
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_V=block_v)
    return out
