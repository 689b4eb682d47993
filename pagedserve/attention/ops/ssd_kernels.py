"""Triton kernels of the Mamba-2 (SSD) mixer's stateful part.

Layouts and math as in `attention.mamba.ssd_torch` (its ops are these kernels' reference): x
[T, H, P], dt [T, H], B and C [T, G, N], A, D and dt_bias [H], state [num_slots, H, P, N]; any
strides. Loads are upcast to float32 at once and all arithmetic is float32.

Kernel `_ssd_prefill_kernel` (prefill requests)
  grid:    (num_prefills, H, cdiv(P, BLOCK_P))
  form:    a walk over the request's tokens with the [BLOCK_P, N] state tile in registers,
           BLOCK_T tokens a step; each step is the SSD block form on tensor cores (three dots):
             y     = ((C B^T) * decay(l, s) masked to s <= l) @ (dt x)  +  exp(cum_l) C h^T
             h_new = exp(cum_last) h  +  (dt x * exp(cum_last - cum))^T @ B
           with cum the running sum of dt * A within the step. Tokens past the end get dt = 0
           (decay 1, nothing added), so h after the last step is the final state. B and C are
           read by every head of their group and every P block (no cross-program sharing).

Kernel `_ssd_decode_kernel` (decodes)
  grid:    (num_decodes, H, cdiv(P, BLOCK_P)); one step of the recurrence per request, state
           read, advanced and written back in one pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.attention.mamba.ssd_torch import DEFAULT_DT_LIMIT
from pagedserve.attention.ops.mamba_kernels import _softplus


@triton.jit
def _ssd_prefill_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_skip_ptr, dt_bias_ptr, state_ptr, out_ptr,
    qsl_ptr, slot_ptr, has_init_ptr,
    head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_dtt, stride_dth,
    stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn,
    stride_ss, stride_sh, stride_sp, stride_sn, stride_ot, stride_oh, stride_op,
    BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    group = head // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_T)
    p_mask = p < head_dim
    n_mask = n < state_size
    pn_mask = p_mask[:, None] & n_mask[None, :]
    causal = k[:, None] >= k[None, :]

    a = tl.load(a_ptr + head).to(tl.float32)
    d_skip = tl.load(d_skip_ptr + head).to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + head).to(tl.float32)
    state = (state_ptr + slot * stride_ss + head * stride_sh + p[:, None] * stride_sp
             + n[None, :] * stride_sn)
    h = tl.load(state, mask=pn_mask & has_init, other=0.0).to(tl.float32)  # [BLOCK_P, BLOCK_N]
    x_base = x_ptr + head * stride_xh + p[None, :] * stride_xp
    out_base = out_ptr + head * stride_oh + p[None, :] * stride_op
    b_base = b_ptr + group * stride_bg + n[None, :] * stride_bn
    c_base = c_ptr + group * stride_cg + n[None, :] * stride_cn

    for t0 in range(start, end, BLOCK_T):
        t = t0 + k
        t_mask = t < end
        t64 = t.to(tl.int64)[:, None]
        tp_mask = t_mask[:, None] & p_mask[None, :]
        tn_mask = t_mask[:, None] & n_mask[None, :]
        dt = tl.load(dt_ptr + t.to(tl.int64) * stride_dtt + head * stride_dth, mask=t_mask,
                     other=0.0).to(tl.float32)
        dt = tl.minimum(tl.maximum(_softplus(dt + dt_bias), dt_min), dt_max)
        dt = tl.where(t_mask, dt, 0.0)
        cum = tl.cumsum(dt * a, axis=0)  # [BLOCK_T]
        total = tl.sum(dt * a, axis=0)
        x = tl.load(x_base + t64 * stride_xt, mask=tp_mask, other=0.0).to(tl.float32)
        b = tl.load(b_base + t64 * stride_bt, mask=tn_mask, other=0.0).to(tl.float32)
        c = tl.load(c_base + t64 * stride_ct, mask=tn_mask, other=0.0).to(tl.float32)
        xdt = x * dt[:, None]  # [BLOCK_T, BLOCK_P]

        scores = tl.dot(c, tl.trans(b), input_precision=DOT_PRECISION)  # [BLOCK_T, BLOCK_T]
        # exp only where s <= l: above the diagonal the difference is positive and may overflow.
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        y = tl.dot(scores * decay, xdt, input_precision=DOT_PRECISION)
        y += tl.exp(cum)[:, None] * tl.dot(c, tl.trans(h), input_precision=DOT_PRECISION)
        y += d_skip * x
        tl.store(out_base + t64 * stride_ot, y.to(out_ptr.dtype.element_ty), mask=tp_mask)

        to_end = tl.exp(total - cum)  # [BLOCK_T]
        h = tl.exp(total) * h + tl.dot(tl.trans(xdt * to_end[:, None]), b,
                                       input_precision=DOT_PRECISION)
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=pn_mask)


@triton.jit
def _ssd_decode_kernel(
    x_ptr, dt_ptr, a_ptr, b_ptr, c_ptr, d_skip_ptr, dt_bias_ptr, state_ptr, out_ptr,
    slot_ptr, has_init_ptr,
    head_dim, state_size, heads_per_group, dt_min, dt_max,
    stride_xt, stride_xh, stride_xp, stride_dtt, stride_dth,
    stride_bt, stride_bg, stride_bn, stride_ct, stride_cg, stride_cn,
    stride_ss, stride_sh, stride_sp, stride_sn, stride_ot, stride_oh, stride_op,
    BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    row = req.to(tl.int64)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    group = head // heads_per_group
    p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_mask = p < head_dim
    n_mask = n < state_size
    pn_mask = p_mask[:, None] & n_mask[None, :]

    dt = tl.load(dt_ptr + row * stride_dtt + head * stride_dth).to(tl.float32)
    dt = _softplus(dt + tl.load(dt_bias_ptr + head).to(tl.float32))
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    a = tl.load(a_ptr + head).to(tl.float32)
    x = tl.load(x_ptr + row * stride_xt + head * stride_xh + p * stride_xp, mask=p_mask,
                other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + group * stride_bg + n * stride_bn, mask=n_mask,
                other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_ct + group * stride_cg + n * stride_cn, mask=n_mask,
                other=0.0).to(tl.float32)
    state = (state_ptr + slot * stride_ss + head * stride_sh + p[:, None] * stride_sp
             + n[None, :] * stride_sn)
    h = tl.load(state, mask=pn_mask & has_init, other=0.0).to(tl.float32)

    h = tl.exp(dt * a) * h + (dt * x)[:, None] * b[None, :]
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=pn_mask)
    y = tl.sum(h * c[None, :], axis=1) + tl.load(d_skip_ptr + head).to(tl.float32) * x
    tl.store(out_ptr + row * stride_ot + head * stride_oh + p * stride_op,
             y.to(out_ptr.dtype.element_ty), mask=p_mask)


def _strides(*tensors: torch.Tensor) -> list[int]:
    return [s for t in tensors for s in t.stride()]


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                   state: torch.Tensor, query_start_loc: torch.Tensor,
                   state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   chunk_size: int = 256,
                   dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT,
                   out: torch.Tensor | None = None, block_t: int = 32, block_p: int = 32,
                   num_warps: int = 4) -> torch.Tensor:
    """SSD scan of each prefill request's tokens from its saved state; writes each final state
    into its slot. Returns y [T, H, P] (into `out` if given). `chunk_size` is the model's; the
    result does not depend on it, the kernel steps min(block_t, chunk_size) tokens at a time."""
    out = torch.empty_like(x) if out is None else out
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    _, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    # tl.dot needs every tile side >= 16.
    block_t = max(16, min(block_t, triton.next_power_of_2(chunk_size)))
    block_p = max(16, min(block_p, triton.next_power_of_2(head_dim)))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_prefill_kernel[grid](
        x, dt, A, B, C, D, dt_bias, state, out, query_start_loc, state_indices,
        has_initial_state, head_dim, state_size, num_heads // num_groups,
        float(dt_limit[0]), float(dt_limit[1]), *_strides(x, dt, B, C, state, out),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_N=max(16, triton.next_power_of_2(state_size)),
        # float32 models get full-precision dots; tf32 is already finer than bf16 inputs.
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=num_warps)
    return out


def ssd_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor,
                     dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT,
                     out: torch.Tensor | None = None, block_p: int = 32) -> torch.Tensor:
    """One decode token per request (x [B, H, P], dt [B, H], B, C [B, G, N]): advance each
    slot's state one step. Returns y [B, H, P] (into `out` if given)."""
    out = torch.empty_like(x) if out is None else out
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    _, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    block_p = min(block_p, triton.next_power_of_2(head_dim))
    grid = (num_reqs, num_heads, triton.cdiv(head_dim, block_p))
    _ssd_decode_kernel[grid](
        x, dt, A, B, C, D, dt_bias, state, out, state_indices, has_initial_state,
        head_dim, state_size, num_heads // num_groups, float(dt_limit[0]), float(dt_limit[1]),
        *_strides(x, dt, B, C, state, out),
        BLOCK_P=block_p, BLOCK_N=triton.next_power_of_2(state_size))
    return out
