"""Mamba-2 (SSD) state ops in plain torch: the CPU path and the reference for the Triton kernels.

Shapes: tokens packed [T, ...] in batch order; x [T, H, P] (heads x head dim), dt [T, H], B and
C [T, G, N] (G groups, group g shared by the H / G consecutive heads g * H/G ...), A, D and
dt_bias [H] (A = -exp(A_log), float32); `state` [num_slots, H, P, N] (float32) holds every slot,
indexed by `state_indices` [B]. A request without an initial state starts from zeros, whatever
its slot holds.

The math is transformers' Mamba2Mixer / BambaMixer (the gate z and the gated RMSNorm stay in the
layer; y includes the D skip):

    dt_t = clamp(softplus(dt_t + dt_bias), *dt_limit)
    h_t  = exp(dt_t * A) * h_{t-1} + dt_t * x_t B_t^T      (per head: [P, N])
    y_t  = h_t C_t + D * x_t

Prefill (`ssd_chunk_scan`): each request's tokens are cut into chunks of `chunk_size` from its
first token (its last chunk padded with dt = 0, which leaves the state alone), so all chunks of
the step are one [num_chunks, chunk_size] grid with no padding to the longest request. Within a
chunk the SSD block form (as transformers' chunked scan): a masked "attention" C B^T weighted by
the decays between positions, plus the chunk's start state read through C. Across chunks a loop
over the chunk index, vectorised over requests, carries each request's state. Everything runs in
float32 and y is cast to x's dtype.

Decode (`ssd_state_update`): one step of the recurrence per request, batched. It clamps dt to
dt_limit like the prefill; transformers' mixers call their single-step update without it, which
only matters for a model with a limit other than (0, inf): pass the default there to match them.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

DEFAULT_DT_LIMIT = (0.0, math.inf)


def discretize_dt(dt: torch.Tensor, dt_bias: torch.Tensor,
                  dt_limit: tuple[float, float]) -> torch.Tensor:
    """The step size of each token and head in float32: clamp(softplus(dt + dt_bias))."""
    dt = F.softplus(dt.float() + dt_bias.float())
    return dt.clamp(min=dt_limit[0], max=dt_limit[1])


def initial_state(state: torch.Tensor, state_indices: torch.Tensor,
                  has_initial_state: torch.Tensor) -> torch.Tensor:
    """Each request's saved state in float32, or zeros for a request that starts now (its slot
    may hold anything, NaN included)."""
    saved = state[state_indices].float()
    keep = has_initial_state.view(-1, *([1] * (saved.dim() - 1)))
    return torch.where(keep, saved, torch.zeros_like(saved))


def _segment_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., L] -> [..., L, L]: entry (l, s) = a[s+1] + ... + a[l] for s <= l, -inf above the
    diagonal. Summed directly rather than as a difference of cumulative sums, which loses
    precision once the sums grow large."""
    length = a.shape[-1]
    strict = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device), -1)
    sums = a[..., :, None].expand(*a.shape, length).masked_fill(~strict, 0).cumsum(dim=-2)
    causal = torch.tril(torch.ones(length, length, dtype=torch.bool, device=a.device))
    return sums.masked_fill(~causal, -math.inf)


def ssd_chunk_scan(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                   C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                   state: torch.Tensor, query_start_loc: torch.Tensor,
                   state_indices: torch.Tensor, has_initial_state: torch.Tensor,
                   chunk_size: int = 256,
                   dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT) -> torch.Tensor:
    """SSD scan of each prefill request's tokens (request i: tokens query_start_loc[i] to
    query_start_loc[i + 1]) from its saved state; writes each final state into its slot.
    Returns y [T, H, P] in x's dtype (rows outside the requests are left unset)."""
    num_reqs = len(state_indices)
    num_tokens, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    heads_per_group = num_heads // num_groups
    y = x.new_empty(num_tokens + 1, num_heads, head_dim)  # the last row takes padding writes
    if num_reqs == 0:
        return y[:num_tokens]
    dev = x.device
    starts = query_start_loc[:num_reqs].long()
    ends = query_start_loc[1:num_reqs + 1].long()
    num_chunks = (ends - starts + chunk_size - 1) // chunk_size
    counts = num_chunks.tolist()  # the grid's shape: the one host read of the op
    total, most = sum(counts), max(counts)

    # The chunk grid: chunk c covers tokens tok[c] of request chunk_req[c].
    chunk_req = torch.repeat_interleave(torch.arange(num_reqs, device=dev), num_chunks,
                                        output_size=total)
    first_chunk = torch.cumsum(num_chunks, 0) - num_chunks
    chunk_pos = torch.arange(total, device=dev) - first_chunk[chunk_req]
    tok = (starts[chunk_req] + chunk_pos * chunk_size)[:, None] + torch.arange(chunk_size,
                                                                                device=dev)
    valid = tok < ends[chunk_req][:, None]
    tok = torch.where(valid, tok, starts[chunk_req][:, None])  # a real token; dt = 0 below

    g, r, p, n = num_groups, heads_per_group, head_dim, state_size
    dtc = discretize_dt(dt[tok], dt_bias, dt_limit) * valid[..., None]  # [NC, L, H]
    xc = x[tok].float().view(total, chunk_size, g, r, p)
    xdt = xc * dtc.view(total, chunk_size, g, r, 1)
    bc, cc = B[tok].float(), C[tok].float()  # [NC, L, G, N]
    log_decay = (dtc * A.float()).permute(0, 2, 1).reshape(total, g, r, chunk_size)
    cum = torch.cumsum(log_decay, dim=-1)  # [NC, G, R, L]

    # Within a chunk: y_l += sum_{s <= l} (C_l . B_s) exp(sum_{s < k <= l} dt_k A) dt_s x_s.
    scores = torch.einsum("clgn,csgn->cgls", cc, bc)[:, :, None] * torch.exp(
        _segment_sum(log_decay))
    y_diag = torch.einsum("cgrls,csgrp->clgrp", scores, xdt)

    # What each chunk adds to the state at its end, and how much it decays the state it got.
    to_end = torch.exp(cum[..., -1:] - cum).permute(0, 3, 1, 2)[..., None]  # [NC, L, G, R, 1]
    chunk_states = torch.einsum("clgn,clgrp->cgrpn", bc, xdt * to_end)
    chunk_decay = torch.exp(cum[..., -1])  # [NC, G, R]

    # Across chunks: request i's chunk j starts from the state after its chunk j - 1. A request
    # with fewer chunks points at an extra row (decay 1, nothing added), which leaves it alone.
    table = first_chunk[:, None] + torch.arange(most, device=dev)
    table = torch.where(torch.arange(most, device=dev) < num_chunks[:, None], table, total)
    chunk_states = torch.cat([chunk_states, chunk_states.new_zeros(1, g, r, p, n)])
    chunk_decay = torch.cat([chunk_decay, chunk_decay.new_ones(1, g, r)])
    h = initial_state(state, state_indices, has_initial_state).view(num_reqs, g, r, p, n)
    start_states = chunk_states.new_empty(total + 1, g, r, p, n)
    for j in range(most):
        ids = table[:, j]
        start_states[ids] = h
        h = chunk_decay[ids][..., None, None] * h + chunk_states[ids]
    state[state_indices] = h.view(num_reqs, num_heads, p, n).to(state.dtype)

    # From the chunk's start state: y_l += exp(sum_{k <= l} dt_k A) C_l h_start.
    y_off = torch.einsum("clgn,cgrpn->clgrp", cc, start_states[:total]) * torch.exp(cum).permute(
        0, 3, 1, 2)[..., None]
    yc = y_diag + y_off + D.float().view(g, r, 1) * xc
    rows = torch.where(valid, tok, num_tokens).flatten()
    y[rows] = yc.reshape(-1, num_heads, head_dim).to(y.dtype)
    return y[:num_tokens]


def ssd_state_update(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, D: torch.Tensor, dt_bias: torch.Tensor,
                     state: torch.Tensor, state_indices: torch.Tensor,
                     has_initial_state: torch.Tensor,
                     dt_limit: tuple[float, float] = DEFAULT_DT_LIMIT) -> torch.Tensor:
    """One decode token per request (x [B, H, P], dt [B, H], B, C [B, G, N]): advance each
    slot's state one step. Returns y [B, H, P] in x's dtype."""
    num_reqs, num_heads, head_dim = x.shape
    num_groups, state_size = B.shape[1:]
    g, r = num_groups, num_heads // num_groups
    step = discretize_dt(dt, dt_bias, dt_limit).view(num_reqs, g, r)
    xf = x.float().view(num_reqs, g, r, head_dim)
    h = initial_state(state, state_indices, has_initial_state).view(num_reqs, g, r, head_dim,
                                                                     state_size)
    decay = torch.exp(step * A.float().view(g, r))
    h = decay[..., None, None] * h + (step[..., None] * xf)[..., None] * B.float()[:, :, None,
                                                                                    None, :]
    state[state_indices] = h.view(num_reqs, num_heads, head_dim, state_size).to(state.dtype)
    y = torch.einsum("bgrpn,bgn->bgrp", h, C.float()) + D.float().view(g, r, 1) * xf
    return y.reshape(num_reqs, num_heads, head_dim).to(x.dtype)
