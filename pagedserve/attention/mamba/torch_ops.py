"""Mamba-1 state ops (and the causal conv Mamba-2 and LFM2 share) in plain torch: the CPU path
and the reference for the Triton kernels.

Shapes: tokens are packed [T, ...] in batch order; `conv_state` [num_slots, d_inner, K - 1] and
`ssm_state` [num_slots, d_inner, N] hold every slot, indexed by `state_indices` [B]. A request
without an initial state (nothing computed yet) starts from zeros, whatever its slot holds.

Prefill requests are scattered into a zero-padded [B, max_len] grid (`token_index` is the flat
grid index of each packed token), so the conv is one grouped `conv1d` and the scan one loop over
the time steps of the longest chunk, vectorised over requests, channels and states. A padded
step has dt = 0, so it leaves the state alone: the state after the loop is each request's final
one. The arithmetic follows transformers' slow Mamba path op for op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _to_grid(packed: torch.Tensor, token_index: torch.Tensor, num_reqs: int,
             max_len: int) -> torch.Tensor:
    """[T, C] packed tokens -> [B, max_len, C], zero-padded."""
    grid = packed.new_zeros(num_reqs * max_len, packed.shape[-1])
    grid[token_index] = packed
    return grid.view(num_reqs, max_len, -1)


def activation_fn(activation: str | None):
    """The conv's output activation by name: Mamba-1 and Mamba-2 use SiLU, LFM2's short conv
    none."""
    if activation is None:
        return lambda out: out
    if activation in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported conv activation {activation!r} (silu or None)")


def _initial(state: torch.Tensor, state_indices: torch.Tensor,
             has_initial_state: torch.Tensor) -> torch.Tensor:
    """The saved state of each request, or zeros for a request that starts now."""
    saved = state[state_indices]
    return torch.where(has_initial_state[:, None, None], saved, torch.zeros_like(saved))


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor, state_indices: torch.Tensor,
                          has_initial_state: torch.Tensor, token_index: torch.Tensor,
                          lens: torch.Tensor, max_len: int,
                          activation: str | None = "silu") -> torch.Tensor:
    """Depthwise causal conv (+ `activation`) over each request's new tokens x [T, d] (weight
    [d, K]), continuing from its saved inputs; writes the last K - 1 inputs back. Returns
    [T, d]."""
    act = activation_fn(activation)
    num_reqs, (_, d), k = len(state_indices), x.shape, weight.shape[1]
    init = _initial(conv_state, state_indices, has_initial_state).to(x.dtype)
    new = _to_grid(x, token_index, num_reqs, max_len).transpose(1, 2)  # [B, d, L]
    full = torch.cat([init, new], dim=2)  # [B, d, K - 1 + L]
    out = act(F.conv1d(full.to(weight.dtype), weight[:, None, :], bias, groups=d))
    # A request of n tokens ends at column K - 2 + n: its last K - 1 inputs start at column n.
    cols = lens[:, None] + torch.arange(k - 1, device=x.device)
    conv_state[state_indices] = full.gather(2, cols[:, None, :].expand(-1, d, -1)).to(
        conv_state.dtype)
    return out.to(x.dtype).transpose(1, 2).reshape(num_reqs * max_len, d)[token_index]


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor,
                         has_initial_state: torch.Tensor,
                         activation: str | None = "silu") -> torch.Tensor:
    """One new token per request, x [B, d]: conv (+ `activation`) over (saved inputs, x), shift
    x into the state."""
    act = activation_fn(activation)
    d = x.shape[1]
    init = _initial(conv_state, state_indices, has_initial_state).to(x.dtype)
    window = torch.cat([init, x[:, :, None]], dim=2)  # [B, d, K]
    out = act(F.conv1d(window.to(weight.dtype), weight[:, None, :], bias, groups=d))
    conv_state[state_indices] = window[:, :, 1:].to(conv_state.dtype)
    return out[:, :, 0].to(x.dtype)


def selective_scan_prefill(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                           state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                           token_index: torch.Tensor, max_len: int) -> torch.Tensor:
    """Selective scan of x, dt, z [T, d], B, C [T, N] (A [d, N] float32, D and dt_bias [d])
    from each request's saved state; writes the final state back. Returns y [T, d]."""
    num_reqs, d = len(state_indices), x.shape[1]
    dt = F.softplus(dt + dt_bias.to(dt.dtype))
    dt_g = _to_grid(dt, token_index, num_reqs, max_len).float()
    x_g = _to_grid(x, token_index, num_reqs, max_len)
    b_g = _to_grid(B, token_index, num_reqs, max_len).float()
    c_g = _to_grid(C, token_index, num_reqs, max_len)
    h = _initial(ssm_state, state_indices, has_initial_state).float()  # [B, d, N]
    ys = x.new_empty(num_reqs, max_len, d)
    for step in range(max_len):
        dt_t = dt_g[:, step, :, None]  # [B, d, 1]
        h = torch.exp(A * dt_t) * h + (dt_t * b_g[:, step, None, :]) * x_g[:, step, :, None].float()
        ys[:, step] = torch.matmul(h.to(x.dtype), c_g[:, step, :, None])[..., 0]
    ssm_state[state_indices] = h.to(ssm_state.dtype)
    y = ys.view(num_reqs * max_len, d)[token_index]
    return ((y + x * D) * F.silu(z)).to(x.dtype)


def selective_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                           C: torch.Tensor, D: torch.Tensor, z: torch.Tensor,
                           dt_bias: torch.Tensor, ssm_state: torch.Tensor,
                           state_indices: torch.Tensor,
                           has_initial_state: torch.Tensor) -> torch.Tensor:
    """One token per request (x, dt, z [B, d], B, C [B, N]): advance each state one step."""
    dt = F.softplus(dt + dt_bias.to(dt.dtype)).float()
    h = _initial(ssm_state, state_indices, has_initial_state).float()
    h = h * torch.exp(dt[..., None] * A) + (dt[..., None] * B.float()[:, None, :]) * x.float()[
        ..., None]
    ssm_state[state_indices] = h.to(ssm_state.dtype)
    y = torch.matmul(h.to(C.dtype), C[..., None])[..., 0]
    return ((y + x * D) * F.silu(z)).to(x.dtype)
