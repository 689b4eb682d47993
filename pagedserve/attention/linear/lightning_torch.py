"""Lightning attention (MiniMax-Text-01's linear attention) over a step's packed tokens, in torch.

Per head, with the kv state S [D, Dv] and a constant per-head decay rate s > 0:

    S_t = exp(-s) * S_{t-1} + k_t v_t^T
    o_t = S_t^T q_t

No scaling of q and no normalisation: the layer applies SiLU to q, k, v before the call and its
RMSNorm and output gate after it. `slope` [H] is the rate the layer computed (`slope_rate`
here), transformers' `MiniMaxLightningAttention.slope_rate` flattened:
base^(h+1) * (1 - l / (L - 1 + 1e-5) + 1e-5) for head h (from 0) of layer l of L layers,
base = 2^(-8 / H); the per-token decay is exp(-slope).

Prefill (`lightning_attention_prefill`): the requests are scattered into a zero-padded grid of
blocks of `block_size` tokens, processed block by block for all requests and heads at once, as
transformers' layer does: o = (q exp(-s(i+1))) S_prev + (q k^T * exp(-s(i-j)), j <= i) v, and
S = exp(-s n) S_prev + sum_j exp(-s(n-1-j)) k_j v_j^T. The decays come from a per-token log
decay that is -s on real tokens and 0 on padding, so a request's padding tail leaves its state
as its last token left it. Decode (`lightning_attention_decode`): one step per request.
Computed in float32; the output has v's dtype, the state stays float32.
"""

from __future__ import annotations

import torch

from pagedserve.attention.linear import packing


def slope_rate(num_heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    """MiniMax's per-head decay rate [H] for one layer: ALiBi-like slopes base^(h+1), base =
    2^(-8 / H), scaled down linearly with depth (to ~1e-5 at the last layer), as transformers'
    `MiniMaxLightningAttention.get_slope_rate` (whose epsilons are kept)."""
    base = 1 / (2 ** (8 / num_heads))
    factor = 1 - layer_idx / (num_layers - 1 + 1e-5) + 1e-5
    return base ** torch.arange(1, num_heads + 1, dtype=torch.float32) * factor


def lightning_attention_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                slope: torch.Tensor, state: torch.Tensor,
                                query_start_loc: torch.Tensor, state_indices: torch.Tensor,
                                has_initial_state: torch.Tensor, block_size: int = 256, *,
                                max_query_len: int | None = None) -> torch.Tensor:
    """Prefill: q, k [T, H, D], v [T, H, Dv] of P requests (`query_start_loc` [P+1],
    `state_indices` and `has_initial_state` [P]), per-head decay rate `slope` [H], each request
    continuing from its slot of `state` [num_slots, H, D, Dv] (float32), where its final state
    is written back. Returns o [T, H, Dv]."""
    num_reqs, num_tokens = len(state_indices), q.shape[0]
    num_heads, dv = q.shape[1], v.shape[2]
    if num_reqs == 0:
        return v.new_empty(num_tokens, num_heads, dv)
    longest = max_query_len if max_query_len is not None else packing.max_len(query_start_loc)
    num_blocks = -(-longest // block_size)
    padded = num_blocks * block_size
    index = packing.grid_index(query_start_loc, num_tokens, padded)

    def grid(x: torch.Tensor) -> torch.Tensor:
        # [T, H, ...] -> [B, H, num_blocks, block, ...]
        x = packing.to_grid(x.float(), index, num_reqs, padded).transpose(1, 2)
        return x.reshape(num_reqs, num_heads, num_blocks, block_size, *x.shape[3:])

    log_decay = -slope.float().expand(num_tokens, num_heads)
    q, k, v, g = (grid(x) for x in (q, k, v, log_decay))
    cum = g.cumsum(-1)  # [B, H, N, C]: -s * (tokens so far in the block, this one included)
    causal = torch.ones(block_size, block_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    intra = ((q @ k.transpose(-1, -2)) * decay) @ v  # [B, H, N, C, Dv]
    q_decayed = q * cum.exp()[..., None]
    kv_block = (k * (cum[..., -1:] - cum).exp()[..., None]).transpose(-1, -2) @ v
    block_decay = cum[..., -1].exp()[..., None, None]

    s = packing.initial_state(state, state_indices, has_initial_state)  # [B, H, D, Dv]
    out = torch.empty_like(intra)
    for b in range(num_blocks):
        out[:, :, b] = q_decayed[:, :, b] @ s + intra[:, :, b]
        s = s * block_decay[:, :, b] + kv_block[:, :, b]
    state[state_indices] = s.to(state.dtype)
    out = out.reshape(num_reqs, num_heads, padded, dv).transpose(1, 2)
    return packing.from_grid(out, index).to(v.dtype)


def lightning_attention_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               slope: torch.Tensor, state: torch.Tensor,
                               state_indices: torch.Tensor,
                               has_initial_state: torch.Tensor) -> torch.Tensor:
    """Decode: one token per request (q, k [B, H, D], v [B, H, Dv]); advances each request's
    state slot one step. Returns o [B, H, Dv]."""
    s = packing.initial_state(state, state_indices, has_initial_state)  # [B, H, D, Dv]
    s = s * torch.exp(-slope.float())[:, None, None] + k.float()[..., :, None] * v.float()[
        ..., None, :]
    state[state_indices] = s.to(state.dtype)
    return (q.float()[..., None, :] @ s)[..., 0, :].to(v.dtype)
