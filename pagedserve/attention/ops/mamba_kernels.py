"""Triton kernels of the Mamba-1 mixer's stateful part (the MAMBA backend on CUDA).

Layouts as in `attention.mamba.torch_ops`: packed tokens [T, ...] (any row stride, unit channel
stride is not required), `conv_state` [num_slots, d, K - 1], `ssm_state` [num_slots, d, N],
per request `query_start_loc` (token offsets), `state_indices` and `has_initial_state`.
Loads are upcast to float32 at once (bf16 arithmetic is also broken in the interpreter).

Kernel `_causal_conv1d_kernel` (prefill chunks and decodes in one launch; SiLU or no activation,
so Mamba-2's xBC conv and LFM2's short conv use it too)
  grid:    (B, cdiv(max_query_len, BLOCK_T), cdiv(d, BLOCK_D))
  tiling:  a [BLOCK_T, BLOCK_D] tile of output tokens; tap k reads the input K - 1 - k tokens
           back, from the new tokens or, before the first one, from the saved conv state. Only
           the first tile of a request reads the state (BLOCK_T >= K - 1), and it alone writes
           the new state after a barrier, so no tile reads a state already overwritten.

Kernel `_selective_scan_kernel` (prefill chunks)
  grid:    (num_prefills, cdiv(d, BLOCK_D))
  tiling:  the state [BLOCK_D, N] stays in registers while the program walks its request's
           tokens CHUNK at a time; within a chunk the recurrence h_t = a_t * h_{t-1} + b_t is an
           associative scan over the chunk's (a, b) pairs, combined with the carried state.
           Padding tokens get dt = 0 (a = 1, b = 0), so the last row is the carried state.

Kernel `_selective_state_update_kernel` (decodes)
  grid:    (num_decodes, cdiv(d, BLOCK_D)); one step of the recurrence per request, state
           read, advanced and written back in one pass, output gated in the same program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _softplus(x):
    # As torch's softplus (threshold 20): x itself where exp would overflow the fp32 sum.
    return tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))


@triton.jit
def _causal_conv1d_kernel(
    x_ptr, w_ptr, bias_ptr, state_ptr, out_ptr, qsl_ptr, slot_ptr, has_init_ptr,
    dim,
    stride_xt, stride_xd, stride_wd, stride_wk, stride_ss, stride_sd, stride_sk,
    stride_ot, stride_od,
    K: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    req = tl.program_id(0)
    tile = tl.program_id(1)
    start = tl.load(qsl_ptr + req)
    length = tl.load(qsl_ptr + req + 1) - start
    if tile * BLOCK_T >= length:
        return
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    t = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_mask = d < dim
    t_mask = t < length
    state_row = state_ptr + slot * stride_ss + d * stride_sd

    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        pos = t - (K - 1) + k  # the input tap k sees, relative to the request's first token
        w = tl.load(w_ptr + d * stride_wd + k * stride_wk, mask=d_mask, other=0.0)
        new_mask = ((pos >= 0) & t_mask)[:, None] & d_mask[None, :]
        new = tl.load(x_ptr + (start + pos)[:, None].to(tl.int64) * stride_xt
                      + d[None, :] * stride_xd, mask=new_mask, other=0.0)
        old_mask = ((pos < 0) & t_mask & has_init)[:, None] & d_mask[None, :]
        old = tl.load(state_row[None, :] + (K - 1 + pos)[:, None] * stride_sk, mask=old_mask,
                      other=0.0)
        acc += w.to(tl.float32)[None, :] * (new.to(tl.float32) + old.to(tl.float32))
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptr + (start + t)[:, None].to(tl.int64) * stride_ot + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=t_mask[:, None] & d_mask[None, :])

    if tile == 0:
        tl.debug_barrier()  # every read of the old state in this tile is done
        # Names differ from the loop above: Triton types a name once per scope.
        for j in tl.static_range(K - 1):
            src = length - (K - 1) + j
            tail_new = tl.load(x_ptr + (start + src).to(tl.int64) * stride_xt + d * stride_xd,
                               mask=d_mask & (src >= 0), other=0.0)
            tail_old = tl.load(state_row + (K - 1 + src) * stride_sk,
                               mask=d_mask & (src < 0) & has_init, other=0.0)
            value = tail_new.to(tl.float32) + tail_old.to(tl.float32)
            tl.store(state_row + j * stride_sk, value.to(state_ptr.dtype.element_ty),
                     mask=d_mask)


@triton.jit
def _combine(a_left, b_left, a_right, b_right):
    return a_left * a_right, a_right * b_left + b_right


@triton.jit
def _selective_scan_kernel(
    x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, a_ptr, d_skip_ptr, dt_bias_ptr, state_ptr, out_ptr,
    qsl_ptr, slot_ptr, has_init_ptr,
    dim, state_size,
    stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, stride_ad,
    stride_ss, stride_sd, stride_ot,
    CHUNK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    start = tl.load(qsl_ptr + req)
    end = tl.load(qsl_ptr + req + 1)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < dim
    n_mask = n < state_size
    dn_mask = d_mask[:, None] & n_mask[None, :]

    a = tl.load(a_ptr + d[:, None] * stride_ad + n[None, :], mask=dn_mask, other=0.0)
    a = a.to(tl.float32)
    dt_bias = tl.load(dt_bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    d_skip = tl.load(d_skip_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    state = state_ptr + slot * stride_ss + d[:, None] * stride_sd + n[None, :]
    h = tl.load(state, mask=dn_mask & has_init, other=0.0).to(tl.float32)
    last = (tl.arange(0, CHUNK) == CHUNK - 1)[:, None, None]

    for chunk_start in range(start, end, CHUNK):
        t = chunk_start + tl.arange(0, CHUNK)
        t_mask = t < end
        t64 = t.to(tl.int64)
        td_mask = t_mask[:, None] & d_mask[None, :]
        tn_mask = t_mask[:, None] & n_mask[None, :]
        x = tl.load(x_ptr + t64[:, None] * stride_xt + d[None, :], mask=td_mask,
                    other=0.0).to(tl.float32)
        dt = tl.load(dt_ptr + t64[:, None] * stride_dtt + d[None, :], mask=td_mask,
                     other=0.0).to(tl.float32)
        dt = tl.where(td_mask, _softplus(dt + dt_bias[None, :]), 0.0)
        b = tl.load(b_ptr + t64[:, None] * stride_bt + n[None, :], mask=tn_mask,
                    other=0.0).to(tl.float32)
        c = tl.load(c_ptr + t64[:, None] * stride_ct + n[None, :], mask=tn_mask,
                    other=0.0).to(tl.float32)
        decay = tl.exp(dt[:, :, None] * a[None, :, :])  # [CHUNK, BLOCK_D, BLOCK_N]
        inject = (dt[:, :, None] * b[:, None, :]) * x[:, :, None]
        decay, inject = tl.associative_scan((decay, inject), axis=0, combine_fn=_combine)
        states = decay * h[None, :, :] + inject  # the state after each token of the chunk
        y = tl.sum(states * c[:, None, :], axis=2) + x * d_skip[None, :]
        z = tl.load(z_ptr + t64[:, None] * stride_zt + d[None, :], mask=td_mask,
                    other=0.0).to(tl.float32)
        y = y * (z * tl.sigmoid(z))
        tl.store(out_ptr + t64[:, None] * stride_ot + d[None, :],
                 y.to(out_ptr.dtype.element_ty), mask=td_mask)
        h = tl.sum(tl.where(last, states, 0.0), axis=0)
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=dn_mask)


@triton.jit
def _selective_state_update_kernel(
    x_ptr, dt_ptr, z_ptr, b_ptr, c_ptr, a_ptr, d_skip_ptr, dt_bias_ptr, state_ptr, out_ptr,
    slot_ptr, has_init_ptr,
    dim, state_size,
    stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, stride_ad,
    stride_ss, stride_sd, stride_ot,
    BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    slot = tl.load(slot_ptr + req).to(tl.int64)
    has_init = tl.load(has_init_ptr + req) != 0
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_mask = d < dim
    n_mask = n < state_size
    dn_mask = d_mask[:, None] & n_mask[None, :]
    row = req.to(tl.int64)

    x = tl.load(x_ptr + row * stride_xt + d, mask=d_mask, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + row * stride_dtt + d, mask=d_mask, other=0.0).to(tl.float32)
    dt = _softplus(dt + tl.load(dt_bias_ptr + d, mask=d_mask, other=0.0).to(tl.float32))
    z = tl.load(z_ptr + row * stride_zt + d, mask=d_mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + row * stride_bt + n, mask=n_mask, other=0.0).to(tl.float32)
    c = tl.load(c_ptr + row * stride_ct + n, mask=n_mask, other=0.0).to(tl.float32)
    a = tl.load(a_ptr + d[:, None] * stride_ad + n[None, :], mask=dn_mask, other=0.0)
    state = state_ptr + slot * stride_ss + d[:, None] * stride_sd + n[None, :]
    h = tl.load(state, mask=dn_mask & has_init, other=0.0).to(tl.float32)

    h = h * tl.exp(dt[:, None] * a.to(tl.float32)) + (dt[:, None] * b[None, :]) * x[:, None]
    tl.store(state, h.to(state_ptr.dtype.element_ty), mask=dn_mask)
    y = tl.sum(h * c[None, :], axis=1)
    y += x * tl.load(d_skip_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
    y = y * (z * tl.sigmoid(z))
    tl.store(out_ptr + row * stride_ot + d, y.to(out_ptr.dtype.element_ty), mask=d_mask)


def _check_channels_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError("mamba kernels need unit stride along channels/states")


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, query_start_loc: torch.Tensor,
                  state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                  max_query_len: int, block_t: int = 32, block_d: int = 64,
                  activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv (+ `activation`: "silu" or None) of every request's new tokens
    x [T, d] (weight [d, K]), continuing from and updating its conv state. Returns [T, d]."""
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"unsupported conv activation {activation!r} (silu or None)")
    num_reqs = len(state_indices)
    d, k = weight.shape
    out = torch.empty_like(x)
    if num_reqs == 0:
        return out
    block_t = max(block_t, triton.next_power_of_2(k - 1))
    grid = (num_reqs, triton.cdiv(max_query_len, block_t), triton.cdiv(d, block_d))
    _causal_conv1d_kernel[grid](
        x, weight, bias if bias is not None else weight, conv_state, out, query_start_loc,
        state_indices, has_initial_state, d,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1),
        conv_state.stride(0), conv_state.stride(1), conv_state.stride(2),
        out.stride(0), out.stride(1),
        K=k, HAS_BIAS=bias is not None, SILU=activation is not None, BLOCK_T=block_t,
        BLOCK_D=block_d)
    return out


def selective_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, dt_bias: torch.Tensor,
                   ssm_state: torch.Tensor, query_start_loc: torch.Tensor,
                   state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   out: torch.Tensor | None = None, chunk: int = 8, block_d: int = 16,
                   num_warps: int = 4) -> torch.Tensor:
    """Chunked selective scan of each prefill request's tokens (x, dt, z [T, d], B, C [T, N])
    from its saved state; writes the final state back. Returns y [T, d] (into `out` if
    given)."""
    out = torch.empty_like(x) if out is None else out
    _check_channels_contiguous(x, dt, z, B, C, A, ssm_state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    d, n = A.shape
    grid = (num_reqs, triton.cdiv(d, block_d))
    _selective_scan_kernel[grid](
        x, dt, z, B, C, A, D, dt_bias, ssm_state, out, query_start_loc, state_indices,
        has_initial_state, d, n,
        x.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), A.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), out.stride(0),
        CHUNK=chunk, BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n), num_warps=num_warps)
    return out


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                           state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                           out: torch.Tensor | None = None, block_d: int = 32) -> torch.Tensor:
    """One decode step per request (x, dt, z [B, d], B, C [B, N]). Returns y [B, d] (into
    `out` if given)."""
    out = torch.empty_like(x) if out is None else out
    _check_channels_contiguous(x, dt, z, B, C, A, ssm_state, out)
    num_reqs = len(state_indices)
    if num_reqs == 0:
        return out
    d, n = A.shape
    grid = (num_reqs, triton.cdiv(d, block_d))
    _selective_state_update_kernel[grid](
        x, dt, z, B, C, A, D, dt_bias, ssm_state, out, state_indices, has_initial_state, d, n,
        x.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), A.stride(0),
        ssm_state.stride(0), ssm_state.stride(1), out.stride(0),
        BLOCK_D=block_d, BLOCK_N=triton.next_power_of_2(n))
    return out
