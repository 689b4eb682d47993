"""The gated delta rule (Qwen3-Next's gated delta net) over a step's packed tokens, in torch.

Per head, with the state S [Dk, Dv], decay g_t <= 0 (log space) and write strength beta_t:

    S_t = exp(g_t) * S_{t-1}
    S_t = S_t + k_t (beta_t * (v_t - S_t^T k_t))^T      (the delta rule: write the correction)
    o_t = S_t^T q_t

q and k are L2-normalised here in float32 (x * rsqrt(|x|^2 + 1e-6)), as transformers does with
`use_qk_l2norm_in_kernel=True`, the setting Qwen3-Next's layer uses; `use_qk_l2norm=False`
leaves them as given. q is always scaled by 1 / sqrt(Dk). Everything is computed in float32;
the output has v's dtype, the state stays float32. Heads are already expanded: q and k have as
many heads as v (the layer repeats its key heads before the call).

Prefill (`chunk_gated_delta_rule`): the requests are scattered into a zero-padded
[B, H, L, D] grid, L a multiple of the chunk size, and the chunks are processed in order, each
for all requests and heads at once. Within a chunk the sequential writes are folded into one
unit lower-triangular solve (the WY / UT form): with G the running sum of g in the chunk,
A_ij = beta_i k_i.k_j exp(G_i - G_j) (j < i), the corrected values are

    U = (I + A)^-1 (beta v)  -  (I + A)^-1 (beta k exp(G)) S_prev

and the chunk's outputs and final state follow by matmuls. A padding token has g = 0 and
k = v = beta = 0: it neither decays nor writes, so the grid's last state is each request's.
Decode (`recurrent_gated_delta_rule`): one step of the recurrence per request, batched.
"""

from __future__ import annotations

import torch

from pagedserve.attention.linear import packing

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / |x| along the last dim (float32), with transformers' epsilon inside the root."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(q: torch.Tensor, k: torch.Tensor,
                use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    else:
        q, k = q.float(), k.float()
    return q * q.shape[-1] ** -0.5, k


def chunk_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           beta: torch.Tensor, state: torch.Tensor,
                           query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                           has_initial_state: torch.Tensor, chunk_size: int = 64, *,
                           max_query_len: int | None = None,
                           use_qk_l2norm: bool = True) -> torch.Tensor:
    """Prefill: q, k [T, H, Dk], v [T, H, Dv], g, beta [T, H] of P requests
    (`query_start_loc` [P+1], `state_indices` and `has_initial_state` [P]), each continuing
    from its slot of `state` [num_slots, H, Dk, Dv] (float32), where its final state is written
    back. `max_query_len` (the longest request) saves a host sync. Returns o [T, H, Dv]."""
    num_reqs, num_tokens = len(state_indices), q.shape[0]
    num_heads, dv = q.shape[1], v.shape[2]
    if num_reqs == 0:
        return v.new_empty(num_tokens, num_heads, dv)
    longest = max_query_len if max_query_len is not None else packing.max_len(query_start_loc)
    num_chunks = -(-longest // chunk_size)
    padded = num_chunks * chunk_size
    index = packing.grid_index(query_start_loc, num_tokens, padded)

    def grid(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [B, H, num_chunks, chunk, ...]
        x = packing.to_grid(x.float(), index, num_reqs, padded).transpose(1, 2)
        return x.reshape(num_reqs, num_heads, num_chunks, chunk_size, *x.shape[3:])

    q, k = _prepare_qk(q, k, use_qk_l2norm)
    q, k, v, g, beta = (grid(x) for x in (q, k, v, g, beta))
    cum = g.cumsum(-1)  # [B, H, N, C]: log decay from the chunk's start through each token
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(G_i - G_j) for j <= i; above the diagonal -inf first, so no overflow reaches the exp.
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # Unit lower-triangular system; its diagonal (beta_i |k_i|^2) is ignored by the solve.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    rhs = torch.cat([v * beta[..., None], k_beta * cum.exp()[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    u, w = solved[..., :dv], solved[..., dv:]  # [B, H, N, C, Dv], [B, H, N, C, Dk]
    scores = (q @ k.transpose(-1, -2)) * decay  # causal, the diagonal included
    q_decayed = q * cum.exp()[..., None]  # reads the state as it was at the chunk's start
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]  # decay from each token to the end
    chunk_decay = cum[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    s = packing.initial_state(state, state_indices, has_initial_state)  # [B, H, Dk, Dv]
    out = torch.empty_like(v[..., :dv])
    for c in range(num_chunks):
        corrected = u[:, :, c] - w[:, :, c] @ s
        out[:, :, c] = q_decayed[:, :, c] @ s + scores[:, :, c] @ corrected
        s = s * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ corrected
    state[state_indices] = s.to(state.dtype)
    out = out.reshape(num_reqs, num_heads, padded, dv).transpose(1, 2)
    return packing.from_grid(out, index).to(v.dtype)


def recurrent_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor, has_initial_state: torch.Tensor, *,
                               use_qk_l2norm: bool = True) -> torch.Tensor:
    """Decode: one token per request (q, k [B, H, Dk], v [B, H, Dv], g, beta [B, H]); advances
    each request's state slot one step. Returns o [B, H, Dv]."""
    q, k = _prepare_qk(q, k, use_qk_l2norm)
    s = packing.initial_state(state, state_indices, has_initial_state)  # [B, H, Dk, Dv]
    s = s * g.float().exp()[..., None, None]
    predicted = (k[..., None, :] @ s)[..., 0, :]  # S^T k: [B, H, Dv]
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    state[state_indices] = s.to(state.dtype)
    return (q[..., None, :] @ s)[..., 0, :].to(v.dtype)
